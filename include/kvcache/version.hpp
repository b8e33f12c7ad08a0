// The library's version: the one place it is written. CMake's project(),
// the Conan recipe and the vcpkg port's manifest read or are checked against
// these three lines (tests/packaging/check_versions.cmake). Macros only, so
// config.hpp can name the versioned namespace from it; kvcache::version()
// and version_string() are config.hpp's (every header includes it).
#pragma once

#define KVCACHE_VERSION_MAJOR 0
#define KVCACHE_VERSION_MINOR 2
#define KVCACHE_VERSION_PATCH 0

/// The version as one number, major * 10000 + minor * 100 + patch (0.2.0 is
/// 200), for `#if KVCACHE_VERSION >= ...` in engines that support several.
#define KVCACHE_VERSION (KVCACHE_VERSION_MAJOR * 10000 + KVCACHE_VERSION_MINOR * 100 + KVCACHE_VERSION_PATCH)

#define KVCACHE_STRINGIFY_(x) #x
#define KVCACHE_STRINGIFY(x) KVCACHE_STRINGIFY_(x)
/// The version as "major.minor.patch".
#define KVCACHE_VERSION_STRING                                                  \
  KVCACHE_STRINGIFY(KVCACHE_VERSION_MAJOR) "." KVCACHE_STRINGIFY(KVCACHE_VERSION_MINOR) "." \
      KVCACHE_STRINGIFY(KVCACHE_VERSION_PATCH)
