// CUDA launcher of seal_blocks: one CTA per (block, layer, token) item in a
// grid-stride loop, threads covering (K|V, head) rows x lanes (seal_item).
#pragma once

#include <cuda_runtime.h>

#include "kvcache/kernels/cuda/launch.cuh"
#include "kvcache/kernels/seal.hpp"

KVCACHE_BEGIN_NAMESPACE

namespace cuda_detail {
struct SealRow {
  SealParams p;
  __device__ void operator()(std::int64_t item, std::int32_t kv, std::int32_t head, std::int32_t lane,
                             std::int32_t lanes) const {
    seal_item(p, item, kv, head, lane, lanes);
  }
};
}  // namespace cuda_detail

/// CUDA launcher of seal_blocks on `stream`: cudaErrorInvalidValue for a bad
/// shape (checked on the host), else the launch's error; never synchronizes.
/// The block list is device memory and not checked: a block outside the
/// pool, or one given twice, is the caller's error.
inline cudaError_t seal_blocks_cuda(const SealParams& p, cudaStream_t stream) {
  if (auto st = check_seal_shape(p); !st) return cuda_detail::invalid(st);
  if (p.num_blocks == 0) return cudaSuccess;
  const std::int32_t lanes = cuda_detail::lanes_for(p.cache.dtype, p.src.dtype, p.k_scale, p.cache.head_dim);
  return cuda_detail::launch_kv_rows(cuda_detail::SealRow{p}, seal_items(p), p.cache.num_kv_heads, lanes, stream,
                                     p.cache.kv_planes);
}

KVCACHE_END_NAMESPACE
