// How a HybridCache's sequences grow (its GrowingCache calls: reserve,
// advance, computed, truncate): reserve() and advance() as one
// all-or-nothing step over every group (what left each window, on computed
// tokens, is freed first and counts as room), the blocks each group takes,
// and the slots of the tokens added, with their ids kept beside them for
// publishing. HybridCache derives from it and befriends it, as it does its
// accounting, imports, exports and selection.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/pool/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/prefix/prefix_cache.hpp"
#include "kvcache/groups/group_rows.hpp"
#include "kvcache/groups/group_rule.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// The growth of a HybridCache's rows: reserve, advance, computed and truncate (admit runs grow()).
template <class Cache>
class HybridGrowth {
 public:
  /// The next tokens of sequence id (their ids: what computed() publishes),
  /// all or nothing across groups: what left each window (on computed tokens)
  /// is freed first and counts as room. slots: [groups][tokens.size()].
  /// Returns the blocks taken (ReserveInfo, as every cache's; never a copy).
  /// Tokens reserved and not computed stay within the configured
  /// prefill_chunk (HybridConfig): more is invalid_argument naming n_tokens, with
  /// how many more it may reserve now as the limit.
  Result<ReserveInfo> reserve(SeqId id, std::span<const std::int32_t> tokens, std::span<std::int32_t> slots) {
    return reserve_impl(id, clamp(tokens.size()), tokens, slots, clamp(tokens.size()), false);
  }
  /// n more tokens without their ids: only without prefix caching (nothing to publish).
  Result<ReserveInfo> reserve(SeqId id, std::int32_t n, std::span<std::int32_t> slots) {
    if (self().cfg_.prefix_caching) return Status{Errc::invalid_argument, "n_tokens (prefix caching is on: pass the token ids)", n, 0};
    return reserve_impl(id, n, {}, slots, n, false);
  }
  /// The decode step in one call: every token reserved so far was computed
  /// (computed(id, tokens(id))), then `tokens` are reserved as by reserve().
  /// All or nothing: when the reserve cannot be made, nothing is marked computed either.
  Result<ReserveInfo> advance(SeqId id, std::span<const std::int32_t> tokens, std::span<std::int32_t> slots) {
    return reserve_impl(id, clamp(tokens.size()), tokens, slots, clamp(tokens.size()), true);
  }
  /// advance() of n tokens without their ids: only without prefix caching.
  Result<ReserveInfo> advance(SeqId id, std::int32_t n, std::span<std::int32_t> slots) {
    if (self().cfg_.prefix_caching) return Status{Errc::invalid_argument, "n_tokens (prefix caching is on: pass the token ids)", n, 0};
    return reserve_impl(id, n, {}, slots, n, true);
  }

  /// reserve() of a batch, as Cache<>::reserve_batch: seqs[k] reserves
  /// counts[k] tokens, their ids packed in `ids` as the slots are. slots are
  /// [groups()][stride] with stride = slots.size() / groups(): group g's
  /// slots of the batch, entry after entry, from slots[g * stride], then -1
  /// to the row's end (a padded CUDA-graph batch). Each entry is checked and
  /// counted as reserve() would check and count it after the entries before
  /// it (a block two entries share and both let go counts for neither), and
  /// the batch is all or nothing: on an error nothing changes and every slot
  /// is -1. `copies` is never written (a hybrid row shares no partial
  /// block): BatchInfo{the slots of a group, 0}.
  Result<BatchInfo> reserve_batch(std::span<const SeqId> seqs, std::span<const std::int32_t> counts,
                                  std::span<const std::int32_t> ids, std::span<std::int32_t> slots,
                                  std::span<BlockCopy> copies = {}) {
    (void)copies;
    return batch(seqs, counts, ids, true, slots, false);
  }
  /// reserve_batch() without the ids: only without prefix caching (nothing to publish).
  Result<BatchInfo> reserve_batch(std::span<const SeqId> seqs, std::span<const std::int32_t> counts, std::span<std::int32_t> slots,
                                  std::span<BlockCopy> copies = {}) {
    (void)copies;
    return batch(seqs, counts, {}, false, slots, false);
  }
  /// The decode step of a batch: advance() of each entry (every token it
  /// reserved computed, then its counts[k] tokens reserved), as reserve_batch() lays them out, all or nothing.
  Result<BatchInfo> advance_batch(std::span<const SeqId> seqs, std::span<const std::int32_t> counts,
                                  std::span<const std::int32_t> ids, std::span<std::int32_t> slots,
                                  std::span<BlockCopy> copies = {}) {
    (void)copies;
    return batch(seqs, counts, ids, true, slots, true);
  }
  /// advance_batch() without the ids: only without prefix caching.
  Result<BatchInfo> advance_batch(std::span<const SeqId> seqs, std::span<const std::int32_t> counts, std::span<std::int32_t> slots,
                                  std::span<BlockCopy> copies = {}) {
    (void)copies;
    return batch(seqs, counts, {}, false, slots, true);
  }

  /// The forward pass wrote K/V for tokens [0, tokens): full blocks of every
  /// caching group are published (prefix caching), and later reserves may free what left a window.
  Status computed(SeqId id, std::int64_t tokens) {
    Cache& c = self();
    if (auto st = c.validate(id); !st) return st;
    auto& s = c.seqs_[id.index];
    if (tokens < s.computed || tokens > s.reserved) return Status{Errc::invalid_argument, "tokens (computed)", tokens, s.reserved};
    return c.mark_computed(id.index, tokens);
  }

  /// Rolls back the last n reserved tokens (not computed: a rejected draft, a cancelled chunk).
  Status truncate(SeqId id, std::int32_t n) {
    Cache& c = self();
    if (auto st = c.validate(id); !st) return st;
    auto& s = c.seqs_[id.index];
    if (n < 0) return Status{Errc::invalid_argument, "n_tokens", n, 0};  // Cache<>::truncate's words
    if (n > s.reserved - s.computed) return Status{Errc::truncate_too_many, "n_tokens", n, s.reserved - s.computed};
    s.reserved -= n;  // the ids of the tokens left stay in their slots (hybrid_prefix.hpp)
    for (GroupRows& rows : c.rows_)
      if (rows.rule().caches()) rows.cut(c.pool_, id.index, std::int32_t(rows.rule().blocks_for(s.reserved)));
    c.selection_.truncated(c.rows_, c.pool_, id.index, s.reserved);
    c.eviction_.truncated(c.rows_, id.index, s.reserved);
    return {};
  }

 protected:
  /// reserve() and advance() (which first counts every reserved token as computed).
  /// Freeing and the room it makes are counted on the computed tokens after
  /// the call, so a failed advance marks nothing: publishing frees no block.
  /// new_blocks: the blocks every group took; a hybrid row shares no
  /// partial block, so there is never a copy to run.
  /// slots: group g's n slots at slots[g * stride] (stride >= n).
  Result<ReserveInfo> reserve_impl(SeqId id, std::int32_t n, std::span<const std::int32_t> tokens, std::span<std::int32_t> slots,
                                    std::int32_t stride, bool advance) {
    auto room = check_growth(id, n, slots, stride, advance, self().pool_.num_free());
    if (!room) return room.status();
    return apply_growth(id.index, n, tokens, slots, stride, advance, *room == kInPlace);
  }
  /// After check_growth(): the growth itself (in_place: what check_growth said).
  Result<ReserveInfo> apply_growth(std::uint32_t i, std::int32_t n, std::span<const std::int32_t> tokens, std::span<std::int32_t> slots,
                                   std::int32_t stride, bool advance, bool in_place) {
    Cache& c = self();
    auto& s = c.seqs_[i];
    const std::int64_t done = advance ? s.reserved : s.computed;
    if (advance && done > s.computed)
      if (auto st = c.mark_computed(i, done); !st) return st;
    if (in_place) {
      write_slots(i, n, tokens, slots, stride);
      return ReserveInfo{};
    }
    for (GroupRows& rows : c.rows_) rows.free_below(c.pool_, i, std::int32_t(rows.rule().skipped_blocks(done)));
    return ReserveInfo{.new_blocks = grow(i, n, tokens, slots, stride)};
  }

  /// check_growth()'s answer when no group frees or allocates.
  static constexpr std::int64_t kInPlace = INT64_MIN;
  /// reserve_impl()'s checks, changing nothing: the free blocks left after
  /// the call when `free` are free before it, or kInPlace (the common decode
  /// step: no group frees or allocates, the free blocks stay as they are).
  Result<std::int64_t> check_growth(SeqId id, std::int32_t n, std::span<const std::int32_t> slots, std::int32_t stride, bool advance,
                                    std::int64_t free) const {
    const Cache& c = self();
    if (auto st = c.validate(id); !st) return st;
    const auto& s = c.seqs_[id.index];
    if (n < 0) return Status{Errc::invalid_argument, "n_tokens", n, 0};  // Cache<>::reserve's words
    if (n > c.cfg_.max_tokens - s.reserved) return Status{Errc::capacity_exceeded, "n_tokens", n, c.cfg_.max_tokens - s.reserved};
    if (const std::int64_t want = n == 0 ? 0 : std::int64_t(c.groups() - 1) * stride + n; std::int64_t(slots.size()) < want)
      return Status{Errc::buffer_too_small, "slots", std::int64_t(slots.size()), want};
    const std::int64_t done = advance ? s.reserved : s.computed;
    if (s.reserved + n - done > s.ahead)  // the pool was sized, and every admission promised, for this bound
      return Status{Errc::invalid_argument, "n_tokens (past prefill_chunk: reserved, not computed)", n, s.ahead - (s.reserved - done)};
    if (fits_in_place(id.index, n, done)) return kInPlace;
    std::int64_t need = 0, freeable = 0;
    for (const GroupRows& rows : c.rows_) {
      const GroupRule& r = rows.rule();
      freeable += rows.freeable_below(c.pool_, id.index, std::int32_t(r.skipped_blocks(done)));
      need += r.row_blocks(s.reserved + n) - std::int64_t(rows.row(id.index).size());
    }
    if (need > free + freeable) return Status{Errc::out_of_blocks, "n_blocks", need, free + freeable};
    return free + freeable - need;
  }

  /// reserve_batch() and advance_batch(): every entry checked in order
  /// against the free blocks the entries before it leave, then each run as
  /// its reserve() or advance() (which cannot fail then).
  Result<BatchInfo> batch(std::span<const SeqId> seqs, std::span<const std::int32_t> counts, std::span<const std::int32_t> ids,
                          bool with_ids, std::span<std::int32_t> slots, bool advance) {
    Cache& c = self();
    const auto fail = [&](Status st) -> Result<BatchInfo> {
      std::fill(slots.begin(), slots.end(), -1);  // a scatter launched anyway writes nothing
      return st;
    };
    if (!with_ids && c.cfg_.prefix_caching)
      return fail(Status{Errc::invalid_argument, "ids (prefix caching is on: pass the token ids)", 0, 0});
    if (counts.size() != seqs.size())
      return fail(Status{Errc::invalid_argument, "counts.size", std::int64_t(counts.size()), std::int64_t(seqs.size())});
    std::int64_t total = 0;
    for (const std::int32_t n : counts) {
      if (n < 0) return fail(Status{Errc::invalid_argument, "n_tokens", n, 0});
      total += n;
    }
    if (with_ids)  // Cache<>::reserve_batch's check, the same words
      if (auto st = PrefixState::check_batch_ids(seqs, counts, ids); !st) return fail(st);
    const std::int64_t stride = std::int64_t(slots.size()) / c.groups();
    if (stride < total) return fail(Status{Errc::buffer_too_small, "slots", std::int64_t(slots.size()), total * c.groups()});
    // A stamp is the epoch of the batch that last named the handle, its low
    // bit whether that entry grows in place (what the second pass reads).
    if ((epoch_ += 2) < 2) std::fill(stamps_.begin(), stamps_.end(), 0u), epoch_ = 2;  // wrapped: no stale stamp matches
    std::int64_t free = c.pool_.num_free(), at = 0;
    for (std::size_t k = 0; k < seqs.size(); at += counts[k++]) {
      auto left = check_growth(seqs[k], counts[k], slots.subspan(std::size_t(at)), std::int32_t(stride), advance, free);
      if (!left) return fail(left.status());
      std::uint32_t& stamp = stamps_[seqs[k].index];
      if ((stamp & ~1u) == epoch_) return fail(Status{Errc::duplicate_sequence, "seqs_at", std::int64_t(k), seqs[k].index});
      stamp = epoch_ | std::uint32_t(*left == kInPlace);
      if (*left != kInPlace) free = *left;
    }
    at = 0;
    for (std::size_t k = 0; k < seqs.size(); at += counts[k++]) {
      const std::uint32_t i = seqs[k].index;
      (void)apply_growth(i, counts[k], with_ids ? ids.subspan(std::size_t(at), std::size_t(counts[k])) : ids,
                         slots.subspan(std::size_t(at)), std::int32_t(stride), advance, stamps_[i] & 1u);  // checked above
    }
    for (std::int32_t g = 0; g < c.groups(); ++g)
      std::fill(slots.begin() + g * stride + total, slots.begin() + (g + 1) * stride, -1);
    std::fill(slots.begin() + c.groups() * stride, slots.end(), -1);
    return BatchInfo{.slots = std::int32_t(total), .copies = 0};
  }

  std::vector<std::uint32_t> stamps_;  ///< batch(): per handle, the batch that named it and how it grows (scratch, not state)
  std::uint32_t epoch_ = 0;  ///< batch(): the current batch's stamp (even; scratch, not state)

  /// n more tokens of row i land in blocks every group already holds, and no
  /// group has a block to free: reserve() has nothing to count or change but the slots.
  bool fits_in_place(std::uint32_t i, std::int32_t n, std::int64_t computed) const noexcept {
    const Cache& c = self();
    const auto& s = c.seqs_[i];
    for (const std::int32_t g : c.distinct_) {  // groups of one rule have rows of one shape: one check each
      const GroupRows& rows = c.rows_[std::size_t(g)];
      const GroupRule& r = rows.rule();
      if (r.row_blocks(s.reserved + n) > std::int64_t(rows.row(i).size())) return false;
      if (r.frees() && r.skipped_blocks(computed) > rows.first_live(i)) return false;
    }
    return true;
  }
  /// After the checks: n more tokens in every group (a cross group takes its
  /// encoder's blocks on the first call), their slots at slots[g * stride].
  /// Returns the blocks allocated.
  std::int32_t grow(std::uint32_t i, std::int32_t n, std::span<const std::int32_t> ids, std::span<std::int32_t> slots,
                    std::int32_t stride) noexcept {
    Cache& c = self();
    auto& s = c.seqs_[i];
    std::int32_t allocated = 0;
    for (std::int32_t g = 0; g < c.groups(); ++g) {
      GroupRows& rows = c.rows_[std::size_t(g)];
      const std::int64_t want = rows.rule().row_blocks(s.reserved + n);
      if (const auto have = std::int64_t(rows.row(i).size()); want > have) {
        c.scratch_.resize(std::size_t(want - have));
        (void)c.pool_.allocate(c.scratch_);  // counted before any change: cannot fail
        for (const BlockId b : c.scratch_) c.owner_[std::size_t(b)] = std::int8_t(g);
        rows.append(i, c.scratch_);
        allocated += std::int32_t(want - have);
      }
    }
    write_slots(i, n, ids, slots, stride);
    return allocated;
  }
  /// The slots of row i's next n tokens at slots[g * stride] (-1 in cross
  /// groups), and their ids beside them (what publishing hashes); reserved += n.
  void write_slots(std::uint32_t i, std::int32_t n, std::span<const std::int32_t> ids, std::span<std::int32_t> slots,
                   std::int32_t stride) noexcept {
    Cache& c = self();
    auto& s = c.seqs_[i];
    std::int32_t* kept = c.cfg_.prefix_caching && !ids.empty() ? c.prefix_.kept() : nullptr;
    const std::int32_t per_page = c.prefix_.max_block_size();
    for (std::int32_t g = 0; g < c.groups(); ++g) {
      const GroupRows& rows = c.rows_[std::size_t(g)];
      const GroupRule& r = rows.rule();
      std::int32_t* out = slots.data() + std::size_t(g) * std::size_t(stride);
      const BlockId* row = rows.row(i).data();
      const std::int32_t m = r.caches() ? n : 0;
      std::int32_t* keep = kept && c.prefix_.keeper(g) == g ? kept : nullptr;  // once per rule (HybridPrefix::keeper)
      for (std::int32_t t = 0; t < m; ++t) {
        const std::int64_t p = s.reserved + t;
        const BlockId b = row[r.div(p)];
        out[t] = b * r.block_size + r.mod(p);
        if (keep) keep[std::size_t(b) * std::size_t(per_page) + std::size_t(r.mod(p))] = ids[std::size_t(t)];
      }
      std::fill(out + m, out + n, -1);
    }
    s.reserved += n;
  }

 private:
  static std::int32_t clamp(std::size_t n) noexcept { return std::int32_t(std::min<std::size_t>(n, INT32_MAX)); }
  Cache& self() noexcept { return static_cast<Cache&>(*this); }
  const Cache& self() const noexcept { return static_cast<const Cache&>(*this); }
};

KVCACHE_END_NAMESPACE
