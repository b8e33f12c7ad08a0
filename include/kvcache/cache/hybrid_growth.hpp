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

#include "kvcache/pool/block_pool.hpp"
#include "kvcache/config.hpp"
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
  /// prefill_chunk (HybridConfig): more is invalid_argument naming n, with
  /// how many more it may reserve now as the limit.
  Result<ReserveInfo> reserve(SeqId id, std::span<const std::int32_t> tokens, std::span<std::int32_t> slots) {
    return reserve_impl(id, std::int32_t(std::min<std::size_t>(tokens.size(), INT32_MAX)), tokens, slots, false);
  }
  /// n more tokens without their ids: only without prefix caching (nothing to publish).
  Result<ReserveInfo> reserve(SeqId id, std::int32_t n, std::span<std::int32_t> slots) {
    if (self().cfg_.prefix_caching) return Status{Errc::invalid_argument, "n (prefix caching is on: pass the token ids)", n, 0};
    return reserve_impl(id, n, {}, slots, false);
  }
  /// The decode step in one call: every token reserved so far was computed
  /// (computed(id, tokens(id))), then `tokens` are reserved as by reserve().
  /// All or nothing: when the reserve cannot be made, nothing is marked computed either.
  Result<ReserveInfo> advance(SeqId id, std::span<const std::int32_t> tokens, std::span<std::int32_t> slots) {
    return reserve_impl(id, std::int32_t(std::min<std::size_t>(tokens.size(), INT32_MAX)), tokens, slots, true);
  }
  /// advance() of n tokens without their ids: only without prefix caching.
  Result<ReserveInfo> advance(SeqId id, std::int32_t n, std::span<std::int32_t> slots) {
    if (self().cfg_.prefix_caching) return Status{Errc::invalid_argument, "n (prefix caching is on: pass the token ids)", n, 0};
    return reserve_impl(id, n, {}, slots, true);
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
    if (n < 0 || n > s.reserved - s.computed) return Status{Errc::truncate_too_many, "n", n, s.reserved - s.computed};
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
  Result<ReserveInfo> reserve_impl(SeqId id, std::int32_t n, std::span<const std::int32_t> tokens, std::span<std::int32_t> slots,
                                    bool advance) {
    Cache& c = self();
    if (auto st = c.validate(id); !st) return st;
    auto& s = c.seqs_[id.index];
    if (n < 0 || n > c.cfg_.max_tokens - s.reserved) return Status{Errc::invalid_argument, "n", n, c.cfg_.max_tokens - s.reserved};
    if (std::int64_t(slots.size()) < std::int64_t(c.groups()) * n)
      return Status{Errc::buffer_too_small, "slots", std::int64_t(slots.size()), std::int64_t(c.groups()) * n};
    const std::int64_t done = advance ? s.reserved : s.computed;
    if (s.reserved + n - done > s.ahead)  // the pool was sized, and every admission promised, for this bound
      return Status{Errc::invalid_argument, "n (past prefill_chunk: reserved, not computed)", n, s.ahead - (s.reserved - done)};
    const bool in_place = fits_in_place(id.index, n, done);  // the common decode step: no group frees or allocates
    if (!in_place) {
      std::int64_t need = 0, freeable = 0;
      for (const GroupRows& rows : c.rows_) {
        const GroupRule& r = rows.rule();
        freeable += rows.freeable_below(c.pool_, id.index, std::int32_t(r.skipped_blocks(done)));
        need += r.row_blocks(s.reserved + n) - std::int64_t(rows.row(id.index).size());
      }
      if (need > c.pool_.num_free() + freeable) return Status{Errc::out_of_blocks, "n_blocks", need, c.pool_.num_free() + freeable};
    }
    if (advance && done > s.computed)
      if (auto st = c.mark_computed(id.index, done); !st) return st;
    if (in_place) {
      write_slots(id.index, n, tokens, slots, n);
      return ReserveInfo{};
    }
    for (GroupRows& rows : c.rows_) rows.free_below(c.pool_, id.index, std::int32_t(rows.rule().skipped_blocks(done)));
    return ReserveInfo{.new_blocks = grow(id.index, n, tokens, slots, n)};
  }

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
  /// The slots of row i's next n tokens (-1 up to stride, and in cross groups),
  /// and their ids beside them (what publishing hashes); reserved += n.
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
      for (std::int32_t t = 0; t < m; ++t) {
        const std::int64_t p = s.reserved + t;
        const BlockId b = row[r.div(p)];
        out[t] = b * r.block_size + r.mod(p);
        if (kept) kept[std::size_t(b) * std::size_t(per_page) + std::size_t(r.mod(p))] = ids[std::size_t(t)];
      }
      std::fill(out + m, out + stride, -1);
    }
    s.reserved += n;
  }

 private:
  Cache& self() noexcept { return static_cast<Cache&>(*this); }
  const Cache& self() const noexcept { return static_cast<const Cache&>(*this); }
};

KVCACHE_END_NAMESPACE
