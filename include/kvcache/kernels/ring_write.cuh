// CUDA launcher of the ring write with promotion: one CTA per (layer, token).
#pragma once

#include <cuda_runtime.h>

#include "kvcache/kernels/cuda/launch.cuh"
#include "kvcache/kernels/ring_write.hpp"

KVCACHE_BEGIN_NAMESPACE

namespace cuda_detail {
// Item = (layer, token).
struct RingWriteRow {
  RingWriteParams p;
  __device__ void operator()(std::int64_t item, std::int32_t kv, std::int32_t head, std::int32_t lane,
                             std::int32_t lanes) const {
    ring_write_row(p, static_cast<std::int32_t>(item / p.num_tokens), item % p.num_tokens, kv, head, lane, lanes);
  }
};
}  // namespace cuda_detail

/// CUDA launcher of ring_write on `stream`; returns the launch's error, never synchronizes.
inline cudaError_t ring_write_cuda(const RingWriteParams& p, cudaStream_t stream) {
  if (auto st = check_ring_write_shape(p); !st) return cuda_detail::invalid(st);
  if (p.num_tokens == 0) return cudaSuccess;
  const std::int32_t lanes = cuda_detail::lanes_for(p.cache.dtype, p.src.dtype, p.k_scale, p.cache.head_dim);
  return cuda_detail::launch_kv_rows(cuda_detail::RingWriteRow{p}, std::int64_t{p.num_layers} * p.num_tokens,
                                     p.cache.num_kv_heads, lanes, stream, p.cache.kv_planes);
}

KVCACHE_END_NAMESPACE
