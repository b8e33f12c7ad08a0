// The one door from the portable kernel bodies to the host backend: each
// fast_* call does the first part of a row by the host's vector loops and
// says how much it did (0 or false on CUDA, on other CPUs, or on a CPU
// without the instructions); the caller's scalar loop does the rest, with
// the same bits. CUDA translation units include it too and get only the
// zeros (KVCACHE_HOST_SIMD 0). What the backend is for: kernels/host/README.md.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvcache/config.hpp"
#include "kvcache/core/kv_format.hpp"
#include "kvcache/kernels/detail/backend.hpp"
#include "kvcache/kernels/host/cpu.hpp"
#include "kvcache/kernels/host/groups.hpp"
#include "kvcache/kernels/host/rows.hpp"
#include "kvcache/kernels/host/stream.hpp"
#include "kvcache/kernels/host/x86/avx2_channels.hpp"
#include "kvcache/kernels/host/x86/avx2_reduce.hpp"

KVCACHE_BEGIN_NAMESPACE

/// The first elements of store_row(dt, dst, load_row(st, src) times mul)
/// (divide: store_row_divided(..., by mul)) by the host's vector loops
/// (kernels/host/rows.hpp), the same bits; returns how many (a multiple of
/// 8; 0 on CUDA, without AVX2, or for packed types).
KVCACHE_HOST_DEVICE inline std::int32_t fast_rows(void* dst, DType dt, const void* src, DType st, std::int32_t n,
                                                  float mul, bool stream = false, bool divide = false) noexcept {
#if KVCACHE_HOST_SIMD
  return simd::move_rows(dst, dt, src, st, n, mul, stream, divide);
#else
  (void)dst, (void)dt, (void)src, (void)st, (void)n, (void)mul, (void)stream, (void)divide;
  return 0;
#endif
}

/// The largest of |x[0, k)|'s bits into m, for the first k elements the
/// host's AVX2 loops take (a multiple of 8; 0 on CUDA or without AVX2); returns k.
KVCACHE_HOST_DEVICE inline std::int32_t fast_abs_max_bits(const float* x, std::int32_t n, std::uint32_t& m) noexcept {
#if KVCACHE_HOST_SIMD
  return simd::abs_max_bits(x, n, m);
#else
  (void)x, (void)n, (void)m;
  return 0;
#endif
}

/// out[i] = fmaf(a[i], b, c) (b, c: arrays for step 1, one value for 0) for the first k
/// elements on the host's FMA, fmaf's bits; returns k (0 on CUDA or without FMA).
KVCACHE_HOST_DEVICE inline std::int32_t fast_fma(float* out, const float* a, const float* b, std::int32_t bstep, const float* c,
                                                 std::int32_t cstep, std::int32_t n) noexcept {
#if KVCACHE_HOST_SIMD
  return simd::fmadd(out, a, b, bstep, c, cstep, n);
#else
  (void)out, (void)a, (void)b, (void)bstep, (void)c, (void)cstep, (void)n;
  return 0;
#endif
}

/// simd::quantize_groups on the host (the source divided by div); false on CUDA or without AVX2.
KVCACHE_HOST_DEVICE inline bool fast_quantize_groups(std::byte* codes, std::byte* entries, const void* src, DType st,
                                                     DType code, bool minimum, std::int32_t group, std::int32_t groups,
                                                     float div, float code_max) noexcept {
#if KVCACHE_HOST_SIMD
  return simd::quantize_groups(codes, entries, src, st, code, minimum, group, groups, div, code_max);
#else
  (void)codes, (void)entries, (void)src, (void)st, (void)code, (void)minimum, (void)group, (void)groups, (void)div,
      (void)code_max;
  return false;
#endif
}

/// simd::dequantize_groups on the host; false on CUDA or without AVX2.
KVCACHE_HOST_DEVICE inline bool fast_dequantize_groups(void* out, DType ot, const std::byte* codes,
                                                       const std::byte* entries, DType code, bool minimum,
                                                       std::int32_t group, std::int32_t groups, float mul) noexcept {
#if KVCACHE_HOST_SIMD
  return simd::dequantize_groups(out, ot, codes, entries, code, minimum, group, groups, mul);
#else
  (void)out, (void)ot, (void)codes, (void)entries, (void)code, (void)minimum, (void)group, (void)groups, (void)mul;
  return false;
#endif
}

/// simd::dequantize_channels on the host; false on CUDA or without AVX2.
KVCACHE_HOST_DEVICE inline bool fast_dequantize_channels(void* out, DType ot, const std::byte* codes, const std::byte* entries,
                                                         DType code, bool minimum, std::int32_t n, float mul) noexcept {
#if KVCACHE_HOST_SIMD
  return simd::dequantize_channels(out, ot, codes, entries, code, minimum, n, mul);
#else
  (void)out, (void)ot, (void)codes, (void)entries, (void)code, (void)minimum, (void)n, (void)mul;
  return false;
#endif
}

/// Copies a row of whole 64-byte lines at dst with non-temporal stores;
/// false (nothing copied) on CUDA, when dst is not such a row, or without AVX2.
KVCACHE_HOST_DEVICE inline bool fast_stream_copy(void* dst, const void* src, std::int64_t bytes) noexcept {
#if KVCACHE_HOST_SIMD
  return simd::stream_copy(dst, src, bytes);
#else
  (void)dst, (void)src, (void)bytes;
  return false;
#endif
}

/// Orders the calling thread's streamed rows before what it does next; a
/// launcher that streamed calls it once (nothing on CUDA or without AVX2).
KVCACHE_HOST_DEVICE inline void stream_fence() noexcept {
#if KVCACHE_HOST_SIMD
  simd::stream_fence();
#endif
}

KVCACHE_END_NAMESPACE
