// Ring write with promotion: each new token goes to a slot of its stream's
// local ring; when the token it replaces is marked for promotion, that token
// is first copied to a given global slot (write-gated admission, sliding
// windows). Read-before-overwrite holds per thread: the promotion and the
// write split the row the same way. A quantized pool's row is quantized as
// it is written (store_quantized_row) and promoted with its entries.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvcache/kernels/detail/common.hpp"
#include "kvcache/kernels/detail/quant_rows.hpp"
#include "kvcache/kernels/detail/rows.hpp"
#include "kvcache/kernels/scatter.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Parameters of ring_write: tokens into ring slots, promoting marked replaced tokens first.
struct RingWriteParams {
  PoolView cache{};  ///< The pool.
  KvSource src{};  ///< The new K/V.
  std::int64_t num_tokens = 0;  ///< Tokens written.
  std::int32_t first_layer = 0;  ///< First layer written.
  std::int32_t num_layers = 1;  ///< Layers written.
  const std::int32_t* ring_slots = nullptr;  ///< where token t goes (negative = skip)
  const std::int32_t* promote_slots = nullptr;  ///< where the replaced token goes first (-1 / null = dropped)
  float k_scale = 1.0f;  ///< Quantization scale of K (cache = input / scale).
  float v_scale = 1.0f;  ///< Quantization scale of V.
  /// Engine-held scales of format.k (tensor: [cache layers]; head: [cache
  /// layers][kv_heads]), times k_scale; null: none. Memory the backend reads.
  const float* k_scales = nullptr;
  const float* v_scales = nullptr;  ///< The same for format.v.
};
static_assert(std::is_trivially_copyable_v<RingWriteParams>);

/// Writes one (layer, token) into its ring slot, promoting the replaced token first when marked.
KVCACHE_HOST_DEVICE inline void ring_write_row(const RingWriteParams& p, std::int32_t layer, std::int64_t token,
                                               std::int32_t kv, std::int32_t head, std::int32_t lane,
                                               std::int32_t nlanes) noexcept {
  const std::int64_t pool_slots = p.cache.num_blocks * p.cache.block_size, b = p.cache.block_size;
  const std::int64_t ring = p.ring_slots[token];
  if (ring < 0 || ring >= pool_slots) return;
  const std::int32_t cache_layer = p.first_layer + layer;
  std::byte* ring_row = p.cache.row(ring / b, cache_layer, kv, static_cast<std::int32_t>(ring % b), head);
  // What the row's inputs are divided by: the call's scale times the engine-held one (the rounding of x / d, as vLLM's writes).
  const float div = (kv == 0 ? p.k_scale : p.v_scale) * held_scale(p.cache, kv, kv == 0 ? p.k_scales : p.v_scales, cache_layer, head);
  const std::int64_t promote = p.promote_slots ? p.promote_slots[token] : -1;
  if (quantized_side(p.cache, kv)) {
    std::byte* ring_entries = row_entries(p.cache, ring / b, cache_layer, kv, static_cast<std::int32_t>(ring % b), head);
    if (promote >= 0 && promote < pool_slots) {
      const auto pt = static_cast<std::int32_t>(promote % b);
      copy_quantized_row(p.cache, kv, p.cache.row(promote / b, cache_layer, kv, pt, head),
                         row_entries(p.cache, promote / b, cache_layer, kv, pt, head), ring_row, ring_entries, lane, nlanes);
    }
    store_quantized_row(p.cache, kv, ring_row, ring_entries, p.src.row(kv, layer, token, head), p.src.dtype, div, lane,
                        nlanes);
    return;
  }
  const bool by_elements = !raw_move(p.cache.dtype, p.src.dtype, div);  // same partition in both passes
  if (promote >= 0 && promote < pool_slots)
    move_row(p.cache.row(promote / b, cache_layer, kv, static_cast<std::int32_t>(promote % b), head), p.cache.dtype,
             ring_row, p.cache.dtype, p.cache.head_dim, 1.0f, lane, nlanes, by_elements);
  move_row(ring_row, p.cache.dtype, p.src.row(kv, layer, token, head), p.src.dtype, p.cache.head_dim, div, lane,
           nlanes, by_elements, false, true);
}

/// What the host can see (shapes, layers, scales); shared by both launchers.
inline Status check_ring_write_shape(const RingWriteParams& p) noexcept {
  if (p.num_tokens > 0 && !p.ring_slots) return Status{Errc::invalid_argument, "ring_slots", 0, 1};
  return check_scatter_shape({p.cache, p.src, TokenAddress{p.ring_slots}, p.num_tokens, p.first_layer, p.num_layers,
                              p.k_scale, p.v_scale, p.k_scales, p.v_scales});
}

/// Host backend: validates every slot, then writes; nothing is written on an error.
inline Status ring_write_host(const RingWriteParams& p) noexcept {
  if (auto st = check_ring_write_shape(p); !st) return st;
  if (auto st = check_held_scales(p.cache, p.k_scales, p.v_scales, true); !st) return st;
  const std::int64_t pool_slots = p.cache.num_blocks * p.cache.block_size;
  for (std::int64_t t = 0; t < p.num_tokens; ++t) {
    if (p.ring_slots[t] >= pool_slots) return Status{Errc::invalid_argument, "ring_slots", t, pool_slots};
    if (p.promote_slots && p.promote_slots[t] >= pool_slots)
      return Status{Errc::invalid_argument, "promote_slots", t, pool_slots};
  }
  for (std::int64_t t = 0; t < p.num_tokens; ++t)
    for (std::int32_t l = 0; l < p.num_layers; ++l)
      for (std::int32_t kv = 0; kv < p.cache.kv_planes; ++kv)
        for (std::int32_t h = 0; h < p.cache.num_kv_heads; ++h) ring_write_row(p, l, t, kv, h, 0, 1);
  return {};
}

KVCACHE_END_NAMESPACE
