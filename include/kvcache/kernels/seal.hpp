// Seal: whole blocks written at once, from their tokens' full-precision K/V.
// A channel-scaled side (Scales::channel, KIVI's keys) takes one scale and
// minimum per (block, head, channel) over the block's tokens, so its codes
// exist only once the block's last token is known: the engine keeps the
// open block in full precision (KIVI's residual) and seals it when it
// fills. Every other side of the block is written as scatter writes it.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvcache/kernels/detail/common.hpp"
#include "kvcache/kernels/detail/quant.hpp"
#include "kvcache/kernels/detail/quant_rows.hpp"
#include "kvcache/kernels/detail/rows.hpp"
#include "kvcache/kernels/scatter.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Parameters of seal_blocks: block i of `blocks` receives source tokens
/// [i * block_size, (i + 1) * block_size), all of them, in every layer of
/// [first_layer, first_layer + num_layers).
struct SealParams {
  PoolView cache{};  ///< The pool.
  KvSource src{};  ///< The blocks' K/V: source token i * block_size + t is block i's token t.
  const std::int32_t* blocks = nullptr;  ///< [num_blocks] pool blocks written whole; no block twice.
  std::int32_t num_blocks = 0;  ///< Blocks sealed.
  std::int32_t first_layer = 0;  ///< First cache layer written.
  std::int32_t num_layers = 1;  ///< Source layer l lands in cache layer first_layer + l.
  float k_scale = 1.0f;  ///< K is stored as input / k_scale (a per-tensor factor over the stored scales).
  float v_scale = 1.0f;  ///< The same for V.
  /// Engine-held scales of a tensor- or head-scaled side, as scatter's; null: none.
  const float* k_scales = nullptr;
  const float* v_scales = nullptr;  ///< The same for format.v.
};
static_assert(std::is_trivially_copyable_v<SealParams>);

/// The scatter that writes a sealed block's rows on a side without channel
/// scales: the same rows, quantized the same way.
KVCACHE_HOST_DEVICE inline ScatterParams seal_rows(const SealParams& p) noexcept {
  return {p.cache, p.src, TokenAddress{}, 0, p.first_layer, p.num_layers, p.k_scale, p.v_scale, p.k_scales, p.v_scales};
}

/// Codes of a channel side that share one byte (8, 4 or 2 bits a code): a
/// unit of seal_channel_unit.
KVCACHE_HOST_DEVICE inline std::int32_t seal_unit(const PoolView& v) noexcept { return 8 / dtype_bits(v.dtype); }

/// Seals the channels [unit * n, (unit + 1) * n) (n = seal_unit: the codes of
/// one byte) of block i, layer, side kv (channel-scaled), kv-head head: each
/// channel's range over the block's tokens gives its entry (quant::group_scale,
/// as a group's), then every token's byte of codes (shared by both backends).
KVCACHE_HOST_DEVICE inline void seal_channel_unit(const SealParams& p, std::int32_t i, std::int32_t layer, std::int32_t kv,
                                                  std::int32_t head, std::int32_t unit) noexcept {
  const PoolView& v = p.cache;
  const SideFormat& f = side_format(v, kv);
  const std::int32_t n = seal_unit(v), bits = dtype_bits(v.dtype), B = v.block_size, c0 = unit * n;
  const std::int64_t block = p.blocks[i], first = std::int64_t{i} * B;
  const float div = kv == 0 ? p.k_scale : p.v_scale;  // the values are divided by it, as scatter divides
  std::byte* entries = row_entries(v, block, p.first_layer + layer, kv, 0, head);
  const std::int64_t eb = group_entry_bytes(v.dtype, f);
  float scale[4], minimum[4];
  for (std::int32_t j = 0; j < n; ++j) {
    // The channel's range, as quantize_group finds a group's (order keys, so
    // NaN and -0 rank as they do there).
    std::int32_t kmin = 0, kmax = 0;
    std::uint32_t amax = 0;
    for (std::int32_t t = 0; t < B; ++t) {
      const float x = load_elem(p.src.dtype, p.src.row(kv, layer, first + t, head), c0 + j) / div;
      const std::int32_t k = quant::order_key(x);
      kmin = t == 0 || k < kmin ? k : kmin;
      kmax = t == 0 || k > kmax ? k : kmax;
      const std::uint32_t a = cvt::bits(x) & 0x7fffffffu;
      amax = a > amax ? a : amax;
    }
    const quant::GroupScale g = quant::group_scale(v.dtype, f.minimum, quant::from_order_key(kmin),
                                                   quant::from_order_key(kmax), cvt::from_bits(amax));
    std::byte* entry = entries + (c0 + j) * eb;
    quant::store_entry_value(v.dtype, entry, 0, g.scale);
    if (f.minimum) quant::store_entry_value(v.dtype, entry, 1, g.minimum);
    scale[j] = g.scale;
    minimum[j] = g.minimum;
  }
  for (std::int32_t t = 0; t < B; ++t) {
    const std::byte* in = p.src.row(kv, layer, first + t, head);
    std::uint32_t byte = 0;
    for (std::int32_t j = 0; j < n; ++j)
      byte |= quant::encode(v.dtype, f.minimum, quant::quotient(load_elem(p.src.dtype, in, c0 + j) / div - minimum[j], scale[j]))
              << (bits * j);
    *reinterpret_cast<std::uint8_t*>(v.row(block, p.first_layer + layer, kv, t, head) + unit) = static_cast<std::uint8_t>(byte);
  }
}

/// Writes token t of block i, layer, side kv (not channel-scaled), kv-head
/// head, as scatter writes a row; lanes split it (shared by both backends).
KVCACHE_HOST_DEVICE inline void seal_row(const SealParams& p, std::int32_t i, std::int32_t layer, std::int32_t kv,
                                         std::int32_t token, std::int32_t head, std::int32_t lane, std::int32_t nlanes) noexcept {
  const std::int64_t block = p.blocks[i];
  scatter_row_at(seal_rows(p), layer, kv, head, block, token, p.cache.row(block, p.first_layer + layer, kv, token, head),
                 p.src.row(kv, layer, std::int64_t{i} * p.cache.block_size + token, head), lane, nlanes);
}

/// One item of a seal: a token of one layer of one block.
struct SealItem {
  std::int32_t i;  ///< The block's index in SealParams::blocks.
  std::int32_t layer;  ///< The layer, from SealParams::first_layer.
  std::int32_t t;  ///< The token in the block.
};
/// What item `item` of a seal is (items run token-fastest, then layer, then block).
KVCACHE_HOST_DEVICE inline SealItem seal_item_of(const SealParams& p, std::int64_t item) noexcept {
  const std::int32_t B = p.cache.block_size;
  const std::int64_t rest = item / B;
  return {static_cast<std::int32_t>(rest / p.num_layers), static_cast<std::int32_t>(rest % p.num_layers),
          static_cast<std::int32_t>(item % B)};
}

/// Item (block i, layer, token t) of a seal, side kv, kv-head head: token
/// t's row on a row-written side; on a channel side, item t = 0 seals the
/// (block, layer, head)'s channels, a unit a lane, and other items do
/// nothing. Both backends run this over items x sides x heads x lanes.
KVCACHE_HOST_DEVICE inline void seal_item(const SealParams& p, std::int64_t item, std::int32_t kv, std::int32_t head,
                                          std::int32_t lane, std::int32_t nlanes) noexcept {
  const auto [i, layer, t] = seal_item_of(p, item);
  if (!channel_side(p.cache, kv)) {
    seal_row(p, i, layer, kv, t, head, lane, nlanes);
    return;
  }
  if (t != 0) return;
  for (std::int32_t u = lane; u * seal_unit(p.cache) < p.cache.head_dim; u += nlanes) seal_channel_unit(p, i, layer, kv, head, u);
}

/// Items of a seal: blocks x layers x tokens.
KVCACHE_HOST_DEVICE inline std::int64_t seal_items(const SealParams& p) noexcept {
  return std::int64_t{p.num_blocks} * p.num_layers * p.cache.block_size;
}

/// The most values of one (block, head) the host's seal buffers: block_size x head_dim.
inline constexpr std::int32_t kSealHostFloats = 8192;
/// The largest head_dim the host's seal buffers.
inline constexpr std::int32_t kSealHostDim = 512;
/// The host seal's buffers, on the caller's stack (no allocation).
struct SealScratch {
  float x[kSealHostFloats + 2 * kSealHostDim];  ///< The block's rows, then each channel's scale and minimum.
  std::int32_t n[4 * kSealHostDim];  ///< Each channel's smallest and largest order key and largest |x| bits; a row's codes.
};
/// True when a (block, head) of v fits SealScratch: seal_blocks_host then
/// takes seal_channels_host, else the per-unit body.
inline bool seal_host_fits(const PoolView& v) noexcept {
  return v.head_dim <= kSealHostDim && std::int64_t{v.block_size} * v.head_dim <= kSealHostFloats;
}
/// Where a (block i, layer, side kv, kv-head head) of a seal is: the pool
/// block, its first source token, what its values are divided by (the
/// side's tensor scale), and SealScratch's parts: the block's rows as
/// floats (x), each channel's scale (sc) and minimum (mn).
struct SealHostBlock {
  std::int64_t block;  ///< The pool block.
  std::int64_t first;  ///< Its first source token.
  float div;  ///< The side's tensor scale: the values are divided by it.
  float* x;  ///< block_size x head_dim floats: the block's rows.
  float* sc;  ///< head_dim: each channel's scale.
  float* mn;  ///< head_dim: each channel's minimum.
};
/// Block i's side kv as seal_channels_host sees it, its buffers in scratch
/// (not seal_unit's channel runs, which are the CUDA seal's work items).
inline SealHostBlock seal_host_block(const SealParams& p, std::int32_t i, std::int32_t kv, SealScratch& scratch) noexcept {
  const std::int32_t B = p.cache.block_size, D = p.cache.head_dim;
  float* x = scratch.x;
  return {p.blocks[i], std::int64_t{i} * B, kv == 0 ? p.k_scale : p.v_scale, x, x + std::int64_t{B} * D,
          x + std::int64_t{B} * D + D};
}
/// Block u's source rows into u.x as floats: load_elem(src) / div, as the
/// scatter rows compute it.
inline void seal_host_rows(const SealParams& p, const SealHostBlock& u, std::int32_t layer, std::int32_t kv,
                           std::int32_t head) noexcept {
  const std::int32_t D = p.cache.head_dim;
  for (std::int32_t t = 0; t < p.cache.block_size; ++t) {
    const std::byte* in = p.src.row(kv, layer, u.first + t, head);
    float* row = u.x + std::int64_t{t} * D;
    const std::int32_t done = fast_rows(row, DType::f32, in, p.src.dtype, D, u.div, false, true);
    load_row(p.src.dtype, in + row_bytes(p.src.dtype, done), row + done, D - done);
    for (std::int32_t d = done; d < D; ++d) row[d] /= u.div;
  }
}

#if KVCACHE_HOST_SIMD
namespace simd {
/// seal_channels_host's vector paths: sixteen channels a vector where the
/// CPU has AVX-512 (kernels/host/x86/avx512_channels.hpp), else eight (AVX2,
/// kernels/host/x86/avx2_channels.hpp), the scalar path's entries and codes; false when
/// neither takes the side's format (nothing written). An entry point
/// (kernels/host/cpu.hpp).
KVCACHE_HOST_KERNEL bool seal_block_channels(const SealParams& p, std::int32_t i, std::int32_t layer, std::int32_t kv,
                                             std::int32_t head, SealScratch& scratch) noexcept
#if KVCACHE_HOST_KERNEL_DECLARED
    ;
#else
{
  const PoolView& v = p.cache;
  const SideFormat& f = side_format(v, kv);
  const std::int32_t B = v.block_size, D = v.head_dim;
  const SealHostBlock u = seal_host_block(p, i, kv, scratch);
  std::byte* entries = row_entries(v, u.block, p.first_layer + layer, kv, 0, head);
#if !defined(KVCACHE_NO_AVX512)
  {  // Straight from the source rows, without the float buffer's pass.
    const auto src = [&](std::int32_t t) { return p.src.row(kv, layer, u.first + t, head); };
    const auto out = [&](std::int32_t t) { return v.row(u.block, p.first_layer + layer, kv, t, head); };
    if (channels_fast(v.dtype, D, p.src.dtype) &&
        avx512::seal_channels(v.dtype, f.minimum, p.src.dtype, src, out, entries, B, D, u.div, u.x, u.sc, u.mn))
      return true;
  }
#endif
  if (!channels_fast(v.dtype, D, DType::f32)) return false;
  seal_host_rows(p, u, layer, kv, head);
  channel_entries(v.dtype, f.minimum, u.x, B, D, entries, u.sc, u.mn);
  for (std::int32_t t = 0; t < B; ++t)
    channel_codes(v.dtype, f.minimum, v.row(u.block, p.first_layer + layer, kv, t, head), u.x + std::int64_t{t} * D, u.sc,
                  u.mn, D);
  return true;
}
#endif
}  // namespace simd
#endif

/// The host's seal of a (block i, layer, channel side kv, kv-head head):
/// seal_channel_unit's bits, in the order a CPU wants. The block's rows go
/// through a float buffer once, the channels' ranges accumulate a row at a
/// time (vectors across channels, not strided reads down each channel), and
/// each token's codes are computed across its row (seal_host_fits(v) holds).
inline void seal_channels_host(const SealParams& p, std::int32_t i, std::int32_t layer, std::int32_t kv, std::int32_t head,
                               SealScratch& scratch) noexcept {
#if KVCACHE_HOST_SIMD
  if (simd::seal_block_channels(p, i, layer, kv, head, scratch)) return;
#endif
  const PoolView& v = p.cache;
  const SideFormat& f = side_format(v, kv);
  const std::int32_t B = v.block_size, D = v.head_dim;
  const SealHostBlock u = seal_host_block(p, i, kv, scratch);
  const std::int64_t block = u.block;
  float *x = u.x, *sc = u.sc, *mn = u.mn;
  std::int32_t *kmin = scratch.n, *kmax = kmin + D, *amax = kmax + D, *q = amax + D;  // amax: |x|'s bits, below 2^31
  seal_host_rows(p, u, layer, kv, head);
  for (std::int32_t d = 0; d < D; ++d) kmin[d] = kmax[d] = quant::order_key(x[d]), amax[d] = 0;
  for (std::int32_t t = 0; t < B; ++t)
    for (std::int32_t d = 0; d < D; ++d) {
      const float xv = x[std::int64_t{t} * D + d];
      const std::int32_t k = quant::order_key(xv);
      const auto a = static_cast<std::int32_t>(cvt::bits(xv) & 0x7fffffffu);
      kmin[d] = k < kmin[d] ? k : kmin[d];
      kmax[d] = k > kmax[d] ? k : kmax[d];
      amax[d] = a > amax[d] ? a : amax[d];
    }
  std::byte* entries = row_entries(v, block, p.first_layer + layer, kv, 0, head);
  const std::int64_t eb = group_entry_bytes(v.dtype, f);
  for (std::int32_t d = 0; d < D; ++d) {
    const quant::GroupScale g =
        quant::group_scale(v.dtype, f.minimum, quant::from_order_key(kmin[d]), quant::from_order_key(kmax[d]),
                            cvt::from_bits(static_cast<std::uint32_t>(amax[d])));
    quant::store_entry_value(v.dtype, entries + d * eb, 0, g.scale);
    if (f.minimum) quant::store_entry_value(v.dtype, entries + d * eb, 1, g.minimum);
    sc[d] = g.scale;
    mn[d] = g.minimum;
  }
  const auto cmax = static_cast<std::int32_t>(quant::code_max(v.dtype, f.minimum));
  const std::int32_t lo = f.minimum ? 0 : -cmax, bits = dtype_bits(v.dtype);
  const std::uint32_t mask = (1u << bits) - 1u;
  for (std::int32_t t = 0; t < B; ++t) {
    const float* row = x + std::int64_t{t} * D;
    for (std::int32_t d = 0; d < D; ++d) q[d] = cvt::to_int(quant::quotient(row[d] - mn[d], sc[d]), lo, cmax);  // encode's integer
    auto* out = reinterpret_cast<std::uint8_t*>(v.row(block, p.first_layer + layer, kv, t, head));
    for (std::int32_t b = 0; b * 8 < D * bits; ++b) {
      std::uint32_t byte = 0;
      for (std::int32_t j = 0; j < 8 / bits; ++j) byte |= (static_cast<std::uint32_t>(q[b * (8 / bits) + j]) & mask) << (bits * j);
      out[b] = static_cast<std::uint8_t>(byte);
    }
  }
}

/// Checks what the host can see: the pool, layers, counts, pointers and
/// scales (not the block list, which may be device memory).
inline Status check_seal_shape(const SealParams& p) noexcept {
  if (!p.cache.base) return Status{Errc::invalid_argument, "cache.base", 0, 1};
  if (p.num_blocks < 0) return Status{Errc::invalid_argument, "num_blocks", p.num_blocks, 0};
  if (auto st = check_planes(p.cache, "cache.kv_planes"); !st) return st;
  if (p.num_blocks > 0 && (!p.blocks || !p.src.k || (p.cache.kv_planes == 2 && !p.src.v)))
    return Status{Errc::invalid_argument, "blocks/src.k/src.v", 0, 1};
  return check_source_writes(p.cache, p.src, p.first_layer, p.num_layers, p.k_scale, p.v_scale, p.k_scales, p.v_scales);
}

/// Host backend: checks every block (in the pool, none twice) before
/// writing anything, then seals them.
inline Status seal_blocks_host(const SealParams& p) noexcept {
  if (auto st = check_seal_shape(p); !st) return st;
  if (auto st = check_held_scales(p.cache, p.k_scales, p.v_scales, true); !st) return st;
  for (std::int32_t i = 0; i < p.num_blocks; ++i) {
    if (p.blocks[i] < 0 || p.blocks[i] >= p.cache.num_blocks)
      return Status{Errc::invalid_argument, "blocks (outside the pool)", p.blocks[i], p.cache.num_blocks};
    for (std::int32_t j = 0; j < i; ++j)
      if (p.blocks[j] == p.blocks[i]) return Status{Errc::invalid_argument, "blocks (sealed twice in one call)", p.blocks[i], j};
  }
  SealScratch scratch;  // 44 KiB of stack
  const bool fits = seal_host_fits(p.cache);
  for (std::int64_t it = 0; it < seal_items(p); ++it)
    for (std::int32_t kv = 0; kv < p.cache.kv_planes; ++kv)
      for (std::int32_t h = 0; h < p.cache.num_kv_heads; ++h) {
        if (!channel_side(p.cache, kv) || !fits) {
          seal_item(p, it, kv, h, 0, 1);
          continue;
        }
        if (const SealItem s = seal_item_of(p, it); s.t == 0) seal_channels_host(p, s.i, s.layer, kv, h, scratch);
      }
  return {};
}

KVCACHE_END_NAMESPACE
