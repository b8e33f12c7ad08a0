// PageSelectParams alone: what Quest's plan and a hybrid's group fill for a
// page_select launch (selection/, cache/hybrid_selection.hpp), without the
// kernel's bodies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvcache/config.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Parameters of page_select: one decode step's queries against a CSR page table's bounds.
struct PageSelectParams {
  const float* bounds = nullptr;          ///< [num_blocks][kv_heads][2][head_dim]: page_bounds' max, then min, per page and head.
  std::int64_t num_blocks = 0;            ///< Blocks the bounds cover.
  std::int32_t num_kv_heads = 1;          ///< Kv-heads per page (1 for head-folded rows).
  std::int32_t head_dim = 0;              ///< Elements per key.
  const float* queries = nullptr;         ///< [num_seqs][kv_heads][group][head_dim] fp32 (post-RoPE, as attention reads them).
  std::int32_t group = 1;                 ///< Query heads per kv-head (GQA); the bound is the max over them.
  const std::int32_t* indptr = nullptr;   ///< [num_seqs + 1]: sequence s's pages are indices[indptr[s] .. indptr[s+1]).
  const std::int32_t* indices = nullptr;  ///< Physical blocks, logical order.
  std::int32_t num_seqs = 0;              ///< Sequences (CSR rows) in the batch.
  std::int32_t num_pages = 0;             ///< indptr[num_seqs]: pages of the whole batch (sizes the scratch).
  std::int32_t budget = 0;                ///< Pages a row reads at most (Quest: token budget / page size).
  std::int32_t first_pages = 1;           ///< Leading pages always read (attention sinks).
  std::int32_t last_pages = 1;            ///< Trailing pages always read: the partial page, and the local pages.
  const std::int32_t* out_indptr = nullptr;  ///< [num_seqs * kv_heads + 1], from page_select_indptr.
  std::int32_t* out_indices = nullptr;    ///< Output: [out_indptr[rows]] physical blocks, each row in logical order.
  void* scratch = nullptr;                ///< Caller memory for the call (page_select_scratch_bytes; CUDA: page_select_cuda_scratch_bytes).
  std::size_t scratch_bytes = 0;          ///< Bytes at scratch.
};
static_assert(std::is_trivially_copyable_v<PageSelectParams>);

KVCACHE_END_NAMESPACE
