// The host backend's channel scales (Scales::channel, KIVI's keys) eight
// channels at a time (AVX2). A channel's group runs down the block's
// tokens, so the lanes of one vector are eight channels of a row: the
// ranges accumulate a row at a time, each channel's scale and minimum come
// out of group_scales in one vector, and a row's codes and its read-back
// take the eight channels' own scales lane by lane. The scalar loops (one
// f16 conversion call per channel per row) cost the seal 95x memcpy and the
// gather 60x. The bits are seal_channel_unit's and load_channel_elem's: the
// same IEEE operations in the same order; test_host_simd checks them.
// With AVX-512 the read-back takes runs of 16 channels sixteen at a time
// (kernels/host/x86/avx512_channels.hpp). CUDA translation units and other CPUs
// compile none of this.
#pragma once

#include <cstdint>

#include "kvcache/kernels/detail/common.hpp"
#include "kvcache/kernels/host/x86/avx2_rows.hpp"
#include "kvcache/kernels/host/x86/avx512_channels.hpp"
#include "kvcache/kernels/host/x86/avx2_groups.hpp"
#include "kvcache/kernels/host/x86/avx2_packed.hpp"
#include "kvcache/core/kv_format.hpp"
#include "kvcache/kernels/detail/quant.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace simd {

#if KVCACHE_HOST_SIMD
namespace avx2 {

// The channels' entries from `rows` rows of d floats (row-major, d a
// multiple of 8): with a minimum, each channel's order-key range gives
// minimum = f16(lo) rounded down and scale = f16((hi - minimum) / code_max)
// rounded up, stored as the (scale, minimum) pair quant::group_scale
// stores; without, its largest |x| gives the scale and the minimum is 0. sc
// (the scale's value) and mn (the minimum's) take one float a channel for the codes.
template <bool Min>
KVCACHE_AVX2 inline void channel_entries(const float* x, std::int32_t rows, std::int32_t d, float code_max, std::byte* entries,
                                         float* sc, float* mn) noexcept {
  for (std::int32_t c = 0; c < d; c += 8) {
    const float* col = x + c;  // row t's eight channels at col + t * d (no lambda: it would not carry the target)
    I h, lo_bits = _mm256_setzero_si256();
    __m256 iv;
    if constexpr (Min) {
      I kmin = order_key(bits(_mm256_loadu_ps(col))), kmax = kmin;
      for (std::int32_t t = 1; t < rows; ++t) {
        const I key = order_key(bits(_mm256_loadu_ps(col + std::int64_t{t} * d)));
        kmin = _mm256_min_epi32(kmin, key), kmax = _mm256_max_epi32(kmax, key);
      }
      const __m256 lo = from_bits(order_key(kmin)), hi = from_bits(order_key(kmax));
      lo_bits = f16_at_most(lo);  // the minimum first: the scale spans from it
      group_scales(_mm256_sub_ps(hi, f16_to_f32(lo_bits)), code_max, h, iv);
      // (scale, minimum) f16 pairs: a 32-bit lane per channel, scale low.
      _mm256_storeu_si256(reinterpret_cast<I*>(entries + 4 * c), _mm256_or_si256(h, _mm256_slli_epi32(lo_bits, 16)));
    } else {
      I amax = _mm256_setzero_si256();  // |x|'s bits are below 2^31: a signed max orders them
      for (std::int32_t t = 0; t < rows; ++t)
        amax = _mm256_max_epi32(amax, _mm256_and_si256(bits(_mm256_loadu_ps(col + std::int64_t{t} * d)), k(0x7fffffffu)));
      group_scales(from_bits(amax), code_max, h, iv);
      store_u16(entries + 2 * c, h);
    }
    (void)iv;
    _mm256_storeu_ps(sc + c, f16_to_f32(h));
    _mm256_storeu_ps(mn + c, f16_to_f32(lo_bits));  // f16 0 is 0.0f: no minimum subtracts +0, as the scalar code does
  }
}

// One row's codes: to_int((x - mn) / sc) per channel (a zero or NaN
// scale's NaN quotient is code 0, as quant::quotient's x * 0 is), clamped
// to the code's range [lo, hi], masked to its bits and packed as seal packs them.
struct ChannelQuant {
  const float *x, *sc, *mn;
  float lo, hi;
  std::uint32_t mask;
  KVCACHE_AVX2_INLINE I operator()(std::int32_t c) const noexcept {
    const __m256 q = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x + c), _mm256_loadu_ps(mn + c)), _mm256_loadu_ps(sc + c));
    return _mm256_and_si256(to_int(q, lo, hi), k(mask));
  }
};
template <DType C>
KVCACHE_AVX2 inline void channel_codes(std::byte* out, const float* x, const float* sc, const float* mn, std::int32_t d,
                                       float lo, float hi) noexcept {
  store_packed_each<C>(out, d, ChannelQuant{x, sc, mn, lo, hi, (1u << dtype_bits(C)) - 1u});
}

// Channels i.. of a row read back: (code * scale [+ minimum]) * mul with
// channel i's own entry in lane i. As in PackedCodes, code x scale is
// exact, so the unfused add has fmaf's bits.
template <DType C, bool Min>
struct ChannelCodes {
  const std::byte* codes;
  const std::byte* entries;
  __m256 mul;
  KVCACHE_AVX2_INLINE __m256 operator()(std::int32_t i) const noexcept {
    const __m256 code = load_packed_codes<C, Min>(codes, i);
    if constexpr (Min) {
      const I e = _mm256_loadu_si256(reinterpret_cast<const I*>(entries + 4 * std::int64_t{i}));
      const __m256 x = _mm256_mul_ps(code, f16_to_f32(_mm256_and_si256(e, k(0xffffu))));
      return _mm256_mul_ps(_mm256_add_ps(x, f16_to_f32(_mm256_srli_epi32(e, 16))), mul);
    } else {
      return _mm256_mul_ps(_mm256_mul_ps(code, f16_to_f32(load_u16(entries + 2 * std::int64_t{i}))), mul);
    }
  }
};

template <DType C, bool Min, DType O>
KVCACHE_AVX2 inline void dequantize_channels(std::byte* out, const std::byte* codes, const std::byte* entries, std::int32_t n,
                                             float mul) noexcept {
  store_each<O>(out, n, ChannelCodes<C, Min>{codes, entries, _mm256_set1_ps(mul)});
}
template <DType C, bool Min>
inline bool dequantize_channels_to(DType ot, std::byte* out, const std::byte* codes, const std::byte* entries, std::int32_t n,
                                   float mul) noexcept {
  switch (ot) {
    case DType::f32: dequantize_channels<C, Min, DType::f32>(out, codes, entries, n, mul); return true;
    case DType::f16: dequantize_channels<C, Min, DType::f16>(out, codes, entries, n, mul); return true;
    case DType::bf16: dequantize_channels<C, Min, DType::bf16>(out, codes, entries, n, mul); return true;
    default: return false;
  }
}
}  // namespace avx2

/// True when the channel loops below take `code` (int8, int4 or int2:
/// the codes channel scales allow) over runs of a multiple of 8 channels
/// to or from `other` (f32, f16 or bf16) on this CPU.
inline bool channels_fast(DType code, std::int32_t channels, DType other) noexcept {
  const bool code_ok = code == DType::int8 || code == DType::int4 || code == DType::int2;
  const bool other_ok = other == DType::f32 || other == DType::f16 || other == DType::bf16;
  return code_ok && other_ok && channels % 8 == 0 && available();
}

/// The entries of `d` channels (a multiple of 8) from `rows` rows of x (f32,
/// row-major), as seal_channel_unit computes them (quant::group_scale of
/// each channel's range), stored at `entries`; sc and mn receive each
/// channel's scale and minimum (or 0) for channel_codes.
inline void channel_entries(DType code, bool minimum, const float* x, std::int32_t rows, std::int32_t d, std::byte* entries,
                            float* sc, float* mn) noexcept {
  const float code_max = quant::code_max(code, minimum);
  if (minimum) avx2::channel_entries<true>(x, rows, d, code_max, entries, sc, mn);
  else avx2::channel_entries<false>(x, rows, d, code_max, entries, sc, mn);
}

/// One row of d channels' codes (packed), from x and channel_entries' sc and mn.
inline void channel_codes(DType code, bool minimum, std::byte* out, const float* x, const float* sc, const float* mn,
                          std::int32_t d) noexcept {
  const float hi = quant::code_max(code, minimum), lo = minimum ? 0.0f : -hi;
  switch (code) {
    case DType::int8: avx2::channel_codes<DType::int8>(out, x, sc, mn, d, lo, hi); return;
    case DType::int4: avx2::channel_codes<DType::int4>(out, x, sc, mn, d, lo, hi); return;
    default: avx2::channel_codes<DType::int2>(out, x, sc, mn, d, lo, hi); return;
  }
}

/// n channels of a channel-scaled row (or run of adjacent rows) dequantized
/// with their entries, times mul, stored as ot: load_channel_elem's bits;
/// false when channels_fast says no (nothing written). Runs of 16 go to the
/// 512-bit loop where the CPU has AVX-512 (kernels/host/x86/avx512_channels.hpp), the
/// rest to the AVX2 one.
KVCACHE_HOST_KERNEL bool dequantize_channels(void* out, DType ot, const std::byte* codes, const std::byte* entries,
                                             DType code, bool minimum, std::int32_t n, float mul) noexcept
#if KVCACHE_HOST_KERNEL_DECLARED
    ;
#else
{
  if (!channels_fast(code, n, ot)) return false;
  auto* o = static_cast<std::byte*>(out);
#if !defined(KVCACHE_NO_AVX512)
  if (const std::int32_t done = avx512::dequantize_channels(o, ot, codes, entries, code, minimum, n, mul); done > 0) {
    if (done == n) return true;
    o += row_bytes(ot, done), codes += row_bytes(code, done), entries += scale_entry_bytes(code, minimum) * done;
    n -= done;
  }
#endif
  if (minimum) switch (code) {
      case DType::int8: return avx2::dequantize_channels_to<DType::int8, true>(ot, o, codes, entries, n, mul);
      case DType::int4: return avx2::dequantize_channels_to<DType::int4, true>(ot, o, codes, entries, n, mul);
      default: return avx2::dequantize_channels_to<DType::int2, true>(ot, o, codes, entries, n, mul);
    }
  switch (code) {
    case DType::int8: return avx2::dequantize_channels_to<DType::int8, false>(ot, o, codes, entries, n, mul);
    case DType::int4: return avx2::dequantize_channels_to<DType::int4, false>(ot, o, codes, entries, n, mul);
    default: return avx2::dequantize_channels_to<DType::int2, false>(ot, o, codes, entries, n, mul);
  }
}
#endif
#endif

}  // namespace simd


KVCACHE_END_NAMESPACE
