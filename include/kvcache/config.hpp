// Build-wide switches and the versioned namespace every header lives in.
#pragma once

#define KVCACHE_VERSION_MAJOR 0
#define KVCACHE_VERSION_MINOR 1
#define KVCACHE_VERSION_PATCH 0

// Bodies shared by the host backend and CUDA kernels carry this marker; it is
// empty under a plain C++ compiler so .hpp headers compile with g++ alone.
#if defined(__CUDACC__)
#define KVCACHE_HOST_DEVICE __host__ __device__
#else
#define KVCACHE_HOST_DEVICE
#endif

// Keeps a rarely taken path out of a hot loop, so the loop's values stay
// in registers instead of being spilled around the inlined cold code.
#if defined(_MSC_VER) && !defined(__clang__)
#define KVCACHE_NOINLINE __declspec(noinline)
#else
#define KVCACHE_NOINLINE __attribute__((noinline))
#endif

// Two engines that embed different copies of the library can link together:
// every symbol sits in kvcache::v0 (inline, so users just write kvcache::).
#define KVCACHE_BEGIN_NAMESPACE \
  namespace kvcache {           \
  inline namespace v0 {
#define KVCACHE_END_NAMESPACE \
  }                           \
  }
