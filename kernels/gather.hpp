// Gather: paged K/V of a batch into dense, contiguous ragged rows (output
// indptr), for engines whose attention wants dense K/V.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common.hpp"

KVCACHE_BEGIN_NAMESPACE

struct GatherParams {
  PoolView cache{};
  std::int32_t layer = 0;
  const std::int32_t* indptr = nullptr;      // CSR page table of the batch
  const std::int32_t* indices = nullptr;
  const std::int32_t* out_indptr = nullptr;  // [num_seqs + 1]: rows of sequence b are out_indptr[b] .. [b+1)
  std::int32_t num_seqs = 0;
  std::int64_t num_rows = 0;                 // out_indptr[num_seqs]
  void* k_out = nullptr;
  void* v_out = nullptr;
  DType out_dtype = DType::f16;
  std::int64_t token_stride = 0, head_stride = 0;  // output strides in bytes
  float k_scale = 1.0f, v_scale = 1.0f;            // output = cache * scale (fp8 dequant)
};
static_assert(std::is_trivially_copyable_v<GatherParams>);

KVCACHE_HOST_DEVICE inline void gather_row(const GatherParams& p, std::int32_t seq, std::int64_t row,
                                           std::int32_t kv, std::int32_t head, std::int32_t lane,
                                           std::int32_t nlanes) noexcept {
  const std::int64_t pos = row - p.out_indptr[seq];
  const std::int32_t b = p.cache.block_size;
  const std::int64_t page_slot = p.indptr[seq] + pos / b;
  if (page_slot >= p.indptr[seq + 1]) return;  // more rows than pages: nothing to read
  const std::int32_t page = p.indices[page_slot];
  if (page < 0 || page >= p.cache.num_blocks) return;
  std::byte* out = static_cast<std::byte*>(kv == 0 ? p.k_out : p.v_out) + row * p.token_stride + head * p.head_stride;
  move_row(out, p.out_dtype, p.cache.row(page, p.layer, kv, static_cast<std::int32_t>(pos % b), head), p.cache.dtype,
           p.cache.head_dim, kv == 0 ? p.k_scale : p.v_scale, lane, nlanes);
}

// Sequence owning output row r (binary search of out_indptr), for launchers
// that go row-parallel.
KVCACHE_HOST_DEVICE inline std::int32_t gather_seq_of_row(const GatherParams& p, std::int64_t r) noexcept {
  std::int32_t lo = 0, hi = p.num_seqs - 1;
  while (lo < hi) {
    const std::int32_t mid = (lo + hi + 1) / 2;
    if (p.out_indptr[mid] <= r) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

inline Status check_gather_shape(const GatherParams& p) noexcept {
  if (!p.cache.base) return Status{Errc::invalid_argument, "cache.base", 0, 1};
  if (p.layer < 0 || p.layer >= p.cache.num_layers) return Status{Errc::invalid_argument, "layer", p.layer, p.cache.num_layers};
  if (p.num_seqs < 0) return Status{Errc::invalid_argument, "num_seqs", p.num_seqs, 0};
  if (p.num_rows > 0 && (!p.k_out || !p.v_out || !p.indptr || !p.indices || !p.out_indptr))
    return Status{Errc::invalid_argument, "pointers", 0, 1};
  if (!(p.k_scale > 0.0f) || !(p.v_scale > 0.0f)) return Status{Errc::invalid_argument, "k_scale/v_scale", 0, 0};
  return {};
}

// Host backend: validates the page table and row counts, then copies.
inline Status gather_host(const GatherParams& p) noexcept {
  if (auto st = check_gather_shape(p); !st) return st;
  if (p.num_seqs > 0 && (p.out_indptr[0] != 0 || p.out_indptr[p.num_seqs] != p.num_rows))
    return Status{Errc::invalid_argument, "out_indptr", p.num_seqs > 0 ? p.out_indptr[p.num_seqs] : 0, p.num_rows};
  for (std::int32_t s = 0; s < p.num_seqs; ++s) {
    const std::int64_t rows = p.out_indptr[s + 1] - p.out_indptr[s];
    const std::int64_t pages = p.indptr[s + 1] - p.indptr[s];
    if (rows < 0 || rows > pages * p.cache.block_size)
      return Status{Errc::invalid_argument, "rows_of_seq", s, pages * p.cache.block_size};
    for (std::int32_t i = p.indptr[s]; i < p.indptr[s + 1]; ++i)
      if (p.indices[i] < 0 || p.indices[i] >= p.cache.num_blocks)
        return Status{Errc::invalid_argument, "indices", i, p.cache.num_blocks};
  }
#if defined(_OPENMP)
#pragma omp parallel for schedule(dynamic)
#endif
  for (std::int32_t s = 0; s < p.num_seqs; ++s)
    for (std::int64_t r = p.out_indptr[s]; r < p.out_indptr[s + 1]; ++r)
      for (std::int32_t kv = 0; kv < 2; ++kv)
        for (std::int32_t h = 0; h < p.cache.num_kv_heads; ++h) gather_row(p, s, r, kv, h, 0, 1);
  return {};
}

KVCACHE_END_NAMESPACE
