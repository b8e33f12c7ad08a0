// CUDA launcher of RoPE re-rotation: one CTA per (entry, layer, token);
// threads cover heads x rotation pairs. Entries outside the pool or beyond
// the table are skipped on the device (rope_host reports them).
#pragma once

#include <cuda_runtime.h>

#include "kvcache/kernels/cuda/launch.cuh"
#include "kvcache/kernels/rope.hpp"

KVCACHE_BEGIN_NAMESPACE

static __global__ void rope_kernel(RopeParams p, std::int32_t lanes) {
  const std::int64_t per_entry = std::int64_t{p.num_layers} * p.cache.block_size;
  const std::int64_t items = std::int64_t{p.num_entries} * per_entry;
  for (std::int64_t it = blockIdx.x; it < items; it += gridDim.x) {
    const auto entry = static_cast<std::int32_t>(it / per_entry);
    const auto layer = static_cast<std::int32_t>((it % per_entry) / p.cache.block_size);
    const auto token = static_cast<std::int32_t>(it % p.cache.block_size);
    for (std::int32_t i = threadIdx.x; i < p.cache.num_kv_heads * lanes; i += blockDim.x)
      rope_row(p, entry, layer, token, i / lanes, i % lanes, lanes);
  }
}

/// CUDA launcher of rope on `stream`; returns the launch's error, never synchronizes.
inline cudaError_t rope_cuda(const RopeParams& p, cudaStream_t stream) {
  if (auto st = check_rope_shape(p); !st) return cuda_detail::invalid(st);
  if (p.num_entries == 0) return cudaSuccess;
  const std::int32_t half = rope_dims(p) / 2, lanes = half < 32 ? half : 32;
  rope_kernel<<<cuda_detail::grid_for(std::int64_t{p.num_entries} * p.num_layers * p.cache.block_size),
                cuda_detail::threads_for(p.cache.num_kv_heads, lanes), 0, stream>>>(p, lanes);
  return cudaGetLastError();
}

KVCACHE_END_NAMESPACE
