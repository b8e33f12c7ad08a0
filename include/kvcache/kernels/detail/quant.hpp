// Group quantization's scalar parts: codes, entries, scales and the
// quotient every writer rounds (a whole group's and row's codecs are
// quant_groups.hpp). Host and CUDA run this same code, so a pool written on
// either reads the same bits.
//
// The scale is rounded to its stored type (f16, or e4m3 for fp4) before the
// codes are computed, and the codes are computed from that stored scale: the
// reader multiplies by exactly what the writer divided by. The scale is
// rounded up, never down, and a minimum down, never up, so no value of the
// group lies beyond the codes' reach: none saturates. The error bound that
// follows (core/kv_format.hpp states it per format) holds for every finite input
// within the entry type's range. A code is the rounding of the quotient
// x / s (one IEEE division: quotient()), not of x * (1 / s), which differs
// by a code near rounding midpoints; the host's vector loops compute the
// same quotients (a divide, or a product corrected by its FMA residual where
// that is exact), as an engine-held scale's writes do (store_row_divided:
// vLLM's fp8(x / scale) bit for bit).
#pragma once

#include <cmath>
#include <cstdint>

#include "kvcache/kernels/detail/common.hpp"
#include "kvcache/core/kv_format.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace quant {

/// Largest code magnitude: what the group's largest value maps to.
KVCACHE_HOST_DEVICE constexpr float code_max(DType code, bool minimum) noexcept {
  switch (code) {
    case DType::fp8_e4m3: return cvt::kE4m3Max;
    case DType::fp8_e5m2: return 57344.0f;
    case DType::int8: return minimum ? 255.0f : 127.0f;
    case DType::int4: return minimum ? 15.0f : 7.0f;
    case DType::fp4_e2m1: return 6.0f;
    case DType::int2: return minimum ? 3.0f : 1.0f;
    default: return 1.0f;
  }
}

/// fp4 e2m1 (sign, 2 exponent bits, 1 mantissa bit) to float.
KVCACHE_HOST_DEVICE inline float e2m1_to_f32(std::uint32_t q) noexcept {
  const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float m = mag[q & 7u];
  return (q & 8u) ? -m : m;
}
/// Float to the nearest e2m1 code (ties to the even code), saturating at 6;
/// the sign kept (-0 gives -0, code 8); NaN gives +0.
KVCACHE_HOST_DEVICE inline std::uint32_t f32_to_e2m1(float v) noexcept {
  if (!(v == v)) return 0;
  const std::uint32_t sign = (cvt::bits(v) >> 31) != 0 ? 8u : 0u;
  const float a = v < 0.0f ? -v : v;
  // Midpoints between consecutive magnitudes; at a midpoint the even code
  // (mantissa bit 0) wins: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2, 3.5->4, 5->4.
  std::uint32_t m;
  if (a <= 0.25f) m = 0;
  else if (a < 0.75f) m = 1;
  else if (a <= 1.25f) m = 2;
  else if (a < 1.75f) m = 3;
  else if (a <= 2.5f) m = 4;
  else if (a < 3.5f) m = 5;
  else if (a <= 5.0f) m = 6;
  else m = 7;
  return sign | m;
}

/// Code i of a row of `code` at p, as a float (before scaling). Signed
/// integers for symmetric groups, unsigned with a minimum.
KVCACHE_HOST_DEVICE inline float load_code(DType code, bool minimum, const void* p, std::int32_t i) noexcept {
  const auto* b = static_cast<const std::uint8_t*>(p);
  switch (code) {
    case DType::int8: return minimum ? static_cast<float>(b[i]) : static_cast<float>(static_cast<std::int8_t>(b[i]));
    case DType::int4: {
      const std::uint32_t n = (i & 1) ? (b[i >> 1] >> 4) : (b[i >> 1] & 15u);
      return minimum ? static_cast<float>(n) : static_cast<float>(static_cast<std::int32_t>(n ^ 8u) - 8);
    }
    case DType::fp4_e2m1: return e2m1_to_f32((i & 1) ? (b[i >> 1] >> 4) : (b[i >> 1] & 15u));
    case DType::int2: {
      const std::uint32_t n = (std::uint32_t{b[i >> 2]} >> (2 * (i & 3))) & 3u;
      return minimum ? static_cast<float>(n) : static_cast<float>(static_cast<std::int32_t>(n ^ 2u) - 2);
    }
    default: return load_elem(code, p, i);
  }
}

/// Codes [0, n) of a row of `code` at p (from a byte boundary), as
/// load_code gives them: one loop per type and sign, without load_code's
/// switch per value, so the host compiler vectorizes them.
KVCACHE_HOST_DEVICE inline void load_codes(DType code, bool minimum, const void* p, std::int32_t n, float* out) noexcept {
  const auto* b = static_cast<const std::uint8_t*>(p);
  switch (code) {
    case DType::int8:
      if (minimum)
        for (std::int32_t i = 0; i < n; ++i) out[i] = static_cast<float>(b[i]);
      else
        for (std::int32_t i = 0; i < n; ++i) out[i] = static_cast<float>(static_cast<std::int8_t>(b[i]));
      return;
    case DType::int4:
      if (minimum)
        for (std::int32_t i = 0; i < n; ++i) out[i] = static_cast<float>((std::uint32_t{b[i >> 1]} >> (4 * (i & 1))) & 15u);
      else
        for (std::int32_t i = 0; i < n; ++i)
          out[i] = static_cast<float>(static_cast<std::int32_t>(((std::uint32_t{b[i >> 1]} >> (4 * (i & 1))) & 15u) ^ 8u) - 8);
      return;
    case DType::int2:
      if (minimum)
        for (std::int32_t i = 0; i < n; ++i) out[i] = static_cast<float>((std::uint32_t{b[i >> 2]} >> (2 * (i & 3))) & 3u);
      else
        for (std::int32_t i = 0; i < n; ++i)
          out[i] = static_cast<float>(static_cast<std::int32_t>(((std::uint32_t{b[i >> 2]} >> (2 * (i & 3))) & 3u) ^ 2u) - 2);
      return;
    default:
      for (std::int32_t i = 0; i < n; ++i) out[i] = load_code(code, minimum, p, i);
      return;
  }
}

/// The code of v (already divided by the scale) as its bits: a byte, or a
/// nibble in the low 4 bits.
KVCACHE_HOST_DEVICE inline std::uint32_t encode(DType code, bool minimum, float v) noexcept {
  switch (code) {
    case DType::fp8_e4m3: return cvt::f32_to_e4m3(v);
    case DType::fp8_e5m2: return cvt::f32_to_e5m2(v);
    case DType::int8:
      return minimum ? static_cast<std::uint32_t>(cvt::to_int(v, 0, 255))
                     : static_cast<std::uint32_t>(cvt::to_int(v, -127, 127)) & 0xffu;
    case DType::int4:
      return minimum ? static_cast<std::uint32_t>(cvt::to_int(v, 0, 15)) : static_cast<std::uint32_t>(cvt::to_int(v, -7, 7)) & 15u;
    case DType::fp4_e2m1: return f32_to_e2m1(v);
    case DType::int2:
      return minimum ? static_cast<std::uint32_t>(cvt::to_int(v, 0, 3)) : static_cast<std::uint32_t>(cvt::to_int(v, -1, 1)) & 3u;
    default: return 0;
  }
}

/// A group's scale and minimum, as stored and as the codes use them.
struct GroupScale {
  float scale = 0.0f;  ///< Stored scale (0: every code is 0, the group was all zeros, or below the scale type).
  float minimum = 0.0f;  ///< Stored minimum (minimum formats; else 0).
};

// Entry value i in the entry type (f16, or e4m3 for fp4): load_elem /
// store_elem without their switch over every type (a call per group).
KVCACHE_HOST_DEVICE inline float load_entry_value(DType code, const void* entry, std::int32_t i) noexcept {
  return code == DType::fp4_e2m1 ? cvt::e4m3_to_f32(static_cast<const std::uint8_t*>(entry)[i])
                                 : cvt::f16_to_f32(static_cast<const std::uint16_t*>(entry)[i]);
}
KVCACHE_HOST_DEVICE inline void store_entry_value(DType code, void* entry, std::int32_t i, float v) noexcept {
  if (code == DType::fp4_e2m1) static_cast<std::uint8_t*>(entry)[i] = cvt::f32_to_e4m3(v);
  else static_cast<std::uint16_t*>(entry)[i] = cvt::f32_to_f16(v);
}

/// Reads a group's entry (scale, then minimum if any, in group_scale_dtype(code)).
KVCACHE_HOST_DEVICE inline GroupScale load_entry(DType code, bool minimum, const void* entry) noexcept {
  return GroupScale{load_entry_value(code, entry, 0), minimum ? load_entry_value(code, entry, 1) : 0.0f};
}

/// x's bits as an integer that orders as x does (a negative x's magnitude
/// bits flipped), and back: integer min and max of these are the floats'
/// (and vectorize, where float ones do not without -ffast-math).
KVCACHE_HOST_DEVICE inline std::int32_t order_key(float x) noexcept {
  const auto u = static_cast<std::int32_t>(cvt::bits(x));
  return u ^ ((u >> 31) & 0x7fffffff);
}
KVCACHE_HOST_DEVICE inline float from_order_key(std::int32_t k) noexcept {
  return cvt::from_bits(static_cast<std::uint32_t>(k ^ ((k >> 31) & 0x7fffffff)));
}
/// The smallest and largest order_key of x[0, n), n >= 1.
KVCACHE_HOST_DEVICE inline void key_range(const float* x, std::int32_t n, std::int32_t& kmin, std::int32_t& kmax) noexcept {
  kmin = kmax = order_key(x[0]);
  for (std::int32_t i = 1; i < n; ++i) {
    const std::int32_t k = order_key(x[i]);
    kmin = k < kmin ? k : kmin;
    kmax = k > kmax ? k : kmax;
  }
}

/// f16 bits of the largest f16 value at most lo (lo rounded down), within
/// the finite range: a minimum below -65504 is -65504, never -inf (its
/// group's values below it saturate at code 0); a NaN stays a NaN.
KVCACHE_HOST_DEVICE inline std::uint16_t f16_at_most(float lo) noexcept {
  std::uint32_t b = cvt::f32_to_f16(lo);
  if (cvt::f16_to_f32(static_cast<std::uint16_t>(b)) > lo) b = (b & 0x8000u) ? b + 1u : b - 1u;  // one step down
  if ((b & 0x7fffu) == 0x7c00u) b = (b & 0x8000u) | 0x7bffu;  // an infinity: the largest finite of its sign
  return static_cast<std::uint16_t>(b);
}

/// Entry bits (f16, or e4m3 for fp4) of the smallest entry value at least
/// want (want >= 0 and at most the type's largest: rounded up), so that no
/// value of the group maps past code_max; a NaN stays a NaN.
KVCACHE_HOST_DEVICE inline std::uint32_t entry_at_least(DType code, float want) noexcept {
  if (code == DType::fp4_e2m1) {
    const std::uint32_t b = cvt::f32_to_e4m3(want);
    return b + (cvt::e4m3_to_f32(static_cast<std::uint8_t>(b)) < want ? 1u : 0u);  // one step up: never past 448, want is at most it
  }
  const std::uint32_t b = cvt::f32_to_f16(want);
  return b + (cvt::f16_to_f32(static_cast<std::uint16_t>(b)) < want ? 1u : 0u);  // never past 65504 either
}

/// What a group whose values span [lo, hi] (minimum formats) or whose
/// largest magnitude is amax stores: its scale and minimum rounded to the
/// entry type, as the reader will see them (storing them again is exact).
/// The minimum is lo rounded down (f16_at_most), the scale (hi - minimum) /
/// code_max or amax / code_max rounded up (entry_at_least), saturated at
/// the entry type's largest. Every writer of a group, host or CUDA, one
/// thread or many, calls this (the host's vector loops do the same
/// operations in the same order).
KVCACHE_HOST_DEVICE inline GroupScale group_scale(DType code, bool minimum, float lo, float hi, float amax) noexcept {
  const float type_max = group_scale_dtype(code) == DType::f16 ? cvt::kF16Max : cvt::kE4m3Max;
  GroupScale g{};
  if (minimum) g.minimum = cvt::f16_to_f32(f16_at_most(lo));
  float want = (minimum ? hi - g.minimum : amax) / code_max(code, minimum);
  want = want > type_max ? type_max : want;  // a scale past its type saturates, never inf
  want = want < 0.0f ? 0.0f : want;  // every value below a minimum clamped at -65504: they saturate at code 0
  const std::uint32_t e = entry_at_least(code, want);
  g.scale = code == DType::fp4_e2m1 ? cvt::e4m3_to_f32(static_cast<std::uint8_t>(e)) : cvt::f16_to_f32(static_cast<std::uint16_t>(e));
  return g;
}

/// What a code rounds: t / s (t a value, or a value less the minimum; s the
/// group's stored scale), one IEEE division, or t * 0 where s is 0 (a group
/// of zeros: every code 0) or NaN. Every writer, host or CUDA, divides.
KVCACHE_HOST_DEVICE inline float quotient(float t, float s) noexcept { return s > 0.0f ? t / s : t * 0.0f; }

}  // namespace quant
KVCACHE_END_NAMESPACE
