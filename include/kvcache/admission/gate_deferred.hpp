// Write-Gated KV's deferred writes: the contract that lets a GPU engine
// write without waiting for its gates. Where a token's ring slot is and
// which token it replaces do not depend on gates, so the host knows them;
// whether the replaced token is promoted, and to which global slot, does.
// The host allots each head's worst case (every leaving token admitted, up
// to the cap) before the step; the device decides (ring_admit) against its
// own copy of each head's global length and ring bits, writing only into
// allotted blocks; one step or more later the host replays the same
// decisions from the gates it reads back (reconcile) and returns what the
// allotment did not use.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>

#include "kvcache/admission/gate_batch.hpp"
#include "kvcache/config.hpp"
#include "kvcache/table/head_rows.hpp"
#include "kvcache/kernels/params/ring_admit.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Write-Gated KV's no-host-sync writes (a base of WriteGate).
class GateDeferred : public GateBatch {
  friend class WriteGate;

 public:
  using GateBatch::GateBatch;

  // --- deferred writes: the gates stay on the device ----------------------------
  using DeferredSpans = GateDeferredSpans;  ///< Where allot() puts what the device's launch needs.
  /// The no-host-sync write, part 1 (no gates needed): allots layer `layer`
  /// of s room for n new tokens, as if every token leaving a ring were
  /// admitted (rows grow to ring + min(cap, global + leaving)), and gives the
  /// rings' state before the write. The engine then exports the head rows
  /// and launches ring_admit with the gates, the rows, and its device state
  /// (each head's global length and ring bits), which decides and moves on
  /// the device. Needs GlobalCapAction::drop (the device cannot fail a
  /// write). Up to max_pending writes of a (sequence, layer) may wait for
  /// reconcile(). All or nothing.
  Result<GateWriteInfo> allot(PageTable& table, BlockPool& pool, SeqId s, std::int32_t layer, std::int32_t n,
                              const DeferredSpans& out) noexcept;
  /// Part 2, any time later (gates read back from the device): replays the
  /// oldest allotted write of (s, layer) with its gates, exactly as the
  /// device ran it, and gives back the blocks its allotment did not use (rows
  /// keep what later allotted writes may need). Returns what it did.
  Result<GateWriteInfo> reconcile(PageTable& table, BlockPool& pool, SeqId s, std::int32_t layer,
                                  std::span<const float> gates) noexcept;
  /// Allotted writes of (s, layer) not reconciled yet.
  Result<std::int32_t> pending(SeqId s, std::int32_t layer) const noexcept;
  /// The device state ring_admit advances, as the host holds it for (s,
  /// layer): each head's global length ([kv_heads]) and its ring's admission
  /// bits ([kv_heads][W], 0 or 1, by ring slot). Seed the device's copy with
  /// it when a sequence's writes move from write() to allot() (a prefill on
  /// the host, then decode without host syncs), after a fork, and after an
  /// eviction of the global regions (their lengths shrink). With
  /// deferred writes pending the device is ahead of the host: reconcile first
  /// (invalid_argument naming them). A buffer too small is buffer_too_small.
  Status device_state(SeqId s, std::int32_t layer, std::span<std::int32_t> global_len,
                      std::span<std::uint8_t> bits) const noexcept;
  /// The ring_admit launch's policy parameters, exactly as reconcile()
  /// replays them: num_heads, window (W), global_limit (the effective cap,
  /// global_cap()) and tau. The engine fills in the rest (pool, K/V, gates,
  /// the allotted rings' state, its device state, the rows), so the device
  /// and the host's bookkeeping cannot disagree through a parameter.
  RingAdmitParams ring_admit_params() const noexcept {
    RingAdmitParams p{};
    p.num_heads = cfg_.num_kv_heads;
    p.window = w_;
    p.global_limit = cap_;
    p.tau = cfg_.tau;
    return p;
  }

};

inline Result<std::int32_t> GateDeferred::pending(SeqId s, std::int32_t layer) const noexcept {
  if (auto st = validate(s); !st) return st;
  if (layer < 0 || layer >= cfg_.num_layers) return Status{Errc::invalid_argument, "layer", layer, cfg_.num_layers};
  return std::int32_t{npending(s.index, layer)};
}

inline Status GateDeferred::device_state(SeqId s, std::int32_t layer, std::span<std::int32_t> global_len,
                                      std::span<std::uint8_t> bits) const noexcept {
  if (auto st = validate(s); !st) return st;
  if (layer < 0 || layer >= cfg_.num_layers) return Status{Errc::invalid_argument, "layer", layer, cfg_.num_layers};
  if (npending(s.index, layer) > 0)
    return Status{Errc::invalid_argument, "pending_writes (reconcile first)", npending(s.index, layer), 0};
  const std::int32_t H = cfg_.num_kv_heads;
  if (std::int64_t(global_len.size()) < H) return Status{Errc::buffer_too_small, "global_len", std::int64_t(global_len.size()), H};
  if (std::int64_t(bits.size()) < std::int64_t{H} * w_)
    return Status{Errc::buffer_too_small, "bits", std::int64_t(bits.size()), std::int64_t{H} * w_};
  for (std::int32_t h = 0; h < H; ++h) {
    const std::size_t hi = head_index(s.index, layer, h);
    global_len[std::size_t(h)] = heads_[hi].global;
    for (std::int32_t r = 0; r < w_; ++r) bits[std::size_t(h) * std::size_t(w_) + std::size_t(r)] = bit(hi, r) ? 1 : 0;
  }
  return {};
}

inline Result<GateWriteInfo> GateDeferred::allot(PageTable& table, BlockPool& pool, SeqId s, std::int32_t layer,
                                              std::int32_t n, const DeferredSpans& out) noexcept {
  if (auto st = validate(s); !st) return st;
  const std::int32_t H = cfg_.num_kv_heads;
  if (layer < 0 || layer >= cfg_.num_layers) return Status{Errc::invalid_argument, "layer", layer, cfg_.num_layers};
  if (n < 0 || n > INT32_MAX / H) return Status{Errc::invalid_argument, "n_tokens", n, 0};
  if (cfg_.at_cap != GlobalCapAction::drop)
    return Status{Errc::invalid_argument, "at_cap (deferred writes drop at the cap)", std::int64_t(cfg_.at_cap),
                  std::int64_t(GlobalCapAction::drop)};
  if (npending(s.index, layer) >= max_pending)
    return Status{Errc::capacity_exceeded, "pending_writes", npending(s.index, layer) + 1, max_pending};
  if (std::int64_t(out.ring_start.size()) < H || std::int64_t(out.ring_len.size()) < H)
    return Status{Errc::buffer_too_small, "ring_start / ring_len",
                  std::int64_t(std::min(out.ring_start.size(), out.ring_len.size())), H};
  // Plan: each head's allotment after this write, and copies of shared blocks it may rewrite.
  std::int64_t blocks = 0, ncopies = 0;
  for (std::int32_t h = 0; h < H; ++h) {
    const std::size_t hi = head_index(s.index, layer, h);
    const auto row = table.blocks_unchecked(ids_[hi]);
    const std::int32_t before = allotted_row_tokens(hi, s.index, layer);
    const std::int32_t after = allotted_row_tokens(hi, s.index, layer, n);
    if (after > table.max_blocks_per_stream() * b_)
      return Status{Errc::capacity_exceeded, "row_tokens", after, table.max_blocks_per_stream() * b_};
    blocks += std::max<std::int64_t>(0, blocks_for_tokens(after, b_) - std::int64_t(row.size()));
    if (forked_[s.index]) {
      std::int64_t leaving = 0;
      mark_rewritten(after_pending(hi, s.index, layer, leaving), n, after > before, std::int32_t(row.size()));
      ncopies += count_shared(pool, row);
    }
  }
  if (std::int64_t(out.copies.size()) < ncopies)
    return Status{Errc::buffer_too_small, "copies", std::int64_t(out.copies.size()), ncopies};
  if (blocks + ncopies > pool.num_free()) return Status{Errc::out_of_blocks, "n_blocks", blocks + ncopies, pool.num_free()};
  // Apply: grow the rows, copy what a fork shares, hand out the rings.
  GateWriteInfo info{};
  for (std::int32_t h = 0; h < H; ++h) {
    const std::size_t hi = head_index(s.index, layer, h);
    std::int64_t leaving = 0;
    const Head ring = after_pending(hi, s.index, layer, leaving);
    out.ring_start[std::size_t(h)] = ring.start;
    out.ring_len[std::size_t(h)] = ring.len;
    const std::int32_t grow = allotted_row_tokens(hi, s.index, layer, n) - table.tokens_unchecked(ids_[hi]);
    grow_row(table, pool, s.index, hi, grow, ring, n, out.copies, info);
  }
  queue(s.index, layer)[npending(s.index, layer)++] = n;
  return info;
}

inline Result<GateWriteInfo> GateDeferred::reconcile(PageTable& table, BlockPool& pool, SeqId s, std::int32_t layer,
                                                  std::span<const float> gates) noexcept {
  if (auto st = validate(s); !st) return st;
  const std::int32_t H = cfg_.num_kv_heads;
  if (layer < 0 || layer >= cfg_.num_layers) return Status{Errc::invalid_argument, "layer", layer, cfg_.num_layers};
  if (npending(s.index, layer) == 0) return Status{Errc::invalid_argument, "pending_writes (none to reconcile)", 0, 1};
  std::int32_t* q = queue(s.index, layer);
  const std::int64_t n = q[0];
  if (std::int64_t(gates.size()) != n * H) return Status{Errc::invalid_argument, "gates.size", std::int64_t(gates.size()), n * H};
  if (const std::int64_t bad = first_outside(gates, 0.0f, 1.0f); bad >= 0)
    return Status{Errc::invalid_argument, "gates_at", bad, 1};
  std::copy(q + 1, q + npending(s.index, layer), q);  // the oldest write leaves the queue
  --npending(s.index, layer);
  GateWriteInfo info{};
  std::int64_t& appended = appended_[std::size_t(s.index) * std::size_t(cfg_.num_layers) + std::size_t(layer)];
  for (std::int32_t h = 0; h < H; ++h) {
    const std::size_t hi = head_index(s.index, layer, h);
    apply_head(hi, h, n, gates, table.blocks_unchecked(ids_[hi]), appended, info, nullptr);
    // What the allotment did not use, and later writes will not need, goes back.
    const std::int32_t extra = table.tokens_unchecked(ids_[hi]) - allotted_row_tokens(hi, s.index, layer);
    if (extra > 0) (void)table.truncate(pool, ids_[hi], extra);
  }
  appended += n;
  return info;
}

KVCACHE_END_NAMESPACE
