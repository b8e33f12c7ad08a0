// Head-paged admission: a policy that owns one page-table stream per
// (sequence, layer, kv-head) and places every write itself (WriteGate). Its
// interface as a concept, the commands a write hands the engine, and the
// head-folded exports that let stock paged-attention kernels read heads of
// ragged lengths: each (sequence, kv-head) is one row, with its own length
// and block list, over a pool of single-head blocks.
//
//   rows, one layer (layer >= 0):  row k * H + h         = kv-head h of seqs[k]
//   rows, all layers (layer = -1): row (l * S + k) * H + h  (layer l's rows are
//                                  one contiguous slice: per-layer calls use offsets)
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <span>

#include "kvcache/pool/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/table/page_table.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/core/slot_move.hpp"
#include "kvcache/status.hpp"
#include "kvcache/core/strided_span.hpp"

KVCACHE_BEGIN_NAMESPACE

/// What one write (or rollback) did, summed over its heads.
struct GateWriteInfo {
  std::int32_t promoted = 0;        ///< ring tokens copied to global (moves)
  std::int32_t direct = 0;          ///< chunk tokens written straight to global
  std::int32_t dropped = 0;         ///< tokens that left unadmitted
  std::int32_t dropped_at_cap = 0;  ///< admitted tokens dropped because a head was at its cap
  std::int32_t moves = 0;           ///< entries written to `moves`
  std::int32_t copies = 0;          ///< entries written to `copies` (copy-on-write of blocks a fork shares)
};

/// Where a write (or rollback) puts its commands for the engine, which runs
/// them in this order: `copies` (block_copy), `moves` (compaction), then the
/// tokens at `slots` (scatter), or moves and tokens in one ring_write launch
/// with `promote`.
struct GateWriteSpans {
  std::span<std::int32_t> slots{};    ///< [n][kv_heads]: each new token's slot per head, -1: dropped (write only)
  std::span<SlotMove> moves{};        ///< promotions (write) or ring refills (rollback), src -> dst slots
  std::span<std::int32_t> promote{};  ///< optional, [n][kv_heads], n <= W: ring_write's promotion per token, -1: none
  std::span<BlockCopy> copies{};      ///< blocks shared with a fork that this call rewrites: copy src -> dst first
};

/// Where a deferred write's allotment puts what the device's ring_admit launch needs.
struct GateDeferredSpans {
  std::span<std::int32_t> ring_start{};  ///< [kv_heads]: each ring's oldest slot before the write
  std::span<std::int32_t> ring_len{};    ///< [kv_heads]: ring tokens before the write
  std::span<BlockCopy> copies{};         ///< blocks a fork shares that the write may rewrite: copy first
};

template <class P>
concept HeadPagedAdmission =
    AdmissionPolicy<P> && P::kind == AdmissionKind::head_paged &&
    requires(P& p, const P& cp, PageTable& t, const PageTable& ct, BlockPool& pool, SeqId s, std::int32_t i,
             std::int64_t n, std::span<const float> gates, const GateWriteSpans& out, const typename P::Config& cfg) {
      P(cfg, i, t);
      { P::streams_for(cfg, i) } -> std::same_as<std::int64_t>;
      { p.add(t) } -> std::same_as<Result<SeqId>>;
      { p.fork(t, pool, s) } -> std::same_as<Result<SeqId>>;
      { p.free(t, pool, s) } -> std::same_as<Status>;
      { p.write(t, pool, s, i, gates, out) } -> std::same_as<Result<GateWriteInfo>>;
      { p.write_batch(t, pool, std::span<const SeqId>{}, i, gates, out) } -> std::same_as<Result<GateWriteInfo>>;
      { p.truncate(t, pool, s, i, out) } -> std::same_as<Result<GateWriteInfo>>;
      { p.allot(t, pool, s, i, i, GateDeferredSpans{}) } -> std::same_as<Result<GateWriteInfo>>;
      { p.reconcile(t, pool, s, i, gates) } -> std::same_as<Result<GateWriteInfo>>;
      { cp.head(s, i, i) } -> std::same_as<Result<SeqId>>;
      { cp.head_unchecked(s, i, i) } -> std::same_as<SeqId>;
      { cp.positions(s, i, i) } -> std::same_as<Result<StridedSpan<const std::int32_t>>>;
      { cp.num_layers() } -> std::same_as<std::int32_t>;
      { cp.num_kv_heads() } -> std::same_as<std::int32_t>;
      { cp.local_window() } -> std::same_as<std::int32_t>;
      { cp.free_sequences() } -> std::same_as<std::int32_t>;
      { cp.max_blocks_held(n) } -> std::same_as<std::int64_t>;
      { cp.check(ct) } -> std::same_as<Status>;
    };

namespace head_rows {
// Validates layer (-1: all) and every sequence; returns the row count.
template <HeadPagedAdmission A>
Result<std::int64_t> count(const A& a, std::span<const SeqId> seqs, std::int32_t layer) noexcept {
  if (layer < -1 || layer >= a.num_layers()) return Status{Errc::invalid_argument, "layer", layer, a.num_layers()};
  for (const SeqId s : seqs)
    if (auto h = a.head(s, 0, 0); !h) return h.status();
  return std::int64_t(seqs.size()) * a.num_kv_heads() * (layer < 0 ? a.num_layers() : 1);
}
// Calls f(row, head stream) in row order; sequences already validated.
template <HeadPagedAdmission A, class F>
void each(const A& a, std::span<const SeqId> seqs, std::int32_t layer, F&& f) noexcept {
  const std::int32_t first = layer < 0 ? 0 : layer, last = layer < 0 ? a.num_layers() : layer + 1, H = a.num_kv_heads();
  std::int64_t row = 0;
  for (std::int32_t l = first; l < last; ++l)
    for (const SeqId s : seqs)
      for (std::int32_t h = 0; h < H; ++h) f(row++, a.head_unchecked(s, l, h));
}
}  // namespace head_rows

/// Head-folded dense block table: row r of out (row_stride entries) holds
/// head row r's blocks, null-padded. Validated before anything is written.
template <HeadPagedAdmission A>
Status export_heads_block_table(const PageTable& t, const A& a, std::span<const SeqId> seqs, std::int32_t layer,
                                std::span<std::int32_t> out, std::int32_t row_stride) noexcept {
  auto rows = head_rows::count(a, seqs, layer);
  if (!rows) return rows.status();
  if (row_stride < 1) return Status{Errc::invalid_argument, "row_stride", row_stride, 1};
  if (std::int64_t(out.size()) < *rows * row_stride)
    return Status{Errc::buffer_too_small, "out", std::int64_t(out.size()), *rows * row_stride};
  std::int64_t longest = 0;
  head_rows::each(a, seqs, layer, [&](std::int64_t, SeqId h) {
    longest = std::max(longest, std::int64_t(t.blocks_unchecked(h).size()));
  });
  if (longest > row_stride) return Status{Errc::buffer_too_small, "row_stride", row_stride, longest};
  head_rows::each(a, seqs, layer, [&](std::int64_t r, SeqId h) {
    const auto blocks = t.blocks_unchecked(h);
    std::int32_t* dst = out.data() + r * row_stride;
    std::copy(blocks.begin(), blocks.end(), dst);
    std::fill(dst + blocks.size(), dst + row_stride, BlockPool::null_block);
  });
  return {};
}

/// Head-folded FlashInfer paging: head row r's pages are
/// indices[indptr[r] .. indptr[r+1]), its last page holds last_page_len[r]
/// tokens (0: empty). Returns pages written.
template <HeadPagedAdmission A>
Result<std::int32_t> export_heads_csr(const PageTable& t, const A& a, std::span<const SeqId> seqs, std::int32_t layer,
                                      std::span<std::int32_t> indptr, std::span<std::int32_t> indices,
                                      std::span<std::int32_t> last_page_len) noexcept {
  auto rows = head_rows::count(a, seqs, layer);
  if (!rows) return rows.status();
  if (std::int64_t(indptr.size()) < *rows + 1)
    return Status{Errc::buffer_too_small, "indptr", std::int64_t(indptr.size()), *rows + 1};
  if (std::int64_t(last_page_len.size()) < *rows)
    return Status{Errc::buffer_too_small, "last_page_len", std::int64_t(last_page_len.size()), *rows};
  std::int64_t nnz = 0;
  head_rows::each(a, seqs, layer, [&](std::int64_t, SeqId h) { nnz += std::int64_t(t.blocks_unchecked(h).size()); });
  if (std::int64_t(indices.size()) < nnz) return Status{Errc::buffer_too_small, "indices", std::int64_t(indices.size()), nnz};
  const std::int32_t bs = t.block_size();
  std::int32_t at = 0;
  indptr[0] = 0;
  head_rows::each(a, seqs, layer, [&](std::int64_t r, SeqId h) {
    const auto blocks = t.blocks_unchecked(h);
    std::copy(blocks.begin(), blocks.end(), indices.data() + at);
    at += std::int32_t(blocks.size());
    indptr[std::size_t(r + 1)] = at;
    const std::int32_t n = t.tokens_unchecked(h);
    last_page_len[std::size_t(r)] = n == 0 ? 0 : (n - 1) % bs + 1;
  });
  return at;
}

/// Tokens each head row holds (its cache_seqlens), one per row.
template <HeadPagedAdmission A>
Status export_heads_lengths(const PageTable& t, const A& a, std::span<const SeqId> seqs, std::int32_t layer,
                            std::span<std::int32_t> out) noexcept {
  auto rows = head_rows::count(a, seqs, layer);
  if (!rows) return rows.status();
  if (std::int64_t(out.size()) < *rows) return Status{Errc::buffer_too_small, "out", std::int64_t(out.size()), *rows};
  head_rows::each(a, seqs, layer, [&](std::int64_t r, SeqId h) { out[std::size_t(r)] = t.tokens_unchecked(h); });
  return {};
}

/// What a sparse (vertical-slash) prefill kernel needs per head row: the
/// positions of its tokens in row order, columns[indptr[r] .. indptr[r+1]).
/// A row's first min(len, W) entries are the ring: positions within the last
/// W, the earlier part of a chunk's local band (its own keys are the rest).
/// The entries from W on are the admitted global columns, ascending until a
/// token policy evicts from the region (its compaction moves the region's
/// last tokens into the holes; eviction/global_region.hpp). Export
/// before writing the chunk: a query at position p then reads the global
/// columns, the ring entries it is causal to, and the chunk's keys in (p - W, p].
/// Returns columns written.
template <HeadPagedAdmission A>
Result<std::int32_t> export_head_columns(const A& a, std::span<const SeqId> seqs, std::int32_t layer,
                                         std::span<std::int32_t> indptr, std::span<std::int32_t> columns) noexcept {
  auto rows = head_rows::count(a, seqs, layer);
  if (!rows) return rows.status();
  if (std::int64_t(indptr.size()) < *rows + 1)
    return Status{Errc::buffer_too_small, "indptr", std::int64_t(indptr.size()), *rows + 1};
  const std::int32_t first = layer < 0 ? 0 : layer, last = layer < 0 ? a.num_layers() : layer + 1;
  std::int64_t total = 0;
  for (std::int32_t l = first; l < last; ++l)
    for (const SeqId s : seqs)
      for (std::int32_t h = 0; h < a.num_kv_heads(); ++h) total += std::int64_t(a.positions(s, l, h)->size());
  if (std::int64_t(columns.size()) < total)
    return Status{Errc::buffer_too_small, "columns", std::int64_t(columns.size()), total};
  std::int32_t at = 0;
  std::int64_t r = 0;
  indptr[0] = 0;
  for (std::int32_t l = first; l < last; ++l)
    for (const SeqId s : seqs)
      for (std::int32_t h = 0; h < a.num_kv_heads(); ++h) {
        const auto p = *a.positions(s, l, h);
        std::copy(p.begin(), p.end(), columns.data() + at);
        at += std::int32_t(p.size());
        indptr[std::size_t(++r)] = at;
      }
  return at;
}

KVCACHE_END_NAMESPACE
