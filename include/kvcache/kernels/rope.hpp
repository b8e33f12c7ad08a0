// RoPE re-rotation after eviction: the keys of each listed block are rotated
// by that block's position delta (tokens), in place. NeoX pairs dims (i, i+R/2),
// GPT-J pairs (2i, 2i+1). Angles come from a shared table with one row per
// |delta| (a negative delta uses the conjugate), computed once by
// make_rope_table or supplied by the caller.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <type_traits>

#include "common.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Which dimensions a rotation pairs: NeoX (d, d + R/2) or GPT-J (2d, 2d + 1).
enum class RopeStyle : std::uint8_t { neox, gptj };

/// cos/sin[delta * (rotary_dim/2) + i] = cos/sin(delta * theta^(-2i/rotary_dim)),
/// for delta in [0, max_delta]. Computed in double, stored as float.
inline Status make_rope_table(double theta, std::int32_t rotary_dim, std::int32_t max_delta, std::span<float> cos_out,
                              std::span<float> sin_out) noexcept {
  if (!(theta > 0.0) || !std::isfinite(theta))  // the value is reported only when it converts (no NaN or inf to int)
    return Status{Errc::invalid_argument, "theta", std::isfinite(theta) && std::fabs(theta) < 9.2e18 ? std::int64_t(theta) : 0, 0};
  if (rotary_dim < 2 || rotary_dim % 2) return Status{Errc::invalid_argument, "rotary_dim", rotary_dim, 2};
  if (max_delta < 0) return Status{Errc::invalid_argument, "max_delta", max_delta, 0};
  const std::int64_t half = rotary_dim / 2, need = (std::int64_t{max_delta} + 1) * half;
  if (std::int64_t(cos_out.size()) < need || std::int64_t(sin_out.size()) < need)
    return Status{Errc::buffer_too_small, "cos/sin", std::int64_t(std::min(cos_out.size(), sin_out.size())), need};
  for (std::int64_t d = 0; d <= max_delta; ++d)
    for (std::int64_t i = 0; i < half; ++i) {
      const double angle = double(d) * std::pow(theta, -2.0 * double(i) / double(rotary_dim));
      cos_out[std::size_t(d * half + i)] = static_cast<float>(std::cos(angle));
      sin_out[std::size_t(d * half + i)] = static_cast<float>(std::sin(angle));
    }
  return {};
}

/// Parameters of rope: re-rotate the keys of listed blocks by a per-block position delta.
struct RopeParams {
  PoolView cache{};  ///< The pool.
  std::int32_t first_layer = 0;  ///< First layer rotated.
  std::int32_t num_layers = 1;  ///< Layers rotated.
  const std::int32_t* blocks = nullptr;  ///< blocks whose keys rotate
  const std::int32_t* deltas = nullptr;  ///< position delta per block, in tokens (signed)
  std::int32_t num_entries = 0;  ///< Entries in blocks and deltas.
  const float* cos = nullptr;  ///< cos table: (max_delta + 1) rows of rotary_dim / 2.
  const float* sin = nullptr;  ///< sin table, same shape.
  std::int32_t max_delta = 0;  ///< rows in the table: |delta| <= max_delta
  std::int32_t rotary_dim = 0;  ///< leading dims rotated (0 = head_dim)
  RopeStyle style = RopeStyle::neox;  ///< NeoX (d, d + R/2) or GPT-J (2d, 2d + 1) pairs.
};
static_assert(std::is_trivially_copyable_v<RopeParams>);

/// Dimensions rotated: rotary_dim, or head_dim when it is 0.
KVCACHE_HOST_DEVICE inline std::int32_t rope_dims(const RopeParams& p) noexcept {
  return p.rotary_dim > 0 ? p.rotary_dim : p.cache.head_dim;
}

/// One (entry, layer, token, head) key row; lanes split the rotation pairs.
KVCACHE_HOST_DEVICE inline void rope_row(const RopeParams& p, std::int32_t entry, std::int32_t layer,
                                         std::int32_t token, std::int32_t head, std::int32_t lane,
                                         std::int32_t nlanes) noexcept {
  const std::int32_t block = p.blocks[entry], delta = p.deltas[entry];
  const std::int32_t ad = delta < 0 ? -delta : delta;
  if (block < 0 || block >= p.cache.num_blocks || ad > p.max_delta || delta == 0) return;
  std::byte* row = p.cache.row(block, p.first_layer + layer, 0, token, head);
  const std::int32_t half = rope_dims(p) / 2;
  for (std::int32_t i = lane; i < half; i += nlanes) {
    const float c = p.cos[std::int64_t{ad} * half + i];
    const float s = delta < 0 ? -p.sin[std::int64_t{ad} * half + i] : p.sin[std::int64_t{ad} * half + i];
    const std::int32_t ix = p.style == RopeStyle::neox ? i : 2 * i, iy = p.style == RopeStyle::neox ? i + half : 2 * i + 1;
    const float x = load_elem(p.cache.dtype, row, ix), y = load_elem(p.cache.dtype, row, iy);
    // Explicit fma: host and device round identically.
    store_elem(p.cache.dtype, row, ix, fmaf(x, c, -(y * s)));
    store_elem(p.cache.dtype, row, iy, fmaf(y, c, x * s));
  }
}

/// Checks the parameters' shape (pool, layer range, rotary dims, pointers, max_delta).
inline Status check_rope_shape(const RopeParams& p) noexcept {
  if (!p.cache.base) return Status{Errc::invalid_argument, "cache.base", 0, 1};
  if (p.num_layers < 1 || p.first_layer < 0 || std::int64_t{p.first_layer} + p.num_layers > p.cache.num_layers)
    return Status{Errc::invalid_argument, "first_layer+num_layers", std::int64_t{p.first_layer} + p.num_layers, p.cache.num_layers};
  const std::int32_t r = rope_dims(p);
  if (r < 2 || r % 2 || r > p.cache.head_dim) return Status{Errc::invalid_argument, "rotary_dim", r, p.cache.head_dim};
  if (p.num_entries > 0 && (!p.blocks || !p.deltas || !p.cos || !p.sin)) return Status{Errc::invalid_argument, "pointers", 0, 1};
  if (p.max_delta < 0) return Status{Errc::invalid_argument, "max_delta", p.max_delta, 0};
  if (auto st = check_pool_dtype(p.cache, "cache.dtype"); !st) return st;
  if (p.style != RopeStyle::neox && p.style != RopeStyle::gptj)
    return Status{Errc::invalid_argument, "style", static_cast<std::int64_t>(p.style), 1};
  return {};
}

/// Host backend: an entry naming a block outside the pool or a delta beyond the
/// table is an error naming the entry, and nothing is rotated.
inline Status rope_host(const RopeParams& p) noexcept {
  if (auto st = check_rope_shape(p); !st) return st;
  for (std::int32_t e = 0; e < p.num_entries; ++e) {
    if (p.blocks[e] < 0 || p.blocks[e] >= p.cache.num_blocks) return Status{Errc::invalid_argument, "blocks", e, p.cache.num_blocks};
    if (p.deltas[e] > p.max_delta || p.deltas[e] < -p.max_delta) return Status{Errc::invalid_argument, "deltas", e, p.max_delta};
  }
  for (std::int32_t e = 0; e < p.num_entries; ++e)
    for (std::int32_t l = 0; l < p.num_layers; ++l)
      for (std::int32_t t = 0; t < p.cache.block_size; ++t)
        for (std::int32_t h = 0; h < p.cache.num_kv_heads; ++h) rope_row(p, e, l, t, h, 0, 1);
  return {};
}

KVCACHE_END_NAMESPACE
