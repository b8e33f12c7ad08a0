// CUDA launcher of the write gate: one CTA per (token, kv-head). Threads
// normalize the two keys into shared memory, each thread computes hidden
// units (same input order as the host), warp 0 sums the 32 strided partials,
// lane 0 finishes: the host backend's operations in the host's order.
#pragma once

#include <cuda_runtime.h>

#include "kvcache/kernels/cuda/launch.cuh"
#include "kvcache/kernels/write_gate.hpp"

KVCACHE_BEGIN_NAMESPACE

namespace cuda_detail {
static __global__ void write_gate_kernel(WriteGateParams p) {
  extern __shared__ float smem[];  // z[2 * head_dim], a[hidden], partials[32]
  const auto& w = p.w;
  float* z = smem;
  float* a = z + 2 * w.head_dim;
  float* partials = a + w.hidden;
  const std::int64_t items = p.num_tokens * w.num_kv_heads;
  for (std::int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const std::int64_t t = item / w.num_kv_heads;
    const auto h = static_cast<std::int32_t>(item % w.num_kv_heads);
    if (threadIdx.x == 0) gate_norm(gate_key(p, p.k_pre, t, h), p.dtype, w.norm_pre, w.head_dim, w.norm_eps, z);
    if (threadIdx.x == 32)  // the second key on another warp (blocks have at least 64 threads)
      gate_norm(gate_key(p, p.k_post, t, h), p.dtype, w.norm_post, w.head_dim, w.norm_eps, z + w.head_dim);
    __syncthreads();
    for (std::int32_t j = static_cast<std::int32_t>(threadIdx.x); j < w.hidden; j += static_cast<std::int32_t>(blockDim.x))
      a[j] = gate_math::activate(gate_hidden(w, h, j, z), w.activation);
    __syncthreads();
    if (threadIdx.x < gate_math::kPartials) partials[threadIdx.x] = gate_partial(w, h, static_cast<std::int32_t>(threadIdx.x), a);
    __syncthreads();
    if (threadIdx.x == 0) p.gates[item] = gate_finish(w, h, partials);
    __syncthreads();
  }
}
}  // namespace cuda_detail

/// Shared memory one CTA of write_gate_cuda uses, in bytes.
inline std::size_t write_gate_smem_bytes(const WriteGateWeights& w) noexcept {
  return sizeof(float) * (std::size_t(2) * std::size_t(w.head_dim) + std::size_t(w.hidden) + gate_math::kPartials);
}

/// CUDA launcher of write_gate on `stream`; returns the launch's error, never synchronizes.
/// A CTA holds 2 x head_dim + hidden + 32 floats in shared memory: shapes past
/// 48 KiB (write_gate_smem_bytes) return cudaErrorInvalidValue.
inline cudaError_t write_gate_cuda(const WriteGateParams& p, cudaStream_t stream) {
  if (auto st = check_write_gate_shape(p); !st) return cuda_detail::invalid(st);
  if (p.num_tokens == 0) return cudaSuccess;
  const std::size_t smem = write_gate_smem_bytes(p.w);
  if (smem > 48 * 1024) return cudaErrorInvalidValue;  // past the default dynamic limit
  const std::int64_t items = p.num_tokens * p.w.num_kv_heads;
  const unsigned threads = p.w.hidden >= 256 ? 256u : (p.w.hidden > 64 ? 128u : 64u);
  cuda_detail::write_gate_kernel<<<cuda_detail::grid_for(items), threads, smem, stream>>>(p);
  return cudaGetLastError();
}

KVCACHE_END_NAMESPACE
