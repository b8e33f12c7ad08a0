// What the host's vector loops may use on this CPU, read at run time: the
// host build targets x86-64's SSE2 baseline, so AVX2, F16C, FMA and
// AVX-512 are asked of cpuid once and the loops that need them are compiled
// with their own target attribute. CUDA translation units and other CPUs
// see KVCACHE_HOST_SIMD 0 and compile none of the vector code; defining
// KVCACHE_NO_AVX512 compiles out the 512-bit loops alone (for a CPU that
// slows its clock for them, as Intel's before Ice Lake do).
#pragma once

#include "kvcache/config.hpp"

#include "kvcache/kernels/detail/backend.hpp"  // KVCACHE_HOST_SIMD, KVCACHE_HOST_KERNEL

#if KVCACHE_HOST_SIMD
#include <cpuid.h>
#include <immintrin.h>
#endif

KVCACHE_BEGIN_NAMESPACE
namespace simd {

#if KVCACHE_HOST_SIMD
// The target every host vector loop is compiled for, given here once.
// Entry points carry it; the helpers they call are always inlined: a helper
// left out of line takes and returns its vectors through memory (the
// caller's ABI has no 256-bit registers), which made fp8 rows take twice
// as long (22.9 ms against 12 for bench_quant's prefill).
#define KVCACHE_AVX2 __attribute__((target("avx2,f16c")))
#define KVCACHE_AVX2_INLINE __attribute__((target("avx2,f16c"), always_inline))
// The 512-bit loops' target (kernels/host/x86/avx512_rows.hpp): AVX-512 F, BW (byte and
// 16-bit lanes) and DQ (vrangeps), which every AVX-512 server CPU has.
#define KVCACHE_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx2,f16c")))
#define KVCACHE_AVX512_INLINE __attribute__((target("avx512f,avx512bw,avx512dq,avx2,f16c"), always_inline))
// Every AVX-512 header's namespace avx512 opens after KVCACHE_AVX512_BEGIN
// and closes before KVCACHE_AVX512_END: g++ 12's AVX-512 intrinsics start
// from a self-initialized "undefined" vector, which -Wmaybe-uninitialized
// reports wherever they are inlined (GCC bug 105593, fixed in 13).
#if defined(__GNUC__) && !defined(__clang__)
#define KVCACHE_AVX512_BEGIN _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"")
#define KVCACHE_AVX512_END _Pragma("GCC diagnostic pop")
#else
#define KVCACHE_AVX512_BEGIN
#define KVCACHE_AVX512_END
#endif

/// True when this CPU runs the AVX2 + F16C loops. AVX2 from the compiler's
/// cpuid reading (it checks the OS saves the 256-bit registers); F16C from
/// cpuid leaf 1 (clang 14's builtin does not know it), read once: cpuid
/// traps to the hypervisor on a VM. A constant of the machine, not state.
inline bool available() noexcept {
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __builtin_cpu_supports("avx2") && __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
  }();
  return yes;
}

/// True when this CPU also has FMA3 (cpuid leaf 1), read once. A fused
/// multiply-add rounds once, as fmaf does, so its results are fmaf's bits;
/// without the instruction the host build's fmaf is a libm call per value.
inline bool fma_available() noexcept {
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return available() && __get_cpuid(1, &a, &b, &c, &d) && (c & bit_FMA) != 0;
  }();
  return yes;
}

/// True when this CPU runs the 512-bit loops: AVX-512 F, BW and DQ (the
/// compiler's cpuid reading checks the OS saves the 512-bit registers), and
/// the AVX2 loops, which do the rows' remainders. False when built with
/// KVCACHE_NO_AVX512.
inline bool avx512_available() noexcept {
#if defined(KVCACHE_NO_AVX512)
  return false;
#else
  static const bool yes = available() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq");
  return yes;
#endif
}
#else
inline bool available() noexcept { return false; }
inline bool fma_available() noexcept { return false; }
inline bool avx512_available() noexcept { return false; }
#endif

}  // namespace simd
KVCACHE_END_NAMESPACE
