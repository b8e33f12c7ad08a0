// CUDA launcher of gather: one CTA per output row (token) in a grid-stride
// loop; threads cover (K|V, head) rows x lanes.
#pragma once

#include <cuda_runtime.h>

#include "cuda_launch.cuh"
#include "quant_chunks.cuh"
#include "gather.hpp"

KVCACHE_BEGIN_NAMESPACE

namespace cuda_detail {
// Item = output row.
struct GatherRow {
  GatherParams p;
  __device__ void operator()(std::int64_t item, std::int32_t kv, std::int32_t head, std::int32_t lane,
                             std::int32_t lanes) const {
    gather_row(p, gather_seq_of_row(p, item), item, kv, head, lane, lanes);
  }
};
struct GatherPtrs {
  GatherParams p;
  __device__ bool operator()(std::int64_t item, std::int32_t row, std::byte*& dst, const std::byte*& src) const {
    return gather_ptrs(p, gather_seq_of_row(p, item), item, row / p.cache.num_kv_heads, row % p.cache.num_kv_heads,
                       dst, src);
  }
};
// Item = output row; lane = chunk.
struct GatherChunks {
  GatherParams p;
  EntryRows rows;
  __device__ void operator()(std::int64_t item, std::int32_t kv, std::int32_t head, std::int32_t chunk,
                             std::int32_t) const {
    std::int32_t page = 0, offset = 0;
    if (!gather_page(p, gather_seq_of_row(p, item), item, page, offset)) return;
    load_chunk(p.cache, kv, p.cache.row(page, p.layer, kv, offset, head), rows.at(p.cache, page, p.layer, kv, offset, head),
               gather_dst(p, kv, item, head), p.out_dtype, gather_mul(p, kv, head), chunk);
  }
};
inline bool gather_vectorizable(const GatherParams& p, std::int32_t rows, std::int32_t vecs) {
  const std::int64_t head_bytes = std::int64_t{p.cache.head_dim} * dtype_bytes(p.cache.dtype);
  const Strides& c = p.cache.strides;
  return !quantized_pool(p.cache) && !p.k_scales && !p.v_scales && raw_move(p.out_dtype, p.cache.dtype, p.k_scale) && raw_move(p.out_dtype, p.cache.dtype, p.v_scale) &&
         aligned16(head_bytes) && aligned16(p.cache.base) && aligned16(p.k_out) &&
         (p.cache.kv_planes == 1 || aligned16(p.v_out)) &&
         aligned16(c.block | c.layer | c.kv | c.token | c.head) && aligned16(p.token_stride | p.head_stride) &&
         rows * vecs <= 1024;
}
}  // namespace cuda_detail

/// CUDA launcher of gather on `stream`; returns the launch's error, never synchronizes.
inline cudaError_t gather_cuda(const GatherParams& p, cudaStream_t stream) {
  if (auto st = check_gather_shape(p); !st) return cuda_detail::invalid(st);
  if (p.num_rows == 0 || p.num_seqs == 0) return cudaSuccess;
  const std::int32_t rows = p.cache.kv_planes * p.cache.num_kv_heads;
  const auto vecs = static_cast<std::int32_t>(std::int64_t{p.cache.head_dim} * dtype_bytes(p.cache.dtype) / 16);
  if (cuda_detail::gather_vectorizable(p, rows, vecs)) {
    return cuda_detail::launch_vec_copy(cuda_detail::GatherPtrs{p}, p.num_rows, rows, vecs, stream);
  }
  if (cuda_detail::chunked_rows(p.cache, p.out_dtype)) {
    return cuda_detail::launch_kv_rows(cuda_detail::GatherChunks{p, cuda_detail::EntryRows::of(p.cache)}, p.num_rows, p.cache.num_kv_heads,
                                       p.cache.head_dim / cuda_detail::kChunk, stream, p.cache.kv_planes);
  }
  const std::int32_t lanes = cuda_detail::lanes_for(p.out_dtype, p.cache.dtype, p.k_scale, p.cache.head_dim);
  return cuda_detail::launch_kv_rows(cuda_detail::GatherRow{p}, p.num_rows, p.cache.num_kv_heads, lanes, stream,
                                     p.cache.kv_planes);
}

KVCACHE_END_NAMESPACE
