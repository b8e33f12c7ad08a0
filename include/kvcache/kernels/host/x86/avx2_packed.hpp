// The host backend's sub-byte codes eight lanes at a time (AVX2): a
// group's codes computed from values already divided by its scale (and
// less its minimum), packed into bytes, and read back as floats, with the
// bits of quant::encode, quantize_group's packing and load_code. int4 and
// fp4 hold two codes a byte (element 2i in byte i's low nibble), int2
// four. The group loops (kernels/host/x86/avx2_groups.hpp) use these; test_host_simd
// checks them against the scalar code. CUDA translation units and other
// CPUs compile none of this.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvcache/kernels/detail/common.hpp"
#include "kvcache/kernels/host/x86/avx2_rows.hpp"
#include "kvcache/core/kv_format.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace simd {

#if KVCACHE_HOST_SIMD
namespace avx2 {

// m + 1 in the lanes where a passes `at` (compare Pred; a mask is -1).
template <int Pred>
KVCACHE_AVX2_INLINE inline I past(I m, __m256 a, float at) noexcept {
  return _mm256_sub_epi32(m, _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(at), Pred)));
}
// Symmetric packed codes of 8 values already divided by the scale, one a
// lane (quant::encode's bits): int4 and int2 by to_int with their bounds,
// masked to the code's bits; fp4 e2m1's magnitude code counts the
// midpoints |v| passes (> at an even code's upper midpoint, >= at an odd
// one's: ties go to the even code), its sign bit set where v's is (-0
// included). A NaN fails every compare and takes no sign: code 0, as
// f32_to_e2m1 gives.
template <DType C>
KVCACHE_AVX2_INLINE inline I packed_codes(__m256 v) noexcept {
  if constexpr (C == DType::fp4_e2m1) {
    const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
    I m = _mm256_setzero_si256();
    m = past<_CMP_GT_OQ>(m, a, 0.25f), m = past<_CMP_GE_OQ>(m, a, 0.75f);
    m = past<_CMP_GT_OQ>(m, a, 1.25f), m = past<_CMP_GE_OQ>(m, a, 1.75f);
    m = past<_CMP_GT_OQ>(m, a, 2.5f), m = past<_CMP_GE_OQ>(m, a, 3.5f);
    m = past<_CMP_GT_OQ>(m, a, 5.0f);
    const I ordered = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_ORD_Q));
    const I sign = _mm256_and_si256(_mm256_and_si256(_mm256_srai_epi32(_mm256_castps_si256(v), 31), ordered), k(8u));
    return _mm256_or_si256(m, sign);
  } else {
    const float hi = C == DType::int4 ? 7.0f : 1.0f;
    return _mm256_and_si256(to_int(v, -hi, hi), k(C == DType::int4 ? 15u : 3u));
  }
}

// Eight codes (one a lane, below 2^bits) packed as quantize_group packs
// them: a byte a code for int8; element 2i in byte i's low nibble for int4
// and fp4, 4i in byte i's low two bits for int2. Shifted into place, a
// half's lanes are summed (their bits are disjoint: the sum is their OR),
// and each half's bytes taken from the low lanes.
template <DType C>
KVCACHE_AVX2_INLINE inline void store_packed(std::byte* p, I c) noexcept {
  if constexpr (C == DType::int8) {
    store_u8(p, c);
  } else if constexpr (C == DType::int4 || C == DType::fp4_e2m1) {  // 4 bytes: each half's lanes 0, 1 after one pairwise sum
    const I h = _mm256_hadd_epi32(_mm256_sllv_epi32(c, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4)), c);
    const I b = _mm256_shuffle_epi8(h, _mm256_setr_epi8(0, 4, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                                       0, 4, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    const auto w = static_cast<std::uint32_t>(_mm_cvtsi128_si32(_mm256_castsi256_si128(b))) |
                   static_cast<std::uint32_t>(_mm_cvtsi128_si32(_mm256_extracti128_si256(b, 1))) << 16;
    std::memcpy(p, &w, 4);
  } else {  // int2, 2 bytes: each half's lane 0 after two pairwise sums
    I h = _mm256_sllv_epi32(c, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6));
    h = _mm256_hadd_epi32(h, h);
    h = _mm256_hadd_epi32(h, h);
    const auto w = static_cast<std::uint16_t>(_mm_cvtsi128_si32(_mm256_castsi256_si128(h)) |
                                              _mm_cvtsi128_si32(_mm256_extracti128_si256(h, 1)) << 8);
    std::memcpy(p, &w, 2);
  }
}

// 32 codes (four vectors of eight, each lane below 2^bits) packed with
// whole-vector operations, and `bytes` of them (all 32 codes', or the
// first 16's) stored at p: narrowed to 32 bytes in order (the unsigned
// packs are exact below 256; they work within 128-bit halves, so a
// permute restores the order), then adjacent bytes merged by multiply-adds
// (maddubs: b[2k] + b[2k + 1] * 2^bits; for int2 madd merges those pairs
// again), then one store. store_packed's four stores of eight codes, each
// through two horizontal adds and a move to a general register, took 37%
// of an int2 scatter.
template <DType C>
KVCACHE_AVX2_INLINE inline void store_packed32(std::byte* p, I a, I b, I c, I d, std::int32_t bytes) noexcept {
  const I x = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(_mm256_packus_epi32(a, b), _mm256_packus_epi32(c, d)),
                                          _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  __m128i y;
  if constexpr (C == DType::int8) {
    if (bytes == 32) return _mm256_storeu_si256(reinterpret_cast<I*>(p), x);
    y = _mm256_castsi256_si128(x);
  } else if constexpr (C == DType::int4 || C == DType::fp4_e2m1) {  // low nibble first
    const I w = _mm256_maddubs_epi16(x, _mm256_set1_epi16(0x1001));  // words below 256
    y = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi16(w, w), 0x08));  // each half's 8 bytes, together
  } else {  // int2: two bits a code, first code lowest
    const I w = _mm256_madd_epi16(_mm256_maddubs_epi16(x, _mm256_set1_epi16(0x0401)), _mm256_set1_epi32(0x00100001));
    const I z = _mm256_packus_epi16(_mm256_packus_epi32(w, w), _mm256_setzero_si256());  // each half's 4 bytes first
    y = _mm_unpacklo_epi32(_mm256_castsi256_si128(z), _mm256_extracti128_si256(z, 1));
  }
  if (bytes == 16) _mm_storeu_si128(reinterpret_cast<__m128i*>(p), y);
  else if (bytes == 8) _mm_storel_epi64(reinterpret_cast<__m128i*>(p), y);
  else {
    const auto w = static_cast<std::uint32_t>(_mm_cvtsi128_si32(y));
    std::memcpy(p, &w, 4);
  }
}
// n codes (a multiple of 8), eight a vector from f(i), packed at p: 32 at
// a time through store_packed32 (then 16 through it, with zeros for the
// rest), then 8 through store_packed. f is a functor whose operator()
// carries KVCACHE_AVX2_INLINE (a lambda would not inherit the target).
template <DType C, class F>
KVCACHE_AVX2_INLINE inline void store_packed_each(std::byte* p, std::int32_t n, F f) noexcept {
  std::int32_t i = 0;
  for (; i + 32 <= n; i += 32)
    store_packed32<C>(p + row_bytes(C, i), f(i), f(i + 8), f(i + 16), f(i + 24), static_cast<std::int32_t>(row_bytes(C, 32)));
  if (i + 16 <= n) {
    const I zero = _mm256_setzero_si256();
    store_packed32<C>(p + row_bytes(C, i), f(i), f(i + 8), zero, zero, static_cast<std::int32_t>(row_bytes(C, 16)));
    i += 16;
  }
  if (i < n) store_packed<C>(p + row_bytes(C, i), f(i));
}

// Eight codes of a group from element i, as floats (load_code's values):
// unsigned integers with a minimum; without, int8 signed, int4 and int2
// signed (their top bit flipped, less its weight) and fp4 e2m1 by a table
// of its 8 magnitudes and its sign bit.
template <DType C, bool Min>
KVCACHE_AVX2_INLINE inline __m256 load_packed_codes(const std::byte* codes, std::int32_t i) noexcept {
  if constexpr (C == DType::int8) return Min ? _mm256_cvtepi32_ps(load_u8(codes + i)) : load8<DType::int8, false>(codes + i);
  constexpr bool two = C == DType::int2;
  std::uint32_t w = 0;
  std::memcpy(&w, codes + row_bytes(C, i), two ? 2 : 4);
  const I shifts = two ? _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14) : _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const I n = _mm256_and_si256(_mm256_srlv_epi32(k(w), shifts), k(two ? 3u : 15u));
  if constexpr (Min) return _mm256_cvtepi32_ps(n);
  if constexpr (C == DType::fp4_e2m1) {
    const __m256 mag = _mm256_permutevar8x32_ps(_mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f), n);  // uses n's low 3 bits
    return _mm256_or_ps(mag, from_bits(_mm256_slli_epi32(_mm256_and_si256(n, k(8u)), 28)));
  }
  const std::uint32_t top = two ? 2u : 8u;
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_xor_si256(n, k(top)), k(top)));
}

// (code * scale [+ minimum]) * mul from element i: dequantize_group, then
// move_row. With a minimum the scalar code's fmaf gives the bits of an
// unfused multiply and add: code x scale is exact (an integer of at most 8
// bits times an f16's 11), so the add is the only rounding either way.
template <DType C, bool Min>
struct PackedCodes {
  const std::byte* codes;
  __m256 scale, minimum, mul;
  KVCACHE_AVX2_INLINE __m256 operator()(std::int32_t i) const noexcept {
    const __m256 x = _mm256_mul_ps(load_packed_codes<C, Min>(codes, i), scale);
    return _mm256_mul_ps(Min ? _mm256_add_ps(x, minimum) : x, mul);
  }
};

}  // namespace avx2
#endif

}  // namespace simd
KVCACHE_END_NAMESPACE
