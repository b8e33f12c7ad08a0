// CUDA launcher of compaction: one CTA per (move, layer); the planner's moves
// never read a slot another move writes, so they run in parallel in place.
#pragma once

#include <cuda_runtime.h>

#include "compaction.hpp"
#include "cuda_launch.cuh"

KVCACHE_BEGIN_NAMESPACE

__global__ void compaction_kernel(CompactionParams p, std::int32_t lanes) {
  const std::int64_t items = std::int64_t{p.num_moves} * p.num_layers;
  const std::int32_t rows = 2 * p.cache.num_kv_heads;
  for (std::int64_t it = blockIdx.x; it < items; it += gridDim.x) {
    const auto move = static_cast<std::int32_t>(it / p.num_layers);
    const auto layer = static_cast<std::int32_t>(it % p.num_layers);
    for (std::int32_t i = threadIdx.x; i < rows * lanes; i += blockDim.x) {
      const std::int32_t row = i / lanes;
      compaction_row(p, move, layer, row / p.cache.num_kv_heads, row % p.cache.num_kv_heads, i % lanes, lanes);
    }
  }
}

inline cudaError_t compaction_cuda(const CompactionParams& p, cudaStream_t stream) {
  if (!p.cache.base || p.num_layers < 1 || p.first_layer < 0 || p.first_layer + p.num_layers > p.cache.num_layers ||
      p.num_moves < 0 || (p.num_moves > 0 && !p.moves))
    return cudaErrorInvalidValue;
  if (p.num_moves == 0) return cudaSuccess;
  const std::int32_t lanes = cuda_detail::lanes_for(p.cache.dtype, p.cache.dtype, 1.0f, p.cache.head_dim);
  compaction_kernel<<<cuda_detail::grid_for(std::int64_t{p.num_moves} * p.num_layers),
                      cuda_detail::threads_for(2 * p.cache.num_kv_heads, lanes), 0, stream>>>(p, lanes);
  return cudaGetLastError();
}

KVCACHE_END_NAMESPACE
