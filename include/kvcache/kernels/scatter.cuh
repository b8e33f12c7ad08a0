// CUDA launcher of scatter (append). Raw moves: one CTA per (layer, token)
// item in a grid-stride loop, its threads covering (K|V, head) rows x
// 16-byte lanes; quantized rows of 8-element chunks: chunk_rows_kernel
// (kernels/cuda/quant_chunks.cuh).
// num_layers > 1 writes all layers of a decode step in one launch.
#pragma once

#include <cuda_runtime.h>

#include "kvcache/kernels/cuda/launch.cuh"
#include "kvcache/kernels/cuda/quant_chunks.cuh"
#include "kvcache/kernels/scatter.hpp"

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
// so a group's threads always shuffle together. Th: the thread's source
// chunk, code row and entry row at layer 0, token 0 (block 0), and its
// scale at layer 0 (scatter_div); an item adds its layer, token and slot.
template <bool Aligned>
struct ScatterChunks {
  ScatterParams p;
  EntryRows rows;
  struct Th {
    const std::byte* src;
    std::byte* codes;
    std::byte* entries;  // null without group scales
    std::int64_t entry_token;  // entry bytes a token apart
    float div;
    std::int32_t kv, head, chunk;
  };
  __device__ Th thread(std::int32_t kv, std::int32_t head, std::int32_t chunk) const {
    return {p.src.row(kv, 0, 0, head) + row_bytes(p.src.dtype, std::int64_t{chunk} * kChunk),
            p.cache.row(0, p.first_layer, kv, 0, head),
            rows.at(p.cache, 0, p.first_layer, kv, 0, head),
            rows.token * row_entry_bytes(p.cache, kv),
            scatter_div(p, 0, kv, head),
            kv,
            head,
            chunk};
  }
  __device__ DType code() const { return p.cache.dtype; }
  template <DType C>
  __device__ void item(const Th& th, std::int64_t item) const {
    const bool one = p.num_layers == 1;  // no 64-bit division, no scale, per item
    const auto layer = one ? 0 : static_cast<std::int32_t>(item / p.num_tokens);
    const std::int64_t token = one ? item : item % p.num_tokens;
    std::int64_t block = 0;
    std::int32_t offset = 0;
    if (!scatter_slot(p, token, block, offset)) return;
    const Strides& s = p.cache.strides;
    const std::int64_t at = block * s.block + std::int64_t{layer} * s.layer;
    float x[kChunk];
    read_chunk<Aligned>(th.src + layer * p.src.layer_stride + token * p.src.token_stride, p.src.dtype,
                        one ? th.div : scatter_div(p, layer, th.kv, th.head), x);
    quantize_chunk_as<C, Aligned>(p.cache, th.kv, th.codes + at + std::int64_t{offset} * s.token,
                                  th.entries ? th.entries + at + offset * th.entry_token : nullptr, x, th.chunk);
  }
  __device__ void operator()(std::int64_t it, std::int32_t kv, std::int32_t head, std::int32_t chunk, std::int32_t) const {
    chunk_row_item(*this, it, kv, head, chunk);
  }
};

// The chunked path's Aligned moves: 16-byte caller chunks, pool chunks at multiples of their size.
inline bool scatter_chunks_aligned(const ScatterParams& p) {
  return chunks_aligned(p.cache) && aligned16(p.src.k) && (p.cache.kv_planes == 1 || aligned16(p.src.v)) &&
         aligned16(p.src.layer_stride | p.src.token_stride | p.src.head_stride);
}

// Raw moves of 16-byte-aligned rows take the vector path.
inline bool scatter_vectorizable(const ScatterParams& p, std::int32_t rows, std::int32_t vecs) {
  const std::int64_t head_bytes = std::int64_t{p.cache.head_dim} * dtype_bytes(p.cache.dtype);
  const Strides& c = p.cache.strides;
  return !quantized_pool(p.cache) && !p.k_scales && !p.v_scales && raw_move(p.cache.dtype, p.src.dtype, p.k_scale) && raw_move(p.cache.dtype, p.src.dtype, p.v_scale) &&
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
    const cuda_detail::EntryRows er = cuda_detail::EntryRows::of(p.cache);
    return cuda_detail::launch_chunk_rows(cuda_detail::ScatterChunks<true>{p, er}, cuda_detail::ScatterChunks<false>{p, er},
                                          cuda_detail::scatter_chunks_aligned(p), items, p.cache.num_kv_heads,
                                          p.cache.head_dim / cuda_detail::kChunk, p.cache.kv_planes, stream);
  }
  const std::int32_t lanes = cuda_detail::lanes_for(p.cache.dtype, p.src.dtype, p.k_scale, p.cache.head_dim);
  return cuda_detail::launch_kv_rows(cuda_detail::ScatterRow{p}, items, p.cache.num_kv_heads, lanes, stream,
                                     p.cache.kv_planes);
}

KVCACHE_END_NAMESPACE
