// The 512-bit loops' integer and sub-byte codes, sixteen lanes at a time:
// the codes of values already divided by their group's scale (symmetric
// int8, int4, int2 and fp4 e2m1, packed_codes; with a minimum,
// minimum_codes: quant::encode's bits), 64 codes packed as quantize_group
// packs them (int4 and fp4 two a byte, element 2i in byte i's low nibble;
// int2 four, 4i in byte i's low bits), and sixteen codes read back as
// floats (load_code's values). kernels/host/x86/avx512_groups.hpp (symmetric),
// kernels/host/x86/avx512_minimum.hpp (with a minimum) and kernels/host/x86/avx512_channels.hpp
// (KIVI's channels) use them; test_host_simd checks them against the
// scalar code. CUDA translation
// units, other CPUs and builds with KVCACHE_NO_AVX512 compile none of this.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvcache/kernels/host/cpu.hpp"
#include "kvcache/kernels/host/x86/avx512_rows.hpp"
#include "kvcache/config.hpp"
#include "kvcache/core/kv_format.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace simd {

#if KVCACHE_HOST_SIMD && !defined(KVCACHE_NO_AVX512)
KVCACHE_AVX512_BEGIN
namespace avx512 {

// Symmetric codes of sixteen values, one a lane, below 2^bits.
// - int8, int4, int2: cvt::to_int with their bounds, masked to the code's bits.
//   vrangeps keeps the smaller magnitude of v and the bound with v's sign
//   (clamping before rounding gives to_int's integer: the bounds are
//   integers, rounding monotonic); a NaN, which it keeps, is zeroed by the
//   conversion's mask.
// - fp4 e2m1 as kernels/host/x86/avx512_rows.hpp's f32_to_fp8 rounds: |v| clamped to 6,
//   plus magic = 2^(e + 22) for its binade's exponent field e (127 for
//   |v| below 2, where the codes step by 0.5; 128 and 129 above, steps of 1
//   and 2), rounds |v| to its step once, to nearest even, which is
//   f32_to_e2m1's tie rule; the sum's bits less magic's are the steps,
//   plus the binade's first code (0, 2, 4: `less` is magic less it, both
//   looked up by e's low four bits). A NaN is code 0, and the sign bit (8)
//   is set where v's is (-0 included; not for a NaN), as f32_to_e2m1 gives.
// Ten operations for sixteen fp4 codes; the AVX2 loop's seven compares
// took eighteen for eight.
template <DType C>
KVCACHE_AVX512_INLINE inline I packed_codes(V v) noexcept {
  const __mmask16 number = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
  if constexpr (C == DType::fp4_e2m1) {
    const I magic = _mm512_setr_epi32(0x4b000000, 0x4b800000, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x4a800000);
    const I less = _mm512_setr_epi32(0x4afffffe, 0x4b7ffffc, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x4a800000);
    const V c = _mm512_range_ps(v, _mm512_set1_ps(6.0f), 0x0a);  // min(|v|, 6), sign cleared
    const I e = _mm512_srli_epi32(_mm512_max_epi32(bits(c), k(127u << 23)), 23);
    const I sum = bits(_mm512_add_ps(c, from_bits(_mm512_permutexvar_epi32(e, magic))));
    const I code = _mm512_maskz_sub_epi32(number, sum, _mm512_permutexvar_epi32(e, less));
    return _mm512_mask_or_epi32(code, number & _mm512_test_epi32_mask(bits(v), k(0x80000000u)), code, k(8u));
  } else {
    static_assert(C == DType::int8 || C == DType::int4 || C == DType::int2);
    const V bound = _mm512_set1_ps(C == DType::int8 ? 127.0f : C == DType::int4 ? 7.0f : 1.0f);
    return _mm512_and_si512(_mm512_maskz_cvtps_epi32(number, _mm512_range_ps(v, bound, 0x02)),
                            k((1u << dtype_bits(C)) - 1u));
  }
}
// Codes with a minimum, of values already less it and divided by the
// scale: cvt::to_int(v, 0, code_max); max_ps returns its second operand for
// a NaN, so a NaN is code 0, as to_int makes it.
KVCACHE_AVX512_INLINE inline I minimum_codes(V v, V code_max) noexcept {
  return _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, _mm512_setzero_ps()), code_max));
}

// 64 codes (a, b, c, d: sixteen each, one a lane, each in [0, 2^bits))
// packed as quantize_group packs them, and the first `bytes` of them
// stored at p: narrowed to bytes in order (the packs work within 128-bit
// quarters; a permute puts their runs back), then for int4 and fp4
// adjacent bytes merged into one (low nibble first) and for int2 four
// (first code lowest).
template <DType C>
KVCACHE_AVX512_INLINE inline void store_codes(std::byte* p, I a, I b, I c, I d, std::int32_t bytes) noexcept {
  constexpr bool nibbles = C == DType::int4 || C == DType::fp4_e2m1;
  const I x = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),
                                       _mm512_packus_epi16(_mm512_packus_epi32(a, b), _mm512_packus_epi32(c, d)));
  I y = x;
  if constexpr (nibbles)
    y = _mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_maddubs_epi16(x, _mm512_set1_epi16(0x1001))));
  if constexpr (C == DType::int2)
    y = _mm512_castsi128_si512(_mm512_cvtepi32_epi8(
        _mm512_madd_epi16(_mm512_maddubs_epi16(x, _mm512_set1_epi16(0x0401)), _mm512_set1_epi32(0x00100001))));
  if (bytes < static_cast<std::int32_t>(row_bytes(C, 64)))
    _mm512_mask_storeu_epi8(p, (__mmask64{1} << bytes) - 1, y);
  else if constexpr (C == DType::int8)
    _mm512_storeu_si512(p, y);
  else if constexpr (nibbles)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_castsi512_si256(y));
  else
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_castsi512_si128(y));
}

// The float value of each code, indexed by its low four bits: int4 signed
// (top bit flipped, less its weight) or unsigned (with a minimum); int2's
// four values repeated (its lanes keep other codes' bits above the low
// two); fp4 e2m1's eight magnitudes, then the same negated (-0 included).
template <DType C, bool Min>
KVCACHE_AVX512_INLINE inline V code_values() noexcept {
  if constexpr (C == DType::fp4_e2m1)
    return _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f,
                          -4.0f, -6.0f);
  if constexpr (C == DType::int4 && Min) return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  if constexpr (C == DType::int4 && !Min) return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  if constexpr (C == DType::int2 && Min) return _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
  if constexpr (C == DType::int2 && !Min) return _mm512_setr_ps(0, 1, -2, -1, 0, 1, -2, -1, 0, 1, -2, -1, 0, 1, -2, -1);
}

// Sixteen codes of a group from element i, as floats (load_code's): int8
// unsigned with a minimum (symmetric int8 is kernels/host/x86/avx512_rows.hpp's load16);
// sub-byte codes shifted into the low bits of their lanes and looked up in
// code_values (one permute: no mask, sign fix or conversion).
template <DType C, bool Min>
KVCACHE_AVX512_INLINE inline V load_codes(const std::byte* codes, std::int32_t i) noexcept {
  if constexpr (C == DType::int8) {
    static_assert(Min);
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i))));
  } else if constexpr (C == DType::int2) {
    std::uint32_t w;
    std::memcpy(&w, codes + i / 4, 4);
    const I n = _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(w)),
                                  _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30));
    return _mm512_permutexvar_ps(n, code_values<C, Min>());
  } else {  // int4, fp4: each byte twice, the second copy's high nibble shifted down
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i / 2));
    const I n = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b)),
                                  _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4));
    return _mm512_permutexvar_ps(n, code_values<C, Min>());
  }
}

}  // namespace avx512
KVCACHE_AVX512_END
#endif

}  // namespace simd
KVCACHE_END_NAMESPACE
