// Stale page bounds under a head-paged admission (WriteGate + Quest): which
// head rows' pages each head-paged call leaves stale. A row's ring pages are
// always read (selection never ranks them), so only the global region's
// bounds matter; promotions and direct writes append to it and are folded in
// by the engine's page_bounds_update, like a per-sequence cache's appends.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>

#include "kvcache/table/head_rows.hpp"
#include "kvcache/config.hpp"
#include "kvcache/table/page_table.hpp"
#include "kvcache/selection/stale_pages.hpp"
#include "kvcache/core/sequence_id.hpp"

KVCACHE_BEGIN_NAMESPACE

namespace stale_heads {

/// Copy-on-write blocks a write of layers [first, last) of seqs wrote: stale from there in their rows.
template <HeadPagedAdmission A>
void copied(StalePages& stale, const PageTable& t, const A& a, std::span<const SeqId> seqs, std::int32_t first,
            std::int32_t last, std::span<const BlockCopy> copies) noexcept {
  if (copies.empty()) return;
  for (std::int32_t l = first; l < last; ++l)
    for (const SeqId s : seqs)
      for (std::int32_t h = 0; h < a.num_kv_heads(); ++h) {
        const SeqId row = a.head_unchecked(s, l, h);
        const auto blocks = t.blocks_unchecked(row);
        for (std::size_t j = 0; j < blocks.size(); ++j)
          for (const BlockCopy& c : copies)
            if (c.dst == blocks[j]) stale.mark(row.index, std::int32_t(j));
      }
}

/// After a rollback of s: a row's partial global tail keeps the removed keys'
/// extremes; recompute it unless another row shares it (the looser bound holds for both).
template <HeadPagedAdmission A, class Pool>
void truncated(StalePages& stale, const PageTable& t, const Pool& pool, const A& a, SeqId s) noexcept {
  const std::int32_t B = t.block_size(), W = a.local_window();
  for (std::int32_t l = 0; l < a.num_layers(); ++l)
    for (std::int32_t h = 0; h < a.num_kv_heads(); ++h) {
      const SeqId row = a.head_unchecked(s, l, h);
      const std::int32_t used = t.tokens_unchecked(row);
      if (used <= W || used % B == 0) continue;
      if (pool.ref_count(t.blocks_unchecked(row)[std::size_t(used / B)]) == 1) stale.mark(row.index, used / B);
    }
}

/// A deferred write of n tokens to `layer` of s, reconciled: the device
/// promoted into the last n global slots of each row at most; recompute them.
template <HeadPagedAdmission A>
void reconciled(StalePages& stale, const PageTable& t, const A& a, SeqId s, std::int32_t layer, std::int32_t n) noexcept {
  const std::int32_t B = t.block_size(), W = a.local_window();
  for (std::int32_t h = 0; h < a.num_kv_heads(); ++h) {
    const SeqId row = a.head_unchecked(s, layer, h);
    const std::int32_t used = t.tokens_unchecked(row);
    if (used > W) stale.mark(row.index, std::max(W, used - n) / B);
  }
}

/// A fork's rows share its parent's pages, stale ones included.
template <HeadPagedAdmission A>
void forked(StalePages& stale, const A& a, SeqId parent, SeqId child) noexcept {
  for (std::int32_t l = 0; l < a.num_layers(); ++l)
    for (std::int32_t h = 0; h < a.num_kv_heads(); ++h)
      stale.copy(a.head_unchecked(parent, l, h).index, a.head_unchecked(child, l, h).index);
}

/// A freed sequence's rows are empty: nothing stale.
template <HeadPagedAdmission A>
void freed(StalePages& stale, const A& a, SeqId s) noexcept {
  for (std::int32_t l = 0; l < a.num_layers(); ++l)
    for (std::int32_t h = 0; h < a.num_kv_heads(); ++h) stale.clear(a.head_unchecked(s, l, h).index);
}

}  // namespace stale_heads

KVCACHE_END_NAMESPACE
