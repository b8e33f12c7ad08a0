// The host backend's group quantization, eight lanes at a time, straight
// from the caller's row to codes and entries and back: symmetric codes
// (int8, fp8 e4m3 and e5m2, int4 and int2 with an f16 scale a group; fp4
// e2m1 with an e4m3 one, NVFP4's groups of 16) and integer codes with a
// minimum (int8, int4, int2: an f16 scale and minimum a group, llama.cpp's
// q4_1 and KIVI's groups). quant::quantize_group does the same through a
// float buffer and a scalar scale per group; at 32-value groups that
// per-group overhead cost 5x the conversion itself. Here up to eight
// groups' scales are computed together in one vector (the division, the
// saturation and the entry type's round trip), and the row is read twice
// from L1 (its range, then its codes) instead of being staged. The bits
// are quantize_group's and dequantize_group's: the same IEEE operations in
// the same order (x = load / k, k the call's scale; amax of |x|'s bits;
// scale = entry(amax / code_max), saturated, rounded up; code =
// encode(quant::quotient(x, scale)): x / scale, or x * 0 for a zero or NaN
// scale), which test_host_simd checks against the scalar code. With a
// minimum the range is the order keys' min and max (as key_range), minimum
// = lo rounded down to f16, scale = f16((hi - minimum) / code_max) rounded
// up, code = to_int(quotient(x - minimum, scale), 0, code_max), and back
// fmaf(code, scale, minimum)'s bits (PackedCodes).
// Sub-byte codes are packed and read by kernels/host/x86/avx2_packed.hpp. CUDA
// translation units and other CPUs compile none of this.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvcache/kernels/detail/common.hpp"
#include "kvcache/kernels/host/x86/avx2_rows.hpp"
#include "kvcache/kernels/host/x86/avx2_packed.hpp"
#include "kvcache/kernels/host/x86/avx2_reduce.hpp"
#include "kvcache/core/kv_format.hpp"
#include "kvcache/kernels/detail/quant.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace simd {

#if KVCACHE_HOST_SIMD
namespace avx2 {

// group_scale for eight groups' abs maxima (or ranges above their
// minima): amax / code_max, saturated at the entry type's largest (an
// ordered compare: a NaN stays NaN, as `want > max ?` leaves it), then
// through the entry type and back (the bit codes, whose bits are cvt's):
// f16, or e4m3 for fp4 (NVFP4's scales), one step up where that rounded
// below want (quant::entry_at_least). The entry bits go to the entries;
// inv = 1 / scale where scale > 0.
template <DType E>
KVCACHE_AVX2_INLINE inline __m256 entry_values(I b) noexcept {  // (a function, not a lambda: a lambda has no target)
  if constexpr (E == DType::f16) return f16_to_f32(b);
  else return e4m3_to_f32(b);
}
template <DType E = DType::f16>
KVCACHE_AVX2_INLINE inline void group_scales(__m256 amax, float code_max, I& entry_bits, __m256& inv) noexcept {
  static_assert(E == DType::f16 || E == DType::fp8_e4m3);
  __m256 want = _mm256_div_ps(amax, _mm256_set1_ps(code_max));
  const __m256 type_max = _mm256_set1_ps(E == DType::f16 ? cvt::kF16Max : cvt::kE4m3Max);
  want = _mm256_blendv_ps(want, type_max, _mm256_cmp_ps(want, type_max, _CMP_GT_OQ));
  want = _mm256_andnot_ps(_mm256_cmp_ps(want, _mm256_setzero_ps(), _CMP_LT_OQ), want);  // below 0 (under a clamped minimum): 0
  entry_bits = codes<E>(want);
  // Below want: one step up (a compare's all-ones lane is -1).
  entry_bits = _mm256_sub_epi32(entry_bits, _mm256_castps_si256(_mm256_cmp_ps(entry_values<E>(entry_bits), want, _CMP_LT_OQ)));
  const __m256 scale = entry_values<E>(entry_bits);
  inv = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0f), scale), _mm256_cmp_ps(scale, _mm256_setzero_ps(), _CMP_GT_OQ));
}

// quant::f16_at_most for eight minima: f16 bits of lo rounded down, an
// infinity made the largest finite of its sign, a NaN kept.
KVCACHE_AVX2_INLINE inline I f16_at_most(__m256 lo) noexcept {
  I b = f32_to_f16(lo);
  const I above = _mm256_castps_si256(_mm256_cmp_ps(f16_to_f32(b), lo, _CMP_GT_OQ));
  const I negative = _mm256_cmpgt_epi32(_mm256_and_si256(b, k(0x8000u)), _mm256_setzero_si256());
  const I step = _mm256_or_si256(_mm256_andnot_si256(negative, k(0xffffffffu)), k(1u));  // +1 on a negative's bits, -1 on a positive's
  b = _mm256_add_epi32(b, _mm256_and_si256(above, step));  // one step down
  const I inf = _mm256_cmpeq_epi32(_mm256_and_si256(b, k(0x7fffu)), k(0x7c00u));
  return _mm256_blendv_epi8(b, _mm256_or_si256(_mm256_and_si256(b, k(0x8000u)), k(0x7bffu)), inf);
}

// Elements i.. of a group divided by the call's scale k (by_k: k is not 1)
// and then by the group's stored scale s: quant::quotient's bits (vdivps),
// x * 0 where s is 0 or NaN (zero).
template <DType S>
struct Quotients {
  const std::byte* src;
  __m256 k, s;
  bool by_k, zero;
  KVCACHE_AVX2_INLINE __m256 operator()(std::int32_t i) const noexcept {
    __m256 x = load8<S, false>(src + row_bytes(S, i));
    if (by_k) x = _mm256_div_ps(x, k);
    return zero ? _mm256_mul_ps(x, _mm256_setzero_ps()) : _mm256_div_ps(x, s);
  }
};
// A group's symmetric packed codes from element i: packed_codes of x(i)
// (the values divided by k, then by the scale).
template <DType C, class X>
struct SymmetricCodes {
  X x;
  KVCACHE_AVX2_INLINE I operator()(std::int32_t i) const noexcept { return packed_codes<C>(x(i)); }
};
// A group's codes with a minimum from element i: to_int(quotient(x / k - minimum, scale), 0, code_max).
template <DType S>
struct MinimumCodes {
  const std::byte* src;
  __m256 k, minimum, s;
  bool by_k, zero;
  float code_max;
  KVCACHE_AVX2_INLINE I operator()(std::int32_t i) const noexcept {
    __m256 x = load8<S, false>(src + row_bytes(S, i));
    if (by_k) x = _mm256_div_ps(x, k);
    const __m256 t = _mm256_sub_ps(x, minimum);
    return to_int(zero ? _mm256_mul_ps(t, _mm256_setzero_ps()) : _mm256_div_ps(t, s), 0.0f, code_max);
  }
};

template <DType S, DType C>
KVCACHE_AVX2 inline void quantize_groups(std::byte* codes, std::byte* entries, const std::byte* src, std::int32_t group,
                                         std::int32_t groups, float div, float code_max) noexcept {
  const __m256 m = _mm256_set1_ps(div);
  const bool by_k = div != 1.0f;
  for (std::int32_t b = 0; b < groups; b += 8) {
    const std::int32_t nb = groups - b < 8 ? groups - b : 8;
    alignas(32) std::uint32_t amax[8] = {};
    for (std::int32_t j = 0; j < nb; ++j) {
      const std::byte* in = src + row_bytes(S, std::int64_t{b + j} * group);
      I a = _mm256_setzero_si256();
      for (std::int32_t i = 0; i < group; i += 8) {
        __m256 x = load8<S, false>(in + row_bytes(S, i));
        if (by_k) x = _mm256_div_ps(x, m);
        a = _mm256_max_epi32(a, _mm256_and_si256(bits(x), k(0x7fffffffu)));
      }
      amax[j] = hmax_epi32(a);
    }
    I h;
    __m256 inv;
    const __m256 a = from_bits(_mm256_load_si256(reinterpret_cast<const I*>(amax)));
    group_scales<group_scale_dtype(C)>(a, code_max, h, inv);
    alignas(32) std::uint32_t hb[8];
    alignas(32) float ib[8];
    _mm256_store_si256(reinterpret_cast<I*>(hb), h);
    _mm256_store_ps(ib, entry_values<group_scale_dtype(C)>(h));  // each group's scale
    for (std::int32_t j = 0; j < nb; ++j) {
      if constexpr (C == DType::fp4_e2m1) {
        entries[b + j] = static_cast<std::byte>(hb[j]);
      } else {
        const auto e = static_cast<std::uint16_t>(hb[j]);
        std::memcpy(entries + 2 * (b + j), &e, 2);
      }
      const std::byte* in = src + row_bytes(S, std::int64_t{b + j} * group);
      std::byte* out = codes + row_bytes(C, std::int64_t{b + j} * group);
      const Quotients<S> x{in, m, _mm256_set1_ps(ib[j]), by_k, !(ib[j] > 0.0f)};
      if constexpr (dtype_bits(C) == 8) {
        store_each<C>(out, group, x);
      } else {
        store_packed_each<C>(out, group, SymmetricCodes<C, Quotients<S>>{x});
      }
    }
  }
}

template <DType C, DType O>
KVCACHE_AVX2 inline void dequantize_groups(std::byte* out, const std::byte* codes, const std::byte* entries, std::int32_t group,
                                           std::int32_t groups, float mul) noexcept {
  const __m256 m = _mm256_set1_ps(mul);
  for (std::int32_t g = 0; g < groups; ++g) {
    float scale;  // fp4's is an e4m3 byte, the rest f16
    if constexpr (C == DType::fp4_e2m1) {
      scale = cvt::e4m3_to_f32(static_cast<std::uint8_t>(entries[g]));
    } else {
      std::uint16_t e;
      std::memcpy(&e, entries + 2 * g, 2);
      scale = cvt::f16_to_f32(e);
    }
    // (code * scale) * mul, as dequantize_group then move_row compute it.
    std::byte* o = out + row_bytes(O, std::int64_t{g} * group);
    const std::byte* c = codes + row_bytes(C, std::int64_t{g} * group);
    if constexpr (C == DType::fp8_e4m3) {
      if (e4m3_prescales(scale)) {  // an f16 scale: always, unless NaN
        store_each<O>(o, group, E4m3Scaled<true>{c, _mm256_set1_ps(scale * 256.0f), m});
        continue;
      }
    }
    if constexpr (dtype_bits(C) == 8)
      store_each<O>(o, group, Scaled<C, true, true>{c, _mm256_set1_ps(scale), m});
    else
      store_each<O>(o, group, PackedCodes<C, false>{c, _mm256_set1_ps(scale), _mm256_setzero_ps(), m});
  }
}

// order_key (kernels/detail/quant.hpp) eight lanes at a time: x's bits as an integer that
// orders as x does; its own inverse.
KVCACHE_AVX2_INLINE inline I order_key(I u) noexcept {
  return _mm256_xor_si256(u, _mm256_and_si256(_mm256_srai_epi32(u, 31), k(0x7fffffffu)));
}

// Groups with a minimum: up to eight groups' ranges, then their scales and
// minima in one vector each, then each group's codes (packed as
// quantize_group packs them).
template <DType S, DType C>
KVCACHE_AVX2 inline void quantize_groups_min(std::byte* codes, std::byte* entries, const std::byte* src, std::int32_t group,
                                             std::int32_t groups, float div) noexcept {
  const __m256 m = _mm256_set1_ps(div);
  const bool by_k = div != 1.0f;
  const float qmax = quant::code_max(C, true);
  for (std::int32_t b = 0; b < groups; b += 8) {
    const std::int32_t nb = groups - b < 8 ? groups - b : 8;
    alignas(32) std::int32_t lo[8] = {}, hi[8] = {};
    for (std::int32_t j = 0; j < nb; ++j) {
      const std::byte* in = src + row_bytes(S, std::int64_t{b + j} * group);
      I kmin = k(0x7fffffffu), kmax = k(0x80000000u);
      for (std::int32_t i = 0; i < group; i += 8) {
        __m256 x = load8<S, false>(in + row_bytes(S, i));
        if (by_k) x = _mm256_div_ps(x, m);
        const I key = order_key(bits(x));
        kmin = _mm256_min_epi32(kmin, key), kmax = _mm256_max_epi32(kmax, key);
      }
      lo[j] = hmin_epi32(kmin), hi[j] = static_cast<std::int32_t>(hmax_epi32(kmax));
    }
    const __m256 vlo = from_bits(order_key(_mm256_load_si256(reinterpret_cast<const I*>(lo))));
    const __m256 vhi = from_bits(order_key(_mm256_load_si256(reinterpret_cast<const I*>(hi))));
    const I mh = f16_at_most(vlo);  // the minimum first: the scale spans from it
    const __m256 mv = f16_to_f32(mh);
    I h;
    __m256 inv;
    group_scales(_mm256_sub_ps(vhi, mv), qmax, h, inv);
    alignas(32) std::uint32_t hb[8], mb[8];
    alignas(32) float ib[8], mf[8];
    _mm256_store_si256(reinterpret_cast<I*>(hb), h);
    _mm256_store_si256(reinterpret_cast<I*>(mb), mh);
    _mm256_store_ps(ib, f16_to_f32(h));  // each group's scale
    _mm256_store_ps(mf, mv);
    for (std::int32_t j = 0; j < nb; ++j) {
      const std::uint16_t e[2] = {static_cast<std::uint16_t>(hb[j]), static_cast<std::uint16_t>(mb[j])};
      std::memcpy(entries + 4 * (b + j), e, 4);
      const std::byte* in = src + row_bytes(S, std::int64_t{b + j} * group);
      const __m256 mn = _mm256_set1_ps(mf[j]), sv = _mm256_set1_ps(ib[j]);
      std::byte* out = codes + row_bytes(C, std::int64_t{b + j} * group);
      store_packed_each<C>(out, group, MinimumCodes<S>{in, m, mn, sv, by_k, !(ib[j] > 0.0f), qmax});
    }
  }
}

template <DType C, DType O>
KVCACHE_AVX2 inline void dequantize_groups_min(std::byte* out, const std::byte* codes, const std::byte* entries,
                                               std::int32_t group, std::int32_t groups, float mul) noexcept {
  for (std::int32_t g = 0; g < groups; ++g) {
    std::uint16_t e[2];
    std::memcpy(e, entries + 4 * g, 4);
    store_each<O>(out + row_bytes(O, std::int64_t{g} * group), group,
                  PackedCodes<C, true>{codes + row_bytes(C, std::int64_t{g} * group), _mm256_set1_ps(cvt::f16_to_f32(e[0])),
                              _mm256_set1_ps(cvt::f16_to_f32(e[1])), _mm256_set1_ps(mul)});
  }
}

// The caller's type, then the code's: every pair a template instance.
template <DType S>
inline bool quantize_to(DType code, bool minimum, std::byte* codes, std::byte* entries, const std::byte* src,
                        std::int32_t group, std::int32_t groups, float mul, float code_max) noexcept {
  if (minimum) switch (code) {
      case DType::int8: quantize_groups_min<S, DType::int8>(codes, entries, src, group, groups, mul); return true;
      case DType::int4: quantize_groups_min<S, DType::int4>(codes, entries, src, group, groups, mul); return true;
      case DType::int2: quantize_groups_min<S, DType::int2>(codes, entries, src, group, groups, mul); return true;
      default: return false;
    }
  switch (code) {
    case DType::int8: quantize_groups<S, DType::int8>(codes, entries, src, group, groups, mul, code_max); return true;
    case DType::fp8_e4m3: quantize_groups<S, DType::fp8_e4m3>(codes, entries, src, group, groups, mul, code_max); return true;
    case DType::fp8_e5m2: quantize_groups<S, DType::fp8_e5m2>(codes, entries, src, group, groups, mul, code_max); return true;
    case DType::int4: quantize_groups<S, DType::int4>(codes, entries, src, group, groups, mul, code_max); return true;
    case DType::int2: quantize_groups<S, DType::int2>(codes, entries, src, group, groups, mul, code_max); return true;
    case DType::fp4_e2m1: quantize_groups<S, DType::fp4_e2m1>(codes, entries, src, group, groups, mul, code_max); return true;
    default: return false;
  }
}
template <DType C, bool Min = false>
inline bool dequantize_to(DType ot, std::byte* out, const std::byte* codes, const std::byte* entries, std::int32_t group,
                          std::int32_t groups, float mul) noexcept {
  if constexpr (Min) {
    switch (ot) {
      case DType::f32: dequantize_groups_min<C, DType::f32>(out, codes, entries, group, groups, mul); return true;
      case DType::f16: dequantize_groups_min<C, DType::f16>(out, codes, entries, group, groups, mul); return true;
      case DType::bf16: dequantize_groups_min<C, DType::bf16>(out, codes, entries, group, groups, mul); return true;
      default: return false;
    }
  } else {
    switch (ot) {
      case DType::f32: dequantize_groups<C, DType::f32>(out, codes, entries, group, groups, mul); return true;
      case DType::f16: dequantize_groups<C, DType::f16>(out, codes, entries, group, groups, mul); return true;
      case DType::bf16: dequantize_groups<C, DType::bf16>(out, codes, entries, group, groups, mul); return true;
      default: return false;
    }
  }
}
}  // namespace avx2

#endif

}  // namespace simd
KVCACHE_END_NAMESPACE
