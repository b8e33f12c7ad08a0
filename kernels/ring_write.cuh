// CUDA launcher of the ring write with promotion: one CTA per (layer, token).
#pragma once

#include <cuda_runtime.h>

#include "cuda_launch.cuh"
#include "ring_write.hpp"

KVCACHE_BEGIN_NAMESPACE

__global__ void ring_write_kernel(RingWriteParams p, std::int32_t lanes) {
  const std::int64_t items = std::int64_t{p.num_layers} * p.num_tokens;
  const std::int32_t rows = 2 * p.cache.num_kv_heads;
  for (std::int64_t it = blockIdx.x; it < items; it += gridDim.x) {
    const auto layer = static_cast<std::int32_t>(it / p.num_tokens);
    const std::int64_t token = it % p.num_tokens;
    for (std::int32_t i = threadIdx.x; i < rows * lanes; i += blockDim.x) {
      const std::int32_t row = i / lanes;
      ring_write_row(p, layer, token, row / p.cache.num_kv_heads, row % p.cache.num_kv_heads, i % lanes, lanes);
    }
  }
}

inline cudaError_t ring_write_cuda(const RingWriteParams& p, cudaStream_t stream) {
  ScatterParams shape{p.cache, p.src, TokenAddress{p.ring_slots}, p.num_tokens, p.first_layer, p.num_layers,
                      p.k_scale, p.v_scale};
  if (auto st = check_scatter_shape(shape); !st) return cuda_detail::invalid(st);
  if (p.num_tokens == 0) return cudaSuccess;
  if (!p.ring_slots) return cudaErrorInvalidValue;
  const std::int32_t lanes = cuda_detail::lanes_for(p.cache.dtype, p.src.dtype, 1.0f / p.k_scale, p.cache.head_dim);
  ring_write_kernel<<<cuda_detail::grid_for(std::int64_t{p.num_layers} * p.num_tokens),
                      cuda_detail::threads_for(2 * p.cache.num_kv_heads, lanes), 0, stream>>>(p, lanes);
  return cudaGetLastError();
}

KVCACHE_END_NAMESPACE
