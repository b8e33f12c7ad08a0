// CUDA launcher of ring admission: one warp per kv-head, its lanes across head_dim.
#pragma once

#include <cuda_runtime.h>

#include "kvcache/kernels/cuda/launch.cuh"
#include "kvcache/kernels/ring_admit.hpp"

KVCACHE_BEGIN_NAMESPACE

namespace cuda_detail {
static __global__ void ring_admit_kernel(RingAdmitParams p) {
  ring_admit_head(p, static_cast<std::int32_t>(blockIdx.x), static_cast<std::int32_t>(threadIdx.x),
                  static_cast<std::int32_t>(blockDim.x));
}
}  // namespace cuda_detail

/// CUDA launcher of ring_admit on `stream`; returns the launch's error, never synchronizes.
inline cudaError_t ring_admit_cuda(const RingAdmitParams& p, cudaStream_t stream) {
  if (auto st = check_ring_admit_shape(p); !st) return cuda_detail::invalid(st);
  if (p.num_tokens == 0) return cudaSuccess;
  cuda_detail::ring_admit_kernel<<<static_cast<unsigned>(p.num_heads), 32, 0, stream>>>(p);
  return cudaGetLastError();
}

KVCACHE_END_NAMESPACE
