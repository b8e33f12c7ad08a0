// What one stored K or V value is: its element type (a float type, or a
// code of 8, 4 or 2 bits) and how it is scaled (not at all, by a scale the
// engine holds per layer or per (layer, head), or by a scale stored beside
// every group of G values). Geometry sizes a pool from this; the kernels
// quantize on write and dequantize on read from it.
#pragma once

#include <cstdint>

#include "kvcache/config.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Element type of a pool, a kernel's input or its output. The first four
/// are float types; the rest are codes that need a scale to mean anything
/// (fp8 e4m3 may be used either way, as vLLM does).
///   fp8_e5m2:  OCP E5M2 (max 57344), saturating.
///   int8:      signed, symmetric [-127, 127]; unsigned [0, 255] with a minimum.
///   int4:      two per byte, element 2i in the low nibble; [-7, 7], or [0, 15] with a minimum.
///   fp4_e2m1:  two per byte as int4; values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (NVFP4's element).
///   int2:      four per byte, element 4i + j in bits 2j..2j+1; [-1, 1], or [0, 3] with a minimum
///              (KIVI's 2-bit); group scales only.
enum class DType : std::uint8_t { f32, f16, bf16, fp8_e4m3, fp8_e5m2, int8, int4, fp4_e2m1, int2 };

/// The last DType: errors name it as the limit of a dtype field.
inline constexpr std::int64_t kLastDType = 8;

/// A DType's name ("fp8_e4m3"), for messages (Status::named); "?" outside the enum.
constexpr const char* dtype_name(std::int64_t d) noexcept {
  constexpr const char* names[] = {"f32", "f16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "fp4_e2m1", "int2"};
  return d >= 0 && d <= kLastDType ? names[d] : "?";
}

/// Bits per element of d; 0 for a value outside the enum.
KVCACHE_HOST_DEVICE constexpr std::int32_t dtype_bits(DType d) noexcept {
  switch (d) {
    case DType::f32: return 32;
    case DType::f16: return 16;
    case DType::bf16: return 16;
    case DType::fp8_e4m3: return 8;
    case DType::fp8_e5m2: return 8;
    case DType::int8: return 8;
    case DType::int4: return 4;
    case DType::fp4_e2m1: return 4;
    case DType::int2: return 2;
  }
  return 0;
}

/// Bytes per element of d: 0 for the packed 4- and 2-bit types (they share bytes)
/// and for a value outside the enum. Row sizes come from row_bytes().
KVCACHE_HOST_DEVICE constexpr std::int64_t dtype_bytes(DType d) noexcept {
  const std::int32_t b = dtype_bits(d);
  return b >= 8 ? b / 8 : 0;
}

/// Bytes of n consecutive elements of d (n even for the 4-bit types, a multiple of 4 for int2).
KVCACHE_HOST_DEVICE constexpr std::int64_t row_bytes(DType d, std::int64_t n) noexcept { return n * dtype_bits(d) / 8; }

/// True for the integer codes, which only mean something with a scale: int8, int4, int2.
KVCACHE_HOST_DEVICE constexpr bool is_integer_code(DType d) noexcept {
  return d == DType::int8 || d == DType::int4 || d == DType::int2;
}

/// How one side (K or V) of a pool is scaled.
///   none:   stored as is (a float type), or with the call's per-tensor scale as today.
///   tensor: one scale per layer, held by the engine (vLLM's k_scale / v_scale).
///   head:   one scale per (layer, kv head), held by the engine (per-head fp8 checkpoints).
///   group:  one scale per G consecutive values of a (token, head) row, stored
///           in the pool beside the codes, so moving a block moves its scales.
///   channel: one scale per (block, head, channel): a group runs along the
///           block's tokens, as KIVI quantizes keys (outlier channels get their
///           own range). Stored in the plane after the codes like group
///           entries; a block's codes exist only once its tokens are all known,
///           so seal_blocks writes it whole (kernels/seal.hpp) and the row
///           writers refuse it.
enum class Scales : std::uint8_t { none, tensor, head, group, channel };

/// The last Scales: errors name it as the limit of a scales field.
inline constexpr std::int64_t kLastScales = 4;

/// A Scales' name ("group"), for messages (Status::named); "?" outside the enum.
constexpr const char* scales_name(std::int64_t s) noexcept {
  constexpr const char* names[] = {"none", "tensor", "head", "group", "channel"};
  return s >= 0 && s <= kLastScales ? names[s] : "?";
}

/// One side's scaling.
struct SideFormat {
  Scales scales = Scales::none;  ///< The scheme.
  std::int32_t group = 0;  ///< group: values per scale, 16, 32, 64 or 128, dividing head_dim; else 0 (channel: the block).
  /// group or channel, integer codes only: a minimum stored beside each scale
  /// (unsigned codes, x = minimum + q * scale: llama.cpp's q4_1, KIVI); else a symmetric code.
  bool minimum = false;

  friend constexpr bool operator==(const SideFormat&, const SideFormat&) = default;
};

/// K's and V's scaling; a pool's element type is GeometrySpec::dtype, the same for both.
struct KvFormat {
  SideFormat k{};  ///< Keys.
  SideFormat v{};  ///< Values (ignored fields must be default when the pool has no V plane).

  friend constexpr bool operator==(const KvFormat&, const KvFormat&) = default;
};

/// The error bound of stored scales (group and channel), what test_quant_bounds
/// checks over every f16 and bf16 input. A group (or channel) holds values x
/// with largest |x| = amax, or spanning [lo, hi] with a minimum; q is the
/// largest code (code_max). The minimum is lo rounded down to f16 (never
/// below -65504), the scale s the range above it (or amax) over q rounded
/// up to its type, so no value maps past the codes:
///   s <= want (1 + 2^-10) + 2^-24   (f16 scales)
///   s <= want (1 + 2^-3) + 2^-9     (e4m3 scales: fp4)
/// with want = amax / q, or (hi - lo + u(lo)) / q, u(lo) the f16 spacing at lo.
/// Each value reads back within
///   s / 2                           integer codes (int8, int4, int2; with or without a minimum)
///   2^-4 |x| + 2^-10 s              fp8 e4m3 codes
///   2^-3 |x| + 2^-17 s              fp8 e5m2 codes
///   max(s / 4, |x| / 4)             fp4 e2m1 codes
/// plus a few ulps of float arithmetic. The 2^-24 and 2^-9 terms are the
/// entry types' smallest steps: below them a group's values lose precision
/// absolutely, not relatively (f16 scales: |error| <= 2^-25 + ...; fp4 at
/// k_scale 1: values below about 2^-11 read back 0; set k_scale to the
/// tensor's range, as NVFP4's per-tensor scale does). The bound holds for
/// every finite input within the entry type's range: |x| <= 65504 q
/// (symmetric f16 scales), 448 q (fp4), and lo, hi in [-65504, 65504] with a
/// minimum. Past it values saturate at the largest scale or the clamped
/// minimum, and read back finite.
///
/// Type of a stored group scale: e4m3 for fp4 (as NVFP4), f16 otherwise (as llama.cpp's q8_0 / q4_0).
KVCACHE_HOST_DEVICE constexpr DType group_scale_dtype(DType code) noexcept {
  return code == DType::fp4_e2m1 ? DType::fp8_e4m3 : DType::f16;
}

/// True when side format f stores its scales in the pool (group or channel entries).
KVCACHE_HOST_DEVICE constexpr bool stored_scales(const SideFormat& f) noexcept {
  return f.scales == Scales::group || f.scales == Scales::channel;
}

/// Bytes one stored entry of `code`'s scales takes: its scale, and its
/// minimum if any.
KVCACHE_HOST_DEVICE constexpr std::int64_t scale_entry_bytes(DType code, bool minimum) noexcept {
  return dtype_bytes(group_scale_dtype(code)) * (minimum ? 2 : 1);
}

/// Bytes one group's entry takes in the pool (scale_entry_bytes); 0 without
/// stored scales. A channel's entry is a group's.
KVCACHE_HOST_DEVICE constexpr std::int64_t group_entry_bytes(DType code, const SideFormat& f) noexcept {
  return stored_scales(f) ? scale_entry_bytes(code, f.minimum) : 0;
}

/// Where one plane's group entries start and how many bytes the plane takes.
struct PlaneSplit {
  std::int64_t scales_offset = 0;  ///< From the plane's start to its entries (the codes' bytes without entries).
  std::int64_t bytes = 0;  ///< Codes, padding, entries.
};

/// The plane rule, the one place it is written: `rows` rows of `codes` bytes
/// of codes in all, then, with entries, each row's `entries_per_row` bytes
/// from a 16-byte boundary (a vector load of the codes never covers a scale).
/// False past int64.
constexpr bool plane_split(std::int64_t codes, std::int64_t rows, std::int64_t entries_per_row, PlaneSplit& out) noexcept {
  if (entries_per_row == 0) {
    out = {codes, codes};
    return true;
  }
  std::int64_t entries = 0, bytes = 0;
  if (codes > INT64_MAX - 15) return false;
  const std::int64_t offset = (codes + 15) / 16 * 16;
  if (__builtin_mul_overflow(rows, entries_per_row, &entries) || __builtin_add_overflow(offset, entries, &bytes))
    return false;
  out = {offset, bytes};
  return true;
}

/// Checks one side (K when is_k) against the pool's element type and head
/// dim: invalid_argument naming the field and why.
inline Status check_side_format(const SideFormat& f, DType dtype, std::int32_t head_dim, bool is_k) noexcept {
  const auto name = [is_k](const char* k, const char* v) { return is_k ? k : v; };
  const auto s = static_cast<std::int64_t>(f.scales);
  if (s > kLastScales) return Status{Errc::invalid_argument, name("format.k.scales", "format.v.scales"), s, kLastScales};
  const bool float_type = dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16;
  if (float_type && f.scales != Scales::none)
    return Status{Errc::invalid_argument, name("format.k.scales (a float dtype is stored unscaled)",
                                               "format.v.scales (a float dtype is stored unscaled)"), s, 0};
  if (dtype == DType::fp4_e2m1 && (f.scales != Scales::group || f.group != 16))
    return Status{Errc::invalid_argument, name("format.k.group (fp4 takes groups of 16)", "format.v.group (fp4 takes groups of 16)"),
                  f.scales == Scales::group ? f.group : 0, 16};
  if (dtype == DType::int2 && !stored_scales(f))  // a 2-bit code's range is too coarse for one scale per layer or head
    return Status{Errc::invalid_argument, name("format.k.scales (2-bit codes take group or channel scales)",
                                               "format.v.scales (2-bit codes take group or channel scales)"), s, 3};
  if (f.scales == Scales::channel) {  // the group is the block: no size to give; integer codes (KIVI's)
    if (!is_integer_code(dtype))
      return Status{Errc::invalid_argument, name("format.k.scales (channel scales take integer codes)",
                                                 "format.v.scales (channel scales take integer codes)"), s, 3};
    if (f.group != 0)
      return Status{Errc::invalid_argument, name("format.k.group (channel: the group is the block)",
                                                 "format.v.group (channel: the group is the block)"), f.group, 0};
    if (head_dim % (8 / dtype_bits(dtype)) != 0)  // a byte of codes is one seal unit
      return Status{Errc::invalid_argument, "head_dim (not whole bytes of codes)", head_dim, 8 / dtype_bits(dtype)};
    return {};
  }
  if (is_integer_code(dtype) && f.scales == Scales::none)
    return Status{Errc::invalid_argument, name("format.k.scales (an integer code needs scales)",
                                               "format.v.scales (an integer code needs scales)"), s, 1};
  if (f.scales != Scales::group) {
    if (f.group != 0) return Status{Errc::invalid_argument, name("format.k.group (only with group scales)",
                                                                 "format.v.group (only with group scales)"), f.group, 0};
    if (f.minimum) return Status{Errc::invalid_argument, name("format.k.minimum (only with group scales)",
                                                              "format.v.minimum (only with group scales)"), 1, 0};
    return {};
  }
  if (f.group != 16 && f.group != 32 && f.group != 64 && f.group != 128)
    return Status{Errc::invalid_argument, name("format.k.group (16, 32, 64 or 128)", "format.v.group (16, 32, 64 or 128)"),
                  f.group, 128};
  if (head_dim % f.group != 0)
    return Status{Errc::invalid_argument, name("format.k.group (must divide head_dim)", "format.v.group (must divide head_dim)"),
                  f.group, head_dim};
  if (f.minimum && !is_integer_code(dtype))
    return Status{Errc::invalid_argument, name("format.k.minimum (integer codes only)", "format.v.minimum (integer codes only)"),
                  1, 0};
  return {};
}

KVCACHE_END_NAMESPACE
