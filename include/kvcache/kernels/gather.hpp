// Gather: paged K/V of a batch into dense, contiguous ragged rows (output
// indptr), for engines whose attention wants dense K/V.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvcache/kernels/detail/common.hpp"
#include "kvcache/kernels/detail/quant_rows.hpp"
#include "kvcache/kernels/detail/rows.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Parameters of gather: a batch's paged K/V into dense ragged rows.
struct GatherParams {
  PoolView cache{};  ///< The pool.
  std::int32_t layer = 0;  ///< Layer read.
  const std::int32_t* indptr = nullptr;  ///< CSR page table of the batch
  const std::int32_t* indices = nullptr;  ///< CSR page indices.
  const std::int32_t* out_indptr = nullptr;  ///< [num_seqs + 1]: rows of sequence b are out_indptr[b] .. [b+1)
  std::int32_t num_seqs = 0;  ///< Sequences in the batch.
  std::int64_t num_rows = 0;  ///< out_indptr[num_seqs]
  void* k_out = nullptr;  ///< K output.
  void* v_out = nullptr;  ///< V output.
  DType out_dtype = DType::f16;  ///< Output element type.
  std::int64_t token_stride = 0;  ///< Output bytes between tokens.
  std::int64_t head_stride = 0;  ///< output strides in bytes
  float k_scale = 1.0f;  ///< K output = cache x k_scale.
  float v_scale = 1.0f;  ///< output = cache * scale (fp8 dequant)
  /// Engine-held scales of format.k (tensor: [cache layers]; head: [cache
  /// layers][kv_heads]), times k_scale; null: none. Memory the backend reads.
  const float* k_scales = nullptr;
  const float* v_scales = nullptr;  ///< The same for format.v.
};
static_assert(std::is_trivially_copyable_v<GatherParams>);

/// The (page, offset) output row `row` of sequence `seq` reads; false when
/// the row is outside the sequence's pages.
KVCACHE_HOST_DEVICE inline bool gather_page(const GatherParams& p, std::int32_t seq, std::int64_t row, std::int32_t& page,
                                            std::int32_t& offset) noexcept {
  // Positions are int32 (a sequence's rows are int32-indexed): 32-bit division.
  const auto pos = static_cast<std::uint32_t>(row - p.out_indptr[seq]), b = static_cast<std::uint32_t>(p.cache.block_size);
  const std::int64_t page_slot = p.indptr[seq] + std::int64_t{pos / b};
  if (page_slot >= p.indptr[seq + 1]) return false;  // more rows than pages: nothing to read
  page = p.indices[page_slot];
  offset = static_cast<std::int32_t>(pos % b);
  return page >= 0 && page < p.cache.num_blocks;
}

/// Output row `row`'s head `head` on side kv.
KVCACHE_HOST_DEVICE inline std::byte* gather_dst(const GatherParams& p, std::int32_t kv, std::int64_t row, std::int32_t head) noexcept {
  return static_cast<std::byte*>(kv == 0 ? p.k_out : p.v_out) + row * p.token_stride + head * p.head_stride;
}

/// Source and destination of one (sequence, row, K|V, head); false when the row is outside the sequence's pages.
KVCACHE_HOST_DEVICE inline bool gather_ptrs(const GatherParams& p, std::int32_t seq, std::int64_t row, std::int32_t kv,
                                            std::int32_t head, std::byte*& dst, const std::byte*& src) noexcept {
  std::int32_t page = 0, offset = 0;
  if (!gather_page(p, seq, row, page, offset)) return false;
  dst = gather_dst(p, kv, row, head);
  src = p.cache.row(page, p.layer, kv, offset, head);
  return true;
}

/// What a (K|V, head) row's codes are multiplied by: the call's scale times the engine-held one.
KVCACHE_HOST_DEVICE inline float gather_mul(const GatherParams& p, std::int32_t kv, std::int32_t head) noexcept {
  return (kv == 0 ? p.k_scale : p.v_scale) * held_scale(p.cache, kv, kv == 0 ? p.k_scales : p.v_scales, p.layer, head);
}

/// Reads one row whose addresses are known: pool row src, which is (page,
/// offset) of side kv, kv-head head, into output row dst; or `rows` heads
/// from there when heads_in_one_run. Lanes split the row (shared by both
/// backends); `stream`: see move_row.
KVCACHE_HOST_DEVICE inline void gather_row_at(const GatherParams& p, std::int32_t kv, std::int32_t head, std::int64_t page,
                                            std::int32_t offset, std::byte* dst, const std::byte* src, std::int32_t lane,
                                            std::int32_t nlanes, std::int32_t rows = 1, bool stream = false) noexcept {
  const float mul = gather_mul(p, kv, head);
  if (quantized_side(p.cache, kv)) {  // dequantized on read
    load_quantized_row(p.cache, kv, src, row_entries(p.cache, page, p.layer, kv, offset, head), dst, p.out_dtype, mul, lane,
                       nlanes, rows);
    return;
  }
  move_row(dst, p.out_dtype, src, p.cache.dtype, rows * p.cache.head_dim, mul, lane, nlanes, false, stream);
}

/// Gathers one (sequence, row, K|V, head) row; lanes split the row (shared by both backends).
KVCACHE_HOST_DEVICE inline void gather_row(const GatherParams& p, std::int32_t seq, std::int64_t row,
                                           std::int32_t kv, std::int32_t head, std::int32_t lane,
                                           std::int32_t nlanes) noexcept {
  std::int32_t page = 0, offset = 0;
  if (!gather_page(p, seq, row, page, offset)) return;
  gather_row_at(p, kv, head, page, offset, gather_dst(p, kv, row, head), p.cache.row(page, p.layer, kv, offset, head), lane,
                nlanes);
}

/// Sequence owning output row r (binary search of out_indptr), for launchers
/// that go row-parallel.
KVCACHE_HOST_DEVICE inline std::int32_t gather_seq_of_row(const GatherParams& p, std::int64_t r) noexcept {
  std::int32_t lo = 0, hi = p.num_seqs - 1;
  while (lo < hi) {
    const std::int32_t mid = (lo + hi + 1) / 2;
    if (p.out_indptr[mid] <= r) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

/// Prefetches the pool row one block after output row r of sequence s on
/// side kv (its codes; prefetch_lines), when the sequence has one.
inline void prefetch_next_block(const GatherParams& p, std::int32_t s, std::int64_t r, std::int32_t kv) noexcept {
  std::int32_t page = 0, offset = 0;
  if (r + p.cache.block_size >= p.out_indptr[s + 1] || !gather_page(p, s, r + p.cache.block_size, page, offset)) return;
  const std::int64_t bytes = row_bytes(p.cache.dtype, p.cache.head_dim);
  for (std::int32_t h = 0; h < p.cache.num_kv_heads; ++h) prefetch_lines(p.cache.row(page, p.layer, kv, offset, h), bytes);
}

/// Checks the parameters' shape (pool, layer, counts, pointers).
inline Status check_gather_shape(const GatherParams& p) noexcept {
  if (!p.cache.base) return Status{Errc::invalid_argument, "cache.base", 0, 1};
  if (p.layer < 0 || p.layer >= p.cache.num_layers) return Status{Errc::invalid_argument, "layer", p.layer, p.cache.num_layers};
  if (p.num_seqs < 0) return Status{Errc::invalid_argument, "num_seqs", p.num_seqs, 0};
  if (auto st = check_planes(p.cache, "cache.kv_planes"); !st) return st;
  if (p.num_rows > 0 && (!p.k_out || (p.cache.kv_planes == 2 && !p.v_out) || !p.indptr || !p.indices || !p.out_indptr))
    return Status{Errc::invalid_argument, "pointers", 0, 1};
  if (!(p.k_scale > 0.0f) || !(p.v_scale > 0.0f)) return Status{Errc::invalid_argument, "k_scale/v_scale", 0, 0};
  if (auto st = check_pool_rows(p.cache, "cache.dtype"); !st) return st;
  if (auto st = check_dtype(p.out_dtype, "out_dtype"); !st) return st;
  return check_held_scales(p.cache, p.k_scales, p.v_scales, false);
}

/// Host backend: validates the page table and row counts, then copies.
inline Status gather_host(const GatherParams& p) noexcept {
  if (auto st = check_gather_shape(p); !st) return st;
  if (auto st = check_held_scales(p.cache, p.k_scales, p.v_scales, true); !st) return st;
  if (p.num_seqs > 0 && (p.out_indptr[0] != 0 || p.out_indptr[p.num_seqs] != p.num_rows))
    return Status{Errc::invalid_argument, "out_indptr", p.num_seqs > 0 ? p.out_indptr[p.num_seqs] : 0, p.num_rows};
  if (auto st = check_csr(p.indptr, p.num_seqs); !st) return st;
  for (std::int32_t s = 0; s < p.num_seqs; ++s) {
    const std::int64_t rows = std::int64_t{p.out_indptr[s + 1]} - p.out_indptr[s];
    const std::int64_t pages = p.indptr[s + 1] - p.indptr[s];
    if (rows < 0 || rows > pages * p.cache.block_size)
      return Status{Errc::invalid_argument, "rows_of_seq", s, pages * p.cache.block_size};
    for (std::int32_t i = p.indptr[s]; i < p.indptr[s + 1]; ++i)
      if (p.indices[i] < 0 || p.indices[i] >= p.cache.num_blocks)
        return Status{Errc::invalid_argument, "indices", i, p.cache.num_blocks};
  }
  // A row's heads adjacent in the pool and the output move as one run: a
  // copy when nothing converts, whole groups when quantized.
  const bool run[2] = {heads_in_one_run(p.cache, 0, p.head_stride, p.out_dtype, p.k_scales),
                       heads_in_one_run(p.cache, 1, p.head_stride, p.out_dtype, p.v_scales)};
  const bool stream = streams(p.num_rows * p.cache.kv_planes * p.cache.num_kv_heads * row_bytes(p.out_dtype, p.cache.head_dim));
  // Rows that convert ask for their sequence's next block a block ahead
  // (prefetch_next_block). Plain copies do not: it made fp16 rows 6% slower.
  const bool ahead[2] = {quantized_side(p.cache, 0) || p.cache.dtype != p.out_dtype,
                         quantized_side(p.cache, 1) || p.cache.dtype != p.out_dtype};
#if defined(_OPENMP)
#pragma omp parallel
#endif
  {
#if defined(_OPENMP)
#pragma omp for schedule(dynamic) nowait
#endif
    for (std::int32_t s = 0; s < p.num_seqs; ++s)
      for (std::int64_t r = p.out_indptr[s]; r < p.out_indptr[s + 1]; ++r)
        for (std::int32_t kv = 0; kv < p.cache.kv_planes; ++kv) {
          // The row's head 0; heads follow at the strides (no address math per row).
          std::int32_t page = 0, offset = 0;
          if (!gather_page(p, s, r, page, offset)) continue;  // checked above: every row has its page
          std::byte* dst = gather_dst(p, kv, r, 0);
          const std::byte* src = p.cache.row(page, p.layer, kv, offset, 0);
          if (ahead[kv]) prefetch_next_block(p, s, r, kv);
          if (run[kv]) {
            gather_row_at(p, kv, 0, page, offset, dst, src, 0, 1, p.cache.num_kv_heads, stream);
            continue;
          }
          for (std::int32_t h = 0; h < p.cache.num_kv_heads; ++h)
            gather_row_at(p, kv, h, page, offset, dst + h * p.head_stride, src + h * p.cache.strides.head, 0, 1, 1, stream);
        }
    if (stream) stream_fence();  // each thread its own rows
  }
  return {};
}

KVCACHE_END_NAMESPACE
