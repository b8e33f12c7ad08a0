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

#include "kvcache/kernels/detail/common.hpp"
#include "kvcache/kernels/detail/quant_rows.hpp"
#include "kvcache/kernels/detail/rows.hpp"

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

namespace rope_detail {
/// Values a quantized rotation holds at once: two groups of 128, or a whole
/// rotated range that does not split into groups.
inline constexpr std::int32_t kQuantSpan = 256;

/// How a quantized key row's rotation splits into `count` independent
/// pieces: piece i reads and rewrites elements [i * stride, i * stride + n)
/// and, when partner > 0, the same span `partner` elements on (NeoX's other
/// half). Each piece is whole pool_units, so requantizing one never touches
/// another's groups. n == 0: the rotated groups do not split and exceed
/// kQuantSpan.
struct Pieces {
  std::int32_t count = 0, n = 0, stride = 0, partner = 0;
};
KVCACHE_HOST_DEVICE inline Pieces quantized_pieces(const RopeParams& p) noexcept {
  const std::int32_t u = pool_unit(p.cache, 0), r = rope_dims(p), half = r / 2;
  if (p.style == RopeStyle::gptj)  // pairs (2i, 2i + 1) never straddle a unit (units are even)
    return u >= 2 ? Pieces{(r + u - 1) / u, u, u, 0} : Pieces{};
  if (half % u == 0) return Pieces{half / u, u, u, half};  // unit g pairs with unit g + half / u
  const std::int32_t end = (r + u - 1) / u * u;  // the units the rotated dims touch, read and rewritten as one
  return end <= kQuantSpan ? Pieces{1, end, end, 0} : Pieces{};
}

/// Rotates x[ix] with x[iy] by (c, s), the same floats as the element path.
KVCACHE_HOST_DEVICE inline void turn(float* x, std::int32_t ix, std::int32_t iy, float c, float s) noexcept {
  const float a = x[ix], b = x[iy];
  x[ix] = fmaf(a, c, -(b * s));
  x[iy] = fmaf(b, c, a * s);
}
}  // namespace rope_detail

/// One quantized key row (group scales or 4-bit codes): each piece is
/// dequantized, rotated in fp32 and requantized (new group scales); lanes
/// split the pieces. Groups past the rotated dims keep their codes.
KVCACHE_HOST_DEVICE inline void rope_quantized_row(const RopeParams& p, std::byte* codes, std::byte* entries,
                                                   std::int32_t ad, bool negative, std::int32_t lane,
                                                   std::int32_t nlanes) noexcept {
  const rope_detail::Pieces pc = rope_detail::quantized_pieces(p);
  const std::int32_t half = rope_dims(p) / 2;
  float x[rope_detail::kQuantSpan];
  for (std::int32_t i = lane; i < pc.count; i += nlanes) {
    const std::int32_t d0 = i * pc.stride, d1 = d0 + pc.partner;  // element d0 + j is x[j]; d1 + j is x[pc.n + j]
    load_pool_span(p.cache, 0, codes, entries, d0, pc.n, x);
    if (pc.partner > 0) load_pool_span(p.cache, 0, codes, entries, d1, pc.n, x + pc.n);
    for (std::int32_t j = 0; j < pc.n; ++j) {
      // The pair this element leads, if any, and where its partner sits in x.
      const std::int32_t d = d0 + j;
      std::int32_t k, iy;
      if (p.style == RopeStyle::gptj) {
        if (d % 2 || d / 2 >= half) continue;
        k = d / 2, iy = j + 1;
      } else if (pc.partner > 0) {
        k = d, iy = pc.n + j;
      } else {
        if (d >= half) break;
        k = d, iy = j + half;
      }
      const float c = p.cos[std::int64_t{ad} * half + k];
      const float s = negative ? -p.sin[std::int64_t{ad} * half + k] : p.sin[std::int64_t{ad} * half + k];
      rope_detail::turn(x, j, iy, c, s);
    }
    store_pool_span(p.cache, 0, codes, entries, d0, pc.n, x);
    if (pc.partner > 0) store_pool_span(p.cache, 0, codes, entries, d1, pc.n, x + pc.n);
  }
}

/// One (entry, layer, token, head) key row; lanes split the rotation pairs.
KVCACHE_HOST_DEVICE inline void rope_row(const RopeParams& p, std::int32_t entry, std::int32_t layer,
                                         std::int32_t token, std::int32_t head, std::int32_t lane,
                                         std::int32_t nlanes) noexcept {
  const std::int32_t block = p.blocks[entry], delta = p.deltas[entry];
  const std::int32_t ad = delta < 0 ? -delta : delta;
  if (block < 0 || block >= p.cache.num_blocks || ad > p.max_delta || delta == 0) return;
  std::byte* row = p.cache.row(block, p.first_layer + layer, 0, token, head);
  if (quantized_side(p.cache, 0))
    return rope_quantized_row(p, row, row_entries(p.cache, block, p.first_layer + layer, 0, token, head), ad, delta < 0,
                              lane, nlanes);
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
  if (auto st = check_pool_rows(p.cache, "cache.dtype"); !st) return st;
  if (auto st = check_row_writes(p.cache, "cache.format (channel scales: a rotated row changes its block's channels)"); !st)
    return st;
  if (quantized_side(p.cache, 0) && rope_detail::quantized_pieces(p).n == 0)
    return Status{Errc::invalid_argument, "rotary_dim (quantized NeoX keys whose half splits a group: at most 256)", r,
                  rope_detail::kQuantSpan};
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
