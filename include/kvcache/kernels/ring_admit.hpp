// Ring admission on the device: Write-Gated KV's write when the gates live
// where the keys are, so the host never waits for them (WriteGate::allot /
// reconcile, admission/write_gate.hpp). Per kv-head, in token order: a token
// enters its ring slot; when the ring is full, the token it replaces moves to
// the head's global region (slot W + global_len) if its gate was >= tau and
// the head is under its cap, else it is dropped. The ring's start and length
// before the call come from the host (they do not depend on gates); the
// global length and the ring's admission bits are device state this kernel
// reads and updates; the head rows were allotted by the host for the worst
// case, so nothing is allocated here.
//
// One item per kv-head: its lanes split head_dim (a quantized pool's rows:
// by groups, or bytes of 4-bit codes, the same split in every move), and
// every lane takes the same decisions from the same inputs. The bits are
// read before the call's own tokens replace them and written once at the
// end, so lanes never race.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvcache/kernels/detail/common.hpp"
#include "kvcache/kernels/detail/quant_rows.hpp"
#include "kvcache/kernels/detail/rows.hpp"
#include "kvcache/kernels/scatter.hpp"
#include "kvcache/kernels/params/ring_admit.hpp"

KVCACHE_BEGIN_NAMESPACE

namespace ring_admit_detail {
KVCACHE_HOST_DEVICE inline std::int64_t slot(const RingAdmitParams& p, std::int32_t h, std::int32_t index) noexcept {
  const std::int32_t b = p.cache.block_size;
  return std::int64_t{p.rows[std::int64_t{h} * p.row_stride + index / b]} * b + index % b;
}
KVCACHE_HOST_DEVICE inline std::byte* at(const RingAdmitParams& p, std::int64_t s, std::int32_t kv) noexcept {
  const std::int64_t b = p.cache.block_size;
  return p.cache.row(s / b, 0, kv, static_cast<std::int32_t>(s % b), 0);
}
/// Slot s of side kv's group entries (quantized pools).
KVCACHE_HOST_DEVICE inline std::byte* entries_at(const RingAdmitParams& p, std::int64_t s, std::int32_t kv) noexcept {
  const std::int64_t b = p.cache.block_size;
  return row_entries(p.cache, s / b, 0, kv, static_cast<std::int32_t>(s % b), 0);
}
/// Writes side kv of slot dst from pool slot `from` (>= 0) or source entry
/// `entry` (from < 0): codes and entries copied, or quantized from the source.
KVCACHE_HOST_DEVICE inline void put(const RingAdmitParams& p, std::int64_t dst, std::int32_t kv, std::int64_t from,
                                    std::int64_t entry, bool by_elements, std::int32_t lane, std::int32_t nlanes) noexcept {
  if (quantized_side(p.cache, kv)) {
    if (from >= 0)
      copy_quantized_row(p.cache, kv, at(p, dst, kv), entries_at(p, dst, kv), at(p, from, kv), entries_at(p, from, kv),
                         lane, nlanes);
    else
      store_quantized_row(p.cache, kv, at(p, dst, kv), entries_at(p, dst, kv), p.src.row(kv, 0, entry, 0), p.src.dtype,
                          1.0f, lane, nlanes);
  } else if (from >= 0) {
    move_row(at(p, dst, kv), p.cache.dtype, at(p, from, kv), p.cache.dtype, p.cache.head_dim, 1.0f, lane, nlanes,
             by_elements);
  } else {
    move_row(at(p, dst, kv), p.cache.dtype, p.src.row(kv, 0, entry, 0), p.src.dtype, p.cache.head_dim, 1.0f, lane, nlanes,
             by_elements);
  }
}
}  // namespace ring_admit_detail

/// One kv-head's write, lanes [lane, nlanes) of its head_dim. Lane 0 also updates the state.
KVCACHE_HOST_DEVICE inline void ring_admit_head(const RingAdmitParams& p, std::int32_t h, std::int32_t lane,
                                                std::int32_t nlanes) noexcept {
  using ring_admit_detail::put;
  using ring_admit_detail::slot;
  const std::int32_t W = p.window, H = p.num_heads, n = p.num_tokens;
  std::int32_t start = p.ring_start[h], len = p.ring_len[h], gl = p.global_len[h], old_left = p.ring_len[h];
  const std::uint8_t* bits = p.bits + std::int64_t{h} * W;
  const bool by_elements = !raw_move(p.cache.dtype, p.src.dtype, 1.0f);
  for (std::int32_t t = 0; t < n; ++t) {
    std::int32_t r;
    if (len < W) {
      r = (start + len) % W;
      ++len;
    } else {
      r = start;
      start = (start + 1) % W;
      const bool old = old_left > 0;  // the victim was in the ring before the call: its bit and K/V are there
      old_left -= old ? 1 : 0;
      const bool admitted = old ? bits[r] != 0 : p.gates[std::int64_t{t - W} * H + h] >= p.tau;
      if (admitted && gl < p.global_limit) {
        const std::int64_t dst = slot(p, h, W + gl);
        ++gl;
        for (std::int32_t kv = 0; kv < 2; ++kv)  // a token of this call that leaves the ring within it: from the source
          put(p, dst, kv, old ? slot(p, h, r) : -1, std::int64_t{t - W} * H + h, by_elements, lane, nlanes);
      }
    }
    for (std::int32_t kv = 0; kv < 2; ++kv) put(p, slot(p, h, r), kv, -1, std::int64_t{t} * H + h, by_elements, lane, nlanes);
  }
#if defined(__CUDA_ARCH__)
  __syncwarp();  // every lane has read the old bits (a head is one warp)
#endif
  if (lane != 0) return;
  // The last min(n, W) tokens hold ring slots: their bits, written once every lane has read the old ones.
  std::uint8_t* out = p.bits + std::int64_t{h} * W;
  const std::int32_t kept = n < W ? n : W;
  std::int32_t r = len < W ? len - 1 : (start + W - 1) % W;  // slot of the newest token
  for (std::int32_t k = 0; k < kept; ++k) {
    out[r] = p.gates[std::int64_t{n - 1 - k} * H + h] >= p.tau ? 1 : 0;
    r = (r + W - 1) % W;
  }
  p.global_len[h] = gl;
}

/// What the host can see: shapes and pointers; shared by both launchers.
inline Status check_ring_admit_shape(const RingAdmitParams& p) noexcept {
  if (p.cache.num_layers != 1 || p.cache.num_kv_heads != 1)
    return Status{Errc::invalid_argument, "cache (one layer and one kv-head per block)", p.cache.num_kv_heads, 1};
  if (p.cache.kv_planes != 2) return Status{Errc::invalid_argument, "cache.kv_planes (K and V)", p.cache.kv_planes, 2};
  if (p.num_tokens < 0) return Status{Errc::invalid_argument, "num_tokens", p.num_tokens, 0};
  if (p.num_heads < 1) return Status{Errc::invalid_argument, "num_heads", p.num_heads, 1};
  if (p.window < p.cache.block_size || p.window % p.cache.block_size != 0)
    return Status{Errc::invalid_argument, "window (a multiple of the block size)", p.window, p.cache.block_size};
  if (p.global_limit < 0) return Status{Errc::invalid_argument, "global_limit", p.global_limit, 0};
  if (!(p.tau >= 0.0f && p.tau <= 1.0f)) return Status{Errc::invalid_argument, "tau (in [0, 1])", 0, 1};
  if (p.row_stride * std::int64_t{p.cache.block_size} < std::int64_t{p.window} + p.global_limit)
    return Status{Errc::invalid_argument, "row_stride (rows hold window + global_limit)", p.row_stride,
                  std::int64_t{p.window} + p.global_limit};
  if (p.num_tokens > 0 &&  // nothing is read or written for no tokens
      (!p.gates || !p.ring_start || !p.ring_len || !p.global_len || !p.bits || !p.rows || !p.src.k || !p.src.v))
    return Status{Errc::invalid_argument, "null pointer", 0, 1};
  if (auto st = check_pool_rows(p.cache, "cache.dtype"); !st) return st;
  if (auto st = check_row_writes(p.cache, "cache.format (a channel-scaled side is written by seal_blocks)"); !st) return st;
  if (auto st = check_dtype(p.src.dtype, "src.dtype"); !st) return st;
  return {};
}

/// Host backend: the same body, one head after another.
inline Status ring_admit_host(const RingAdmitParams& p) noexcept {
  if (auto st = check_ring_admit_shape(p); !st) return st;
  if (p.num_tokens == 0) return {};
  for (std::int32_t h = 0; h < p.num_heads; ++h) ring_admit_head(p, h, 0, 1);
  return {};
}

KVCACHE_END_NAMESPACE
