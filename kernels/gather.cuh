// CUDA launcher of gather: one CTA per output row (token) in a grid-stride
// loop; threads cover (K|V, head) rows x lanes.
#pragma once

#include <cuda_runtime.h>

#include "cuda_launch.cuh"
#include "gather.hpp"

KVCACHE_BEGIN_NAMESPACE

__global__ void gather_kernel(GatherParams p, std::int32_t lanes) {
  const std::int32_t rows = 2 * p.cache.num_kv_heads;
  for (std::int64_t r = blockIdx.x; r < p.num_rows; r += gridDim.x) {
    const std::int32_t seq = gather_seq_of_row(p, r);
    for (std::int32_t i = threadIdx.x; i < rows * lanes; i += blockDim.x) {
      const std::int32_t row = i / lanes;
      gather_row(p, seq, r, row / p.cache.num_kv_heads, row % p.cache.num_kv_heads, i % lanes, lanes);
    }
  }
}

inline cudaError_t gather_cuda(const GatherParams& p, cudaStream_t stream) {
  if (auto st = check_gather_shape(p); !st) return cuda_detail::invalid(st);
  if (p.num_rows == 0 || p.num_seqs == 0) return cudaSuccess;
  const std::int32_t lanes = cuda_detail::lanes_for(p.out_dtype, p.cache.dtype, p.k_scale, p.cache.head_dim);
  gather_kernel<<<cuda_detail::grid_for(p.num_rows), cuda_detail::threads_for(2 * p.cache.num_kv_heads, lanes), 0,
                  stream>>>(p, lanes);
  return cudaGetLastError();
}

KVCACHE_END_NAMESPACE
