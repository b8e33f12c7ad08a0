// A quantized pool's rows: where a (block, layer, K|V, token, head) row's
// group entries are, and the row moves the kernels share: write a row from
// an input (quantizing), read it into an output (dequantizing), move it
// within the pool (codes and entries, never requantized). One body for the
// host and CUDA backends; lanes split a row by groups (group scales) or by
// bytes (the 4-bit types with an engine-held scale).
#pragma once

#include <cstdint>

#include "kvcache/kernels/detail/common.hpp"
#include "kvcache/kernels/detail/quant.hpp"
#include "kvcache/kernels/detail/quant_groups.hpp"
#include "kvcache/kernels/detail/rows.hpp"

KVCACHE_BEGIN_NAMESPACE

/// True when side kv of the view is not element-wise: stored (group or
/// channel) scales, or a 4-bit type.
KVCACHE_HOST_DEVICE inline bool quantized_side(const PoolView& v, std::int32_t kv) noexcept {
  return stored_scales(side_format(v, kv)) || dtype_bits(v.dtype) == 4;
}
/// True when side kv holds channel scales (a block's, written by seal_blocks).
KVCACHE_HOST_DEVICE inline bool channel_side(const PoolView& v, std::int32_t kv) noexcept {
  return side_format(v, kv).scales == Scales::channel;
}
/// True when either side of the view holds channel scales.
KVCACHE_HOST_DEVICE inline bool channel_pool(const PoolView& v) noexcept {
  return channel_side(v, 0) || (v.kv_planes == 2 && channel_side(v, 1));
}

/// A kernel that writes or moves single rows (scatter, ring write, ring
/// admission, compaction, RoPE) cannot write a channel-scaled side: a row's
/// codes depend on every token of its block, so seal_blocks writes such a
/// block whole. invalid_argument naming `what` (the side) otherwise.
inline Status check_row_writes(const PoolView& v, const char* what) noexcept {
  for (std::int32_t kv = 0; kv < v.kv_planes && kv < 2; ++kv)
    if (channel_side(v, kv)) return Status{Errc::invalid_argument, what, kv, static_cast<std::int64_t>(Scales::channel)};
  return {};
}
/// True when either side of the view is quantized_side.
KVCACHE_HOST_DEVICE inline bool quantized_pool(const PoolView& v) noexcept {
  return quantized_side(v, 0) || (v.kv_planes == 2 && quantized_side(v, 1));
}

/// True when a token's rows of side kv can move as one run of num_kv_heads
/// rows (the host loops): one multiplier for every head (no per-head
/// engine-held scales), and heads adjacent both in the pool and in the
/// caller's buffer (head stride other_head_stride, element type other).
/// Adjacent rows have adjacent group entries (row_entries), so a quantized
/// side's run is whole groups with their entries in order.
inline bool heads_in_one_run(const PoolView& v, std::int32_t kv, std::int64_t other_head_stride, DType other,
                             const float* held) noexcept {
  return !(held && side_format(v, kv).scales == Scales::head) && v.strides.head == row_bytes(v.dtype, v.head_dim) &&
         other_head_stride == row_bytes(other, v.head_dim);
}

/// Group entry bytes of one row of side kv (0 without group scales).
KVCACHE_HOST_DEVICE inline std::int64_t row_entry_bytes(const PoolView& v, std::int32_t kv) noexcept {
  const SideFormat& f = side_format(v, kv);
  return f.scales == Scales::group ? v.head_dim / f.group * group_entry_bytes(v.dtype, f) : 0;
}

/// The group entries of one row. A row's entries sit in its plane's entry
/// region at the row's index in the codes' order, which is its codes' offset
/// in the plane over the row's bytes (the layout need not be known).
/// A channel-scaled side's row has no entries of its own: this is its
/// kv-head's channel entries, which every token of the block shares.
KVCACHE_HOST_DEVICE inline std::byte* row_entries(const PoolView& v, std::int64_t block, std::int32_t layer,
                                                  std::int32_t kv, std::int32_t token, std::int32_t head) noexcept {
  std::byte* plane = v.row(block, layer, kv, 0, 0);
  if (channel_side(v, kv))
    return plane + v.scales_offset + std::int64_t{head} * v.head_dim * group_entry_bytes(v.dtype, side_format(v, kv));
  const std::int64_t in_plane = std::int64_t{token} * v.strides.token + std::int64_t{head} * v.strides.head;
  return plane + v.scales_offset + in_plane / row_bytes(v.dtype, v.head_dim) * row_entry_bytes(v, kv);
}

/// Element i of a channel-scaled row (or run of adjacent rows: their heads'
/// entries are adjacent too), dequantized with channel i's entry.
KVCACHE_HOST_DEVICE inline float load_channel_elem(DType code, const SideFormat& f, const std::byte* codes, const std::byte* entries,
                                                   std::int32_t i) noexcept {
  const quant::GroupScale g = quant::load_entry(code, f.minimum, entries + std::int64_t{i} * group_entry_bytes(code, f));
  const float c = quant::load_code(code, f.minimum, codes, i);
  return f.minimum ? fmaf(c, g.scale, g.minimum) : c * g.scale;
}

/// Writes `rows` adjacent rows of side kv (heads_in_one_run; usually one):
/// src (rows * head_dim elements of st) divided by the call's scale `div`
/// (the engine's k_scale / v_scale, times an engine-held scale), quantized
/// into codes `dst` and entries `entries`. Lane units are groups (group
/// scales) or bytes (two 4-bit codes).
KVCACHE_HOST_DEVICE inline void store_quantized_row(const PoolView& v, std::int32_t kv, std::byte* dst, std::byte* entries,
                                                    const void* src, DType st, float div, std::int32_t lane,
                                                    std::int32_t nlanes, std::int32_t rows = 1) noexcept {
  const SideFormat& f = side_format(v, kv);
  const std::int32_t n = rows * v.head_dim;
  if (f.scales == Scales::channel) return;  // seal_blocks writes these; check_row_writes refuses the row writers
  if (f.scales == Scales::group) {
    // One thread, whole-byte symmetric codes: the host's group loops (the same bits).
    if (nlanes == 1 &&
        fast_quantize_groups(dst, entries, src, st, v.dtype, f.minimum, f.group, n / f.group, div, quant::code_max(v.dtype, false)))
      return;
    float x[128];  // a group is at most 128 values
    const std::int64_t eb = group_entry_bytes(v.dtype, f);
    for (std::int32_t g = lane; g * f.group < n; g += nlanes) {
      const std::byte* in = static_cast<const std::byte*>(src) + row_bytes(st, std::int64_t{g} * f.group);
      const std::int32_t done = fast_rows(x, DType::f32, in, st, f.group, div, false, true);
      load_row(st, in + row_bytes(st, done), x + done, f.group - done);
      for (std::int32_t i = done; i < f.group; ++i) x[i] /= div;
      quant::quantize_group(x, f.group, v.dtype, f.minimum, dst + row_bytes(v.dtype, std::int64_t{g} * f.group),
                            entries + g * eb);
    }
    return;
  }
  // A 4-bit type with an engine-held scale: a byte holds elements 2i and 2i + 1.
  auto* b = reinterpret_cast<std::uint8_t*>(dst);
  for (std::int32_t i = lane; 2 * i < n; i += nlanes)
    b[i] = static_cast<std::uint8_t>(quant::encode(v.dtype, false, load_elem(st, src, 2 * i) / div) |
                                     (quant::encode(v.dtype, false, load_elem(st, src, 2 * i + 1) / div) << 4));
}

/// Reads `rows` adjacent rows of side kv (usually one) into out (rows *
/// head_dim elements of ot): dequantized, times mul.
KVCACHE_HOST_DEVICE inline void load_quantized_row(const PoolView& v, std::int32_t kv, const std::byte* codes,
                                                   const std::byte* entries, void* out, DType ot, float mul,
                                                   std::int32_t lane, std::int32_t nlanes, std::int32_t rows = 1) noexcept {
  const SideFormat& f = side_format(v, kv);
  const std::int32_t n = rows * v.head_dim;
  if (f.scales == Scales::channel) {
    // One thread: eight channels a vector with their own entries (the same bits).
    if (nlanes == 1 && fast_dequantize_channels(out, ot, codes, entries, v.dtype, f.minimum, n, mul)) return;
    if (nlanes > 1) {
      for (std::int32_t i = lane; i < n; i += nlanes) store_elem(ot, out, i, load_channel_elem(v.dtype, f, codes, entries, i) * mul);
      return;
    }
    // Otherwise 64 channels at a time through float buffers (codes, scales,
    // minima), so each step is one loop the compiler can vectorize.
    float x[64], sc[64], mn[64];
    const auto* e = reinterpret_cast<const std::uint16_t*>(entries);  // f16 (scale, minimum) a channel
    const std::int32_t per = f.minimum ? 2 : 1;
    for (std::int32_t at = 0; at < n; at += 64) {  // 64 codes are whole bytes: `at` is a byte boundary
      const std::int32_t m = n - at < 64 ? n - at : 64;
      quant::load_codes(v.dtype, f.minimum, codes + row_bytes(v.dtype, at), m, x);
      for (std::int32_t j = 0; j < m; ++j) sc[j] = cvt::f16_to_f32(e[(at + j) * per]);
      if (f.minimum) {
        for (std::int32_t j = 0; j < m; ++j) mn[j] = cvt::f16_to_f32(e[(at + j) * per + 1]);
        for (std::int32_t j = fast_fma(x, x, sc, 1, mn, 1, m); j < m; ++j) x[j] = fmaf(x[j], sc[j], mn[j]);
      } else {
        for (std::int32_t j = 0; j < m; ++j) x[j] *= sc[j];
      }
      std::byte* o = static_cast<std::byte*>(out) + row_bytes(ot, at);
      const std::int32_t done = fast_rows(o, ot, x, DType::f32, m, mul);
      store_row(ot, o + row_bytes(ot, done), x + done, mul, m - done);
    }
    return;
  }
  if (f.scales == Scales::group) {
    if (nlanes == 1 && fast_dequantize_groups(out, ot, codes, entries, v.dtype, f.minimum, f.group, n / f.group, mul)) return;
    float x[128];
    const std::int64_t eb = group_entry_bytes(v.dtype, f);
    for (std::int32_t g = lane; g * f.group < n; g += nlanes) {
      quant::dequantize_group(codes + row_bytes(v.dtype, std::int64_t{g} * f.group), entries + g * eb, f.group, v.dtype,
                              f.minimum, x);
      std::byte* o = static_cast<std::byte*>(out) + row_bytes(ot, std::int64_t{g} * f.group);
      const std::int32_t done = fast_rows(o, ot, x, DType::f32, f.group, mul);
      store_row(ot, o + row_bytes(ot, done), x + done, mul, f.group - done);
    }
    return;
  }
  for (std::int32_t i = lane; 2 * i < n; i += nlanes) {
    store_elem(ot, out, 2 * i, quant::load_code(v.dtype, false, codes, 2 * i) * mul);
    store_elem(ot, out, 2 * i + 1, quant::load_code(v.dtype, false, codes, 2 * i + 1) * mul);
  }
}

/// Copies one row of side kv, codes and entries, from (src, src_entries) to
/// (dst, dst_entries) in the same pool; lanes split it exactly as
/// store_quantized_row does (groups, or bytes of two 4-bit codes), so a lane
/// that copies a row out and then writes a new one into it reads its part
/// before it overwrites it (ring writes).
KVCACHE_HOST_DEVICE inline void copy_quantized_row(const PoolView& v, std::int32_t kv, std::byte* dst, std::byte* dst_entries,
                                                   const std::byte* src, const std::byte* src_entries, std::int32_t lane,
                                                   std::int32_t nlanes) noexcept {
  const SideFormat& f = side_format(v, kv);
  if (f.scales == Scales::channel) return;  // refused by check_row_writes
  if (f.scales == Scales::group) {
    const std::int64_t eb = group_entry_bytes(v.dtype, f), cb = row_bytes(v.dtype, f.group);
    for (std::int32_t g = lane; g * f.group < v.head_dim; g += nlanes) {
      for (std::int64_t i = 0; i < cb; ++i) dst[g * cb + i] = src[g * cb + i];
      for (std::int64_t i = 0; i < eb; ++i) dst_entries[g * eb + i] = src_entries[g * eb + i];
    }
    return;
  }
  for (std::int32_t i = lane; 2 * i < v.head_dim; i += nlanes) dst[i] = src[i];
}

/// Element d of a row of side kv as the pool holds it: dequantized with its
/// group's entry (group scales), the code's value (a 4-bit type with an
/// engine-held scale), the element otherwise. An engine-held scale is not
/// applied, as in every element-wise kernel. The same floats as
/// load_quantized_row.
KVCACHE_HOST_DEVICE inline float load_pool_elem(const PoolView& v, std::int32_t kv, const std::byte* codes,
                                                const std::byte* entries, std::int32_t d) noexcept {
  const SideFormat& f = side_format(v, kv);
  if (f.scales == Scales::channel) return load_channel_elem(v.dtype, f, codes, entries, d);
  if (f.scales != Scales::group) return dtype_bits(v.dtype) == 4 ? quant::load_code(v.dtype, false, codes, d) : load_elem(v.dtype, codes, d);
  const quant::GroupScale g = quant::load_entry(v.dtype, f.minimum, entries + d / f.group * group_entry_bytes(v.dtype, f));
  const float c = quant::load_code(v.dtype, f.minimum, codes, d);
  return f.minimum ? fmaf(c, g.scale, g.minimum) : c * g.scale;
}

/// The element unit of side kv: a row splits into whole units only (a
/// group, the codes sharing a byte, or one element).
KVCACHE_HOST_DEVICE inline std::int32_t pool_unit(const PoolView& v, std::int32_t kv) noexcept {
  const SideFormat& f = side_format(v, kv);
  return f.scales == Scales::group ? f.group : dtype_bits(v.dtype) < 8 ? 8 / dtype_bits(v.dtype) : 1;
}

/// Elements [d0, d0 + n) of a row of side kv into out, as load_pool_elem
/// gives them; d0 and n are whole pool_units.
KVCACHE_HOST_DEVICE inline void load_pool_span(const PoolView& v, std::int32_t kv, const std::byte* codes,
                                               const std::byte* entries, std::int32_t d0, std::int32_t n, float* out) noexcept {
  const SideFormat& f = side_format(v, kv);
  if (f.scales == Scales::channel) {
    for (std::int32_t i = 0; i < n; ++i) out[i] = load_channel_elem(v.dtype, f, codes, entries, d0 + i);
  } else if (f.scales == Scales::group) {
    const std::int64_t eb = group_entry_bytes(v.dtype, f);
    for (std::int32_t d = d0; d < d0 + n; d += f.group)
      quant::dequantize_group(codes + row_bytes(v.dtype, d), entries + d / f.group * eb, f.group, v.dtype, f.minimum,
                              out + (d - d0));
  } else if (dtype_bits(v.dtype) == 4) {
    for (std::int32_t i = 0; i < n; ++i) out[i] = quant::load_code(v.dtype, false, codes, d0 + i);
  } else {
    load_row(v.dtype, codes + row_bytes(v.dtype, d0), out, n);
  }
}

/// Stores x[0, n) as elements [d0, d0 + n) of a row of side kv: each group
/// requantized from its values (a new scale), 4-bit codes encoded, elements
/// stored; d0 and n are whole pool_units.
KVCACHE_HOST_DEVICE inline void store_pool_span(const PoolView& v, std::int32_t kv, std::byte* codes, std::byte* entries,
                                                std::int32_t d0, std::int32_t n, const float* x) noexcept {
  const SideFormat& f = side_format(v, kv);
  if (f.scales == Scales::channel) return;  // refused by check_row_writes
  if (f.scales == Scales::group) {
    const std::int64_t eb = group_entry_bytes(v.dtype, f);
    for (std::int32_t d = d0; d < d0 + n; d += f.group)
      quant::quantize_group(x + (d - d0), f.group, v.dtype, f.minimum, codes + row_bytes(v.dtype, d), entries + d / f.group * eb);
  } else if (dtype_bits(v.dtype) == 4) {
    auto* b = reinterpret_cast<std::uint8_t*>(codes);
    for (std::int32_t i = 0; i < n; i += 2)
      b[(d0 + i) >> 1] = static_cast<std::uint8_t>(quant::encode(v.dtype, false, x[i]) |
                                                   (quant::encode(v.dtype, false, x[i + 1]) << 4));
  } else {
    store_row(v.dtype, codes + row_bytes(v.dtype, d0), x, 1.0f, n);
  }
}

/// Moves one row of side kv within a pool as raw bytes: its codes and its
/// entries (a row is whole groups, so nothing is requantized). Not for a
/// channel-scaled side (check_row_writes): its rows' meaning is their block's.
KVCACHE_HOST_DEVICE inline void move_pool_row(const PoolView& v, std::int32_t kv, std::int64_t dst_block,
                                              std::int32_t dst_token, std::int64_t src_block, std::int32_t src_token,
                                              std::int32_t layer, std::int32_t head, std::int32_t lane,
                                              std::int32_t nlanes) noexcept {
  move_row(v.row(dst_block, layer, kv, dst_token, head), DType::int8, v.row(src_block, layer, kv, src_token, head),
           DType::int8, static_cast<std::int32_t>(row_bytes(v.dtype, v.head_dim)), 1.0f, lane, nlanes);
  if (const std::int64_t eb = row_entry_bytes(v, kv); eb > 0)
    move_row(row_entries(v, dst_block, layer, kv, dst_token, head), DType::int8,
             row_entries(v, src_block, layer, kv, src_token, head), DType::int8, static_cast<std::int32_t>(eb), 1.0f,
             lane, nlanes);
}

/// A pool whose rows the row kernels (scatter, gather, compaction) can
/// move: check_dtype's types, or a quantized format (kernels/detail/quant_rows.hpp).
inline Status check_pool_rows(const PoolView& v, const char* what) noexcept {
  if (dtype_bits(v.dtype) == 0) return Status{Errc::invalid_argument, what, static_cast<std::int64_t>(v.dtype), kLastDType};
  return {};
}

KVCACHE_END_NAMESPACE
