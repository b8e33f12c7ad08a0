// Channel scales (Scales::channel: KIVI's keys, each channel's scale and
// minimum shared down a block's tokens) sixteen channels at a time, where
// the CPU has AVX-512 F, BW and DQ: the seal's entries and codes, and the
// read-back. Lane i of a vector is channel i, so each lane takes its own
// entry. The seal is seal_channel_unit's and kernels/host/x86/avx2_channels.hpp's
// operations; its rows are widened by the hardware (a signalling NaN
// quieted: no entry or code depends on a NaN's payload, since every NaN
// scale or minimum is stored as the f16 NaN sign | 0x7e00 and every NaN
// value codes to 0). In the read-back the AVX2 loop
// (kernels/host/x86/avx2_channels.hpp) widened each channel's f16 scale and minimum by
// the bit decode, two per eight values, which took four times the value
// groups' read-back in a KIVI gather. Here the hardware widens them (its
// bits but for a signalling NaN, which it quiets, as the multiply that
// follows would), the codes come through load_codes' table, and the add is
// unfused (code x scale is exact, so it is fmaf's one rounding, as
// load_channel_elem computes). test_host_simd checks the bits.
#pragma once

#include <cstdint>

#include "kvcache/kernels/host/cpu.hpp"
#include "kvcache/kernels/host/x86/avx512_rows.hpp"
#include "kvcache/kernels/host/x86/avx512_groups.hpp"
#include "kvcache/kernels/host/x86/avx512_minimum.hpp"
#include "kvcache/kernels/host/x86/avx512_packed.hpp"
#include "kvcache/config.hpp"
#include "kvcache/kernels/detail/quant.hpp"
#include "kvcache/core/kv_format.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace simd {

#if KVCACHE_HOST_SIMD && !defined(KVCACHE_NO_AVX512)
KVCACHE_AVX512_BEGIN
namespace avx512 {

// x[0, n) = src (S) / k (the call's scale), n a multiple of 16: a block's rows for the seal.
template <DType S>
KVCACHE_AVX512 inline void scaled_rows(float* x, const std::byte* src, std::int32_t n, float k) noexcept {
  const V m = _mm512_set1_ps(k);
  for (std::int32_t i = 0; i < n; i += 16) _mm512_storeu_ps(x + i, _mm512_div_ps(load16<S>(src + row_bytes(S, i)), m));
}

// avx2::channel_entries sixteen channels a vector: over `rows` rows of d
// floats (d a multiple of 16), each channel's order-key range (Min) or
// largest |x|, its entry (the f16 scale, and minimum as the pair's high
// half), and each channel's scale (sc) and minimum (mn) for channel_codes.
template <bool Min>
KVCACHE_AVX512 inline void channel_entries(const float* x, std::int32_t rows, std::int32_t d, float code_max,
                                           std::byte* entries, float* sc, float* mn) noexcept {
  for (std::int32_t c = 0; c < d; c += 16) {
    const float* col = x + c;
    I entry;
    V iv, lo = _mm512_setzero_ps();
    if constexpr (Min) {
      I kmin = order_keys<32>(bits(_mm512_loadu_ps(col))), kmax = kmin;
      for (std::int32_t t = 1; t < rows; ++t) {
        const I key = order_keys<32>(bits(_mm512_loadu_ps(col + std::int64_t{t} * d)));
        kmin = _mm512_min_epi32(kmin, key), kmax = _mm512_max_epi32(kmax, key);
      }
      const I lh = f16_at_most(from_bits(order_keys<32>(kmin)));  // the minimum first: the scale spans from it
      lo = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(lh));
      group_scales(sub(from_bits(order_keys<32>(kmax)), lo), code_max, entry, iv);
      _mm512_storeu_si512(entries + 4 * std::int64_t{c}, _mm512_or_si512(entry, _mm512_slli_epi32(lh, 16)));
    } else {
      I amax = _mm512_setzero_si512();  // |x|'s bits are below 2^31: a signed max orders them
      for (std::int32_t t = 0; t < rows; ++t)
        amax = _mm512_max_epi32(amax, _mm512_and_si512(_mm512_loadu_si512(col + std::int64_t{t} * d), k(0x7fffffffu)));
      group_scales(from_bits(amax), code_max, entry, iv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(entries + 2 * std::int64_t{c}), _mm512_cvtepi32_epi16(entry));
    }
    (void)iv;
    _mm512_storeu_ps(sc + c, entry_values<DType::f16>(entry));
    _mm512_storeu_ps(mn + c, lo);  // no minimum: +0, which the scalar code subtracts too
  }
}

// One row's codes, 64 channels a store: (x - mn) / sc per channel (integer
// codes: a zero or NaN scale's NaN quotient is code 0, as quant::quotient's
// x * 0 is), coded as a group's values are (minimum_codes, or packed_codes
// without a minimum) and packed as the seal packs them.
template <DType C, bool Min>
KVCACHE_AVX512 inline void channel_codes(std::byte* out, const float* x, const float* sc, const float* mn,
                                         std::int32_t d) noexcept {
  const V hi = _mm512_set1_ps(quant::code_max(C, Min));
  for (std::int32_t c0 = 0; c0 < d; c0 += 64) {
    I q[4];
    for (std::int32_t j = 0; j < 4; ++j) {
      const std::int32_t c = c0 + 16 * j;
      if (c >= d) {
        q[j] = _mm512_setzero_si512();
        continue;
      }
      const V v = _mm512_div_ps(sub(_mm512_loadu_ps(x + c), _mm512_loadu_ps(mn + c)), _mm512_loadu_ps(sc + c));
      q[j] = Min ? minimum_codes(v, hi) : packed_codes<C>(v);
    }
    const std::int32_t left = d - c0 < 64 ? d - c0 : 64;
    store_codes<C>(out + row_bytes(C, c0), q[0], q[1], q[2], q[3], static_cast<std::int32_t>(row_bytes(C, left)));
  }
}

// n channels (a multiple of 16): (code * scale [+ minimum]) * mul, each
// channel's entry in its lane (with a minimum, the (scale, minimum) f16
// pair a 32-bit lane, scale low).
template <DType C, bool Min, DType O>
KVCACHE_AVX512 inline void dequantize_channels(std::byte* out, const std::byte* codes, const std::byte* entries,
                                               std::int32_t n, float mul) noexcept {
  const V m = _mm512_set1_ps(mul);
  for (std::int32_t i = 0; i < n; i += 16) {
    V code;
    if constexpr (C == DType::int8 && !Min)
      code = load16<DType::int8>(codes + i);
    else
      code = load_codes<C, Min>(codes, i);
    V x;
    if constexpr (Min) {
      const I e = _mm512_loadu_si512(entries + 4 * std::int64_t{i});
      const V scale = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(e));
      x = add(_mm512_mul_ps(code, scale), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(e, 16))));
    } else {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(entries + 2 * std::int64_t{i}));
      x = _mm512_mul_ps(code, _mm512_cvtph_ps(h));
    }
    store16<O>(out + row_bytes(O, i), _mm512_mul_ps(x, m));
  }
}
template <DType C, bool Min>
inline void dequantize_channels_to(DType ot, std::byte* out, const std::byte* codes, const std::byte* entries,
                                   std::int32_t n, float mul) noexcept {
  switch (ot) {
    case DType::f32:
      return dequantize_channels<C, Min, DType::f32>(out, codes, entries, n, mul);
    case DType::f16:
      return dequantize_channels<C, Min, DType::f16>(out, codes, entries, n, mul);
    default:
      return dequantize_channels<C, Min, DType::bf16>(out, codes, entries, n, mul);
  }
}
template <bool Min>
inline void dequantize_channels_of(DType code, DType ot, std::byte* out, const std::byte* codes,
                                   const std::byte* entries, std::int32_t n, float mul) noexcept {
  switch (code) {
    case DType::int8:
      return dequantize_channels_to<DType::int8, Min>(ot, out, codes, entries, n, mul);
    case DType::int4:
      return dequantize_channels_to<DType::int4, Min>(ot, out, codes, entries, n, mul);
    default:
      return dequantize_channels_to<DType::int2, Min>(ot, out, codes, entries, n, mul);
  }
}

/// The seal of a (block, head)'s channels when d (a multiple of 16) and the
/// source type (f32, f16, bf16) allow, with AVX-512: `rows` rows of the
/// source (row t at src(t)) divided by k into x, then the entries and each
/// row's codes (row t at out(t)), as seal_channels_host's AVX2 path writes
/// them. False (nothing written) without AVX-512 or for other d. The
/// caller has checked channels_fast(code, d, st).
template <class Src, class Out>
inline bool seal_channels(DType code, bool minimum, DType st, Src src, Out out, std::byte* entries, std::int32_t rows,
                          std::int32_t d, float k, float* x, float* sc, float* mn) noexcept {
  if (d % 16 != 0 || !avx512_available()) return false;
  for (std::int32_t t = 0; t < rows; ++t) {
    float* row = x + std::int64_t{t} * d;
    if (st == DType::f32)
      scaled_rows<DType::f32>(row, src(t), d, k);
    else if (st == DType::f16)
      scaled_rows<DType::f16>(row, src(t), d, k);
    else
      scaled_rows<DType::bf16>(row, src(t), d, k);
  }
  const float code_max = quant::code_max(code, minimum);
  if (minimum)
    channel_entries<true>(x, rows, d, code_max, entries, sc, mn);
  else
    channel_entries<false>(x, rows, d, code_max, entries, sc, mn);
  for (std::int32_t t = 0; t < rows; ++t) {
    const float* row = x + std::int64_t{t} * d;
    std::byte* o = out(t);
    if (code == DType::int8)
      minimum ? channel_codes<DType::int8, true>(o, row, sc, mn, d)
              : channel_codes<DType::int8, false>(o, row, sc, mn, d);
    else if (code == DType::int4)
      minimum ? channel_codes<DType::int4, true>(o, row, sc, mn, d)
              : channel_codes<DType::int4, false>(o, row, sc, mn, d);
    else
      minimum ? channel_codes<DType::int2, true>(o, row, sc, mn, d)
              : channel_codes<DType::int2, false>(o, row, sc, mn, d);
  }
  return true;
}

/// The first n - n % 16 channels of simd::dequantize_channels (int8, int4
/// or int2 codes; f32, f16 or bf16 out); returns how many it did (0 without
/// AVX-512). The caller has checked channels_fast.
inline std::int32_t dequantize_channels(void* out, DType ot, const std::byte* codes, const std::byte* entries,
                                        DType code, bool minimum, std::int32_t n, float mul) noexcept {
  const std::int32_t n16 = n - n % 16;
  if (n16 == 0 || !avx512_available()) return 0;
  auto* o = static_cast<std::byte*>(out);
  if (minimum)
    dequantize_channels_of<true>(code, ot, o, codes, entries, n16, mul);
  else
    dequantize_channels_of<false>(code, ot, o, codes, entries, n16, mul);
  return n16;
}
}  // namespace avx512
KVCACHE_AVX512_END
#endif

}  // namespace simd
KVCACHE_END_NAMESPACE
