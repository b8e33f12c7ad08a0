// CUDA launcher of block copy: one CTA per (pair, layer, K|V) plane. With a
// pool in pinned, mapped host memory it is the batched device<->host swap.
#pragma once

#include <cuda_runtime.h>

#include "kvcache/kernels/block_copy.hpp"
#include "kvcache/kernels/cuda/launch.cuh"

KVCACHE_BEGIN_NAMESPACE

static __global__ void block_copy_kernel(BlockCopyParams p) {
  const std::int32_t planes = p.src.kv_planes;
  const std::int32_t layers = block_copy_layer_end(p) - p.first_layer;
  const std::int64_t items = std::int64_t{p.num_pairs} * layers * planes;
  for (std::int64_t it = blockIdx.x; it < items; it += gridDim.x) {
    const auto kv = static_cast<std::int32_t>(it % planes);
    const auto layer = p.first_layer + static_cast<std::int32_t>((it / planes) % layers);
    const auto pair = static_cast<std::int32_t>(it / (planes * std::int64_t{layers}));
    copy_plane(p, pair, layer, kv, static_cast<std::int32_t>(threadIdx.x), static_cast<std::int32_t>(blockDim.x));
  }
}

/// CUDA launcher of block_copy on `stream`; returns the launch's error, never synchronizes.
inline cudaError_t block_copy_cuda(const BlockCopyParams& p, cudaStream_t stream) {
  if (auto st = check_block_copy_shape(p); !st) return cuda_detail::invalid(st);
  if (p.num_pairs == 0) return cudaSuccess;
  const std::int32_t lanes = cuda_detail::lanes_for(DType::int8, DType::int8, 1.0f, plane_run_bytes(p.src), 256);
  const std::int64_t layers = block_copy_layer_end(p) - p.first_layer;
  block_copy_kernel<<<cuda_detail::grid_for(std::int64_t{p.num_pairs} * layers * p.src.kv_planes),
                      cuda_detail::threads_for(1, lanes), 0, stream>>>(p);
  return cudaGetLastError();
}

KVCACHE_END_NAMESPACE
