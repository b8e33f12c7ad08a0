// WriteGate's side of a token eviction of its global region (declared in
// write_gate.hpp, which includes this file at its end). The global region of
// a head row is a token stream of its own: admitted tokens join it at the
// end (promotions), a rollback takes its newest back into the ring, and a
// token policy's compaction keeps its chosen tokens in its first slots. The
// ring is never evicted: it is the local window the method always reads.
#pragma once

#include "kvcache/admission/write_gate.hpp"
#include "kvcache/page_table_edits.hpp"

KVCACHE_BEGIN_NAMESPACE

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
