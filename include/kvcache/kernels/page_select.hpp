// Page selection (Quest, arXiv 2406.10774): for a step's queries, the pages
// each (sequence, kv-head) reads. A page's upper bound on q·k is
// Σ_d max(q_d·kmax_d, q_d·kmin_d) over its keys' element-wise max and min
// (page_bounds' metadata); under GQA the bound is the max over the kv-head's
// query heads. Each row (sequence s, kv-head h) reads at most `budget`
// pages: its first `first_pages` (sinks) and last `last_pages` (the partial
// page, the local window) always, and the best-bounded pages between them,
// ties to the lower page. A row with no more pages than the budget reads
// them all without estimating. The output is a CSR over rows s × kv_heads +
// h, in the rows' logical page order: a head-folded paging that paged
// attention kernels read as they are (last_page_len is the sequence's).
//
// Both backends compute the same scores in the same order (the sum runs
// along d; a max sits between each product and the sum, so nothing fuses
// into an fma), so they choose the same pages.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvcache/kernels/detail/common.hpp"
#include "kvcache/kernels/params/page_select.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Pages row (s, h) of a sequence of n pages reads.
KVCACHE_HOST_DEVICE constexpr std::int32_t page_select_count(std::int32_t n, std::int32_t budget) noexcept {
  return n < budget ? n : budget;
}

/// The bound of one page for one (sequence, kv-head): the max over the
/// group's query heads of Σ_d max(q_d·kmax_d, q_d·kmin_d). The sum's order
/// is part of the definition (both backends, and the tests' references,
/// follow it): four partial sums, lane k taking d ≡ k (mod 4) in ascending
/// d, then (s0 + s1) + (s2 + s3). Four lanes are one SSE vector, so the host
/// loop vectorizes along d without reordering anything.
/// A NaN (only from non-finite queries, which the host rejects) counts as -inf.
KVCACHE_HOST_DEVICE inline float page_select_bound(const PageSelectParams& p, std::int32_t s, std::int32_t h,
                                                   std::int32_t block) noexcept {
  const float* kmax = p.bounds + (std::int64_t{block} * p.num_kv_heads + h) * 2 * p.head_dim;
  const float* kmin = kmax + p.head_dim;
  const float* q = p.queries + (std::int64_t{s} * p.num_kv_heads + h) * p.group * p.head_dim;
  const std::int32_t D = p.head_dim, D4 = D / 4 * 4;
  float best = -INFINITY;
  for (std::int32_t g = 0; g < p.group; ++g, q += D) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (std::int32_t d = 0; d < D4; d += 4)
      for (std::int32_t k = 0; k < 4; ++k) {
        const float hi = q[d + k] * kmax[d + k], lo = q[d + k] * kmin[d + k];
        acc[k] += hi > lo ? hi : lo;
      }
    for (std::int32_t d = D4; d < D; ++d) {
      const float hi = q[d] * kmax[d], lo = q[d] * kmin[d];
      acc[d - D4] += hi > lo ? hi : lo;
    }
    const float sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    best = sum > best ? sum : best;
  }
  return best == best ? best + 0.0f : -INFINITY;  // + 0: -0 and +0 tie, as a radix sort sees them
}

/// The output CSR's offsets, known on the host before any query: row
/// s × kv_heads + h reads min(pages of s, budget) pages. out has
/// num_seqs × kv_heads + 1 entries. Errors name the bad entry; nothing is written then.
inline Status page_select_indptr(const std::int32_t* indptr, std::int32_t num_seqs, std::int32_t num_kv_heads,
                                 std::int32_t budget, std::int32_t* out, std::size_t out_size) noexcept {
  if (num_seqs < 0) return Status{Errc::invalid_argument, "num_seqs", num_seqs, 0};
  if (num_kv_heads < 1) return Status{Errc::invalid_argument, "num_kv_heads", num_kv_heads, 1};
  if (budget < 1) return Status{Errc::invalid_argument, "budget", budget, 1};
  if (auto st = check_csr(indptr, num_seqs); !st) return st;
  const std::int64_t rows = std::int64_t{num_seqs} * num_kv_heads;
  if (!out || out_size < std::size_t(rows + 1)) return Status{Errc::buffer_too_small, "out_indptr", std::int64_t(out_size), rows + 1};
  std::int64_t total = 0;
  for (std::int32_t s = 0; s < num_seqs; ++s) total += std::int64_t{num_kv_heads} * page_select_count(indptr[s + 1] - indptr[s], budget);
  if (total > INT32_MAX) return Status{Errc::invalid_argument, "out_indptr (pages past int32)", total, INT32_MAX};
  std::int32_t at = 0;
  out[0] = 0;
  for (std::int32_t s = 0; s < num_seqs; ++s)
    for (std::int32_t h = 0; h < num_kv_heads; ++h) {
      at += page_select_count(indptr[s + 1] - indptr[s], budget);
      out[std::size_t(s) * std::size_t(num_kv_heads) + std::size_t(h) + 1] = at;
    }
  return {};
}

/// Scratch the host backend needs: a score per (kv-head, page) of the
/// longest row and an index per page.
inline std::size_t page_select_scratch_bytes(std::int32_t longest_row_pages, std::int32_t num_kv_heads) noexcept {
  const std::size_t n = std::size_t(longest_row_pages < 0 ? 0 : longest_row_pages);
  return n * std::size_t(num_kv_heads < 1 ? 1 : num_kv_heads) * sizeof(float) + n * sizeof(std::int32_t);
}

/// What both backends check on the host (the CSR offsets too when the host can read them).
inline Status check_page_select_shape(const PageSelectParams& p) noexcept {
  if (p.num_seqs < 0) return Status{Errc::invalid_argument, "num_seqs", p.num_seqs, 0};
  if (p.num_kv_heads < 1) return Status{Errc::invalid_argument, "num_kv_heads", p.num_kv_heads, 1};
  if (p.head_dim < 1) return Status{Errc::invalid_argument, "head_dim", p.head_dim, 1};
  if (p.group < 1) return Status{Errc::invalid_argument, "group", p.group, 1};
  if (p.first_pages < 0) return Status{Errc::invalid_argument, "first_pages", p.first_pages, 0};
  if (p.last_pages < 0) return Status{Errc::invalid_argument, "last_pages", p.last_pages, 0};
  if (const std::int64_t forced = std::int64_t{p.first_pages} + p.last_pages; p.budget < 1 || p.budget < forced)
    return Status{Errc::invalid_argument, "budget (at least first_pages + last_pages, and 1)", p.budget,
                  std::max<std::int64_t>(1, forced)};
  if (p.num_pages < 0) return Status{Errc::invalid_argument, "num_pages", p.num_pages, 0};
  if (p.num_seqs > 0 && (!p.bounds || !p.queries || !p.indptr || !p.out_indptr || (p.num_pages > 0 && (!p.indices || !p.out_indices))))
    return Status{Errc::invalid_argument, "pointers", 0, 1};
  return {};
}

/// Host backend: validates everything (CSR, blocks, queries finite, output
/// offsets, scratch), then writes out_indices; nothing is written on an error.
inline Status page_select_host(const PageSelectParams& p) noexcept {
  if (auto st = check_page_select_shape(p); !st) return st;
  if (p.num_seqs == 0) return {};
  if (auto st = check_csr(p.indptr, p.num_seqs); !st) return st;
  if (p.indptr[p.num_seqs] != p.num_pages) return Status{Errc::invalid_argument, "num_pages (indptr[num_seqs])", p.num_pages, p.indptr[p.num_seqs]};
  std::int32_t longest = 0;
  for (std::int32_t s = 0; s < p.num_seqs; ++s) longest = std::max(longest, p.indptr[s + 1] - p.indptr[s]);
  for (std::int32_t e = p.indptr[0]; e < p.indptr[p.num_seqs]; ++e)
    if (p.indices[e] < 0 || p.indices[e] >= p.num_blocks) return Status{Errc::invalid_argument, "indices_at", e, p.num_blocks};
  const std::int64_t nq = std::int64_t{p.num_seqs} * p.num_kv_heads * p.group * p.head_dim;
  for (std::int64_t i = 0; i < nq; ++i)
    if (!std::isfinite(p.queries[i])) return Status{Errc::invalid_argument, "queries_at", i, 0};
  const std::int64_t rows = std::int64_t{p.num_seqs} * p.num_kv_heads;
  if (p.out_indptr[0] != 0) return Status{Errc::invalid_argument, "out_indptr_at", 0, 0};
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int32_t s = std::int32_t(r / p.num_kv_heads), want = page_select_count(p.indptr[s + 1] - p.indptr[s], p.budget);
    if (std::int64_t{p.out_indptr[r + 1]} - p.out_indptr[r] != want)
      return Status{Errc::invalid_argument, "out_indptr_at (page_select_indptr)", r + 1, std::int64_t{p.out_indptr[r]} + want};
  }
  const std::size_t need = page_select_scratch_bytes(longest, p.num_kv_heads);
  if (p.scratch_bytes < need || !p.scratch)
    return Status{Errc::buffer_too_small, "scratch_bytes", std::int64_t(p.scratch_bytes), std::int64_t(need)};

  // A sequence's pages are scored for all its kv-heads in one pass (a page's
  // heads lie together in the bounds: the pass reads them in order), then
  // each head's row picks its pages.
  const std::int32_t H = p.num_kv_heads;
  auto* score = static_cast<float*>(p.scratch);  // [kv_head][page]
  auto* order = reinterpret_cast<std::int32_t*>(score + std::size_t(H) * std::size_t(longest));
  for (std::int32_t s = 0; s < p.num_seqs; ++s) {
    const std::int32_t* pages = p.indices + p.indptr[s];
    const std::int32_t n = p.indptr[s + 1] - p.indptr[s];
    if (n <= p.budget) {  // everything fits: no estimate
      for (std::int32_t h = 0; h < H; ++h) std::copy(pages, pages + n, p.out_indices + p.out_indptr[std::int64_t{s} * H + h]);
      continue;
    }
    // Candidates are the pages between the forced ones; each row keeps the best `pick`, ties to the lower page.
    const std::int32_t lo = p.first_pages, hi = n - p.last_pages, pick = p.budget - p.first_pages - p.last_pages;
    for (std::int32_t j = lo; j < hi; ++j)
      for (std::int32_t h = 0; h < H; ++h) score[std::size_t(h) * std::size_t(longest) + std::size_t(j)] = page_select_bound(p, s, h, pages[j]);
    for (std::int32_t h = 0; h < H; ++h) {
      const float* sc = score + std::size_t(h) * std::size_t(longest);
      std::int32_t c = 0;
      for (std::int32_t j = lo; j < hi; ++j) order[c++] = j;
      const auto better = [&](std::int32_t a, std::int32_t b) { return sc[a] > sc[b] || (sc[a] == sc[b] && a < b); };
      std::nth_element(order, order + pick, order + c, better);
      std::sort(order, order + pick);
      std::int32_t* out = p.out_indices + p.out_indptr[std::int64_t{s} * H + h];
      std::int32_t w = 0;
      for (std::int32_t j = 0; j < lo; ++j) out[w++] = pages[j];
      for (std::int32_t k = 0; k < pick; ++k) out[w++] = pages[order[k]];
      for (std::int32_t j = hi; j < n; ++j) out[w++] = pages[j];
    }
  }
  return {};
}

KVCACHE_END_NAMESPACE
