// The host backend's group quantization for whole-byte symmetric codes
// (int8, fp8 e4m3, fp8 e5m2 with an f16 scale a group), eight lanes at a
// time, straight from the caller's row to codes and entries and back.
// quant::quantize_group does the same through a float buffer and a scalar
// scale per group; at 32-value groups that per-group overhead cost 5x the
// conversion itself. Here up to eight groups' scales are computed together
// in one vector (the division, the saturation and the f16 round trip), and
// the row is read twice from L1 (its abs max, then its codes) instead of
// being staged. The bits are quantize_group's and dequantize_group's:
// the same IEEE operations in the same order (x = load * mul; amax of |x|'s
// bits; scale = f16(amax / code_max), saturated; inv = 1 / scale or 0;
// code = encode(x * inv)), which test_host_simd checks against the scalar
// code. CUDA translation units and other CPUs compile none of this.
#pragma once

#include <cstdint>
#include <cstring>

#include "common.hpp"
#include "host_simd.hpp"
#include "kvcache/kv_format.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace simd {

#if KVCACHE_HOST_SIMD
#define KVCACHE_AVX2 __attribute__((target("avx2,f16c")))
#define KVCACHE_AVX2_INLINE __attribute__((target("avx2,f16c"), always_inline))
namespace avx2 {

// group_scale for eight groups' abs maxima: amax / code_max, saturated at
// f16's largest (an ordered compare: a NaN stays NaN, as `want > max ?`
// leaves it), then through f16 and back (the bit codes, whose bits are
// cvt's). The f16 bits go to the entries; inv = 1 / scale where scale > 0.
KVCACHE_AVX2_INLINE inline void group_scales(__m256 amax, float code_max, I& f16_bits, __m256& inv) noexcept {
  __m256 want = _mm256_div_ps(amax, _mm256_set1_ps(code_max));
  const __m256 f16_max = _mm256_set1_ps(cvt::kF16Max);
  want = _mm256_blendv_ps(want, f16_max, _mm256_cmp_ps(want, f16_max, _CMP_GT_OQ));
  f16_bits = f32_to_f16(want);
  const __m256 scale = f16_to_f32(f16_bits);
  inv = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0f), scale), _mm256_cmp_ps(scale, _mm256_setzero_ps(), _CMP_GT_OQ));
}

template <DType S, DType C>
KVCACHE_AVX2 inline void quantize_groups(std::byte* codes, std::byte* entries, const std::byte* src, std::int32_t group,
                                         std::int32_t groups, float mul, float code_max) noexcept {
  const __m256 m = _mm256_set1_ps(mul);
  for (std::int32_t b = 0; b < groups; b += 8) {
    const std::int32_t nb = groups - b < 8 ? groups - b : 8;
    alignas(32) std::uint32_t amax[8] = {};
    for (std::int32_t j = 0; j < nb; ++j) {
      const std::byte* in = src + row_bytes(S, std::int64_t{b + j} * group);
      I a = _mm256_setzero_si256();
      for (std::int32_t i = 0; i < group; i += 8)
        a = _mm256_max_epi32(a, _mm256_and_si256(bits(_mm256_mul_ps(load8<S, false>(in + row_bytes(S, i)), m)), k(0x7fffffffu)));
      amax[j] = hmax_epi32(a);
    }
    I h;
    __m256 inv;
    group_scales(from_bits(_mm256_load_si256(reinterpret_cast<const I*>(amax))), code_max, h, inv);
    alignas(32) std::uint32_t hb[8];
    alignas(32) float ib[8];
    _mm256_store_si256(reinterpret_cast<I*>(hb), h);
    _mm256_store_ps(ib, inv);
    for (std::int32_t j = 0; j < nb; ++j) {
      const auto e = static_cast<std::uint16_t>(hb[j]);
      std::memcpy(entries + 2 * (b + j), &e, 2);
      const std::byte* in = src + row_bytes(S, std::int64_t{b + j} * group);
      std::byte* out = codes + std::int64_t{b + j} * group;
      store_each<C>(out, group, Scaled<S, false, true>{in, m, _mm256_set1_ps(ib[j])});
    }
  }
}

template <DType C, DType O>
KVCACHE_AVX2 inline void dequantize_groups(std::byte* out, const std::byte* codes, const std::byte* entries, std::int32_t group,
                                           std::int32_t groups, float mul) noexcept {
  const __m256 m = _mm256_set1_ps(mul);
  for (std::int32_t g = 0; g < groups; ++g) {
    std::uint16_t e;
    std::memcpy(&e, entries + 2 * g, 2);
    // (code * scale) * mul, as dequantize_group then move_row compute it.
    store_each<O>(out + row_bytes(O, std::int64_t{g} * group), group,
                  Scaled<C, true, true>{codes + std::int64_t{g} * group, _mm256_set1_ps(cvt::f16_to_f32(e)), m});
  }
}

// The caller's type, then the code's: every pair a template instance.
template <DType S>
inline bool quantize_to(DType code, std::byte* codes, std::byte* entries, const std::byte* src, std::int32_t group,
                        std::int32_t groups, float mul, float code_max) noexcept {
  switch (code) {
    case DType::int8: quantize_groups<S, DType::int8>(codes, entries, src, group, groups, mul, code_max); return true;
    case DType::fp8_e4m3: quantize_groups<S, DType::fp8_e4m3>(codes, entries, src, group, groups, mul, code_max); return true;
    case DType::fp8_e5m2: quantize_groups<S, DType::fp8_e5m2>(codes, entries, src, group, groups, mul, code_max); return true;
    default: return false;
  }
}
template <DType C>
inline bool dequantize_to(DType ot, std::byte* out, const std::byte* codes, const std::byte* entries, std::int32_t group,
                          std::int32_t groups, float mul) noexcept {
  switch (ot) {
    case DType::f32: dequantize_groups<C, DType::f32>(out, codes, entries, group, groups, mul); return true;
    case DType::f16: dequantize_groups<C, DType::f16>(out, codes, entries, group, groups, mul); return true;
    case DType::bf16: dequantize_groups<C, DType::bf16>(out, codes, entries, group, groups, mul); return true;
    default: return false;
  }
}
}  // namespace avx2

/// True when the group loops below take a row of `code` (int8, fp8 e4m3 or
/// e5m2; symmetric groups of a multiple of 8 values) to or from `other`
/// (f32, f16 or bf16) on this CPU.
inline bool groups_fast(DType code, bool minimum, std::int32_t group, DType other) noexcept {
  const bool code_ok = code == DType::int8 || code == DType::fp8_e4m3 || code == DType::fp8_e5m2;
  const bool other_ok = other == DType::f32 || other == DType::f16 || other == DType::bf16;
  return code_ok && other_ok && !minimum && group % 8 == 0 && available();
}

/// quant::quantize_group of each of `groups` groups of src (st, times mul)
/// into codes and f16 entries (2 bytes each, packed); false when
/// groups_fast says no (nothing written).
inline bool quantize_groups(std::byte* codes, std::byte* entries, const void* src, DType st, DType code, bool minimum,
                            std::int32_t group, std::int32_t groups, float mul, float code_max) noexcept {
  if (!groups_fast(code, minimum, group, st)) return false;
  const auto* s = static_cast<const std::byte*>(src);
  switch (st) {
    case DType::f32: return avx2::quantize_to<DType::f32>(code, codes, entries, s, group, groups, mul, code_max);
    case DType::f16: return avx2::quantize_to<DType::f16>(code, codes, entries, s, group, groups, mul, code_max);
    default: return avx2::quantize_to<DType::bf16>(code, codes, entries, s, group, groups, mul, code_max);
  }
}

/// quant::dequantize_group of each group, times mul, stored as ot; false
/// when groups_fast says no (nothing written).
inline bool dequantize_groups(void* out, DType ot, const std::byte* codes, const std::byte* entries, DType code, bool minimum,
                              std::int32_t group, std::int32_t groups, float mul) noexcept {
  if (!groups_fast(code, minimum, group, ot)) return false;
  auto* o = static_cast<std::byte*>(out);
  switch (code) {
    case DType::int8: return avx2::dequantize_to<DType::int8>(ot, o, codes, entries, group, groups, mul);
    case DType::fp8_e4m3: return avx2::dequantize_to<DType::fp8_e4m3>(ot, o, codes, entries, group, groups, mul);
    default: return avx2::dequantize_to<DType::fp8_e5m2>(ot, o, codes, entries, group, groups, mul);
  }
}
#undef KVCACHE_AVX2
#undef KVCACHE_AVX2_INLINE
#endif

}  // namespace simd

/// simd::quantize_groups on the host; false on CUDA or without AVX2.
KVCACHE_HOST_DEVICE inline bool fast_quantize_groups(std::byte* codes, std::byte* entries, const void* src, DType st, DType code,
                                                     bool minimum, std::int32_t group, std::int32_t groups, float mul,
                                                     float code_max) noexcept {
#if KVCACHE_HOST_SIMD
  return simd::quantize_groups(codes, entries, src, st, code, minimum, group, groups, mul, code_max);
#else
  (void)codes, (void)entries, (void)src, (void)st, (void)code, (void)minimum, (void)group, (void)groups, (void)mul, (void)code_max;
  return false;
#endif
}

/// simd::dequantize_groups on the host; false on CUDA or without AVX2.
KVCACHE_HOST_DEVICE inline bool fast_dequantize_groups(void* out, DType ot, const std::byte* codes, const std::byte* entries,
                                                       DType code, bool minimum, std::int32_t group, std::int32_t groups,
                                                       float mul) noexcept {
#if KVCACHE_HOST_SIMD
  return simd::dequantize_groups(out, ot, codes, entries, code, minimum, group, groups, mul);
#else
  (void)out, (void)ot, (void)codes, (void)entries, (void)code, (void)minimum, (void)group, (void)groups, (void)mul;
  return false;
#endif
}

KVCACHE_END_NAMESPACE
