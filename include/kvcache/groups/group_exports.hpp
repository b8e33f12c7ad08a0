// One group's rows as attention kernels read them: a dense block table with
// the null id where a block was skipped (vLLM-style kernels with a window
// bound), a CSR over the live blocks with each row's first token position
// (FlashInfer-style), and the slot of any stored position. A row with
// eviction holes is read compacted in both, as Cache<>'s table holds a row
// after a block eviction: its live blocks one after another, tokens_held
// tokens, the keys keeping the positions they were rotated at.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>

#include "kvcache/pool/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/groups/group_rows.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Dense table of rows `rows_at` of g: row k at out[k * row_stride], null ids
/// for skipped blocks and past the row's end; a row with eviction holes
/// lists its skipped blocks' nulls, then its live blocks one after another.
/// buffer_too_small when out or a row does not fit (names the row's length).
inline Status export_group_table(const GroupRows& g, std::span<const std::uint32_t> rows_at, std::span<std::int32_t> out,
                                 std::int32_t row_stride) noexcept {
  if (row_stride < 1) return Status{Errc::invalid_argument, "row_stride", row_stride, 1};
  const std::int64_t need = std::int64_t(rows_at.size()) * row_stride;
  if (std::int64_t(out.size()) < need) return Status{Errc::buffer_too_small, "out", std::int64_t(out.size()), need};
  for (const std::uint32_t i : rows_at)
    if (const std::int64_t len = std::int64_t(g.row(i).size()) - g.holes(i); len > row_stride)
      return Status{Errc::buffer_too_small, "row_stride", row_stride, len};
  std::int32_t* dst = out.data();
  for (const std::uint32_t i : rows_at) {
    // Null ids before the first live block (a window's), then the live blocks.
    std::int32_t* end = g.copy_live(i, std::fill_n(dst, g.first_live(i), BlockPool::null_block));
    std::fill(end, dst + row_stride, BlockPool::null_block);
    dst += row_stride;
  }
  return {};
}

/// CSR of the live blocks of rows `rows_at` of g: indptr[k] .. indptr[k+1]
/// in indices, and first_pos[k] the positions the row does not hold before
/// its live blocks' tokens ((first_live + holes) * block_size: the first
/// token's position when the row has no holes), so a kernel reads
/// tokens − first_pos of them. Returns the number of indices written.
inline Result<std::int32_t> export_group_csr(const GroupRows& g, std::span<const std::uint32_t> rows_at,
                                             std::span<std::int32_t> indptr, std::span<std::int32_t> indices,
                                             std::span<std::int32_t> first_pos) noexcept {
  const auto n = std::int64_t(rows_at.size());
  if (std::int64_t(indptr.size()) < n + 1) return Status{Errc::buffer_too_small, "indptr", std::int64_t(indptr.size()), n + 1};
  if (std::int64_t(first_pos.size()) < n) return Status{Errc::buffer_too_small, "first_pos", std::int64_t(first_pos.size()), n};
  std::int64_t total = 0;
  for (const std::uint32_t i : rows_at) total += g.live(i);
  if (std::int64_t(indices.size()) < total) return Status{Errc::buffer_too_small, "indices", std::int64_t(indices.size()), total};
  std::int32_t at = 0;
  indptr[0] = 0;
  for (std::size_t k = 0; k < rows_at.size(); ++k) {
    const std::uint32_t i = rows_at[k];
    (void)g.copy_live(i, indices.begin() + at);
    at += g.live(i);
    indptr[k + 1] = at;
    first_pos[k] = std::int32_t(g.not_held(i));
  }
  return at;
}

/// The slots of positions [begin, end) of row i of g (all in live blocks, below `stored`, its tokens):
/// invalid_argument names a position freed or evicted.
inline Status export_group_slots(const GroupRows& g, std::uint32_t i, std::int64_t stored, std::int64_t begin,
                                 std::int64_t end, std::span<std::int32_t> out) noexcept {
  const std::int32_t B = g.rule().block_size;
  const std::int64_t lo = std::int64_t(g.first_live(i)) * B;
  if (begin < lo || begin > end) return Status{Errc::invalid_argument, "begin (a freed or later position)", begin, lo};
  if (end > stored) return Status{Errc::invalid_argument, "end", end, stored};
  if (std::int64_t(out.size()) < end - begin) return Status{Errc::buffer_too_small, "out", std::int64_t(out.size()), end - begin};
  const auto row = g.row(i);
  if (g.holes(i) > 0 && begin < end)
    for (std::int64_t j = begin / B; j < (end + B - 1) / B; ++j)
      if (row[std::size_t(j)] == BlockPool::null_block)
        return Status{Errc::invalid_argument, "begin (an evicted position in range)", j * B, begin};
  for (std::int64_t p = begin; p < end; ++p) out[std::size_t(p - begin)] = row[std::size_t(p / B)] * B + std::int32_t(p % B);
  return {};
}

KVCACHE_END_NAMESPACE
