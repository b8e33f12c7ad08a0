// CUDA launcher of page metadata: one CTA per listed page; threads cover
// heads x dims.
#pragma once

#include <cuda_runtime.h>

#include "cuda_launch.cuh"
#include "page_bounds.hpp"

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

KVCACHE_END_NAMESPACE
