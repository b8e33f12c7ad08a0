// CUDA launcher of compaction: one CTA per (move, layer); the planner's moves
// never read a slot another move writes, so they run in parallel in place.
#pragma once

#include <cuda_runtime.h>

#include "kvcache/kernels/compaction.hpp"
#include "kvcache/kernels/cuda/launch.cuh"

KVCACHE_BEGIN_NAMESPACE

namespace cuda_detail {
// Item = (move, layer).
struct CompactionRow {
  CompactionParams p;
  __device__ void operator()(std::int64_t item, std::int32_t kv, std::int32_t head, std::int32_t lane,
                             std::int32_t lanes) const {
    compaction_row(p, static_cast<std::int32_t>(item / p.num_layers), static_cast<std::int32_t>(item % p.num_layers), kv,
                   head, lane, lanes);
  }
};
}  // namespace cuda_detail

/// CUDA launcher of compaction on `stream`; returns the launch's error, never synchronizes.
inline cudaError_t compaction_cuda(const CompactionParams& p, cudaStream_t stream) {
  if (auto st = check_compaction_shape(p); !st) return cuda_detail::invalid(st);
  if (p.num_moves == 0) return cudaSuccess;
  const std::int32_t lanes = cuda_detail::lanes_for(p.cache.dtype, p.cache.dtype, 1.0f, p.cache.head_dim);
  return cuda_detail::launch_kv_rows(cuda_detail::CompactionRow{p}, std::int64_t{p.num_moves} * p.num_layers,
                                     static_cast<std::int32_t>(heads_of(p)), lanes, stream, p.cache.kv_planes);
}

KVCACHE_END_NAMESPACE
