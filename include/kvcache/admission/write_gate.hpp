// Write-Gated KV admission (arXiv 2512.17452): every (sequence, layer,
// kv-head) is its own stream over a pool of single-head blocks, holding a
// local ring of the last W tokens and a global region of admitted ones.
//
//   row of one head stream:  [ ring: W slots ........ ][ global: admitted tokens ... ]
//                             row index 0          W-1   W ...
//
// A token enters the ring. When the ring is full, the token a write replaces
// (the oldest) is promoted to the end of the global region if its gate was
// >= tau, else dropped: lazy promotion. A prefill chunk longer than the ring
// sends its early tokens straight to global (or nowhere). Heads keep ragged
// lengths; each head's live tokens are always the row's first tokens (the ring
// is full whenever the global region is not empty), so stock paged kernels
// read a head as one row of a head-folded table.
//
// The engine writes a call's tokens with two kernels: `compaction` runs the
// promotions (ring slot -> global slot, disjoint), then `scatter` puts the new
// tokens at their slots (-1: dropped). When a call writes at most W tokens,
// `ring_write(slots, promote)` does both in one launch.
//
// The class is built in layers, one concept each: the per-head state
// (gate_heads.hpp), synchronous writes and rollback (gate_writes.hpp), the
// batched decode write (gate_batch.hpp), deferred writes (gate_deferred.hpp),
// and here what a token eviction of the global region needs.
#pragma once

#include <cstdint>
#include <span>

#include "kvcache/admission/gate_deferred.hpp"
#include "kvcache/pool/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/table/page_table.hpp"
#include "kvcache/table/page_table_edits.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/core/slot_move.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Write-Gated KV admission over a PageTable of single-head streams.
class WriteGate : public GateDeferred {
 public:
  static constexpr Signals required_signals{Signals::gate_scores};  ///< Reads gate scores.
  static constexpr AdmissionKind kind = AdmissionKind::head_paged;  ///< Owns one stream per (sequence, layer, kv-head).
  using Config = WriteGateConfig;  ///< What a Cache is given to build it.
  using GateDeferred::GateDeferred;

  // --- eviction of the global region (a token policy through the cache) --------
  /// Global tokens of (s, layer, kv_head) that a token eviction may choose
  /// from: past the blocks the row shares (a fork), as a global token index.
  /// 0 when s has deferred writes pending (nothing may move then: reconcile first).
  std::int32_t first_evictable(const PageTable& table, const BlockPool& pool, SeqId s, std::int32_t layer,
                               std::int32_t kv_head) const noexcept;
  /// A token eviction of the head's global region ran (eviction/global_region.hpp):
  /// global token m.dst now holds what m.src held (global token indices, the
  /// engine runs them as slot moves), and its last `count` tokens leave; the
  /// first `first_changed` stay where they were. The caller planned it
  /// (first_evictable, no pending writes): it cannot fail.
  void compact_global(PageTable& table, BlockPool& pool, SeqId s, std::int32_t layer, std::int32_t kv_head,
                      std::span<const SlotMove> index_moves, std::int32_t count, std::int32_t first_changed) noexcept;

};
static_assert(HeadPagedAdmission<WriteGate>);

inline std::int32_t WriteGate::first_evictable(const PageTable& table, const BlockPool& pool, SeqId s,
                                               std::int32_t layer, std::int32_t kv_head) const noexcept {
  const std::size_t hi = head_index(s.index, layer, kv_head);
  const std::int32_t global = heads_[hi].global;
  if (npending(s.index, layer) > 0) return global;  // the device may still promote into it
  const auto row = table.blocks_unchecked(ids_[hi]);
  std::int32_t shared = 0;  // blocks up to the last shared one stay
  for (auto b = std::int32_t(row.size()); b-- > 0;)
    if (pool.ref_count(row[std::size_t(b)]) > 1) {
      shared = b + 1;
      break;
    }
  return std::min(global, std::max(0, shared * b_ - w_));
}

inline void WriteGate::compact_global(PageTable& table, BlockPool& pool, SeqId s, std::int32_t layer, std::int32_t kv_head,
                                      std::span<const SlotMove> index_moves, std::int32_t count,
                                      std::int32_t first_changed) noexcept {
  const std::size_t hi = head_index(s.index, layer, kv_head);
  Head& h = heads_[hi];
  const auto p = pos(hi);
  for (const SlotMove& m : index_moves) p[std::size_t(w_ + m.dst)] = p[std::size_t(w_ + m.src)];  // sources lie past the kept
  h.global -= count;
  (void)drop_tail(table, pool, ids_[hi], count, w_ + first_changed);
}

KVCACHE_END_NAMESPACE
