// Write-Gated KV's decode step for a batch: one new token for each of a
// batch's sequences in one layer, with one check of the arguments and one
// pass over the layer's heads in memory order (gate_writes.hpp writes one
// sequence).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>

#include "kvcache/admission/gate_writes.hpp"
#include "kvcache/config.hpp"
#include "kvcache/table/head_rows.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Write-Gated KV's batched decode write (a base of WriteGate).
class GateBatch : public GateWrites {
  friend class GateDeferred;
  friend class WriteGate;

 public:
  using GateWrites::GateWrites;

  /// A decode step of layer `layer` for a batch: one new token for each of
  /// `seqs` (each at most once). gates, out.slots and out.promote are
  /// [seqs][kv_heads]; out.moves and out.copies take the whole batch's
  /// commands. The same result as write() per sequence in batch order, with
  /// one check of the arguments and one pass over the layer's heads in
  /// memory order. All or nothing, with write()'s errors; a sequence twice is
  /// invalid_argument naming its index in `seqs`.
  Result<GateWriteInfo> write_batch(PageTable& table, BlockPool& pool, std::span<const SeqId> seqs, std::int32_t layer,
                                    std::span<const float> gates, const GateWriteSpans& out) noexcept;

};

inline Result<GateWriteInfo> GateBatch::write_batch(PageTable& table, BlockPool& pool, std::span<const SeqId> seqs,
                                                    std::int32_t layer, std::span<const float> gates,
                                                    const GateWriteSpans& out) noexcept {
  const std::int32_t H = cfg_.num_kv_heads;
  if (layer < 0 || layer >= cfg_.num_layers) return Status{Errc::invalid_argument, "layer", layer, cfg_.num_layers};
  const std::int64_t rows = std::int64_t(seqs.size()) * H;
  if (std::int64_t(gates.size()) != rows)
    return Status{Errc::invalid_argument, "gates.size (seqs x kv_heads)", std::int64_t(gates.size()), rows};
  if (const std::int64_t bad = first_outside(gates, 0.0f, 1.0f); bad >= 0)
    return Status{Errc::invalid_argument, "gates_at", bad, 1};
  if (std::int64_t(out.slots.size()) < rows)
    return Status{Errc::buffer_too_small, "slots", std::int64_t(out.slots.size()), rows};
  if (!out.promote.empty() && std::int64_t(out.promote.size()) < rows)
    return Status{Errc::buffer_too_small, "promote", std::int64_t(out.promote.size()), rows};
  if (++epoch_ == 0) {  // stamps wrapped: clear them so no old stamp matches
    std::fill(stamp_.begin(), stamp_.end(), 0u);
    epoch_ = 1;
  }
  for (std::size_t k = 0; k < seqs.size(); ++k) {
    if (auto st = validate(seqs[k]); !st) return st;
    const std::uint32_t q = seqs[k].index;
    if (stamp_[q] == epoch_) return Status{Errc::invalid_argument, "seqs_at (a sequence twice)", std::int64_t(k), 0};
    stamp_[q] = epoch_;
    if (npending(q, layer) > 0)
      return Status{Errc::invalid_argument, "pending_writes (reconcile first)", npending(q, layer), 0};
  }
  // Plan, as write() does for n = 1: per head, does the ring's oldest token
  // leave for global (and is that head at its cap), does the row grow into a
  // new block, which shared blocks does the write rewrite. Nothing changes.
  std::int64_t blocks = 0, nmoves = 0, ncopies = 0;
  for (const SeqId s : seqs)
    for (std::int32_t h = 0; h < H; ++h) {
      const std::size_t hi = head_index(s.index, layer, h);
      const Head& st = heads_[hi];
      const bool grows = grows_by_one(hi);
      if (st.len == w_ && bit(hi, st.start)) {
        if (st.global < cap_)
          ++nmoves;
        else if (cfg_.at_cap == GlobalCapAction::refuse)
          return Status{Errc::capacity_exceeded, "global_cap", std::int64_t{st.global} + 1, cap_};
      }
      blocks += grows && bm_.mod(row_tokens(st)) == 0 ? 1 : 0;
      if (forked_[s.index]) {
        const auto row = table.blocks_unchecked(ids_[hi]);
        mark_rewritten(st, 1, grows, std::int32_t(row.size()));
        ncopies += count_shared(pool, row);
      }
    }
  if (std::int64_t(out.moves.size()) < nmoves)
    return Status{Errc::buffer_too_small, "moves", std::int64_t(out.moves.size()), nmoves};
  if (std::int64_t(out.copies.size()) < ncopies)
    return Status{Errc::buffer_too_small, "copies", std::int64_t(out.copies.size()), ncopies};
  if (blocks + ncopies > pool.num_free()) return Status{Errc::out_of_blocks, "n_blocks", blocks + ncopies, pool.num_free()};

  // Apply: as write(), one sequence's heads after another.
  GateWriteInfo info{};
  for (std::size_t k = 0; k < seqs.size(); ++k) {
    const std::uint32_t q = seqs[k].index;
    const auto at = std::ptrdiff_t(k) * H;
    const GateWriteSpans one{out.slots.subspan(std::size_t(at), std::size_t(H)), out.moves,
                             out.promote.empty() ? std::span<std::int32_t>{} : out.promote.subspan(std::size_t(at), std::size_t(H)),
                             out.copies};
    const auto g = gates.subspan(std::size_t(at), std::size_t(H));
    std::int64_t& appended = appended_[std::size_t(q) * std::size_t(cfg_.num_layers) + std::size_t(layer)];
    for (std::int32_t h = 0; h < H; ++h) {
      const std::size_t hi = head_index(q, layer, h);
      const Head st = heads_[hi];
      grow_row(table, pool, q, hi, grows_by_one(hi) ? 1 : 0, st, 1, out.copies, info);
      apply_head(hi, h, 1, g, table.blocks_unchecked(ids_[hi]), appended, info, &one);
    }
    ++appended;
  }
  return info;
}

KVCACHE_END_NAMESPACE
