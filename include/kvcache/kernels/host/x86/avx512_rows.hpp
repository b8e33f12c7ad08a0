// The host's row conversions sixty-four elements at a time (AVX-512 F and
// BW), chosen at run time ahead of kernels/host/x86/avx2_rows.hpp's AVX2 loops: the same
// operations lane by lane, so the scalar code's bits, at twice the lanes
// per instruction. A quantizing scatter (fp16 into int8 or fp8) is bound by
// its conversion's operations rather than its traffic on current servers
// (about 27 AVX2 operations per 32 int8 codes); the wider lanes halve
// them, and AVX-512's saturating packs, mask registers and masked moves
// take some selects off the count. Rows are done in whole runs of 64; the
// AVX2 loops and the scalar loop do what is left (simd::move_rows). An f16
// or e5m2 row into f32, whose NaN payloads only the AVX2 bit decode keeps,
// is left to them too. CUDA translation units, other CPUs and builds with
// KVCACHE_NO_AVX512 compile none of this.
#pragma once

#include <cstdint>

#include "kvcache/kernels/host/cpu.hpp"
#include "kvcache/kernels/host/x86/avx2_rows.hpp"
#include "kvcache/config.hpp"
#include "kvcache/core/kv_format.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace simd {

#if KVCACHE_HOST_SIMD && !defined(KVCACHE_NO_AVX512)
KVCACHE_AVX512_BEGIN
namespace avx512 {
using I = __m512i;
using V = __m512;
KVCACHE_AVX512_INLINE inline I k(std::uint32_t v) noexcept { return _mm512_set1_epi32(static_cast<int>(v)); }
KVCACHE_AVX512_INLINE inline I bits(V f) noexcept { return _mm512_castps_si512(f); }
KVCACHE_AVX512_INLINE inline V from_bits(I u) noexcept { return _mm512_castsi512_ps(u); }
// Unsigned a > b for values below 2^31 (every magnitude here).
KVCACHE_AVX512_INLINE inline __mmask16 gt(I a, std::uint32_t b) noexcept { return _mm512_cmpgt_epi32_mask(a, k(b)); }

/// 64 bytes at p: non-temporal with Stream (p 64-byte aligned), else an
/// unaligned cached store (kernels/host/stream.hpp says when rows stream).
template <bool Stream>
KVCACHE_AVX512_INLINE inline void put64(std::byte* p, I v) noexcept {
  if constexpr (Stream)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p), v);
  else
    _mm512_storeu_si512(reinterpret_cast<void*>(p), v);
}

// ---- loads: 16 elements to 16 floats (cvt::*_to_f32) ----
// fp16 and e5m2 through the hardware conversion, which quiets a signalling
// NaN: the multiply that follows quiets it anyway, and the f32 outputs that
// would keep it are left to the AVX2 loops (wide()).
template <DType T>
KVCACHE_AVX512_INLINE inline V load16(const std::byte* p) noexcept {
  if constexpr (T == DType::f32) return _mm512_loadu_ps(p);
  if constexpr (T == DType::f16) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  if constexpr (T == DType::bf16)
    return from_bits(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  if constexpr (T == DType::fp8_e5m2)
    return _mm512_cvtph_ps(
        _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8));
  if constexpr (T == DType::int8)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// fp8 e4m3 codes as fp16 bits, 32 at a time: avx2::e4m3_as_f16's
// operations (the value times 2^-8, NaN codes sign | 0x7e00), its select
// by a mask register.
KVCACHE_AVX512_INLINE inline I e4m3_as_f16(I s16) noexcept {
  const I h = _mm512_and_si512(_mm512_slli_epi16(s16, 7), _mm512_set1_epi16(static_cast<short>(0xbfff)));
  const __mmask32 nan =
      _mm512_cmpeq_epi16_mask(_mm512_and_si512(h, _mm512_set1_epi16(0x3f80)), _mm512_set1_epi16(0x3f80));
  return _mm512_mask_blend_epi16(nan, h, _mm512_xor_si512(h, _mm512_set1_epi16(0x4180)));
}

// ---- stores: 16 floats to 16 codes, one per 32-bit lane (cvt::f32_to_*) ----
KVCACHE_AVX512_INLINE inline I f32_to_bf16(V f) noexcept {
  const I u = bits(f);
  const I r = _mm512_add_epi32(u, _mm512_add_epi32(k(0x7fffu), _mm512_and_si512(_mm512_srli_epi32(u, 16), k(1))));
  return _mm512_mask_mov_epi32(_mm512_srli_epi32(r, 16), gt(_mm512_and_si512(u, k(0x7fffffffu)), 0x7f800000u),
                               _mm512_or_si512(_mm512_srli_epi32(u, 16), k(0x40u)));
}
// avx2::f32_to_fp8's float-add rounding (see there), with magic and the
// binade's first code looked up rather than computed: the exponent field,
// raised to MinExp, picks one of 32 entries (enough for every binade from
// the smallest normal code's to the largest finite one's, 15 for e4m3 and
// 30 for e5m2) by its low five bits. One vrangeps takes |x| and clamps it;
// the NaN code is merged by the subtract's mask; the sign is or-ed in by one
// ternary logic. 10 operations per 16 values where the computed form took 15.
template <std::uint32_t MinExp, int MBits>
struct Fp8Steps {
  // magic(E) = 2^(E + 23 - MBits) as f32 bits, so |x| + magic rounds x to
  // the code's step; less = magic's bits minus the binade's first code.
  static constexpr std::uint32_t magic(std::uint32_t e) noexcept { return (e + 23u - MBits) << 23; }
  static constexpr auto table(bool less) noexcept {
    struct T {
      alignas(64) std::uint32_t v[32];
    } t{};
    for (std::uint32_t e = MinExp; e < MinExp + 32; ++e)
      t.v[e & 31u] = less ? magic(e) - ((e - MinExp) << MBits) : magic(e);
    return t;
  }
  static constexpr auto magics = table(false), lesses = table(true);
};
template <std::uint32_t MinExp, int MBits, std::uint32_t SatBits, std::uint32_t Nan>
KVCACHE_AVX512_INLINE inline I f32_to_fp8(V f) noexcept {
  using S = Fp8Steps<MinExp, MBits>;
  static_assert((SatBits >> 23) < MinExp + 32, "the largest finite code's binade is past the table");
  const V c = _mm512_range_ps(f, from_bits(k(SatBits)), 0x0a);  // min(|f|, SatBits), sign cleared
  const I e = _mm512_srli_epi32(_mm512_max_epi32(bits(c), k(MinExp << 23)), 23);
  const I lo = _mm512_load_si512(S::magics.v + 0), hi = _mm512_load_si512(S::magics.v + 16);
  const I llo = _mm512_load_si512(S::lesses.v + 0), lhi = _mm512_load_si512(S::lesses.v + 16);
  const I sum = bits(_mm512_add_ps(c, from_bits(_mm512_permutex2var_epi32(lo, e, hi))));
  const I code =
      _mm512_mask_sub_epi32(k(Nan), _mm512_cmp_ps_mask(f, f, _CMP_ORD_Q), sum, _mm512_permutex2var_epi32(llo, e, lhi));
  return _mm512_ternarylogic_epi32(code, _mm512_srli_epi32(bits(f), 24), k(0x80u), 0xf8);  // code | (sign & 0x80)
}
// cvt::to_int(v, -127, 127)'s codes: the clamp in one vrangeps (the
// smaller magnitude of v and 127, with v's sign), and a NaN, which vrangeps
// makes 127 with the NaN's sign, zeroed by the masked conversion.
KVCACHE_AVX512_INLINE inline I to_int8(V v) noexcept {
  return _mm512_maskz_cvtps_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q),
                                  _mm512_range_ps(v, _mm512_set1_ps(127.0f), 0x02));
}
template <DType T>
KVCACHE_AVX512_INLINE inline I codes(V v) noexcept {
  if constexpr (T == DType::bf16) return f32_to_bf16(v);
  if constexpr (T == DType::fp8_e4m3) return f32_to_fp8<121, 3, 0x43e00000u, 0x7fu>(v);
  if constexpr (T == DType::fp8_e5m2) return f32_to_fp8<113, 2, 0x47600000u, 0x7fu>(v);
  if constexpr (T == DType::int8) return to_int8(v);
}
// fp16 by the hardware conversion, a NaN first made the scalar code's sign
// | 0x7e00 (avx2::f16_codes); Nan = false where v holds no other NaN.
template <bool Nan>
KVCACHE_AVX512_INLINE inline __m256i f16_codes(V v) noexcept {
  if constexpr (Nan) {
    const V nan = from_bits(_mm512_or_si512(_mm512_and_si512(bits(v), k(0x80000000u)), k(0x7fc00000u)));
    v = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v, nan);
  }
  return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
}
// 64 elements of T from v[0..3] in order, in whole 64-byte stores. The
// packs work within 128-bit quarters; a permute puts their runs back.
template <DType T, bool Stream, bool Nan>
KVCACHE_AVX512_INLINE inline void store64(std::byte* p, const V (&v)[4]) noexcept {
  if constexpr (T == DType::f32) {
    for (int i = 0; i < 4; ++i) put64<Stream>(p + 64 * i, bits(v[i]));
  } else if constexpr (T == DType::f16) {
    for (int i = 0; i < 2; ++i)
      put64<Stream>(p + 64 * i, _mm512_inserti64x4(_mm512_castsi256_si512(f16_codes<Nan>(v[2 * i])),
                                                   f16_codes<Nan>(v[2 * i + 1]), 1));
  } else if constexpr (T == DType::bf16) {  // lanes below 2^16: unsigned 32 -> 16 packing is exact
    const I order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
    for (int i = 0; i < 2; ++i)
      put64<Stream>(p + 64 * i,
                    _mm512_permutexvar_epi64(order, _mm512_packus_epi32(codes<T>(v[2 * i]), codes<T>(v[2 * i + 1]))));
  } else {  // int8 in [-127, 127] packs signed, fp8 bytes in [0, 255] unsigned: exact either way
    const I a = codes<T>(v[0]), b = codes<T>(v[1]), c = codes<T>(v[2]), d = codes<T>(v[3]);
    const I x = T == DType::int8 ? _mm512_packs_epi16(_mm512_packs_epi32(a, b), _mm512_packs_epi32(c, d))
                                 : _mm512_packus_epi16(_mm512_packus_epi32(a, b), _mm512_packus_epi32(c, d));
    const I y = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), x);
    put64<Stream>(p, y);
  }
}

// Elements i.. of src (type S) times mul, 16 at a time.
template <DType S>
struct Scaled {
  const std::byte* src;
  V mul;
  KVCACHE_AVX512_INLINE void quad(std::int32_t i, V (&v)[4]) const noexcept {
    for (int j = 0; j < 4; ++j) v[j] = _mm512_mul_ps(load16<S>(src + row_bytes(S, i + 16 * j)), mul);
  }
};
// fp8 e4m3 codes through fp16 (e4m3_as_f16), mul256 the multiplier times
// 256 (avx2::e4m3_prescales says where that is exact; wide() checks it).
struct E4m3Scaled {
  const std::byte* src;
  V mul256;
  KVCACHE_AVX512_INLINE void quad(std::int32_t i, V (&v)[4]) const noexcept {
    for (int j = 0; j < 2; ++j) {
      const I h =
          e4m3_as_f16(_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32 * j))));
      v[2 * j] = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), mul256);
      v[2 * j + 1] = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), mul256);
    }
  }
};

// x / d, rounded once: a write's quotient (store_row_divided's, or
// quant::quotient's codes; d a finite divisor, or 0 with inv 0: x * 0).
// With Fma, q = x * inv (inv = 1 / d) corrected by one residual, r = x - q d
// (exact in an FMA), q + r inv: the correctly rounded quotient wherever r
// does not underflow (|x| >= 2^-100, 2^-60 <= d <= 2^60, d positive), at a fraction of
// vdivps's cost. Below that x / d is under 2^-40, whose codes (integers,
// fp8, fp4, f16) are zero either way. q is clamped to +-2^100 (an x / d
// past it, inf included, saturates those codes alike), and the residual is
// taken as q d - x and subtracted, q - (q d - x) inv, so a zero quotient
// keeps x's sign (x - q d would give +0 for x = -0) and a NaN its own.
// Without Fma: vdivps.
template <bool Fma>
KVCACHE_AVX512_INLINE inline V divided(V x, V d, V inv) noexcept {
  if constexpr (!Fma) {
    (void)inv;
    return _mm512_div_ps(x, d);
  } else {
    const V q = _mm512_range_ps(_mm512_mul_ps(x, inv), _mm512_set1_ps(0x1p100f), 0x02);  // |q| at most 2^100, q's sign
    return _mm512_fnmadd_ps(_mm512_fmsub_ps(q, d, x), inv, q);
  }
}
// Elements i.. of src (type S) divided by d (a write's engine-held scale).
template <DType S, bool Fma>
struct Divided {
  const std::byte* src;
  V d, inv;
  KVCACHE_AVX512_INLINE void quad(std::int32_t i, V (&v)[4]) const noexcept {
    for (int j = 0; j < 4; ++j) v[j] = divided<Fma>(load16<S>(src + row_bytes(S, i + 16 * j)), d, inv);
  }
};
template <DType S, DType D, bool Stream, bool Fma>
KVCACHE_AVX512 inline void run_divided(std::byte* dst, const std::byte* src, std::int32_t n64, float d) noexcept {
  const Divided<S, Fma> f{src, _mm512_set1_ps(d), _mm512_set1_ps(1.0f / d)};
  for (std::int32_t i = 0; i < n64; i += 64) {
    V v[4];
    f.quad(i, v);
    store64<D, Stream, true>(dst + row_bytes(D, i), v);
  }
}
// The FMA quotient where its codes are vdivps's (divided): the integer and
// fp8 codes and f16, and a divisor in [2^-60, 2^60]; bf16 and f32 keep every
// bit of a tiny quotient, so they divide.
template <DType S, DType D>
inline void divide(std::byte* dst, const std::byte* src, std::int32_t n64, float d, bool stream) noexcept {
  constexpr bool codes = D == DType::int8 || D == DType::fp8_e4m3 || D == DType::fp8_e5m2 || D == DType::f16;
  if (codes && d >= 0x1p-60f && d <= 0x1p60f) {
    if (stream) run_divided<S, D, true, true>(dst, src, n64, d);
    else run_divided<S, D, false, true>(dst, src, n64, d);
  } else {
    if (stream) run_divided<S, D, true, false>(dst, src, n64, d);
    else run_divided<S, D, false, false>(dst, src, n64, d);
  }
}
template <DType S>
inline bool divide_to(DType dt, std::byte* dst, const std::byte* src, std::int32_t n64, float d, bool stream) noexcept {
  switch (dt) {
    case DType::f32: divide<S, DType::f32>(dst, src, n64, d, stream); return true;
    case DType::f16: divide<S, DType::f16>(dst, src, n64, d, stream); return true;
    case DType::bf16: divide<S, DType::bf16>(dst, src, n64, d, stream); return true;
    case DType::fp8_e4m3: divide<S, DType::fp8_e4m3>(dst, src, n64, d, stream); return true;
    case DType::fp8_e5m2: divide<S, DType::fp8_e5m2>(dst, src, n64, d, stream); return true;
    case DType::int8: divide<S, DType::int8>(dst, src, n64, d, stream); return true;
    default: return false;
  }
}

template <DType D, bool Stream, bool Nan, class F>
KVCACHE_AVX512 inline void run(std::byte* dst, const std::byte* src, std::int32_t n64, float mul) noexcept {
  const F f{src, _mm512_set1_ps(mul)};  // made here: a vector argument would pass through memory
  for (std::int32_t i = 0; i < n64; i += 64) {
    V v[4];
    f.quad(i, v);
    store64<D, Stream, Nan>(dst + row_bytes(D, i), v);
  }
}
template <DType D, bool Nan, class F>
inline void run_streamed(std::byte* dst, const std::byte* src, std::int32_t n64, float mul, bool stream) noexcept {
  if (stream)
    run<D, true, Nan, F>(dst, src, n64, mul);
  else
    run<D, false, Nan, F>(dst, src, n64, mul);
}
// The AVX2 loops' choices (avx2::run): e4m3 through fp16 where the
// multiplier allows it (wide() leaves the others to the AVX2 loops); int8
// into fp16 without the NaN select.
template <DType S, DType D>
inline void run(std::byte* dst, const std::byte* src, std::int32_t n64, float mul, bool stream) noexcept {
  constexpr bool f16_out = D == DType::f16;
  if constexpr (S == DType::fp8_e4m3) {
    run_streamed<D, !f16_out, E4m3Scaled>(dst, src, n64, mul * 256.0f, stream);
  } else {
    if constexpr (S == DType::int8 && f16_out) {
      if (mul == mul) return run_streamed<D, false, Scaled<S>>(dst, src, n64, mul, stream);
    }
    run_streamed<D, true, Scaled<S>>(dst, src, n64, mul, stream);
  }
}
/// True when the 512-bit loops convert st into dt with multiplier mul: every
/// whole-byte pair but fp16 or e5m2 into f32 (NaN payloads), and e4m3 with
/// a multiplier it cannot take through fp16 exactly.
inline bool wide(DType dt, DType st, float mul) noexcept {
  if (dtype_bits(dt) < 8 || dtype_bits(st) < 8) return false;
  if (dt == DType::f32 && (st == DType::f16 || st == DType::fp8_e5m2)) return false;
  if (st == DType::fp8_e4m3) return avx2::e4m3_prescales(mul);
  return true;
}
template <DType S>
inline void run_to(DType dt, std::byte* dst, const std::byte* src, std::int32_t n64, float mul, bool stream) noexcept {
  switch (dt) {
    case DType::f32:
      if constexpr (S != DType::f16 && S != DType::fp8_e5m2) run<S, DType::f32>(dst, src, n64, mul, stream);
      return;
    case DType::f16:
      run<S, DType::f16>(dst, src, n64, mul, stream);
      return;
    case DType::bf16:
      run<S, DType::bf16>(dst, src, n64, mul, stream);
      return;
    case DType::fp8_e4m3:
      run<S, DType::fp8_e4m3>(dst, src, n64, mul, stream);
      return;
    case DType::fp8_e5m2:
      run<S, DType::fp8_e5m2>(dst, src, n64, mul, stream);
      return;
    case DType::int8:
      run<S, DType::int8>(dst, src, n64, mul, stream);
      return;
    default:
      return;
  }
}

/// dst[i] = convert(src[i] * mul) (divide: convert(src[i] / mul), from a
/// float type) for the first n - n % 64 elements of a row, as move_row's
/// scalar loop computes them; returns how many it did (0: no AVX-512, or a
/// pair wide() leaves to the AVX2 loops). stream: non-temporal stores where
/// the row is whole lines (the caller fences).
inline std::int32_t move_rows(void* dst, DType dt, const void* src, DType st, std::int32_t n, float mul,
                              bool stream = false, bool divide = false) noexcept {
  const std::int32_t n64 = n - n % 64;
  if (n64 == 0 || !avx512_available() || !wide(dt, st, divide ? 1.0f : mul)) return 0;
  auto* d = static_cast<std::byte*>(dst);
  const auto* s = static_cast<const std::byte*>(src);
  stream = stream && (reinterpret_cast<std::uintptr_t>(d) & 63u) == 0;  // 64 elements are whole lines in every type
  if (divide) {
    bool done = false;
    switch (st) {
      case DType::f32: done = divide_to<DType::f32>(dt, d, s, n64, mul, stream); break;
      case DType::f16: done = divide_to<DType::f16>(dt, d, s, n64, mul, stream); break;
      case DType::bf16: done = divide_to<DType::bf16>(dt, d, s, n64, mul, stream); break;
      default: break;
    }
    return done ? n64 : 0;
  }
  switch (st) {
    case DType::f32:
      run_to<DType::f32>(dt, d, s, n64, mul, stream);
      break;
    case DType::f16:
      run_to<DType::f16>(dt, d, s, n64, mul, stream);
      break;
    case DType::bf16:
      run_to<DType::bf16>(dt, d, s, n64, mul, stream);
      break;
    case DType::fp8_e4m3:
      run_to<DType::fp8_e4m3>(dt, d, s, n64, mul, stream);
      break;
    case DType::fp8_e5m2:
      run_to<DType::fp8_e5m2>(dt, d, s, n64, mul, stream);
      break;
    case DType::int8:
      run_to<DType::int8>(dt, d, s, n64, mul, stream);
      break;
    default:
      return 0;
  }
  return n64;
}
}  // namespace avx512
KVCACHE_AVX512_END
#endif

}  // namespace simd
KVCACHE_END_NAMESPACE
