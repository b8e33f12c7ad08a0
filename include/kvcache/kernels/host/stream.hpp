// The memory traffic of the host's large row moves: non-temporal
// ("streaming") stores for the writes, prefetch for the reads. A
// cached store first reads its 64-byte line in; a streamed one writes the
// line to memory past the caches. For a call that writes more than a core's
// share of the last-level cache, the first rows are evicted before it ends
// anyway, so caching them buys nothing, while the line reads add a third
// more traffic to a quantizing scatter (fp16 in, int8 out) and two thirds
// more to a dequantizing gather.
// glibc's memcpy makes the same choice at its own threshold. Only whole,
// line-aligned lines stream: a partial line written past the cache costs a
// read-modify-write in memory. Streamed stores are weakly ordered, so a
// launcher fences once its rows are written (stream_fence).
#pragma once

#include <cstdint>

#include "kvcache/kernels/host/cpu.hpp"
#include "kvcache/config.hpp"
#include "kvcache/core/kv_format.hpp"

KVCACHE_BEGIN_NAMESPACE

namespace simd {
#if KVCACHE_HOST_SIMD
namespace avx2 {
/// 32 bytes at p: non-temporal with Stream (p 32-byte aligned), else an
/// unaligned cached store. Every whole 32-byte row store goes through here.
template <bool Stream>
KVCACHE_AVX2_INLINE inline void put32(std::byte* p, __m256i v) noexcept {
  if constexpr (Stream) _mm256_stream_si256(reinterpret_cast<__m256i*>(p), v);
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
}
KVCACHE_AVX2 inline void stream_copy(std::byte* dst, const std::byte* src, std::int64_t bytes) noexcept {
  for (std::int64_t i = 0; i < bytes; i += 64) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    put32<true>(dst + i, a);
    put32<true>(dst + i + 32, b);
  }
}
}  // namespace avx2

/// True when a row of n8 elements of dt at dst is whole 64-byte lines that
/// the 32-element stores cover (n8 a multiple of 32): the rows that stream.
inline bool streams_whole_lines(const void* dst, DType dt, std::int32_t n8) noexcept {
  return (reinterpret_cast<std::uintptr_t>(dst) & 63u) == 0 && n8 % 32 == 0 && row_bytes(dt, n8) % 64 == 0;
}
/// Copies a row of whole 64-byte lines at dst with non-temporal stores;
/// false (nothing copied) when dst is not such a row or the CPU lacks AVX2.
inline bool stream_copy(void* dst, const void* src, std::int64_t bytes) noexcept {
  if ((reinterpret_cast<std::uintptr_t>(dst) & 63u) != 0 || bytes % 64 != 0 || !available()) return false;
  avx2::stream_copy(static_cast<std::byte*>(dst), static_cast<const std::byte*>(src), bytes);
  return true;
}
/// Orders this thread's non-temporal stores before what it does next (an
/// unlock, a flag another thread reads): once after a call's streamed rows.
inline void stream_fence() noexcept { _mm_sfence(); }
#else
inline bool stream_copy(void*, const void*, std::int64_t) noexcept { return false; }
inline void stream_fence() noexcept {}
#endif
}  // namespace simd

KVCACHE_END_NAMESPACE
