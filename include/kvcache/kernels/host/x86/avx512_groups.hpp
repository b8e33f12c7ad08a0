// The host's symmetric group quantization sixteen lanes at a time (int8,
// fp8 e4m3 and e5m2, int4 and int2 with an f16 scale a group; fp4 e2m1
// with an e4m3 one, NVFP4's) in groups of 16, 32, 64 or 128 values, where
// the CPU has AVX-512 F, BW and DQ. The AVX2 loops (kernels/host/x86/avx2_groups.hpp)
// spent most of a 32-value group on its overhead: a conversion and
// multiply per value only to find the range, a horizontal max per group,
// the scales through arrays, eight lanes a store. Here sixteen groups'
// ranges are read from the source's own bits (32 values an operation for
// 16-bit types), one transposing reduction gives their sixteen maxima in
// one vector, their scales take one pass of group_scales' operations
// (those three steps: kernels/host/x86/avx512_group_ranges.hpp), and
// the codes are written 64 at a time by kernels/host/x86/avx512_rows.hpp's encoders and
// packs (whole bytes) or kernels/host/x86/avx512_packed.hpp's (nibbles, bit pairs);
// the group size is a template argument, so no loop counts or divides by
// it. Reading back, each 16 values of a group is one multiply by the
// group's scale and one by the caller's multiplier, stored in the caller's
// type. The bits are quantize_group's and dequantize_group's
// (test_host_simd).
#pragma once

#include <cstdint>
#include <cstring>

#include "kvcache/kernels/host/cpu.hpp"
#include "kvcache/kernels/host/x86/avx512_group_ranges.hpp"
#include "kvcache/kernels/host/x86/avx512_rows.hpp"
#include "kvcache/kernels/host/x86/avx512_packed.hpp"
#include "kvcache/kernels/host/x86/avx2_groups.hpp"
#include "kvcache/config.hpp"
#include "kvcache/kernels/detail/convert.hpp"
#include "kvcache/core/kv_format.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace simd {

#if KVCACHE_HOST_SIMD && !defined(KVCACHE_NO_AVX512)
KVCACHE_AVX512_BEGIN
namespace avx512 {

// The call's scale k the values are divided by: none (1), the FMA quotient
// (k in [2^-60, 2^60], divided<true>: a positive divisor, so a zero
// quotient's sign is x's), or vdivps.
struct CallScale {
  V k, inv;
  enum : std::uint8_t { none, fma, div } how;
  KVCACHE_AVX512_INLINE static CallScale of(float k) noexcept {
    return {_mm512_set1_ps(k), _mm512_set1_ps(1.0f / k), k == 1.0f ? none : k >= 0x1p-60f && k <= 0x1p60f ? fma : div};
  }
  KVCACHE_AVX512_INLINE V apply(V x) const noexcept {
    return how == none ? x : how == fma ? divided<true>(x, k, inv) : _mm512_div_ps(x, k);
  }
};

// Elements i.. of a round's source divided by the call's scale, then by
// their group's stored scale (quant::quotient's bits: the FMA quotient,
// divided<true>, a group of zeros or NaN scale through x * 0).
template <DType S>
KVCACHE_AVX512_INLINE inline V scaled(const std::byte* in, std::int32_t i, const CallScale& k, const float* scale, const float* inv,
                                      int log2_group) noexcept {
  const V x = k.apply(load16<S>(in + row_bytes(S, i)));
  return divided<true>(x, _mm512_set1_ps(scale[i >> log2_group]), _mm512_set1_ps(inv[i >> log2_group]));
}

// quantize_groups' symmetric codes, for groups of G = 16, 32, 64 or 128
// values, up to 16 groups a round; k is the call's scale (the values are
// divided by it). A group's largest |x / k| is taken as (its largest |x|) /
// |k|: rounding is monotonic and symmetric, so for a finite non-zero k
// (ordered_multiplier) that is the same float, and a NaN (any NaN: its
// entry is the entry type's NaN and its inv 0 whatever the payload) where
// there is one. So the first read is the source's bits
// alone, 32 values an operation for 16-bit types; the second converts
// them. Whole-byte codes are kernels/host/x86/avx512_rows.hpp's, sub-byte ones
// kernels/host/x86/avx512_packed.hpp's; fp4's scales are e4m3 bytes, the rest f16.
template <DType S, DType C, int G>
KVCACHE_AVX512 inline void quantize_groups(std::byte* dst, std::byte* entries, const std::byte* src,
                                           std::int32_t groups, float k, float code_max) noexcept {
  static_assert(G >= 16 && (G & (G - 1)) == 0);
  constexpr std::int32_t group = G;
  constexpr DType E = group_scale_dtype(C);
  const CallScale m = CallScale::of(k), abs_k = CallScale::of(k < 0.0f ? -k : k);
  constexpr int lg = __builtin_ctz(static_cast<unsigned>(G));
  alignas(64) float inv[16], scale[16];
  for (std::int32_t b = 0; b < groups; b += 16) {
    const std::int32_t nb = groups - b < 16 ? groups - b : 16, n = nb * group;
    const std::byte* in = src + row_bytes(S, std::int64_t{b} * group);
    I acc[16];
    for (std::int32_t j = 0; j < 16; ++j)
      acc[j] = j < nb ? abs_bits<S, G>(in + row_bytes(S, std::int64_t{j} * group)) : _mm512_setzero_si512();
    I entry;
    V iv;
    const V amax = abs_values<S>(max_each(acc));
    group_scales<E>(abs_k.apply(amax), code_max, entry, iv);
    _mm512_store_ps(scale, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(iv, _mm512_setzero_ps(), _CMP_NEQ_UQ), entry_values<E>(entry)));  // NaN: 0, quotient's x * 0
    const auto in_round = static_cast<__mmask16>((1u << nb) - 1u);
    if constexpr (E == DType::f16)
      _mm512_mask_cvtepi32_storeu_epi16(entries + 2 * b, in_round, entry);
    else
      _mm512_mask_cvtepi32_storeu_epi8(entries + b, in_round, entry);
    _mm512_store_ps(inv, iv);
    std::byte* out = dst + row_bytes(C, std::int64_t{b} * group);
    if constexpr (dtype_bits(C) == 8) {
      std::int32_t i = 0;
      for (; i + 64 <= n; i += 64) {
        const V v[4] = {scaled<S>(in, i, m, scale, inv, lg), scaled<S>(in, i + 16, m, scale, inv, lg),
                        scaled<S>(in, i + 32, m, scale, inv, lg), scaled<S>(in, i + 48, m, scale, inv, lg)};
        store64<C, false, true>(out + i, v);
      }
      for (; i < n; i += 16)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                         _mm512_cvtepi32_epi8(codes<C>(scaled<S>(in, i, m, scale, inv, lg))));
    } else {
      for (std::int32_t i = 0; i < n; i += 64) {
        const std::int32_t left = n - i;
        I c[4];
        for (std::int32_t j = 0; j < 4; ++j)
          c[j] = 16 * j < left ? packed_codes<C>(scaled<S>(in, i + 16 * j, m, scale, inv, lg)) : _mm512_setzero_si512();
        store_codes<C>(out + row_bytes(C, i), c[0], c[1], c[2], c[3],
                       static_cast<std::int32_t>(row_bytes(C, left < 64 ? left : 64)));
      }
    }
  }
}

// 16 elements of O from v (f16: a NaN made the scalar code's sign | 0x7e00).
template <DType O>
KVCACHE_AVX512_INLINE inline void store16(std::byte* p, V v) noexcept {
  if constexpr (O == DType::f32) _mm512_storeu_ps(p, v);
  if constexpr (O == DType::f16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), f16_codes<true>(v));
  if constexpr (O == DType::bf16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(f32_to_bf16(v)));
}

// dequantize_groups' (code * scale) * mul, 16 values a step. Sixteen
// groups' scales are widened together (f16 by the hardware: the scalar
// conversion's bits, a signalling NaN quieted as the multiply would; fp4's
// e4m3 by e4m3_values). Sub-byte codes are load_codes' values. e4m3
// codes go through fp16 with the scale times 256 (avx2::e4m3_prescales:
// every f16 scale but inf and NaN), a group whose scale it refuses through
// the AVX2 loop.
template <DType C, DType O, int G>
KVCACHE_AVX512 inline void dequantize_groups(std::byte* out, const std::byte* codes, const std::byte* entries,
                                             std::int32_t groups, float mul) noexcept {
  constexpr std::int32_t group = G;
  const V m = _mm512_set1_ps(mul);
  alignas(64) float scales[16];
  for (std::int32_t b = 0; b < groups; b += 16) {
    const std::int32_t nb = groups - b < 16 ? groups - b : 16;
    if constexpr (group_scale_dtype(C) == DType::f16) {
      const I h = _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1u << nb) - 1u), entries + 2 * b);
      _mm512_store_ps(scales, _mm512_cvtph_ps(_mm512_castsi512_si256(h)));
    } else {  // fp4's e4m3 bytes
      const I q = _mm512_maskz_loadu_epi8((__mmask64{1} << nb) - 1, entries + b);
      _mm512_store_ps(scales, e4m3_values(_mm512_cvtepu8_epi32(_mm512_castsi512_si128(q))));
    }
    for (std::int32_t j = 0; j < nb; ++j) {
      const std::int32_t g = b + j;
      const float scale = scales[j];
      std::byte* o = out + row_bytes(O, std::int64_t{g} * group);
      const std::byte* c = codes + row_bytes(C, std::int64_t{g} * group);
      if constexpr (C == DType::fp8_e4m3) {
        if (!avx2::e4m3_prescales(scale)) {
          avx2::dequantize_groups<C, O>(o, c, entries + 2 * g, group, 1, mul);
          continue;
        }
        const V s256 = _mm512_set1_ps(scale * 256.0f);
        for (std::int32_t i = 0; i < group; i += 16) {
          const __m256i h =
              avx2::e4m3_as_f16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + i))));
          store16<O>(o + row_bytes(O, i), _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtph_ps(h), s256), m));
        }
      } else if constexpr (dtype_bits(C) == 8) {
        const V s = _mm512_set1_ps(scale);
        for (std::int32_t i = 0; i < group; i += 16)
          store16<O>(o + row_bytes(O, i), _mm512_mul_ps(_mm512_mul_ps(load16<C>(c + i), s), m));
      } else {
        const V s = _mm512_set1_ps(scale);
        for (std::int32_t i = 0; i < group; i += 16)
          store16<O>(o + row_bytes(O, i), _mm512_mul_ps(_mm512_mul_ps(load_codes<C, false>(c, i), s), m));
      }
    }
  }
}

/// True when the 512-bit group loops (these and kernels/host/x86/avx512_minimum.hpp's)
/// take groups of `group` values (16, 32, 64 or 128, as formats take) to
/// or from `other` (f32, f16 or bf16) on this CPU.
inline bool wide_shape(std::int32_t group, DType other) noexcept {
  const bool other_ok = other == DType::f32 || other == DType::f16 || other == DType::bf16;
  return other_ok && (group == 16 || group == 32 || group == 64 || group == 128) && avx512_available();
}
/// True for a finite, non-zero multiplier: the one for which the 512-bit
/// loops' ranges, taken from the source's bits before the multiply, are
/// the products' (see quantize_groups); 0, inf and NaN go to the AVX2 loops.
inline bool ordered_multiplier(float mul) noexcept {
  const float a = mul < 0.0f ? -mul : mul;
  return a > 0.0f && a <= 0x1.fffffep127f;
}
/// True when the loops above take symmetric groups of `code` (int8, fp8
/// e4m3 or e5m2, int4, int2, fp4 e2m1) in wide_shape's groups.
inline bool groups_wide(DType code, bool minimum, std::int32_t group, DType other) noexcept {
  const bool code_ok = !minimum && (code == DType::int8 || code == DType::fp8_e4m3 || code == DType::fp8_e5m2 ||
                                    code == DType::int4 || code == DType::int2 || code == DType::fp4_e2m1);
  return code_ok && wide_shape(group, other);
}

template <DType S, DType C>
inline void quantize_sized(std::byte* codes, std::byte* entries, const std::byte* src, std::int32_t group,
                           std::int32_t groups, float mul, float code_max) noexcept {
  switch (group) {
    case 16:
      return quantize_groups<S, C, 16>(codes, entries, src, groups, mul, code_max);
    case 32:
      return quantize_groups<S, C, 32>(codes, entries, src, groups, mul, code_max);
    case 64:
      return quantize_groups<S, C, 64>(codes, entries, src, groups, mul, code_max);
    default:
      return quantize_groups<S, C, 128>(codes, entries, src, groups, mul, code_max);
  }
}
template <DType S>
inline void quantize_to(DType code, std::byte* codes, std::byte* entries, const std::byte* src, std::int32_t group,
                        std::int32_t groups, float mul, float code_max) noexcept {
  switch (code) {
    case DType::int8:
      return quantize_sized<S, DType::int8>(codes, entries, src, group, groups, mul, code_max);
    case DType::fp8_e4m3:
      return quantize_sized<S, DType::fp8_e4m3>(codes, entries, src, group, groups, mul, code_max);
    case DType::fp8_e5m2:
      return quantize_sized<S, DType::fp8_e5m2>(codes, entries, src, group, groups, mul, code_max);
    case DType::int4:
      return quantize_sized<S, DType::int4>(codes, entries, src, group, groups, mul, code_max);
    case DType::int2:
      return quantize_sized<S, DType::int2>(codes, entries, src, group, groups, mul, code_max);
    default:
      return quantize_sized<S, DType::fp4_e2m1>(codes, entries, src, group, groups, mul, code_max);
  }
}
template <DType C, DType O>
inline void dequantize_sized(std::byte* out, const std::byte* codes, const std::byte* entries, std::int32_t group,
                             std::int32_t groups, float mul) noexcept {
  switch (group) {
    case 16:
      return dequantize_groups<C, O, 16>(out, codes, entries, groups, mul);
    case 32:
      return dequantize_groups<C, O, 32>(out, codes, entries, groups, mul);
    case 64:
      return dequantize_groups<C, O, 64>(out, codes, entries, groups, mul);
    default:
      return dequantize_groups<C, O, 128>(out, codes, entries, groups, mul);
  }
}
template <DType C>
inline void dequantize_to(DType ot, std::byte* out, const std::byte* codes, const std::byte* entries,
                          std::int32_t group, std::int32_t groups, float mul) noexcept {
  switch (ot) {
    case DType::f32:
      return dequantize_sized<C, DType::f32>(out, codes, entries, group, groups, mul);
    case DType::f16:
      return dequantize_sized<C, DType::f16>(out, codes, entries, group, groups, mul);
    default:
      return dequantize_sized<C, DType::bf16>(out, codes, entries, group, groups, mul);
  }
}

/// The symmetric half of simd::quantize_groups; false (nothing
/// written) where groups_wide says no.
inline bool quantize_groups(std::byte* codes, std::byte* entries, const std::byte* src, DType st, DType code,
                            bool minimum, std::int32_t group, std::int32_t groups, float mul, float code_max) noexcept {
  if (!groups_wide(code, minimum, group, st) || !ordered_multiplier(mul)) return false;
  switch (st) {
    case DType::f32:
      quantize_to<DType::f32>(code, codes, entries, src, group, groups, mul, code_max);
      break;
    case DType::f16:
      quantize_to<DType::f16>(code, codes, entries, src, group, groups, mul, code_max);
      break;
    default:
      quantize_to<DType::bf16>(code, codes, entries, src, group, groups, mul, code_max);
      break;
  }
  return true;
}
/// The symmetric half of simd::dequantize_groups; false (nothing
/// written) where groups_wide says no.
inline bool dequantize_groups(std::byte* out, DType ot, const std::byte* codes, const std::byte* entries, DType code,
                              bool minimum, std::int32_t group, std::int32_t groups, float mul) noexcept {
  if (!groups_wide(code, minimum, group, ot)) return false;
  switch (code) {
    case DType::int8:
      dequantize_to<DType::int8>(ot, out, codes, entries, group, groups, mul);
      break;
    case DType::fp8_e4m3:
      dequantize_to<DType::fp8_e4m3>(ot, out, codes, entries, group, groups, mul);
      break;
    case DType::fp8_e5m2:
      dequantize_to<DType::fp8_e5m2>(ot, out, codes, entries, group, groups, mul);
      break;
    case DType::int4:
      dequantize_to<DType::int4>(ot, out, codes, entries, group, groups, mul);
      break;
    case DType::int2:
      dequantize_to<DType::int2>(ot, out, codes, entries, group, groups, mul);
      break;
    default:
      dequantize_to<DType::fp4_e2m1>(ot, out, codes, entries, group, groups, mul);
      break;
  }
  return true;
}
}  // namespace avx512
KVCACHE_AVX512_END
#endif

}  // namespace simd
KVCACHE_END_NAMESPACE
