// The host's row reductions and fused multiply-adds eight lanes at a time
// (AVX2; FMA3 for fma_rows): the largest and smallest of a vector's lanes,
// which the group loops (kernels/host/x86/avx2_groups.hpp) take ranges with, a row's
// largest magnitude (a tensor scale's amax), and out = fmaf(a, b, c) rows,
// one rounding each as fmaf does, so the scalar code's bits. CUDA
// translation units and other CPUs compile none of this (kernels/host/fast_path.hpp's
// fast_abs_max_bits and fast_fma return 0 and the scalar loops do the row).
#pragma once

#include <cstdint>

#include "kvcache/kernels/host/cpu.hpp"
#include "kvcache/kernels/host/x86/avx2_rows.hpp"
#include "kvcache/config.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace simd {

#if KVCACHE_HOST_SIMD
namespace avx2 {
// The largest of eight lanes (signed).
KVCACHE_AVX2_INLINE inline std::uint32_t hmax_epi32(I m) noexcept {
  __m128i h = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0x4e));
  h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0xb1));
  return static_cast<std::uint32_t>(_mm_cvtsi128_si32(h));
}
// The smallest of eight lanes (signed).
KVCACHE_AVX2_INLINE inline std::int32_t hmin_epi32(I m) noexcept {
  __m128i h = _mm_min_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  h = _mm_min_epi32(h, _mm_shuffle_epi32(h, 0x4e));
  h = _mm_min_epi32(h, _mm_shuffle_epi32(h, 0xb1));
  return _mm_cvtsi128_si32(h);
}
KVCACHE_AVX2 inline std::uint32_t abs_max_bits(const float* x, std::int32_t n8) noexcept {
  I m = _mm256_setzero_si256();
  for (std::int32_t i = 0; i < n8; i += 8)
    m = _mm256_max_epi32(m, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const I*>(x + i)), k(0x7fffffffu)));
  return hmax_epi32(m);
}
}  // namespace avx2

/// m = the largest of |x[i]|'s bits (below 2^31: signed max is exact) over
/// the first n - n % 8 elements; returns how many it read (0 without AVX2).
KVCACHE_HOST_KERNEL std::int32_t abs_max_bits(const float* x, std::int32_t n, std::uint32_t& m) noexcept
#if KVCACHE_HOST_KERNEL_DECLARED
    ;
#else
{
  const std::int32_t n8 = n - n % 8;
  if (n8 == 0 || !available()) return 0;
  m = avx2::abs_max_bits(x, n8);
  return n8;
}
#endif

// out[i] = fmaf(a[i], b[i], c[i]), eight at a time; b and c advance by
// bstep / cstep (0: one value for every element, a group's scale and minimum).
__attribute__((target("avx2,fma"))) inline void fma_rows(float* out, const float* a, const float* b, std::int32_t bstep,
                                                         const float* c, std::int32_t cstep, std::int32_t n8) noexcept {
  for (std::int32_t i = 0; i < n8; i += 8) {
    const __m256 bv = bstep ? _mm256_loadu_ps(b + i) : _mm256_set1_ps(*b), cv = cstep ? _mm256_loadu_ps(c + i) : _mm256_set1_ps(*c);
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(_mm256_loadu_ps(a + i), bv, cv));
  }
}
/// out[i] = fmaf(a[i], b, c) (b and c arrays when bstep / cstep are 1, one
/// value when 0) for the first n - n % 8 elements on a CPU with FMA;
/// returns how many (0 without it).
KVCACHE_HOST_KERNEL std::int32_t fmadd(float* out, const float* a, const float* b, std::int32_t bstep, const float* c,
                                       std::int32_t cstep, std::int32_t n) noexcept
#if KVCACHE_HOST_KERNEL_DECLARED
    ;
#else
{
  const std::int32_t n8 = n - n % 8;
  if (n8 == 0 || !fma_available()) return 0;
  fma_rows(out, a, b, bstep, c, cstep, n8);
  return n8;
}
#endif
#elif !defined(__CUDACC__)  // CUDA translation units have none (kernels/host/cpu.hpp)
inline std::int32_t abs_max_bits(const float*, std::int32_t, std::uint32_t&) noexcept { return 0; }
inline std::int32_t fmadd(float*, const float*, const float*, std::int32_t, const float*, std::int32_t, std::int32_t) noexcept {
  return 0;
}
#endif

}  // namespace simd
KVCACHE_END_NAMESPACE
