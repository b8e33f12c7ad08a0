// Scatter (append): new K/V rows into the paged pool, addressed by slot
// mapping (-1 = skip) or by a CSR page table + per-token positions. One launch
// may cover several layers (decode writes all layers of a step at once).
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvcache/kernels/detail/common.hpp"
#include "kvcache/kernels/detail/quant_rows.hpp"
#include "kvcache/kernels/detail/rows.hpp"
#include "kvcache/kernels/params/kv_source.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Where token t goes: slots[t] (block * B + offset, negative = skip), or, when
/// slots is null, page indices[indptr[seq[t]] + pos[t] / B] at entry pos[t] % B
/// of a CSR table of num_seqs sequences (indptr has num_seqs + 1 entries). A
/// negative position skips the token; so does, on CUDA, a sequence outside
/// [0, num_seqs) or a position past its pages (the host backend reports both).
struct TokenAddress {
  const std::int32_t* slots = nullptr;  ///< Slot mapping: slot per token (-1 = skip); null selects CSR mode.
  const std::int32_t* seq = nullptr;  ///< CSR mode: sequence (batch row) of each token.
  const std::int32_t* pos = nullptr;  ///< CSR mode: position of each token in its sequence.
  const std::int32_t* indptr = nullptr;  ///< CSR mode: page ranges per sequence (num_seqs + 1).
  const std::int32_t* indices = nullptr;  ///< CSR mode: physical pages.
  std::int32_t num_seqs = 0;  ///< CSR mode: sequences in indptr

  /// Slot of token t (negative: skip).
  KVCACHE_HOST_DEVICE std::int64_t slot(std::int64_t t, std::int32_t block_size) const noexcept {
    if (slots) return slots[t];
    const std::int32_t p = pos[t], s = seq[t];
    if (p < 0 || s < 0 || s >= num_seqs) return -1;
    const std::int32_t page = p / block_size;
    if (page >= std::int64_t{indptr[s + 1]} - indptr[s]) return -1;
    return std::int64_t{indices[indptr[s] + page]} * block_size + p % block_size;
  }
};

/// Parameters of scatter: new K/V rows into the pool.
struct ScatterParams {
  PoolView cache{};  ///< The pool.
  KvSource src{};  ///< The new K/V.
  TokenAddress addr{};  ///< Where each token goes.
  std::int64_t num_tokens = 0;  ///< Tokens written.
  std::int32_t first_layer = 0;  ///< First cache layer written.
  std::int32_t num_layers = 1;  ///< source layer l lands in cache layer first_layer + l
  float k_scale = 1.0f;  ///< Quantization scale of K (cache = input / scale).
  float v_scale = 1.0f;  ///< dequant scales: cache = input / scale (fp8)
  /// Engine-held scales of format.k (tensor: [cache layers]; head: [cache
  /// layers][kv_heads]), times k_scale; null: none. Memory the backend reads.
  const float* k_scales = nullptr;
  const float* v_scales = nullptr;  ///< The same for format.v.
};
static_assert(std::is_trivially_copyable_v<ScatterParams>);

/// The (block, offset) token `token` lands in; false when it is skipped
/// (negative slot, or outside the pool: the host launcher reports those as
/// errors before writing anything).
KVCACHE_HOST_DEVICE inline bool scatter_slot(const ScatterParams& p, std::int64_t token, std::int64_t& block,
                                             std::int32_t& offset) noexcept {
  const std::int64_t slot = p.addr.slot(token, p.cache.block_size);
  if (slot < 0 || slot >= p.cache.num_blocks * p.cache.block_size) return false;
  // Slots are int32 by contract: 32-bit division (64-bit is slow on GPUs).
  const auto s32 = static_cast<std::uint32_t>(slot), b = static_cast<std::uint32_t>(p.cache.block_size);
  block = s32 / b;
  offset = static_cast<std::int32_t>(s32 % b);
  return true;
}

/// Where one (layer, token, K|V, head) row comes from and goes to; false when
/// the token is skipped (scatter_slot).
KVCACHE_HOST_DEVICE inline bool scatter_ptrs(const ScatterParams& p, std::int32_t layer, std::int64_t token,
                                             std::int32_t kv, std::int32_t head, std::byte*& dst,
                                             const std::byte*& src) noexcept {
  std::int64_t block = 0;
  std::int32_t offset = 0;
  if (!scatter_slot(p, token, block, offset)) return false;
  dst = p.cache.row(block, p.first_layer + layer, kv, offset, head);
  src = p.src.row(kv, layer, token, head);
  return true;
}

/// What a (layer, K|V, head) row's inputs are divided by: the call's scale
/// times the engine-held one (a code is the rounding of x / that, as
/// vLLM's fp8 write computes it; with no held scale, x / k_scale exactly).
KVCACHE_HOST_DEVICE inline float scatter_div(const ScatterParams& p, std::int32_t layer, std::int32_t kv,
                                             std::int32_t head) noexcept {
  return (kv == 0 ? p.k_scale : p.v_scale) * held_scale(p.cache, kv, kv == 0 ? p.k_scales : p.v_scales, p.first_layer + layer, head);
}

/// Writes one row whose addresses are known: source row src into pool row
/// dst, which is (block, offset) of cache layer first_layer + layer, side kv,
/// kv-head head; or `rows` heads from there when heads_in_one_run. Lanes
/// split the row (shared by both backends); `stream`: see move_row.
KVCACHE_HOST_DEVICE inline void scatter_row_at(const ScatterParams& p, std::int32_t layer, std::int32_t kv, std::int32_t head,
                                             std::int64_t block, std::int32_t offset, std::byte* dst, const std::byte* src,
                                             std::int32_t lane, std::int32_t nlanes, std::int32_t rows = 1,
                                             bool stream = false) noexcept {
  const float div = scatter_div(p, layer, kv, head);
  if (quantized_side(p.cache, kv)) {  // quantized on write: codes and the rows' group entries in one pass
    store_quantized_row(p.cache, kv, dst, row_entries(p.cache, block, p.first_layer + layer, kv, offset, head), src,
                        p.src.dtype, div, lane, nlanes, rows);
    return;
  }
  move_row(dst, p.cache.dtype, src, p.src.dtype, rows * p.cache.head_dim, div, lane, nlanes, false, stream, true);
}

/// Writes one (layer, token, K|V, head) row; lanes split the row (shared by both backends).
KVCACHE_HOST_DEVICE inline void scatter_row(const ScatterParams& p, std::int32_t layer, std::int64_t token,
                                            std::int32_t kv, std::int32_t head, std::int32_t lane,
                                            std::int32_t nlanes) noexcept {
  std::int64_t block = 0;
  std::int32_t offset = 0;
  if (!scatter_slot(p, token, block, offset)) return;
  scatter_row_at(p, layer, kv, head, block, offset, p.cache.row(block, p.first_layer + layer, kv, offset, head),
                 p.src.row(kv, layer, token, head), lane, nlanes);
}

/// What every kernel that writes rows from a KvSource checks: the layers it
/// writes, the call's scales, the pool's type, the engine-held scales'
/// shape (not their values) and the source's dtype.
inline Status check_source_writes(const PoolView& cache, const KvSource& src, std::int32_t first_layer,
                                  std::int32_t num_layers, float k_scale, float v_scale, const float* k_scales,
                                  const float* v_scales) noexcept {
  if (num_layers < 1 || first_layer < 0 || std::int64_t{first_layer} + num_layers > cache.num_layers)
    return Status{Errc::invalid_argument, "first_layer+num_layers", std::int64_t{first_layer} + num_layers, cache.num_layers};
  if (!(k_scale > 0.0f) || !(v_scale > 0.0f)) return Status{Errc::invalid_argument, "k_scale/v_scale", 0, 0};
  if (auto st = check_pool_rows(cache, "cache.dtype"); !st) return st;
  if (auto st = check_held_scales(cache, k_scales, v_scales, false); !st) return st;
  return check_dtype(src.dtype, "src.dtype");
}

/// Checks what the host can see: shapes, layers, scales (not device arrays;
/// the host backend also checks the engine-held scales' values).
inline Status check_scatter_shape(const ScatterParams& p) noexcept {
  if (!p.cache.base) return Status{Errc::invalid_argument, "cache.base", 0, 1};
  if (p.num_tokens < 0) return Status{Errc::invalid_argument, "num_tokens", p.num_tokens, 0};
  if (auto st = check_planes(p.cache, "cache.kv_planes"); !st) return st;
  if (p.num_tokens > 0 && (!p.src.k || (p.cache.kv_planes == 2 && !p.src.v)))
    return Status{Errc::invalid_argument, "src.k/src.v", 0, 1};
  if (!p.addr.slots && p.num_tokens > 0 && (!p.addr.seq || !p.addr.pos || !p.addr.indptr || !p.addr.indices))
    return Status{Errc::invalid_argument, "addr", 0, 1};
  if (!p.addr.slots && p.addr.num_seqs < 0) return Status{Errc::invalid_argument, "addr.num_seqs", p.addr.num_seqs, 0};
  if (auto st = check_source_writes(p.cache, p.src, p.first_layer, p.num_layers, p.k_scale, p.v_scale, p.k_scales, p.v_scales); !st)
    return st;
  return check_row_writes(p.cache, "cache.format (a channel-scaled side is written by seal_blocks)");
}

/// Prefetches token t's source rows of side kv, layer l (every head's;
/// `run`: as one run, heads_in_one_run), for a loop that converts them a
/// token ahead (prefetch_lines).
inline void prefetch_source(const ScatterParams& p, std::int32_t l, std::int32_t kv, std::int64_t t,
                            bool run) noexcept {
  const std::byte* src = p.src.row(kv, l, t, 0);
  const std::int64_t bytes = row_bytes(p.src.dtype, p.cache.head_dim);
  if (run) return prefetch_lines(src, bytes * p.cache.num_kv_heads);
  for (std::int32_t h = 0; h < p.cache.num_kv_heads; ++h) prefetch_lines(src + h * p.src.head_stride, bytes);
}

/// Host backend: validates every slot first (a slot outside the pool is an
/// error naming the slot and the pool's slots), then writes. Nothing is written on error.
inline Status scatter_host(const ScatterParams& p) noexcept {
  if (auto st = check_scatter_shape(p); !st) return st;
  if (auto st = check_held_scales(p.cache, p.k_scales, p.v_scales, true); !st) return st;
  const std::int64_t pool_slots = p.cache.num_blocks * p.cache.block_size;
  if (!p.addr.slots && p.num_tokens > 0) {  // CSR mode: the table, then each token's sequence and page
    if (auto st = check_csr(p.addr.indptr, p.addr.num_seqs); !st) return st;
    for (std::int64_t t = 0; t < p.num_tokens; ++t) {
      const std::int32_t pos = p.addr.pos[t], s = p.addr.seq[t];
      if (pos < 0) continue;
      if (s < 0 || s >= p.addr.num_seqs) return Status{Errc::invalid_argument, "addr.seq (a token's sequence)", s, p.addr.num_seqs};
      const std::int64_t room = (std::int64_t{p.addr.indptr[s + 1]} - p.addr.indptr[s]) * p.cache.block_size;
      if (pos >= room) return Status{Errc::invalid_argument, "addr.pos (past its sequence's pages)", pos, room};
    }
  }
  for (std::int64_t t = 0; t < p.num_tokens; ++t)
    if (const std::int64_t slot = p.addr.slot(t, p.cache.block_size); slot >= pool_slots)
      return Status{Errc::invalid_argument, "slot (past the pool)", slot, pool_slots};
  // A token's heads adjacent in the source and the pool (NHD, dense heads)
  // move as one run: a copy when nothing converts, whole groups when quantized.
  const bool run[2] = {heads_in_one_run(p.cache, 0, p.src.head_stride, p.src.dtype, p.k_scales),
                       heads_in_one_run(p.cache, 1, p.src.head_stride, p.src.dtype, p.v_scales)};
  const bool stream = streams(p.num_tokens * p.num_layers * p.cache.kv_planes * p.cache.num_kv_heads *
                              row_bytes(p.cache.dtype, p.cache.head_dim));
  // Rows that convert ask for the next token's source a token ahead
  // (prefetch_source) when the call's source is past what the caches keep
  // (kStreamBytes): a group format's range pass, the first read of each
  // row, waited on memory otherwise. A smaller source, a decode step's, is
  // in cache already, where the prefetches only cost (bench_quant's decode
  // rows: 5-10%); plain copies do not prefetch.
  const bool big = streams(p.num_tokens * p.num_layers * p.cache.kv_planes * p.cache.num_kv_heads *
                           row_bytes(p.src.dtype, p.cache.head_dim));
  const bool ahead[2] = {big && (quantized_side(p.cache, 0) || p.cache.dtype != p.src.dtype),
                         big && (quantized_side(p.cache, 1) || p.cache.dtype != p.src.dtype)};
#if defined(_OPENMP)
#pragma omp parallel
#endif
  {
#if defined(_OPENMP)
#pragma omp for schedule(static) nowait
#endif
    for (std::int64_t t = 0; t < p.num_tokens; ++t) {
      std::int64_t block = 0;
      std::int32_t offset = 0;
      if (!scatter_slot(p, t, block, offset)) continue;
      for (std::int32_t l = 0; l < p.num_layers; ++l)
        for (std::int32_t kv = 0; kv < p.cache.kv_planes; ++kv) {
          // The token's head 0; heads follow at the strides (no address math per row).
          std::byte* dst = p.cache.row(block, p.first_layer + l, kv, offset, 0);
          const std::byte* src = p.src.row(kv, l, t, 0);
          if (ahead[kv] && t + 1 < p.num_tokens) prefetch_source(p, l, kv, t + 1, run[kv]);
          if (run[kv]) {
            scatter_row_at(p, l, kv, 0, block, offset, dst, src, 0, 1, p.cache.num_kv_heads, stream);
            continue;
          }
          for (std::int32_t h = 0; h < p.cache.num_kv_heads; ++h)
            scatter_row_at(p, l, kv, h, block, offset, dst + h * p.cache.strides.head, src + h * p.src.head_stride, 0, 1, 1,
                           stream);
        }
    }
    if (stream) stream_fence();  // each thread its own rows
  }
  return {};
}

KVCACHE_END_NAMESPACE
