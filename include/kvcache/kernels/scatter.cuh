// CUDA launcher of scatter (append). One CTA per (layer, token) item in a
// grid-stride loop; its threads cover (K|V, head) rows x 16-byte lanes.
// num_layers > 1 writes all layers of a decode step in one launch.
#pragma once

#include <cuda_runtime.h>

#include "cuda_launch.cuh"
#include "quant_chunks.cuh"
#include "scatter.hpp"

KVCACHE_BEGIN_NAMESPACE

namespace cuda_detail {
// Item = (layer, token).
struct ScatterRow {
  ScatterParams p;
  __device__ void operator()(std::int64_t item, std::int32_t kv, std::int32_t head, std::int32_t lane,
                             std::int32_t lanes) const {
    scatter_row(p, static_cast<std::int32_t>(item / p.num_tokens), item % p.num_tokens, kv, head, lane, lanes);
  }
};
struct ScatterPtrs {
  ScatterParams p;
  __device__ bool operator()(std::int64_t item, std::int32_t row, std::byte*& dst, const std::byte*& src) const {
    const bool one = p.num_layers == 1;
    const auto layer = one ? 0 : static_cast<std::int32_t>(item / p.num_tokens);
    const std::int64_t token = one ? item : item % p.num_tokens;
    return scatter_ptrs(p, layer, token, row / p.cache.num_kv_heads, row % p.cache.num_kv_heads, dst, src);
  }
};

// Item = (layer, token); lane = chunk. A skipped token skips the whole item,
// so a group's threads always shuffle together.
struct ScatterChunks {
  ScatterParams p;
  EntryRows rows;
  __device__ void operator()(std::int64_t item, std::int32_t kv, std::int32_t head, std::int32_t chunk,
                             std::int32_t) const {
    const bool one = p.num_layers == 1;  // no 64-bit division per thread
    const auto layer = one ? 0 : static_cast<std::int32_t>(item / p.num_tokens);
    const std::int64_t token = one ? item : item % p.num_tokens;
    std::int64_t block = 0;
    std::int32_t offset = 0;
    if (!scatter_slot(p, token, block, offset)) return;
    const std::int32_t cl = p.first_layer + layer;
    store_chunk(p.cache, kv, p.cache.row(block, cl, kv, offset, head), rows.at(p.cache, block, cl, kv, offset, head),
                p.src.row(kv, layer, token, head), p.src.dtype, scatter_mul(p, layer, kv, head), chunk);
  }
};

// Raw moves of 16-byte-aligned rows take the vector path.
inline bool scatter_vectorizable(const ScatterParams& p, std::int32_t rows, std::int32_t vecs) {
  const std::int64_t head_bytes = std::int64_t{p.cache.head_dim} * dtype_bytes(p.cache.dtype);
  const Strides& c = p.cache.strides;
  return !quantized_pool(p.cache) && !p.k_scales && !p.v_scales && raw_move(p.cache.dtype, p.src.dtype, 1.0f / p.k_scale) && raw_move(p.cache.dtype, p.src.dtype, 1.0f / p.v_scale) &&
         aligned16(head_bytes) && aligned16(p.cache.base) && aligned16(p.src.k) &&
         (p.cache.kv_planes == 1 || aligned16(p.src.v)) &&
         aligned16(c.block | c.layer | c.kv | c.token | c.head) &&
         aligned16(p.src.layer_stride | p.src.token_stride | p.src.head_stride) && rows * vecs <= 1024;
}
}  // namespace cuda_detail

/// Returns cudaErrorInvalidValue for a bad shape (checked on the host), else
/// the launch's error. Slots outside the pool are skipped on the device.
inline cudaError_t scatter_cuda(const ScatterParams& p, cudaStream_t stream) {
  if (auto st = check_scatter_shape(p); !st) return cuda_detail::invalid(st);
  if (p.num_tokens == 0) return cudaSuccess;
  const std::int64_t items = std::int64_t{p.num_layers} * p.num_tokens;
  const std::int32_t rows = p.cache.kv_planes * p.cache.num_kv_heads;
  const auto vecs = static_cast<std::int32_t>(std::int64_t{p.cache.head_dim} * dtype_bytes(p.cache.dtype) / 16);
  if (cuda_detail::scatter_vectorizable(p, rows, vecs)) {
    return cuda_detail::launch_vec_copy(cuda_detail::ScatterPtrs{p}, items, rows, vecs, stream);
  }
  if (cuda_detail::chunked_rows(p.cache, p.src.dtype)) {
    return cuda_detail::launch_kv_rows(cuda_detail::ScatterChunks{p, cuda_detail::EntryRows::of(p.cache)}, items, p.cache.num_kv_heads,
                                       p.cache.head_dim / cuda_detail::kChunk, stream, p.cache.kv_planes);
  }
  const std::int32_t lanes = cuda_detail::lanes_for(p.cache.dtype, p.src.dtype, 1.0f / p.k_scale, p.cache.head_dim);
  return cuda_detail::launch_kv_rows(cuda_detail::ScatterRow{p}, items, p.cache.num_kv_heads, lanes, stream,
                                     p.cache.kv_planes);
}

KVCACHE_END_NAMESPACE
