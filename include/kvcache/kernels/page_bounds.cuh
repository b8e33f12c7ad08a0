// CUDA launchers of page metadata: one CTA per listed page (recompute) or
// per written token (update); threads cover heads x dims.
#pragma once

#include <cuda_runtime.h>

#include "kvcache/kernels/cuda/launch.cuh"
#include "kvcache/kernels/page_bounds.hpp"

KVCACHE_BEGIN_NAMESPACE

static __global__ void page_bounds_kernel(PageBoundsParams p) {
  const std::int32_t per_page = p.cache.num_kv_heads * p.cache.head_dim;
  for (std::int64_t e = blockIdx.x; e < p.num_pages; e += gridDim.x)
    for (std::int32_t i = threadIdx.x; i < per_page; i += blockDim.x)
      page_bounds_elem(p, static_cast<std::int32_t>(e), i / p.cache.head_dim, i % p.cache.head_dim);
}

/// CUDA launcher of page_bounds on `stream`; returns the launch's error, never synchronizes.
inline cudaError_t page_bounds_cuda(const PageBoundsParams& p, cudaStream_t stream) {
  if (auto st = check_page_bounds_shape(p); !st) return cuda_detail::invalid(st);
  if (p.num_pages == 0) return cudaSuccess;
  page_bounds_kernel<<<cuda_detail::grid_for(p.num_pages), cuda_detail::threads_for(1, p.cache.num_kv_heads * p.cache.head_dim),
                       0, stream>>>(p);
  return cudaGetLastError();
}

namespace cuda_detail {
// Atomic max and min of floats that are never -0 (bounds_math::canonical):
// floats with the sign bit clear order as ints; with it set, in reverse as
// unsigned ints. The bounds start at -FLT_MAX / FLT_MAX, never NaN.
__device__ inline void atomic_max_total(float* at, float v) {
  if ((__float_as_uint(v) >> 31) == 0u)
    atomicMax(reinterpret_cast<int*>(at), __float_as_int(v));
  else
    atomicMin(reinterpret_cast<unsigned int*>(at), __float_as_uint(v));
}
__device__ inline void atomic_min_total(float* at, float v) {
  if ((__float_as_uint(v) >> 31) == 0u)
    atomicMin(reinterpret_cast<int*>(at), __float_as_int(v));
  else
    atomicMax(reinterpret_cast<unsigned int*>(at), __float_as_uint(v));
}

static __global__ void page_bounds_reset_kernel(PageBoundsUpdateParams p) {
  const std::int32_t B = p.cache.block_size, per_page = p.cache.num_kv_heads * 2 * p.cache.head_dim;
  for (std::int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    const std::int32_t slot = p.slots[t];
    if (slot < 0 || slot >= p.cache.num_blocks * B || slot % B != 0) continue;
    float* out = p.bounds + std::int64_t{slot / B} * per_page;
    for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < per_page; i += static_cast<std::int32_t>(blockDim.x))
      out[i] = (i / p.cache.head_dim) % 2 == 0 ? -FLT_MAX : FLT_MAX;
  }
}

static __global__ void page_bounds_fold_kernel(PageBoundsUpdateParams p) {
  const std::int32_t B = p.cache.block_size, H = p.cache.num_kv_heads, D = p.cache.head_dim;
  for (std::int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    const std::int32_t slot = p.slots[t];
    if (slot < 0 || slot >= p.cache.num_blocks * B) continue;  // the host rejects it; the device skips it
    const std::int32_t page = slot / B, off = slot % B;
    for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < H * D; i += static_cast<std::int32_t>(blockDim.x)) {
      const std::int32_t h = i / D, d = i % D;
      const float v = bounds_math::canonical(page_key_elem(p.cache, page, p.layer, off, h, d));
      float* out = p.bounds + (std::int64_t{page} * H + h) * 2 * D;
      atomic_max_total(out + d, v);
      atomic_min_total(out + D + d, v);
    }
  }
}
}  // namespace cuda_detail

/// CUDA launcher of page_bounds_update on `stream` (two launches: fresh pages
/// reset, then the fold); returns the launch's error, never synchronizes.
/// The same floats as the host backend: max and min are exact and the
/// atomics order the floats as bounds_math does.
inline cudaError_t page_bounds_update_cuda(const PageBoundsUpdateParams& p, cudaStream_t stream) {
  if (auto st = check_page_bounds_update_shape(p); !st) return cuda_detail::invalid(st);
  if (p.num_tokens == 0) return cudaSuccess;
  const unsigned threads = cuda_detail::threads_for(1, p.cache.num_kv_heads * p.cache.head_dim);
  if (p.first_slot_starts_page) {
    cuda_detail::page_bounds_reset_kernel<<<cuda_detail::grid_for(p.num_tokens), threads, 0, stream>>>(p);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  }
  cuda_detail::page_bounds_fold_kernel<<<cuda_detail::grid_for(p.num_tokens), threads, 0, stream>>>(p);
  return cudaGetLastError();
}

KVCACHE_END_NAMESPACE
