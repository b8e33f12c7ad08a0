// Stale page bounds of per-sequence rows (Quest over AdmitAll): which pages
// each edit of a sequence's row leaves stale. Appends keep the bounds current
// through the engine's page_bounds_update; these are the edits that rewrite
// or shrink held slots.
#pragma once

#include <cstdint>
#include <span>

#include "kvcache/config.hpp"
#include "kvcache/pool/block_pool.hpp"
#include "kvcache/selection/stale_pages.hpp"
#include "kvcache/core/sequence_id.hpp"

KVCACHE_BEGIN_NAMESPACE

namespace stale_rows {

/// The logical block the first of the n tokens just reserved for s went to.
template <class Table>
std::int32_t first_new_block(const Table& t, SeqId s, std::int32_t n) noexcept {
  return (t.front_unchecked(s) + t.tokens_unchecked(s) - n) / t.block_size();
}

/// reserve() copied s's shared tail (copy-on-write): the copy holds the old block's keys, recompute it.
template <class Table>
void reserved(StalePages& stale, const Table& t, SeqId s, std::int32_t n, const BlockCopy& copy) noexcept {
  if (copy.src >= 0) stale.mark(s.index, first_new_block(t, s, n));
}

/// reserve_batch() copied some tails: each sequence whose first new token's block is a copy target.
template <class Table>
void reserved(StalePages& stale, const Table& t, std::span<const SeqId> seqs, std::span<const std::int32_t> counts,
              std::span<const BlockCopy> copies) noexcept {
  if (copies.empty()) return;
  for (std::size_t k = 0; k < seqs.size(); ++k) {
    if (counts[k] == 0) continue;
    const std::int32_t j = first_new_block(t, seqs[k], counts[k]);
    const BlockId b = t.blocks_unchecked(seqs[k])[std::size_t(j)];
    for (const BlockCopy& c : copies)
      if (c.dst == b) stale.mark(seqs[k].index, j);
  }
}

/// The rule below on one row of stream `stream`: `used` slots of `blocks`,
/// pages of `block_size` (a layer group's rows call it too).
template <class Pool>
void truncated_tail(StalePages& stale, std::uint32_t stream, std::span<const BlockId> blocks, std::int64_t used,
                    std::int32_t block_size, const Pool& pool) noexcept {
  if (used % block_size == 0) return;
  const auto j = std::int32_t(used / block_size);
  const BlockId tail = blocks[std::size_t(j)];
  if (pool.ref_count(tail) == 1 && !pool.has_hash(tail)) stale.mark(stream, j);
}

/// A rollback left a partial tail that keeps the removed keys' extremes:
/// recompute it, unless another row shares it (that row may hold more of
/// it) or it is still published (a prefix hit may adopt it whole): the
/// looser bound holds for every holder.
template <class Table, class Pool>
void truncated(StalePages& stale, const Table& t, const Pool& pool, SeqId s) noexcept {
  truncated_tail(stale, s.index, t.blocks_unchecked(s), t.front_unchecked(s) + t.tokens_unchecked(s), t.block_size(), pool);
}

/// An evict() that removed tokens (r: its EvictionResult): rotated blocks and
/// compaction targets hold other keys from `first_changed` on; a window's
/// dropped front blocks shift the row's logical indices down.
template <class Result>
void evicted(StalePages& stale, SeqId s, const Result& r, std::int32_t block_size) noexcept {
  if (r.tokens == 0) return;
  if (r.front) stale.shift(s.index, r.evicted);
  else stale.mark(s.index, r.first_changed / block_size);
}

}  // namespace stale_rows

KVCACHE_END_NAMESPACE
