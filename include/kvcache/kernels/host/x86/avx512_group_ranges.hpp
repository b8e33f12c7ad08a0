// Sixteen quantization groups' ranges and scales at once, where the CPU
// has AVX-512 F, BW and DQ (kernels/host/x86/avx512_groups.hpp's first
// steps, and avx512_minimum.hpp's): each group's largest |x| read from the
// source's own bits (abs_bits: 16-bit types 32 to a vector), one
// transposing reduction that leaves the sixteen groups' maxima (or minima)
// in one vector (reduce_each), and their scales by avx2::group_scales'
// operations, so its bits (group_scales).
#pragma once

#include <cstdint>
#include <cstring>

#include "kvcache/config.hpp"
#include "kvcache/core/kv_format.hpp"
#include "kvcache/kernels/detail/convert.hpp"
#include "kvcache/kernels/host/cpu.hpp"
#include "kvcache/kernels/host/x86/avx2_groups.hpp"
#include "kvcache/kernels/host/x86/avx512_rows.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace simd {

#if KVCACHE_HOST_SIMD && !defined(KVCACHE_NO_AVX512)
KVCACHE_AVX512_BEGIN
namespace avx512 {

// How reduce_each combines lanes: signed max or min of 32-bit lanes, or of
// the 16-bit halves of each (each half kept apart).
enum class Pick { max32, min32, max16, min16 };
template <Pick P>
KVCACHE_AVX512_INLINE inline I pick(I a, I b) noexcept {
  if constexpr (P == Pick::max32) return _mm512_max_epi32(a, b);
  if constexpr (P == Pick::min32) return _mm512_min_epi32(a, b);
  if constexpr (P == Pick::max16) return _mm512_max_epi16(a, b);
  if constexpr (P == Pick::min16) return _mm512_min_epi16(a, b);
}
// Lane j of the result is a[j]'s lanes combined by P (for max32, its
// largest lane). Four rounds halve the vectors, each combining two
// shuffles that pair the halves, then the quarters, pairs and lanes of two
// vectors; the last leaves group q + 4r in lane 4q + r, which one permute
// puts back in order. The shuffles move whole 32-bit lanes, so a 16-bit
// pick keeps the low and high halves' results apart.
template <Pick P>
KVCACHE_AVX512_INLINE inline I reduce_each(const I (&a)[16]) noexcept {
  I t[8], u[4], w[2];
  for (int j = 0; j < 8; ++j)
    t[j] =
        pick<P>(_mm512_shuffle_i32x4(a[2 * j], a[2 * j + 1], 0x44), _mm512_shuffle_i32x4(a[2 * j], a[2 * j + 1], 0xee));
  for (int j = 0; j < 4; ++j)
    u[j] =
        pick<P>(_mm512_shuffle_i32x4(t[2 * j], t[2 * j + 1], 0x88), _mm512_shuffle_i32x4(t[2 * j], t[2 * j + 1], 0xdd));
  for (int j = 0; j < 2; ++j)
    w[j] = pick<P>(_mm512_unpacklo_epi64(u[2 * j], u[2 * j + 1]), _mm512_unpackhi_epi64(u[2 * j], u[2 * j + 1]));
  const V w0 = _mm512_castsi512_ps(w[0]), w1 = _mm512_castsi512_ps(w[1]);
  const I z = pick<P>(bits(_mm512_shuffle_ps(w0, w1, 0x88)), bits(_mm512_shuffle_ps(w0, w1, 0xdd)));
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
}
KVCACHE_AVX512_INLINE inline I max_each(const I (&a)[16]) noexcept { return reduce_each<Pick::max32>(a); }

// Sixteen e4m3 codes (one a lane, in its low byte) as floats, exactly:
// e4m3_as_f16 of the codes sign-extended to 16 bits (their value times
// 2^-8; a NaN code a NaN), widened, times 256.
KVCACHE_AVX512_INLINE inline V e4m3_values(I q) noexcept {
  const __m256i s16 = _mm512_cvtepi32_epi16(_mm512_srai_epi32(_mm512_slli_epi32(q, 24), 24));
  const __m256i h = _mm512_castsi512_si256(e4m3_as_f16(_mm512_zextsi256_si512(s16)));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}

// The values of sixteen entries' bits (32-bit lanes): f16, or e4m3 (fp4's scales).
template <DType E>
KVCACHE_AVX512_INLINE inline V entry_values(I e) noexcept {
  if constexpr (E == DType::f16) return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(e));
  else return e4m3_values(e);
}

// avx2::group_scales for sixteen groups (the same operations, so its bits):
// amax / code_max saturated at the entry type's largest (a NaN stays NaN),
// the entry's bits (f16: a NaN made sign | 0x7e00; e4m3, fp4's: its NaN
// code), one step up where they rounded below want, inv = 1 / scale where scale > 0.
template <DType E = DType::f16>
KVCACHE_AVX512_INLINE inline void group_scales(V amax, float code_max, I& entry, V& inv) noexcept {
  static_assert(E == DType::f16 || E == DType::fp8_e4m3);
  const V type_max = _mm512_set1_ps(E == DType::f16 ? cvt::kF16Max : cvt::kE4m3Max);
  V want = _mm512_div_ps(amax, _mm512_set1_ps(code_max));
  want = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(want, type_max, _CMP_GT_OQ), want, type_max);
  want = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(want, _mm512_setzero_ps(), _CMP_LT_OQ), want, _mm512_setzero_ps());  // (as avx2's)
  entry = E == DType::f16 ? _mm512_cvtepu16_epi32(f16_codes<true>(want)) : codes<DType::fp8_e4m3>(want);
  entry = _mm512_mask_add_epi32(entry, _mm512_cmp_ps_mask(entry_values<E>(entry), want, _CMP_LT_OQ), entry, k(1u));
  const V scale = entry_values<E>(entry);
  inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(scale, _mm512_setzero_ps(), _CMP_GT_OQ), _mm512_set1_ps(1.0f), scale);
}

// avx2::f16_at_most for sixteen minima: f16 bits (in 32-bit lanes) of lo
// rounded down, an infinity made the largest finite of its sign.
KVCACHE_AVX512_INLINE inline I f16_at_most(V lo) noexcept {
  I b = _mm512_cvtepu16_epi32(f16_codes<true>(lo));
  const __mmask16 above = _mm512_cmp_ps_mask(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(b)), lo, _CMP_GT_OQ);
  const __mmask16 negative = _mm512_test_epi32_mask(b, k(0x8000u));
  b = _mm512_mask_add_epi32(b, above & negative, b, k(1u));  // one step down
  b = _mm512_mask_sub_epi32(b, above & static_cast<__mmask16>(~negative), b, k(1u));
  const __mmask16 inf = _mm512_cmpeq_epi32_mask(_mm512_and_si512(b, k(0x7fffu)), k(0x7c00u));
  return _mm512_mask_or_epi32(b, inf, _mm512_and_si512(b, k(0x8000u)), k(0x7bffu));
}

// The largest |x|'s bits of a group of G values of S, in
// 32-bit lanes whose largest is the group's: the source's own bits, 16-bit
// types 32 to a vector.
template <DType S, int G>
KVCACHE_AVX512_INLINE inline I abs_bits(const std::byte* in) noexcept {
  if constexpr (S == DType::f32) {
    I a = _mm512_setzero_si512();
    for (std::int32_t i = 0; i < G; i += 16)
      a = _mm512_max_epi32(a, _mm512_and_si512(_mm512_loadu_si512(in + 4 * i), k(0x7fffffffu)));
    return a;
  } else {
    const I mask = _mm512_set1_epi16(0x7fff);
    I a = G == 16
              ? _mm512_and_si512(_mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in))), mask)
              : _mm512_setzero_si512();
    for (std::int32_t i = 0; i + 32 <= G; i += 32)
      a = _mm512_max_epu16(a, _mm512_and_si512(_mm512_loadu_si512(in + 2 * i), mask));
    return _mm512_max_epi32(_mm512_and_si512(a, k(0xffffu)), _mm512_srli_epi32(a, 16));
  }
}
// The values of abs_bits' maxima.
template <DType S>
KVCACHE_AVX512_INLINE inline V abs_values(I a) noexcept {
  if constexpr (S == DType::f32) return from_bits(a);
  if constexpr (S == DType::f16) return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(a));
  if constexpr (S == DType::bf16) return from_bits(_mm512_slli_epi32(a, 16));
}

}  // namespace avx512
KVCACHE_AVX512_END
#endif

}  // namespace simd
KVCACHE_END_NAMESPACE
