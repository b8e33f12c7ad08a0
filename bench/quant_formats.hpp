// The KV formats the quantized benchmarks measure, host and CUDA alike, and
// what a row of them moves: the pool-side bytes (codes and group entries)
// of every token's K and V, which the memcpy / device-copy reference copies.
#pragma once

#include <kvcache/kernels/detail/common.hpp>

#include <cmath>
#include <new>
#include <vector>

#include "kernel_shapes.hpp"

namespace kvbench {

struct Format {
  const char* name;
  kv::DType dtype;
  kv::SideFormat side;
};
inline const kv::SideFormat kTensor{.scales = kv::Scales::tensor};
inline const Format kFormats[] = {
    {"f16", kv::DType::f16, {}},
    {"fp8_e4m3_tensor", kv::DType::fp8_e4m3, kTensor},
    {"int8_tensor", kv::DType::int8, kTensor},
    {"int8_g32", kv::DType::int8, {.scales = kv::Scales::group, .group = 32}},
    {"fp8_e4m3_g32", kv::DType::fp8_e4m3, {.scales = kv::Scales::group, .group = 32}},
    {"int4_g32_min", kv::DType::int4, {.scales = kv::Scales::group, .group = 32, .minimum = true}},
    {"int4_g32", kv::DType::int4, {.scales = kv::Scales::group, .group = 32}},
    {"fp4_g16", kv::DType::fp4_e2m1, {.scales = kv::Scales::group, .group = 16}},
    {"int2_g32_min", kv::DType::int2, {.scales = kv::Scales::group, .group = 32, .minimum = true}},
};

// The call's per-tensor scale: 1 for fp16 (a raw copy), else one that maps
// the inputs' range (|x| <= 20) onto an int8 code's.
inline float scale(const Format& f) { return f.dtype == kv::DType::f16 ? 1.0f : 20.0f / 127.0f; }

inline kv::Geometry geometry(const Format& f) {
  kv::GeometrySpec s = spec();
  s.dtype = f.dtype;
  s.format = {f.side, f.side};
  return *kv::Geometry::make(s);
}
// Pool-side bytes of one token's K and V, all heads: codes and group entries.
inline std::int64_t pool_bytes_per_token(const kv::Geometry& g) { return 2 * 8 * (g.row_bytes() + g.group_bytes_per_row(0)); }

// Host buffers aligned to cache lines, as engines' pools and tensors are
// (PyTorch's CPU allocator: 64 bytes; pinned and mmap'd memory: pages): a
// launcher streams only rows of whole lines.
template <class T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <class U>
  LineAligned(const LineAligned<U>&) noexcept {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, std::size_t n) noexcept { ::operator delete(p, n * sizeof(T), std::align_val_t{64}); }
  friend bool operator==(const LineAligned&, const LineAligned&) { return true; }
};
using Bytes = std::vector<std::byte, LineAligned<std::byte>>;

// fp16 keys of `tokens` tokens with an outlier channel: every group has a
// real range.
inline Bytes sample_keys(std::int64_t tokens) {
  Bytes k(std::size_t(tokens * kRowBytes));
  for (std::int64_t i = 0; i < tokens * 8 * 128; ++i)
    kv::store_elem(kv::DType::f16, k.data(), i, std::sin(float(i)) * (i % 128 == 3 ? 20.0f : 1.0f));
  return k;
}

}  // namespace kvbench
