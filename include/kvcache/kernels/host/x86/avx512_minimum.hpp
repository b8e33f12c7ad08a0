// The host's groups with a minimum (int8, int4, int2 codes, an f16 scale
// and minimum a group: llama.cpp's q4_1 and KIVI's groups) sixteen lanes at
// a time, in groups of 16, 32, 64 or 128 values, where the CPU has AVX-512
// F, BW and DQ. The AVX2 loops (kernels/host/x86/avx2_groups.hpp) found a group's range
// by converting and dividing every value by the call's scale k and
// ordering the quotients' bits, then one horizontal min and max per group.
// Here, as for the symmetric codes (kernels/host/x86/avx512_groups.hpp), the range
// comes from the source's own bits: the order keys of fp16 and bf16 values
// 32 to a vector (signed 16-bit min and max), sixteen groups' minima and
// maxima by one transposing reduction each, then divided by k: for a finite
// non-zero k the smallest quotient is the smallest value's (the largest's
// when k < 0), rounding being monotonic. A NaN is the one value whose
// quotient does not order so (x86 keeps its sign and quiets its payload):
// a round of groups holding one goes to the AVX2 loop. Codes are
// to_int(quant::quotient(x / k - minimum, scale), 0, code_max) (the FMA
// quotient, divided<true>), 64 at a time, narrowed by saturating packs and
// merged into nibbles or bit pairs by multiply-adds.
// The bits are quantize_group's and dequantize_group's (test_host_simd).
#pragma once

#include <cstdint>
#include <cstring>

#include "kvcache/kernels/host/cpu.hpp"
#include "kvcache/kernels/host/x86/avx512_rows.hpp"
#include "kvcache/kernels/host/x86/avx512_groups.hpp"
#include "kvcache/kernels/host/x86/avx512_packed.hpp"
#include "kvcache/kernels/host/x86/avx2_groups.hpp"
#include "kvcache/config.hpp"
#include "kvcache/kernels/detail/convert.hpp"
#include "kvcache/kernels/detail/quant.hpp"
#include "kvcache/core/kv_format.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace simd {

#if KVCACHE_HOST_SIMD && !defined(KVCACHE_NO_AVX512)
KVCACHE_AVX512_BEGIN
namespace avx512 {

// quant::order_key in 32-bit lanes (u ^ ((u >> 31) & 0x7fffffff)), or in
// 16-bit lanes for fp16 and bf16 bits (the same with 15 and 0x7fff): its
// own inverse either way.
template <int Bits>
KVCACHE_AVX512_INLINE inline I order_keys(I u) noexcept {
  if constexpr (Bits == 32)
    return _mm512_ternarylogic_epi32(u, _mm512_srai_epi32(u, 31), k(0x7fffffffu), 0x78);  // u ^ (s & m)
  else
    return _mm512_ternarylogic_epi32(u, _mm512_srai_epi16(u, 15), _mm512_set1_epi16(0x7fff), 0x78);
}

// a - b and a + b, never fused with a multiply before them: the 512-bit
// target has FMA, which g++ contracts a * b - c into (-ffp-contract=fast,
// its default), and (x * mul - minimum) then rounds once where the scalar
// code rounds twice. An operation with its rounding given is not contracted.
KVCACHE_AVX512_INLINE inline V sub(V a, V b) noexcept {
  return _mm512_sub_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
KVCACHE_AVX512_INLINE inline V add(V a, V b) noexcept {
  return _mm512_add_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// The order keys of a group of g values of S (a multiple of 16) whose
// smallest and largest are the group's: for f32 in 32-bit lanes, for a
// 16-bit type in 16-bit lanes (a round's sixteen groups are reduced that
// way too, and their lanes' halves merged once, in key_ranges).
template <DType S>
KVCACHE_AVX512_INLINE inline void key_range(const std::byte* in, std::int32_t g, I& lo, I& hi) noexcept {
  if constexpr (S == DType::f32) {
    lo = hi = order_keys<32>(_mm512_loadu_si512(in));
    for (std::int32_t i = 16; i < g; i += 16) {
      const I key = order_keys<32>(_mm512_loadu_si512(in + 4 * i));
      lo = _mm512_min_epi32(lo, key), hi = _mm512_max_epi32(hi, key);
    }
  } else {
    // 16 values fill half a vector: the other half repeats them.
    lo = hi = order_keys<16>(g == 16 ? _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in)))
                                     : _mm512_loadu_si512(in));
    for (std::int32_t i = 32; i < g; i += 32) {
      const I key = order_keys<16>(_mm512_loadu_si512(in + 2 * i));
      lo = _mm512_min_epi16(lo, key), hi = _mm512_max_epi16(hi, key);
    }
  }
}
// Sixteen groups' smallest and largest keys, group j's in lane j (a 16-bit
// type's sign-extended); lanes past nb are key 0.
template <DType S>
KVCACHE_AVX512_INLINE inline void key_ranges(const std::byte* in, std::int32_t g, std::int32_t nb, I& klo,
                                             I& khi) noexcept {
  I lo[16], hi[16];
  for (std::int32_t j = 0; j < 16; ++j) {
    if (j < nb)
      key_range<S>(in + row_bytes(S, std::int64_t{j} * g), g, lo[j], hi[j]);
    else
      lo[j] = hi[j] = _mm512_setzero_si512();
  }
  if constexpr (S == DType::f32) {
    klo = reduce_each<Pick::min32>(lo), khi = reduce_each<Pick::max32>(hi);
  } else {
    const I a = reduce_each<Pick::min16>(lo), b = reduce_each<Pick::max16>(hi);
    klo = _mm512_min_epi32(_mm512_srai_epi32(_mm512_slli_epi32(a, 16), 16), _mm512_srai_epi32(a, 16));
    khi = _mm512_max_epi32(_mm512_srai_epi32(_mm512_slli_epi32(b, 16), 16), _mm512_srai_epi32(b, 16));
  }
}
// The values of key_range's keys, and the lanes among them that are NaN
// (past +inf's key or below -inf's).
template <DType S>
KVCACHE_AVX512_INLINE inline V key_values(I key) noexcept {
  if constexpr (S == DType::f32)
    return from_bits(order_keys<32>(key));
  else
    return abs_values<S>(order_keys<16>(key));  // the low 16 bits of each lane: abs_values reads those
}
template <DType S>
KVCACHE_AVX512_INLINE inline __mmask16 nan_keys(I lo, I hi) noexcept {
  constexpr std::uint32_t inf = S == DType::f32 ? 0x7f800000u : S == DType::f16 ? 0x7c00u : 0x7f80u;
  constexpr std::uint32_t ninf = S == DType::f32 ? 0x807fffffu : S == DType::f16 ? 0xffff83ffu : 0xffff807fu;
  return static_cast<__mmask16>(_mm512_cmpgt_epi32_mask(hi, k(inf)) | _mm512_cmplt_epi32_mask(lo, k(ninf)));
}

// Elements i.. of a round's source as codes: to_int(quotient(x / k -
// minimum, scale), 0, code_max) (by_k: k is not 1), the group's minimum,
// scale and 1 / scale at i >> lg (a NaN, inf - inf among them, is code 0:
// minimum_codes).
template <DType S>
struct MinimumCodes {
  const std::byte* in;
  CallScale k;
  V code_max;
  const float *minimum, *scale, *inv;
  int lg;
  KVCACHE_AVX512_INLINE I operator()(std::int32_t i) const noexcept {
    const V x = k.apply(load16<S>(in + row_bytes(S, i)));
    const V t = sub(x, _mm512_set1_ps(minimum[i >> lg]));
    return minimum_codes(divided<true>(t, _mm512_set1_ps(scale[i >> lg]), _mm512_set1_ps(inv[i >> lg])), code_max);
  }
};

// quantize_groups_min of avx2 for groups of `group` = 2^lg values (16 to
// 128), up to 16 groups a round; mul finite and non-zero (quantize_groups_min
// below checks). A round with a NaN goes to the AVX2 loop.
template <DType S, DType C>
KVCACHE_AVX512 inline void quantize_groups_min(std::byte* dst, std::byte* entries, const std::byte* src, int lg,
                                               std::int32_t groups, float mul) noexcept {
  const std::int32_t group = 1 << lg;
  const float qmax = quant::code_max(C, true);
  const CallScale m = CallScale::of(mul);  // mul: the call's scale k, the values are divided by
  alignas(64) float inv[16], minimum[16], scale[16];
  for (std::int32_t b = 0; b < groups; b += 16) {
    const std::int32_t nb = groups - b < 16 ? groups - b : 16, n = nb * group;
    const std::byte* in = src + row_bytes(S, std::int64_t{b} * group);
    std::byte* out = dst + row_bytes(C, std::int64_t{b} * group);
    I klo, khi;
    key_ranges<S>(in, group, nb, klo, khi);
    if (nan_keys<S>(klo, khi)) {
      avx2::quantize_groups_min<S, C>(out, entries + 4 * b, in, group, nb, mul);
      continue;
    }
    // The quotients' range (division is monotonic; k < 0 swaps the ends).
    const V a = m.apply(key_values<S>(klo)), z = m.apply(key_values<S>(khi));
    const V vlo = mul < 0.0f ? z : a, vhi = mul < 0.0f ? a : z;
    const I mh = f16_at_most(vlo);  // the minimum first: the scale spans from it
    const V mv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(mh));
    I entry;
    V iv;
    group_scales(sub(vhi, mv), qmax, entry, iv);
    _mm512_mask_storeu_epi32(entries + 4 * b, static_cast<__mmask16>((1u << nb) - 1u),
                             _mm512_or_si512(entry, _mm512_slli_epi32(mh, 16)));
    _mm512_store_ps(inv, iv);
    _mm512_store_ps(scale, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(iv, _mm512_setzero_ps(), _CMP_NEQ_UQ), entry_values<DType::f16>(entry)));  // NaN: 0
    _mm512_store_ps(minimum, mv);
    const MinimumCodes<S> f{in, m, _mm512_set1_ps(qmax), minimum, scale, inv, lg};
    for (std::int32_t i = 0; i < n; i += 64) {
      const I zero = _mm512_setzero_si512();
      const std::int32_t left = n - i;
      store_codes<C>(out + row_bytes(C, i), f(i), left > 16 ? f(i + 16) : zero, left > 32 ? f(i + 32) : zero,
                     left > 48 ? f(i + 48) : zero, static_cast<std::int32_t>(row_bytes(C, left < 64 ? left : 64)));
    }
  }
}

// dequantize_groups_min of avx2: (code * scale + minimum) * mul, sixteen
// values a step, unfused as there (code * scale is exact, so the add is
// fmaf's one rounding). Sixteen groups' scales and minima are widened
// together by the hardware (the scalar conversion, two a group, took a
// third of a 32-value group's time): its bits but for a signalling NaN,
// which it quiets, as the multiply that follows would.
template <DType C, DType O>
KVCACHE_AVX512 inline void dequantize_groups_min(std::byte* out, const std::byte* codes, const std::byte* entries,
                                                 std::int32_t group, std::int32_t groups, float mul) noexcept {
  const V m = _mm512_set1_ps(mul);
  alignas(64) float scales[16], minima[16];
  for (std::int32_t b = 0; b < groups; b += 16) {
    const std::int32_t nb = groups - b < 16 ? groups - b : 16;
    const I e = _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << nb) - 1u), entries + 4 * b);
    _mm512_store_ps(scales, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(e)));
    _mm512_store_ps(minima, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(e, 16))));
    for (std::int32_t j = 0; j < nb; ++j) {
      const V scale = _mm512_set1_ps(scales[j]), minimum = _mm512_set1_ps(minima[j]);
      std::byte* o = out + row_bytes(O, std::int64_t{b + j} * group);
      const std::byte* c = codes + row_bytes(C, std::int64_t{b + j} * group);
      for (std::int32_t i = 0; i < group; i += 16)
        store16<O>(o + row_bytes(O, i),
                   _mm512_mul_ps(add(_mm512_mul_ps(load_codes<C, true>(c, i), scale), minimum), m));
    }
  }
}

/// True when the loops above take groups with a minimum of `code` (int8,
/// int4 or int2) of `group` values (16, 32, 64 or 128) to or from `other`
/// (f32, f16 or bf16) on this CPU.
inline bool minimum_wide(DType code, std::int32_t group, DType other) noexcept {
  return (code == DType::int8 || code == DType::int4 || code == DType::int2) && wide_shape(group, other);
}

template <DType S>
inline void quantize_min_to(DType code, std::byte* codes, std::byte* entries, const std::byte* src, int lg,
                            std::int32_t groups, float mul) noexcept {
  switch (code) {
    case DType::int8:
      return quantize_groups_min<S, DType::int8>(codes, entries, src, lg, groups, mul);
    case DType::int4:
      return quantize_groups_min<S, DType::int4>(codes, entries, src, lg, groups, mul);
    default:
      return quantize_groups_min<S, DType::int2>(codes, entries, src, lg, groups, mul);
  }
}
template <DType C>
inline void dequantize_min_to(DType ot, std::byte* out, const std::byte* codes, const std::byte* entries,
                              std::int32_t group, std::int32_t groups, float mul) noexcept {
  switch (ot) {
    case DType::f32:
      return dequantize_groups_min<C, DType::f32>(out, codes, entries, group, groups, mul);
    case DType::f16:
      return dequantize_groups_min<C, DType::f16>(out, codes, entries, group, groups, mul);
    default:
      return dequantize_groups_min<C, DType::bf16>(out, codes, entries, group, groups, mul);
  }
}

/// The half of simd::quantize_groups with a minimum; false (nothing
/// written) where minimum_wide says no, or mul is 0, inf or NaN.
inline bool quantize_groups_min(std::byte* codes, std::byte* entries, const std::byte* src, DType st, DType code,
                                std::int32_t group, std::int32_t groups, float mul) noexcept {
  if (!minimum_wide(code, group, st) || !ordered_multiplier(mul)) return false;
  const int lg = __builtin_ctz(static_cast<unsigned>(group));
  switch (st) {
    case DType::f32:
      quantize_min_to<DType::f32>(code, codes, entries, src, lg, groups, mul);
      break;
    case DType::f16:
      quantize_min_to<DType::f16>(code, codes, entries, src, lg, groups, mul);
      break;
    default:
      quantize_min_to<DType::bf16>(code, codes, entries, src, lg, groups, mul);
      break;
  }
  return true;
}
/// The half of simd::dequantize_groups with a minimum; false (nothing
/// written) where minimum_wide says no.
inline bool dequantize_groups_min(std::byte* out, DType ot, const std::byte* codes, const std::byte* entries,
                                  DType code, std::int32_t group, std::int32_t groups, float mul) noexcept {
  if (!minimum_wide(code, group, ot)) return false;
  switch (code) {
    case DType::int8:
      dequantize_min_to<DType::int8>(ot, out, codes, entries, group, groups, mul);
      break;
    case DType::int4:
      dequantize_min_to<DType::int4>(ot, out, codes, entries, group, groups, mul);
      break;
    default:
      dequantize_min_to<DType::int2>(ot, out, codes, entries, group, groups, mul);
      break;
  }
  return true;
}
}  // namespace avx512
KVCACHE_AVX512_END
#endif

}  // namespace simd
KVCACHE_END_NAMESPACE
