// The host's row conversions by the widest vector loops this CPU runs:
// whole runs of 64 elements by the 512-bit loops (kernels/host/x86/avx512_rows.hpp), what is
// left 8 at a time by the AVX2 loops (kernels/host/x86/avx2_rows.hpp), and the last few by
// the caller's scalar loop. Every one of them gives the scalar code's bits,
// so which ran is not visible in the result.
#pragma once

#include <cstdint>

#include "kvcache/kernels/host/cpu.hpp"
#include "kvcache/kernels/host/x86/avx2_rows.hpp"
#include "kvcache/kernels/host/x86/avx512_rows.hpp"
#include "kvcache/config.hpp"
#include "kvcache/core/kv_format.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace simd {

/// dst[i] = convert(src[i] * mul) (divide: convert(src[i] / mul)) for the
/// first elements of a row of n, as move_row's scalar loop computes them;
/// returns how many it did, a multiple of 8 (0: no AVX2 on this CPU, a
/// packed type, or a row below 8). stream: non-temporal stores where the
/// row is whole lines (the caller fences once its rows are written: stream_fence).
#if KVCACHE_HOST_SIMD
KVCACHE_HOST_KERNEL std::int32_t move_rows(void* dst, DType dt, const void* src, DType st, std::int32_t n, float mul,
                                           bool stream = false, bool divide = false) noexcept
#if KVCACHE_HOST_KERNEL_DECLARED
    ;
#else
{
  std::int32_t done = 0;
#if !defined(KVCACHE_NO_AVX512)
  done = avx512::move_rows(dst, dt, src, st, n, mul, stream, divide);
#endif
  return done + avx2::move_rows(static_cast<std::byte*>(dst) + row_bytes(dt, done), dt,
                                static_cast<const std::byte*>(src) + row_bytes(st, done), st, n - done, mul, stream, divide);
}
#endif
#elif !defined(__CUDACC__)  // CUDA translation units have none (kernels/host/cpu.hpp)
inline std::int32_t move_rows(void*, DType, const void*, DType, std::int32_t, float, bool = false, bool = false) noexcept { return 0; }
#endif

}  // namespace simd
KVCACHE_END_NAMESPACE
