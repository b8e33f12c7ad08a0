// The page table: the rows (table/page_table_rows.hpp) and the decode step's
// bookkeeping for the whole batch in one call, reserve_batch, at no more
// than the cost of one reserve() per sequence.
//
// One pass validates every entry and appends the common case (the tokens fit
// a tail block only this stream holds) at once, so a step touches each
// stream once. Entries that allocate or copy are planned in that pass (their
// first slot holds a marker) and applied after the all-or-nothing checks by a
// second pass over the planned range: sequential rather than a linked list,
// so its loads do not wait on one another. A decode step's crossing into a
// new block is planned inline and applied without the general path. The pass
// is compiled four ways (block size a power of two or not; every count 1 or
// not), since the decode step is what engines run most. An error undoes the
// appends (streams stamped epoch | 1) and leaves every slot -1.
#pragma once

#include <cstdint>
#include <span>

#include "kvcache/pool/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/table/page_table_rows.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Logical to physical blocks per stream (PageTableRows), with the batched reserve of a decode step.
class PageTable : public PageTableRows {
 public:
  using PageTableRows::PageTableRows;

  /// reserve() for a batch: counts[i] tokens for seqs[i], slots packed in order
  /// into `slots`, the rest of `slots` padded with -1 (padded CUDA-graph
  /// batches). Copy commands (one per shared tail) go to `copies`. All or
  /// nothing: on an error the table and pool are unchanged and every entry of
  /// `slots` is -1, so a scatter launched anyway writes nothing.
  Result<BatchInfo> reserve_batch(BlockPool& pool, std::span<const SeqId> seqs, std::span<const std::int32_t> counts,
                                  std::span<std::int32_t> slots, std::span<BlockCopy> copies) noexcept;

 private:
  // reserve_batch's entries that allocate or copy, planned in its one pass
  // and applied after its all-or-nothing checks (below).
  struct BatchPlan {
    std::uint32_t epoch;          // this call's stamp
    std::int64_t blocks = 0;      // new blocks, copy-on-write targets excluded
    std::int64_t may_copy = 0;    // planned writes into a partial tail (an upper bound on copies)
    std::size_t first = SIZE_MAX; // the first planned entry (none: SIZE_MAX)
    std::size_t last = 0;         // the last planned entry
    std::int64_t first_at = 0;    // the first planned entry's slot offset
    std::int64_t at = 0;          // slots the batch takes
  };
  // Mark a planned entry's first slot until the apply pass writes it: the
  // general case, and the decode step's crossing into a new block.
  static constexpr std::int32_t kPlannedSlot = -2, kNewBlockSlot = -3;
  template <bool Pow2, bool Ones>
  std::size_t batch_pass(const BlockPool& pool, std::span<const SeqId> seqs, std::span<const std::int32_t> counts,
                         std::span<std::int32_t> slots, BatchPlan& plan, std::size_t k) noexcept;
  Status plan_batch_entry(const BlockPool& pool, SeqId s, std::size_t k, std::int32_t n, std::span<std::int32_t> slots,
                          BatchPlan& plan) noexcept;

  // A failed batch leaves every slot -1 (a scatter launched anyway writes nothing).
  static Status batch_failed(std::span<std::int32_t> slots, Status st) noexcept {
    for (std::int32_t& x : slots) x = -1;
    return st;
  }
  // Undoes the in-place appends of seqs[0..k) (stamped epoch | 1), then fails.
  Status batch_undo(std::span<const SeqId> seqs, std::span<const std::int32_t> counts, std::size_t k,
                    std::span<std::int32_t> slots, Status st) noexcept {
    for (std::size_t j = 0; j < k; ++j) {
      Stream& s = st_[seqs[j].index];
      if (s.stamp != (epoch_ | 1u)) continue;
      s.tokens -= counts[j];
      s.appended -= counts[j];
      s.stamp = epoch_;
    }
    return batch_failed(slots, st);
  }

  std::uint32_t epoch_ = 0;  // reserve_batch's stamp (scratch, not state)
};

inline Result<BatchInfo> PageTable::reserve_batch(BlockPool& pool, std::span<const SeqId> seqs,
                                                  std::span<const std::int32_t> counts, std::span<std::int32_t> slots,
                                                  std::span<BlockCopy> copies) noexcept {
  if (counts.size() != seqs.size())
    return batch_failed(slots, Status{Errc::invalid_argument, "counts.size", std::int64_t(counts.size()),
                                      std::int64_t(seqs.size())});
  // Stamps mark the streams this call has seen (duplicates) and, in the low
  // bit, the ones it already appended to (what an error undoes).
  epoch_ += 2;
  if (epoch_ < 2) {  // wrapped: clear the stamps so no stale one matches
    for (auto& st : st_) st.stamp = 0;
    epoch_ = 2;
  }
  BatchPlan plan{epoch_};
  // The fast pass needs every slot to fit the buffer; when they do not, the
  // batch fails (buffer_too_small, or an earlier entry's error), and every
  // entry goes the checked way. Branch-free, so it vectorizes.
  std::int32_t not_one = 0;
  std::int64_t wanted = 0;
  for (const std::int32_t n : counts) {
    not_one |= n ^ 1;
    wanted += n > 0 ? n : 0;
  }
  const bool fits = wanted <= std::int64_t(slots.size()), ones = not_one == 0;
  using Pass = std::size_t (PageTable::*)(const BlockPool&, std::span<const SeqId>, std::span<const std::int32_t>,
                                          std::span<std::int32_t>, BatchPlan&, std::size_t) noexcept;
  const Pass pass = shift_ >= 0 ? (ones ? &PageTable::batch_pass<true, true> : &PageTable::batch_pass<true, false>)
                                : (ones ? &PageTable::batch_pass<false, true> : &PageTable::batch_pass<false, false>);
  const auto run = [&](std::size_t from) { return fits ? (this->*pass)(pool, seqs, counts, slots, plan, from) : from; };
  for (std::size_t k = run(0); k < seqs.size(); k = run(k + 1))
    if (auto e = plan_batch_entry(pool, seqs[k], k, counts[k], slots, plan); !e) [[unlikely]]
      return batch_undo(seqs, counts, k, slots, e);
  const std::size_t all = seqs.size();
  const std::int64_t room = std::int64_t(slots.size()), at = plan.at;
  if (room < at) return batch_undo(seqs, counts, all, slots, Status{Errc::buffer_too_small, "slots", room, at});
  // A planned write into a partial tail needs a copy-on-write block if the
  // tail is shared; that is looked up only when the upper bound (every such
  // tail shared) would not fit the pool or `copies`.
  std::int32_t* const out = slots.data();
  std::int64_t total_copies = plan.may_copy;
  if (plan.may_copy > 0 &&
      (std::int64_t(copies.size()) < plan.may_copy || plan.blocks + plan.may_copy > pool.num_free())) {
    total_copies = 0;
    for (std::size_t k = plan.first, a = std::size_t(plan.first_at); k <= plan.last; a += std::size_t(counts[k++]))
      if (counts[k] > 0 && out[a] == kPlannedSlot) {  // a new block's start never copies
        const std::uint32_t i = seqs[k].index;
        total_copies += mod_b(st_[i].front + st_[i].tokens) != 0 && pool.ref_count(row(i)[st_[i].nblocks - 1]) > 1;
      }
  }
  const std::int64_t total_blocks = plan.blocks + total_copies;
  if (std::int64_t(copies.size()) < total_copies)
    return batch_undo(seqs, counts, all, slots,
                      Status{Errc::buffer_too_small, "copies", std::int64_t(copies.size()), total_copies});
  if (total_blocks > pool.num_free())
    return batch_undo(seqs, counts, all, slots, Status{Errc::out_of_blocks, "n_blocks", total_blocks, pool.num_free()});
  BatchInfo info{};
  for (std::size_t k = plan.first, a = std::size_t(plan.first_at); k <= plan.last; a += std::size_t(counts[k++])) {
    const std::int32_t n = counts[k];
    if (n == 0 || out[a] >= 0) continue;  // nothing, or appended in place (none planned: first > last)
    const std::uint32_t i = seqs[k].index;
    if (out[a] == kNewBlockSlot) {  // starts a block of its own: nothing to copy
      Stream& st = st_[i];
      const BlockId b = *pool.allocate_one();  // counted above
      row(i)[st.nblocks++] = b;
      for (std::int32_t j = 0; j < n; ++j) out[a + std::size_t(j)] = b * block_size_ + j;
      st.tokens += n;
      st.appended += n;
      continue;
    }
    ReserveInfo r{};
    apply_reserve(pool, i, n, out + a, r);
    if (r.copy.src >= 0) copies[static_cast<std::size_t>(info.copies++)] = r.copy;
  }
  info.slots = static_cast<std::int32_t>(at);
  for (std::int32_t *p = out + at, *end = out + room; p != end; ++p) *p = -1;
  return info;
}

// The fast pass: from entry k, appends or plans every entry the two common
// cases cover, and returns the first entry they do not (seqs.size() when
// none). Such an entry, valid or not, goes to plan_batch_entry: the loop
// calls nothing, so its values stay in registers. Members are copied to
// locals: the stores below (int32 slots and fields) could alias them
// otherwise. Only called when `slots` holds every count's slots. Pow2: the
// block size is a power of two (a mask, not a division). Ones: every count
// is 1 (decode).
template <bool Pow2, bool Ones>
inline std::size_t PageTable::batch_pass(const BlockPool& pool, std::span<const SeqId> seqs,
                                         std::span<const std::int32_t> counts, std::span<std::int32_t> slots,
                                         BatchPlan& plan, std::size_t k) noexcept {
  Stream* const streams = st_.data();
  const BlockId* const blocks = blocks_.data();
  const std::uint32_t epoch = plan.epoch, nstreams = static_cast<std::uint32_t>(max_streams_);
  const std::size_t row_len = static_cast<std::size_t>(max_blocks_), count = seqs.size();
  const std::int32_t bs = block_size_, max_blocks = max_blocks_;
  std::int32_t* const out = slots.data();
  std::int64_t at = plan.at;  // slots so far
  for (; k < count; ++k) {
    const SeqId s = seqs[k];
    const std::int32_t n = Ones ? 1 : counts[k];
    if (s.index >= nstreams) [[unlikely]]
      break;
    Stream& st = streams[s.index];
    if (st.alive != 1 || st.gen != s.generation || (st.stamp & ~1u) == epoch) [[unlikely]]
      break;
    const std::int32_t t = st.front + st.tokens, off = Pow2 ? t & (bs - 1) : t % bs;
    if (off != 0) {
      // Fits the partial tail: valid by construction (the tail is inside the
      // row), and nothing to allocate if only this stream holds it and no
      // prefix hit can see it.
      if (!Ones && (n <= 0 || n > bs - off)) break;
      const BlockId tail = blocks[std::size_t(s.index) * row_len + std::size_t(st.nblocks - 1)];
      if (pool.ref_count(tail) != 1 || pool.has_hash(tail)) break;
      const std::int32_t base = tail * bs + off;
      out[at] = base;
      for (std::int32_t j = 1; j < n; ++j) out[at + j] = base + j;
      st.tokens += n;
      st.appended += n;
      st.stamp = epoch | 1u;
    } else {
      // Starts one new block (a decode step crossing a block boundary):
      // planned here, its allocation applied after the checks.
      if ((!Ones && (n <= 0 || n > bs)) || st.nblocks >= max_blocks) break;
      out[at] = kNewBlockSlot;
      st.stamp = epoch;
      if (plan.first == SIZE_MAX) {
        plan.first = k;
        plan.first_at = at;
      }
      plan.last = k;
      plan.blocks += 1;
    }
    at += n;
  }
  plan.at = at;
  return k;
}

// An entry the fast pass does not cover: checked (errors name it), its
// stream stamped, and (when its slots start inside the buffer) its first
// slot marked planned.
KVCACHE_NOINLINE inline Status PageTable::plan_batch_entry(const BlockPool& pool, SeqId s, std::size_t k,
                                                           std::int32_t n, std::span<std::int32_t> slots,
                                                           BatchPlan& plan) noexcept {
  if (auto e = validate(s); !e) return e;
  const std::uint32_t i = s.index;
  Stream& st = st_[i];
  if ((st.stamp & ~1u) == plan.epoch) return Status{Errc::duplicate_sequence, "seqs_at", std::int64_t(k), i};
  const std::int32_t t = st.front + st.tokens;
  if (n < 0 || n > max_tokens_ - t) {
    Need unused{};
    return plan_reserve(pool, i, n, unused);  // names the bad count
  }
  st.stamp = plan.epoch;
  if (n > 0 && plan.at < std::int64_t(slots.size())) {  // past the buffer the batch fails before applying
    slots[std::size_t(plan.at)] = kPlannedSlot;
    if (plan.first == SIZE_MAX) {
      plan.first = k;
      plan.first_at = plan.at;
    }
    plan.last = k;
  }
  plan.blocks += blocks_for(std::int64_t{t} + n) - st.nblocks;
  plan.may_copy += n > 0 && mod_b(t) != 0;
  plan.at += n;
  return {};
}

KVCACHE_END_NAMESPACE
