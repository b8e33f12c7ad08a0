// What the portable kernel bodies know of the backends, and nothing of
// their code: whether this translation unit compiles the host's vector loops
// (KVCACHE_HOST_SIMD) and how their entry points are linked
// (KVCACHE_HOST_KERNEL), and the memory-traffic rules a host launcher
// applies (kStreamBytes, prefetch_lines). The vector loops themselves are
// kernels/host/; the bodies reach them through kernels/host/fast_path.hpp.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvcache/config.hpp"
#include "kvcache/core/kv_format.hpp"

// Whether this translation unit has the host's vector loops: the host build
// targets x86-64's SSE2 baseline and asks cpuid for AVX2, F16C, FMA and
// AVX-512 at run time (kernels/host/cpu.hpp). CUDA translation units and
// other CPUs see 0 and compile none of the vector code; KVCACHE_NO_AVX512
// compiles out the 512-bit loops alone (for a CPU that slows its clock for
// them, as Intel's before Ice Lake do).
#if !defined(__CUDACC__) && defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVCACHE_HOST_SIMD 1
#else
#define KVCACHE_HOST_SIMD 0
#endif

// Where the host's vector entry points are defined. They dispatch on
// run-time formats, so every translation unit that calls scatter_host or
// gather_host compiles every format's vector loops: most of its object code
// and of its compile time. By default they are inline (header-only). A
// program that defines KVCACHE_SEPARATE_HOST_KERNELS in all its translation
// units gets them as declarations, defined once in the one translation unit
// that also defines KVCACHE_HOST_KERNELS_IMPLEMENTATION and includes
// kernels/host_kernels.hpp (docs/install.md). An entry point is written
//   KVCACHE_HOST_KERNEL R f(args) noexcept
//   #if KVCACHE_HOST_KERNEL_DECLARED
//   ;
//   #else
//   { body }
//   #endif
#if KVCACHE_HOST_SIMD && defined(KVCACHE_SEPARATE_HOST_KERNELS)
#define KVCACHE_HOST_KERNEL
#if defined(KVCACHE_HOST_KERNELS_IMPLEMENTATION)
#define KVCACHE_HOST_KERNEL_DECLARED 0
#else
#define KVCACHE_HOST_KERNEL_DECLARED 1
#endif
#else
#define KVCACHE_HOST_KERNEL inline
#define KVCACHE_HOST_KERNEL_DECLARED 0
#endif

KVCACHE_BEGIN_NAMESPACE

/// A host launcher whose call writes at least this many bytes of rows
/// stores them non-temporally: beyond a core's share of the last-level
/// cache (2 to 4 MiB on current servers). Below it rows stay cached for
/// the attention that reads them next (decode's calls are far below it).
inline constexpr std::int64_t kStreamBytes = std::int64_t{4} << 20;

/// True when a call that writes `bytes` of rows streams them (kStreamBytes).
KVCACHE_HOST_DEVICE constexpr bool streams(std::int64_t bytes) noexcept { return bytes >= kStreamBytes; }

/// Asks for `bytes` at p into the cache, a line at a time (host only). The
/// rows a launcher reads next sit in any order, and the hardware
/// prefetcher, which follows addresses within a page, starts over at each
/// block; a block ahead, the lines arrive by the time the loop reaches them.
KVCACHE_HOST_DEVICE inline void prefetch_lines(const std::byte* p, std::int64_t bytes) noexcept {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDA_ARCH__)
  // Not __builtin_prefetch: g++ 12 drops it from this loop (cd-dce) once
  // inlined into the gather launcher.
  for (std::int64_t i = 0; i < bytes; i += 64) __asm__ volatile("prefetcht0 %0" : : "m"(p[i]));
#elif defined(__GNUC__) && !defined(__CUDA_ARCH__)
  for (std::int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i);
#else
  (void)p;
  (void)bytes;
#endif
}

KVCACHE_END_NAMESPACE
