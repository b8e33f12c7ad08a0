// Build-wide switches and the versioned namespace every header lives in.
#pragma once

#include "kvcache/version.hpp"  // KVCACHE_VERSION_MAJOR names the namespace

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
// every symbol sits in an inline namespace named for the major version
// (kvcache::v0 until 1.0; users just write kvcache::), so copies of different
// majors never share a symbol. Two copies of the same major (an engine that
// vendors its own) are kept apart by defining KVCACHE_INLINE_NAMESPACE to a
// name of their own before the first include (e.g. -DKVCACHE_INLINE_NAMESPACE=v0_myengine).
#define KVCACHE_CONCAT_(a, b) a##b
#define KVCACHE_CONCAT(a, b) KVCACHE_CONCAT_(a, b)
#ifndef KVCACHE_INLINE_NAMESPACE
#define KVCACHE_INLINE_NAMESPACE KVCACHE_CONCAT(v, KVCACHE_VERSION_MAJOR)
#endif
#define KVCACHE_BEGIN_NAMESPACE \
  namespace kvcache {           \
  inline namespace KVCACHE_INLINE_NAMESPACE {
#define KVCACHE_END_NAMESPACE \
  }                           \
  }

KVCACHE_BEGIN_NAMESPACE

/// The version of the copy of the library this translation unit was compiled
/// with, as KVCACHE_VERSION (at run time: a Python binding or a log line
/// reports the copy an engine actually carries).
inline int version() noexcept { return KVCACHE_VERSION; }

/// The same as "major.minor.patch".
inline const char* version_string() noexcept { return KVCACHE_VERSION_STRING; }

KVCACHE_END_NAMESPACE

