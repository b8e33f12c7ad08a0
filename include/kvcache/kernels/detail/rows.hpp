// The row mover every data-moving kernel shares: a row copied or converted
// between dtypes and scales, by one thread (the host launchers: whole rows
// through the host's vector loops, kernels/host/fast_path.hpp) or split among
// cooperating CUDA threads. The one body here that reaches the host backend,
// with quant.hpp's and quant_rows.hpp's group loops.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvcache/config.hpp"
#include "kvcache/kernels/detail/common.hpp"
#include "kvcache/kernels/host/fast_path.hpp"

KVCACHE_BEGIN_NAMESPACE

/// How a row moves: raw bytes (same dtype, no scaling) in 16-byte vectors when
/// aligned, else element by element through float (dtype change or scale).
struct alignas(16) Vec16 {
  /// The 128 bits, least significant word first.
  std::uint32_t w[4];
};

/// True when a row can move as raw bytes (same type, no scaling).
KVCACHE_HOST_DEVICE inline bool raw_move(DType dst, DType src, float mul) noexcept { return dst == src && mul == 1.0f; }

/// Host copy of a row run. Fixed-size chunks compile to inline vector moves;
/// a library memcpy of >= 2 KiB switches to `rep movsb`, which runs several
/// times slower when source and destination share page offsets (4K aliasing),
/// as paged pools and token-strided inputs often do.
inline void host_copy(void* dst, const void* src, std::size_t n) noexcept {
  auto* d = static_cast<std::byte*>(dst);
  const auto* s = static_cast<const std::byte*>(src);
  for (; n >= 256; n -= 256, d += 256, s += 256) std::memcpy(d, s, 256);
  for (; n >= 16; n -= 16, d += 16, s += 16) std::memcpy(d, s, 16);
  if (n) std::memcpy(d, s, n);
}

/// dst[i] = convert(src[i] * mul) for the row's n elements (divide:
/// convert(src[i] / mul), a write's engine-held scale); lane/nlanes split
/// the row among cooperating threads (host: 0/1). A raw move goes by 16-byte
/// vectors when aligned; `by_elements` forces element units instead, so a
/// kernel that rewrites a row it just read can give both passes the same
/// partition (no lane then reads bytes another lane writes). `stream`: the
/// host stores whole-line rows non-temporally (kStreamBytes).
KVCACHE_HOST_DEVICE inline void move_row(void* dst, DType dt, const void* src, DType st, std::int32_t n, float mul,
                                         std::int32_t lane, std::int32_t nlanes, bool by_elements = false,
                                         bool stream = false, bool divide = false) noexcept {
  const bool raw = raw_move(dt, st, mul);
  if (raw && !by_elements) {
    const std::int64_t bytes = std::int64_t{n} * dtype_bytes(dt);
#if !defined(__CUDA_ARCH__)
    if (nlanes == 1) {
      if (stream && fast_stream_copy(dst, src, bytes)) return;
      host_copy(dst, src, static_cast<std::size_t>(bytes));
      return;
    }
#endif
    if (((reinterpret_cast<std::uintptr_t>(dst) | reinterpret_cast<std::uintptr_t>(src) |
          static_cast<std::uintptr_t>(bytes)) & 15u) == 0) {
      for (std::int64_t i = lane; i < bytes / 16; i += nlanes)
        static_cast<Vec16*>(dst)[i] = static_cast<const Vec16*>(src)[i];
    } else {
      for (std::int64_t i = lane; i < bytes; i += nlanes)
        static_cast<std::byte*>(dst)[i] = static_cast<const std::byte*>(src)[i];
    }
    return;
  }
  if (raw) {
    const std::int64_t eb = dtype_bytes(dt);
    for (std::int32_t i = lane; i < n; i += nlanes)
      for (std::int64_t b = 0; b < eb; ++b)
        static_cast<std::byte*>(dst)[i * eb + b] = static_cast<const std::byte*>(src)[i * eb + b];
    return;
  }
  if (nlanes == 1) {  // one thread: a head row at a time through a float buffer, each type's switch once
    const std::int32_t done = fast_rows(dst, dt, src, st, n, mul, stream, divide);
    float buf[256];
    for (std::int32_t at = done; at < n; at += 256) {
      const std::int32_t m = n - at < 256 ? n - at : 256;
      load_row(st, static_cast<const std::byte*>(src) + row_bytes(st, at), buf, m);
      if (divide) store_row_divided(dt, static_cast<std::byte*>(dst) + row_bytes(dt, at), buf, mul, m);
      else store_row(dt, static_cast<std::byte*>(dst) + row_bytes(dt, at), buf, mul, m);
    }
    return;
  }
  for (std::int32_t i = lane; i < n; i += nlanes) {
    const float x = load_elem(st, src, i);
    store_elem(dt, dst, i, divide ? x / mul : x * mul);
  }
}

KVCACHE_END_NAMESPACE
