// The host backend's row conversions eight elements at a time (AVX2, and
// F16C for fp16), chosen at run time. SSE2, the x86-64 baseline the host
// build targets, lacks 32-bit integer min/max and 8-wide lanes, so the
// branch-free conversions of kernels/detail/convert.hpp run there at about 1.5 ns an
// element. These loops give the scalar code's bits for every input, NaNs
// included: most are the same integer and float operations lane by lane;
// where an instruction replaces a sequence (F16C's fp16 conversions, int8
// through a float clamp and cvtps2dq), the comment next to it says why the
// result is the same. test_host_simd checks every 8- and 16-bit input and
// random floats against the scalar code. No implicit fma: these targets
// enable only avx2 and f16c, so the compiler cannot fuse a multiply with the
// rounding adds (kernels/host/x86/avx2_reduce.hpp's fma_rows is the one fused
// multiply-add, where the scalar code calls fmaf). CUDA translation units
// and other CPUs compile none of this (move_rows returns 0 and the scalar
// loop does the row).
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvcache/kernels/host/cpu.hpp"
#include "kvcache/kernels/host/stream.hpp"
#include "kvcache/config.hpp"
#include "kvcache/core/kv_format.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace simd {

#if KVCACHE_HOST_SIMD
namespace avx2 {
using I = __m256i;
KVCACHE_AVX2_INLINE inline I k(std::uint32_t v) noexcept { return _mm256_set1_epi32(static_cast<int>(v)); }
KVCACHE_AVX2_INLINE inline I bits(__m256 f) noexcept { return _mm256_castps_si256(f); }
KVCACHE_AVX2_INLINE inline __m256 from_bits(I u) noexcept { return _mm256_castsi256_ps(u); }
// c ? a : b, c all-ones or zero per lane.
KVCACHE_AVX2_INLINE inline I sel(I c, I a, I b) noexcept { return _mm256_blendv_epi8(b, a, c); }
// Unsigned a > b for values below 2^31 (every magnitude here): a signed compare.
KVCACHE_AVX2_INLINE inline I gt(I a, std::uint32_t b) noexcept { return _mm256_cmpgt_epi32(a, k(b)); }
KVCACHE_AVX2_INLINE inline I ge(I a, std::uint32_t b) noexcept { return gt(a, b - 1); }
KVCACHE_AVX2_INLINE inline I eq(I a, std::uint32_t b) noexcept { return _mm256_cmpeq_epi32(a, k(b)); }

// ---- loads: 8 elements to 8 floats (cvt::*_to_f32) ----
KVCACHE_AVX2_INLINE inline I load_u8(const void* p) noexcept {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
}
KVCACHE_AVX2_INLINE inline I load_u16(const void* p) noexcept {
  return _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
}
KVCACHE_AVX2_INLINE inline __m256 f16_to_f32(I h) noexcept {
  const I sign = _mm256_slli_epi32(_mm256_and_si256(h, k(0x8000u)), 16), em = _mm256_and_si256(h, k(0x7fffu));
  const I exp = _mm256_srli_epi32(em, 10), em13 = _mm256_slli_epi32(em, 13);
  const I normal = _mm256_add_epi32(em13, k(112u << 23)), special = _mm256_or_si256(em13, k(0x7f800000u));
  const I sub = bits(_mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(5.9604644775390625e-08f)));
  return from_bits(_mm256_or_si256(sign, sel(_mm256_cmpeq_epi32(exp, k(0)), sub, sel(eq(exp, 31), special, normal))));
}
KVCACHE_AVX2_INLINE inline __m256 e4m3_to_f32(I q) noexcept {
  const I sign = _mm256_slli_epi32(_mm256_and_si256(q, k(0x80u)), 24), em = _mm256_and_si256(q, k(0x7fu));
  const I normal = _mm256_add_epi32(_mm256_slli_epi32(em, 20), k(120u << 23));
  const I sub = bits(_mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(0.001953125f)));
  const I is_sub = _mm256_cmpeq_epi32(_mm256_srli_epi32(em, 3), k(0));
  return from_bits(_mm256_or_si256(sign, sel(eq(em, 0x7fu), k(0x7fc00000u), sel(is_sub, sub, normal))));
}
// F16C's conversion quiets a signalling NaN, the bit code keeps it as it is;
// the multiply that follows quiets it in both, unless the compiler drops a
// multiply by a constant 1 (it may: it assumes no signalling NaNs). Only an
// f32 output keeps a NaN's bits, so it takes the bit code (Exact).
template <DType T, bool Exact>
KVCACHE_AVX2_INLINE inline __m256 load8(const std::byte* p) noexcept {
  if constexpr (T == DType::f32) return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  if constexpr (T == DType::f16 && !Exact) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  if constexpr (T == DType::f16 && Exact) return f16_to_f32(load_u16(p));
  if constexpr (T == DType::bf16) return from_bits(_mm256_slli_epi32(load_u16(p), 16));
  if constexpr (T == DType::fp8_e4m3) return e4m3_to_f32(load_u8(p));
  // e5m2 is fp16's top byte: F16C widens it, its NaN codes quieted as above.
  if constexpr (T == DType::fp8_e5m2 && !Exact)
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 8));
  if constexpr (T == DType::fp8_e5m2 && Exact) return f16_to_f32(_mm256_slli_epi32(load_u8(p), 8));
  if constexpr (T == DType::int8)
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// ---- stores: 8 floats to 8 elements (cvt::f32_to_*, cvt::to_int) ----
KVCACHE_AVX2_INLINE inline void store_u8(std::byte* p, I v) noexcept {  // the low byte of each lane
  const I lo = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const I s = _mm256_shuffle_epi8(v, lo);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p),
                   _mm_unpacklo_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1)));
}
KVCACHE_AVX2_INLINE inline void store_u16(std::byte* p, I v) noexcept {  // lanes below 2^16
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}
KVCACHE_AVX2_INLINE inline I f32_to_f16(__m256 f) noexcept {
  const I u = bits(f), sign = _mm256_and_si256(_mm256_srli_epi32(u, 16), k(0x8000u)), a = _mm256_and_si256(u, k(0x7fffffffu));
  I m = _mm256_sub_epi32(a, k(0x38000000u));
  m = _mm256_add_epi32(m, _mm256_add_epi32(k(0xfffu), _mm256_and_si256(_mm256_srli_epi32(m, 13), k(1))));
  const I normal = _mm256_srli_epi32(m, 13);
  const I sub = _mm256_sub_epi32(bits(_mm256_add_ps(from_bits(a), _mm256_set1_ps(0.5f))), k(0x3f000000u));
  const I mag = sel(gt(a, 0x7f800000u), k(0x7e00u), sel(ge(a, 0x477ff000u), k(0x7c00u), sel(ge(a, 0x38800000u), normal, sub)));
  return _mm256_or_si256(sign, mag);
}
KVCACHE_AVX2_INLINE inline I f32_to_bf16(__m256 f) noexcept {
  const I u = bits(f), nan = gt(_mm256_and_si256(u, k(0x7fffffffu)), 0x7f800000u);
  const I r = _mm256_add_epi32(u, _mm256_add_epi32(k(0x7fffu), _mm256_and_si256(_mm256_srli_epi32(u, 16), k(1))));
  return sel(nan, _mm256_or_si256(_mm256_srli_epi32(u, 16), k(0x40u)), _mm256_srli_epi32(r, 16));
}
// fp8 by one float add (cvt::f32_to_e4m3 / f32_to_e5m2's bits, in 15
// operations where the integer rounding took 22). magic = 2^(E + Shift),
// with E the value's f32 exponent field raised to the smallest normal
// code's (MinExp), has its last mantissa bit where the code's last bit is,
// so |x| + magic rounds to nearest even exactly as the code does, a
// subnormal code included (its magic is the smallest normal's). The sum
// stays in magic's binade, so its bits minus magic's count code steps from
// the binade's first code, (E - MinExp) << MBits. |x| is first clamped to
// the largest finite code's value SatBits (anything from there up
// saturates to it, inf included); a NaN, which the clamp also turns into
// SatBits, then takes the code Nan.
template <std::uint32_t MinExp, int MBits, std::uint32_t SatBits, std::uint32_t Nan>
KVCACHE_AVX2_INLINE inline I f32_to_fp8(__m256 f) noexcept {
  const I u = bits(f), sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), k(0x80u)), a = _mm256_and_si256(u, k(0x7fffffffu));
  const __m256 c = _mm256_min_ps(from_bits(a), from_bits(k(SatBits)));  // a NaN gives SatBits (min's second operand)
  const I e = _mm256_max_epi32(_mm256_and_si256(bits(c), k(0x7f800000u)), k(MinExp << 23));
  const I magic = _mm256_add_epi32(e, k(static_cast<std::uint32_t>(23 - MBits) << 23));
  const I steps = _mm256_sub_epi32(bits(_mm256_add_ps(c, from_bits(magic))), magic);
  const I code = _mm256_add_epi32(steps, _mm256_sub_epi32(_mm256_srli_epi32(e, 23 - MBits), k(MinExp << MBits)));
  return _mm256_or_si256(sign, sel(gt(a, 0x7f800000u), k(Nan), code));
}
// cvt::to_int(v, lo, hi), which rounds to nearest even and then clamps:
// clamping first gives the same integer for every input (the bounds are
// integers and rounding is monotonic), and cvtps2dq rounds to nearest even
// (the default MXCSR mode). NaN gives 0: zeroed before min/max, which would
// otherwise return their second operand.
KVCACHE_AVX2_INLINE inline I to_int(__m256 v, float lo, float hi) noexcept {
  v = _mm256_and_ps(v, _mm256_cmp_ps(v, v, _CMP_ORD_Q));
  v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(lo)), _mm256_set1_ps(hi));
  return _mm256_cvtps_epi32(v);
}
// int8's codes without to_int's NaN mask: max and min return their second
// operand when either is NaN, so with v second a NaN stays NaN and
// cvtps2dq makes it 0x80000000, whose low byte (store_u8) is 0 and which
// the packs of store32 saturate to -128, a code no number reaches (they
// clamp to [-127, 127]): store32 zeroes it there. Two operations fewer
// per eight values on the path every int8 row takes.
KVCACHE_AVX2_INLINE inline I to_int8(__m256 v) noexcept {
  return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_set1_ps(127.0f), _mm256_max_ps(_mm256_set1_ps(-127.0f), v)));
}
// The codes of 8 floats in type T, one per 32-bit lane (T is not f32).
template <DType T>
KVCACHE_AVX2_INLINE inline I codes(__m256 v) noexcept {
  if constexpr (T == DType::f16) return f32_to_f16(v);
  if constexpr (T == DType::bf16) return f32_to_bf16(v);
  if constexpr (T == DType::fp8_e4m3) return f32_to_fp8<121, 3, 0x43e00000u, 0x7fu>(v);
  if constexpr (T == DType::fp8_e5m2) return f32_to_fp8<113, 2, 0x47600000u, 0x7fu>(v);
  if constexpr (T == DType::int8) return to_int8(v);
}
// cvt::f32_to_f16 by F16C: both round to nearest even, overflow to inf and
// round subnormals exactly; only a NaN's bits differ (F16C keeps payload
// bits), so NaNs become the scalar code's sign | 0x7e00 first. Nan = false:
// the caller knows v holds no NaN but the default one (see run).
template <bool Nan = true>
KVCACHE_AVX2_INLINE inline __m128i f16_codes(__m256 v) noexcept {
  if constexpr (Nan) {
    const __m256 nan = _mm256_or_ps(_mm256_and_ps(v, _mm256_set1_ps(-0.0f)), from_bits(k(0x7fc00000u)));
    v = _mm256_blendv_ps(v, nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
}
template <DType T, bool Nan = true>
KVCACHE_AVX2_INLINE inline void store8(std::byte* p, __m256 v) noexcept {
  if constexpr (T == DType::f32) _mm256_storeu_ps(reinterpret_cast<float*>(p), v);
  else if constexpr (T == DType::f16) _mm_storeu_si128(reinterpret_cast<__m128i*>(p), f16_codes<Nan>(v));
  else if constexpr (dtype_bits(T) == 16) store_u16(p, codes<T>(v));
  else store_u8(p, codes<T>(v));
}
// 32 elements with whole 32-byte stores (put32, kernels/host/stream.hpp): a row of
// 8-byte stores to lines not yet in cache fills the store buffer (decode
// writes every row cold). With Stream they are non-temporal (p 32-byte aligned).
template <DType T, bool Stream = false, bool Nan = true>
KVCACHE_AVX2_INLINE inline void store32(std::byte* p, const __m256 (&v)[4]) noexcept {
  if constexpr (T == DType::f32) {
    for (int i = 0; i < 4; ++i) put32<Stream>(p + 32 * i, bits(v[i]));
  } else if constexpr (T == DType::f16) {
    for (int i = 0; i < 2; ++i) put32<Stream>(p + 32 * i, _mm256_set_m128i(f16_codes<Nan>(v[2 * i + 1]), f16_codes<Nan>(v[2 * i])));
  } else if constexpr (dtype_bits(T) == 16) {  // lanes below 2^16: unsigned 32 -> 16 packing is exact
    for (int i = 0; i < 2; ++i)
      put32<Stream>(p + 32 * i, _mm256_permute4x64_epi64(_mm256_packus_epi32(codes<T>(v[2 * i]), codes<T>(v[2 * i + 1])), 0xd8));
  } else {  // int8 in [-127, 127] packs signed, fp8 bytes in [0, 255] unsigned: exact either way
    const I a = codes<T>(v[0]), b = codes<T>(v[1]), c = codes<T>(v[2]), d = codes<T>(v[3]);
    const I x = T == DType::int8 ? _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d))
                                 : _mm256_packus_epi16(_mm256_packus_epi32(a, b), _mm256_packus_epi32(c, d));
    // The packs work within 128-bit halves: put the 4-byte runs back in
    // order. int8's -128 is a NaN's (to_int8): 0, as to_int gives it.
    const I y = _mm256_permutevar8x32_epi32(x, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    put32<Stream>(p, T == DType::int8 ? _mm256_andnot_si256(_mm256_cmpeq_epi8(y, _mm256_set1_epi8(-128)), y) : y);
  }
}

// n elements of D at dst (n a multiple of 8), element i's vector of eight
// from f(i): 32 at a time through store32's whole stores, then 8 at a time
// (Stream: n a multiple of 32 and dst 32-byte aligned, so none are left;
// Nan: see f16_codes). Every host loop that writes a row goes through here;
// f is a functor whose operator() carries KVCACHE_AVX2_INLINE (a lambda
// would not inherit the target).
template <DType D, class F, bool Stream = false, bool Nan = true>
KVCACHE_AVX2_INLINE inline void store_each(std::byte* dst, std::int32_t n, F f) noexcept {  // f by value: a byte store cannot alias it
  std::int32_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256 v[4];
    if constexpr (requires { f.pair(i, v[0], v[1]); }) {  // sixteen at a time (E4m3Scaled)
      f.pair(i, v[0], v[1]);
      f.pair(i + 16, v[2], v[3]);
    } else {
      for (int j = 0; j < 4; ++j) v[j] = f(i + 8 * j);
    }
    store32<D, Stream, Nan>(dst + row_bytes(D, i), v);
  }
  for (; i < n; i += 8) store8<D, Nan>(dst + row_bytes(D, i), f(i));
}
// Elements i.. of src (type S) times mul, then times post when Post (a
// group's 1 / scale: (x * mul) * inv, not x * (mul * inv), as the scalar code).
template <DType S, bool Exact, bool Post = false>
struct Scaled {
  const std::byte* src;
  __m256 mul, post = _mm256_set1_ps(1.0f);
  KVCACHE_AVX2_INLINE __m256 operator()(std::int32_t i) const noexcept {
    const __m256 x = _mm256_mul_ps(load8<S, Exact>(src + row_bytes(S, i)), mul);
    if constexpr (Post) return _mm256_mul_ps(x, post);
    return x;
  }
};

// fp8 e4m3 codes as fp16 bits, 16 at a time (codes sign-extended to 16-bit
// lanes): the code's value times 2^-8, exactly. Shifted left by 7, s.eeee.mmm
// sign-extended reads s s eeee mmm 0000000, fp16's sign, 5-bit exponent and
// 10-bit mantissa with the exponent's top bit a copy of the sign; cleared,
// the exponent field is e4m3's, against a bias of 15 instead of 7, and a
// subnormal (exponent 0) keeps its mantissa's place: 2^-8 either way. The
// NaN code, s.1111.111, becomes s.01111.1110000000; the xor makes it s |
// 0x7e00, which F16C widens to the scalar code's s | 0x7fc00000.
KVCACHE_AVX2_INLINE inline I e4m3_as_f16(I s16) noexcept {
  const I h = _mm256_and_si256(_mm256_slli_epi16(s16, 7), _mm256_set1_epi16(static_cast<short>(0xbfff)));
  const I nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x3f80)), _mm256_set1_epi16(0x3f80));
  return _mm256_xor_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x4180)));
}
/// True when mul * 256 is exact (|mul| below 2^120, or infinite; not NaN),
/// so (x * 2^-8) * (mul * 256) rounds the same real product x * mul once:
/// its bits are x * mul's, subnormal and overflowing results included.
inline bool e4m3_prescales(float mul) noexcept {
  const float a = mul < 0.0f ? -mul : mul;
  return a < 0x1p120f || a > 0x1.fffffep127f;
}
// Scaled for fp8 e4m3 codes through e4m3_as_f16 and F16C, in a third of
// e4m3_to_f32's operations; mul256 is the multiplier times 256
// (e4m3_prescales), post as in Scaled.
template <bool Post = false>
struct E4m3Scaled {
  const std::byte* src;
  __m256 mul256, post = _mm256_set1_ps(1.0f);
  KVCACHE_AVX2_INLINE __m256 scaled(__m128i h) const noexcept {
    const __m256 x = _mm256_mul_ps(_mm256_cvtph_ps(h), mul256);
    if constexpr (Post) return _mm256_mul_ps(x, post);
    return x;
  }
  KVCACHE_AVX2_INLINE __m256 operator()(std::int32_t i) const noexcept {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i));
    return scaled(_mm256_castsi256_si128(e4m3_as_f16(_mm256_cvtepi8_epi16(q))));
  }
  KVCACHE_AVX2_INLINE void pair(std::int32_t i, __m256& a, __m256& b) const noexcept {
    const I h = e4m3_as_f16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    a = scaled(_mm256_castsi256_si128(h));
    b = scaled(_mm256_extracti128_si256(h, 1));
  }
};

template <DType S, DType D, bool Stream, bool Nan, bool ViaF16>
KVCACHE_AVX2 inline void run(std::byte* dst, const std::byte* src, std::int32_t n8, float mul) noexcept {
  if constexpr (ViaF16) {
    store_each<D, E4m3Scaled<>, Stream, Nan>(dst, n8, E4m3Scaled<>{src, _mm256_set1_ps(mul * 256.0f)});
  } else {
    using F = Scaled<S, D == DType::f32>;
    store_each<D, F, Stream, Nan>(dst, n8, F{src, _mm256_set1_ps(mul)});
  }
}
template <DType S, DType D, bool Nan, bool ViaF16 = false>
inline void run_streamed(std::byte* dst, const std::byte* src, std::int32_t n8, float mul, bool stream) noexcept {
  if (stream) run<S, D, true, Nan, ViaF16>(dst, src, n8, mul);
  else run<S, D, false, Nan, ViaF16>(dst, src, n8, mul);
}
// int8 and e4m3 codes hold no NaN but quiet ones without payload (e4m3's
// NaN code, sign | 0x7fc00000, and a multiply's own 0 x inf): times a
// multiplier that is not NaN, F16C converts them to the scalar code's
// sign | 0x7e00. So their fp16 output skips f16_codes' NaN select, a third
// of its operations (Nan = false).
template <DType S, DType D>
inline void run(std::byte* dst, const std::byte* src, std::int32_t n8, float mul, bool stream) noexcept {
  constexpr bool f16_out = D == DType::f16;
  if constexpr (S == DType::fp8_e4m3) {
    if (e4m3_prescales(mul)) return run_streamed<S, D, !f16_out, true>(dst, src, n8, mul, stream);
  }
  if constexpr ((S == DType::int8 || S == DType::fp8_e4m3) && f16_out) {
    if (mul == mul) return run_streamed<S, D, false>(dst, src, n8, mul, stream);
  }
  run_streamed<S, D, true>(dst, src, n8, mul, stream);
}
template <DType S>
inline bool run_to(DType dt, std::byte* dst, const std::byte* src, std::int32_t n8, float mul, bool stream) noexcept {
  switch (dt) {
    case DType::f32: run<S, DType::f32>(dst, src, n8, mul, stream); return true;
    case DType::f16: run<S, DType::f16>(dst, src, n8, mul, stream); return true;
    case DType::bf16: run<S, DType::bf16>(dst, src, n8, mul, stream); return true;
    case DType::fp8_e4m3: run<S, DType::fp8_e4m3>(dst, src, n8, mul, stream); return true;
    case DType::fp8_e5m2: run<S, DType::fp8_e5m2>(dst, src, n8, mul, stream); return true;
    case DType::int8: run<S, DType::int8>(dst, src, n8, mul, stream); return true;
    default: return false;
  }
}

// Elements i.. of src (type S) divided by d: a write's engine-held scale
// (store_row_divided's quotients, IEEE division as the scalar code's).
template <DType S, bool Exact>
struct Divided {
  const std::byte* src;
  __m256 d;
  KVCACHE_AVX2_INLINE __m256 operator()(std::int32_t i) const noexcept { return _mm256_div_ps(load8<S, Exact>(src + row_bytes(S, i)), d); }
};
template <DType S, DType D, bool Stream>
KVCACHE_AVX2 inline void run_divided(std::byte* dst, const std::byte* src, std::int32_t n8, float d) noexcept {
  using F = Divided<S, D == DType::f32>;
  store_each<D, F, Stream>(dst, n8, F{src, _mm256_set1_ps(d)});
}
template <DType S>
inline bool divide_to(DType dt, std::byte* dst, const std::byte* src, std::int32_t n8, float d, bool stream) noexcept {
  const auto run = [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    if (stream) run_divided<S, D, true>(dst, src, n8, d);
    else run_divided<S, D, false>(dst, src, n8, d);
    return true;
  };
  switch (dt) {
    case DType::f32: return run(std::integral_constant<DType, DType::f32>{});
    case DType::f16: return run(std::integral_constant<DType, DType::f16>{});
    case DType::bf16: return run(std::integral_constant<DType, DType::bf16>{});
    case DType::fp8_e4m3: return run(std::integral_constant<DType, DType::fp8_e4m3>{});
    case DType::fp8_e5m2: return run(std::integral_constant<DType, DType::fp8_e5m2>{});
    case DType::int8: return run(std::integral_constant<DType, DType::int8>{});
    default: return false;
  }
}

/// dst[i] = convert(src[i] * mul) (divide: convert(src[i] / mul)) for the
/// first n - n % 8 elements of a row, as move_row's scalar loop computes
/// them; returns how many it did (0: the CPU has no AVX2, or a type is
/// packed). The caller does the rest (simd::move_rows, kernels/host/rows.hpp, runs
/// the 512-bit loops first). stream: non-temporal stores where the row is
/// whole lines (the caller fences once its rows are written: stream_fence).
inline std::int32_t move_rows(void* dst, DType dt, const void* src, DType st, std::int32_t n, float mul,
                              bool stream = false, bool divide = false) noexcept {
  const std::int32_t n8 = n - n % 8;
  if (n8 == 0 || !available()) return 0;
  auto* d = static_cast<std::byte*>(dst);
  const auto* s = static_cast<const std::byte*>(src);
  stream = stream && streams_whole_lines(d, dt, n8);
  bool done = false;
  if (divide) {  // a write: the engine's inputs are float types
    switch (st) {
      case DType::f32: done = divide_to<DType::f32>(dt, d, s, n8, mul, stream); break;
      case DType::f16: done = divide_to<DType::f16>(dt, d, s, n8, mul, stream); break;
      case DType::bf16: done = divide_to<DType::bf16>(dt, d, s, n8, mul, stream); break;
      default: break;
    }
    return done ? n8 : 0;
  }
  switch (st) {
    case DType::f32: done = run_to<DType::f32>(dt, d, s, n8, mul, stream); break;
    case DType::f16: done = run_to<DType::f16>(dt, d, s, n8, mul, stream); break;
    case DType::bf16: done = run_to<DType::bf16>(dt, d, s, n8, mul, stream); break;
    case DType::fp8_e4m3: done = run_to<DType::fp8_e4m3>(dt, d, s, n8, mul, stream); break;
    case DType::fp8_e5m2: done = run_to<DType::fp8_e5m2>(dt, d, s, n8, mul, stream); break;
    case DType::int8: done = run_to<DType::int8>(dt, d, s, n8, mul, stream); break;
    default: break;
  }
  return done ? n8 : 0;
}
}  // namespace avx2
#endif

}  // namespace simd
KVCACHE_END_NAMESPACE
