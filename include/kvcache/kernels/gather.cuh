// CUDA launcher of gather: one CTA per output row (token) in a grid-stride
// loop, threads covering (K|V, head) rows x lanes; quantized rows of
// 8-element chunks: chunk_rows_kernel (kernels/cuda/quant_chunks.cuh).
#pragma once

#include <cuda_runtime.h>

#include "kvcache/kernels/cuda/launch.cuh"
#include "kvcache/kernels/cuda/quant_chunks.cuh"
#include "kvcache/kernels/gather.hpp"

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
// Item = output row; lane = chunk. Th: the thread's output chunk of row
// 0, code row and entry row of block 0, token 0, and its multiplier.
template <bool Aligned>
struct GatherChunks {
  GatherParams p;
  EntryRows rows;
  struct Th {
    std::byte* out;
    const std::byte* codes;
    const std::byte* entries;  // null without group scales
    std::int64_t entry_token;  // entry bytes a token apart
    float mul;
    std::int32_t kv, chunk;
  };
  __device__ Th thread(std::int32_t kv, std::int32_t head, std::int32_t chunk) const {
    return {gather_dst(p, kv, 0, head) + row_bytes(p.out_dtype, std::int64_t{chunk} * kChunk),
            p.cache.row(0, p.layer, kv, 0, head),
            rows.at(p.cache, 0, p.layer, kv, 0, head),
            rows.token * row_entry_bytes(p.cache, kv),
            gather_mul(p, kv, head),
            kv,
            chunk};
  }
  __device__ DType code() const { return p.cache.dtype; }
  template <DType C>
  __device__ void item(const Th& th, std::int64_t item) const {
    std::int32_t page = 0, offset = 0;
    if (!gather_page(p, gather_seq_of_row(p, item), item, page, offset)) return;
    const std::int64_t at = std::int64_t{page} * p.cache.strides.block;
    float x[kChunk];
    dequantize_chunk_as<C, Aligned>(p.cache, th.kv, th.codes + at + std::int64_t{offset} * p.cache.strides.token,
                                    th.entries ? th.entries + at + offset * th.entry_token : nullptr, th.chunk, x);
    write_chunk<Aligned>(th.out + item * p.token_stride, p.out_dtype, th.mul, x);
  }
  __device__ void operator()(std::int64_t it, std::int32_t kv, std::int32_t head, std::int32_t chunk, std::int32_t) const {
    chunk_row_item(*this, it, kv, head, chunk);
  }
};
inline bool gather_chunks_aligned(const GatherParams& p) {
  return p.cache.num_blocks > 0 && chunks_aligned(p.cache) && aligned16(p.k_out) &&
         (p.cache.kv_planes == 1 || aligned16(p.v_out)) && aligned16(p.token_stride | p.head_stride);
}
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
    const cuda_detail::EntryRows er = cuda_detail::EntryRows::of(p.cache);
    return cuda_detail::launch_chunk_rows(cuda_detail::GatherChunks<true>{p, er}, cuda_detail::GatherChunks<false>{p, er},
                                          cuda_detail::gather_chunks_aligned(p), p.num_rows, p.cache.num_kv_heads,
                                          p.cache.head_dim / cuda_detail::kChunk, p.cache.kv_planes, stream);
  }
  const std::int32_t lanes = cuda_detail::lanes_for(p.out_dtype, p.cache.dtype, p.k_scale, p.cache.head_dim);
  return cuda_detail::launch_kv_rows(cuda_detail::GatherRow{p}, p.num_rows, p.cache.num_kv_heads, lanes, stream,
                                     p.cache.kv_planes);
}

KVCACHE_END_NAMESPACE
