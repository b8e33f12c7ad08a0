// Launch shape shared by the CUDA launchers: items (tokens, planes, ...) go to
// CTAs in a grid-stride loop; inside a CTA, threads cover rows x lanes, where
// a lane moves one 16-byte vector (raw copies) or one element (conversions).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kvcache/kernels/detail/rows.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace cuda_detail {

// Lanes per row: the row's units (16-byte vectors when the bytes allow it,
// else elements), at most max_lanes.
inline std::int32_t lanes_for(DType dst, DType src, float mul, std::int32_t elems, std::int32_t max_lanes = 32) {
  const std::int64_t bytes = row_bytes(dst, elems);
  const std::int64_t units = raw_move(dst, src, mul) ? (bytes % 16 == 0 ? bytes / 16 : bytes) : elems;
  return static_cast<std::int32_t>(units < 1 ? 1 : (units > max_lanes ? max_lanes : units));
}

inline unsigned threads_for(std::int32_t rows, std::int32_t lanes) {
  const std::int64_t t = std::int64_t{rows} * lanes;
  const std::int64_t warps = (t + 31) / 32;
  return static_cast<unsigned>(warps * 32 > 1024 ? 1024 : (warps * 32 < 64 ? 64 : warps * 32));
}

inline unsigned grid_for(std::int64_t items) {
  constexpr std::int64_t kMaxGrid = 1 << 20;  // grid-stride beyond this
  return static_cast<unsigned>(items < 1 ? 1 : (items > kMaxGrid ? kMaxGrid : items));
}

inline cudaError_t invalid(const Status& st) { return st.ok() ? cudaSuccess : cudaErrorInvalidValue; }

// Buffers of a CUB segmented sort of (float key, int32 value) pairs: the
// pairs in and out, each segment's begin and end, and CUB's temp storage.
struct SortScratch {
  float* keys_in;
  float* keys_out;
  std::int32_t* vals_in;
  std::int32_t* vals_out;
  std::int32_t* begin;
  std::int32_t* end;
  void* cub_temp;
  std::size_t cub_bytes;
};

// Scratch carving: every buffer starts 256-byte aligned (CUB's temp storage too).
inline std::size_t align256(std::size_t n) { return (n + 255) / 256 * 256; }
// Points slots[i] at n consecutive buffers of sizes[i] bytes from `base`, then
// *cub_temp at CUB's temp storage (base nullptr: every pointer null, sizes
// only); returns the total bytes the caller's scratch must hold.
inline std::size_t carve_buffers(void* base, void** const* slots, const std::size_t* sizes, int n, void** cub_temp,
                                 std::size_t cub_bytes) {
  auto* p = static_cast<char*>(base);
  std::size_t total = 0;
  for (int i = 0; i < n; ++i) {
    *slots[i] = p ? p + total : nullptr;
    total += align256(sizes[i]);
  }
  *cub_temp = p ? p + total : nullptr;
  return total + align256(cub_bytes);
}

}  // namespace cuda_detail
KVCACHE_END_NAMESPACE

KVCACHE_BEGIN_NAMESPACE
namespace cuda_detail {

// Raw 16-byte-vector copy of `rows` rows per item, `vecs` vectors per row, one
// vector per thread (blockDim.x == rows * vecs). Each thread first loads its
// vector of U consecutive items, then stores them: U loads in flight instead
// of one. `ptrs(item, row, dst, src)` is the kernel's shared addressing body.
template <int U, class Ptrs>
static __global__ void vec_copy_kernel(Ptrs ptrs, std::int64_t items, std::int32_t vecs) {
  const std::int32_t row = static_cast<std::int32_t>(threadIdx.x) / vecs, v = static_cast<std::int32_t>(threadIdx.x) % vecs;
  for (std::int64_t base = std::int64_t{blockIdx.x} * U; base < items; base += std::int64_t{gridDim.x} * U) {
    Vec16 r[U];
    Vec16* dst[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      dst[u] = nullptr;
      std::byte* d = nullptr;
      const std::byte* s = nullptr;
      if (base + u < items && ptrs(base + u, row, d, s)) {
        dst[u] = reinterpret_cast<Vec16*>(d) + v;
        r[u] = reinterpret_cast<const Vec16*>(s)[v];
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (dst[u]) *dst[u] = r[u];
  }
}

// The generic row loop: CTAs take items (tokens, moves, ...) in a grid-stride
// loop; threads cover (K|V, head) rows x lanes. `row(item, kv, head, lane,
// lanes)` is the kernel's shared body.
template <class Row>
static __global__ void kv_rows_kernel(Row row, std::int64_t items, std::int32_t heads, std::int32_t lanes,
                                      std::int32_t planes) {
  const std::int32_t rows = planes * heads;
  for (std::int64_t it = blockIdx.x; it < items; it += gridDim.x)
    for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < rows * lanes; i += static_cast<std::int32_t>(blockDim.x)) {
      const std::int32_t r = i / lanes;
      row(it, r / heads, r % heads, i % lanes, lanes);
    }
}

template <class Row>
inline cudaError_t launch_kv_rows(const Row& row, std::int64_t items, std::int32_t heads, std::int32_t lanes,
                                  cudaStream_t stream, std::int32_t planes = 2) {
  kv_rows_kernel<<<grid_for(items), threads_for(planes * heads, lanes), 0, stream>>>(row, items, heads, lanes, planes);
  return cudaGetLastError();
}

// Small batches (decode) want every item in its own CTA for parallelism;
// large ones (prefill) want loads in flight.
template <class Ptrs>
inline cudaError_t launch_vec_copy(const Ptrs& ptrs, std::int64_t items, std::int32_t rows, std::int32_t vecs,
                                   cudaStream_t stream) {
  const auto threads = static_cast<unsigned>(rows * vecs);
  if (items < 4096) vec_copy_kernel<1><<<grid_for(items), threads, 0, stream>>>(ptrs, items, vecs);
  else vec_copy_kernel<4><<<grid_for((items + 3) / 4), threads, 0, stream>>>(ptrs, items, vecs);
  return cudaGetLastError();
}

inline bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }
inline bool aligned16(std::int64_t x) { return (x & 15) == 0; }

}  // namespace cuda_detail
KVCACHE_END_NAMESPACE
