// Page metadata for page selection (Quest): per page and kv-head, the
// element-wise max and min of the keys held, refreshed for the pages a write
// touched. bounds layout: [num_blocks][kv_heads][2][head_dim] float, [..][0][d]
// = max, [..][1][d] = min. An empty page gets (-FLT_MAX, +FLT_MAX).
#pragma once

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "common.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Parameters of page_bounds: per page and kv-head, element-wise key max and min (Quest metadata).
struct PageBoundsParams {
  PoolView cache{};  ///< The pool.
  std::int32_t layer = 0;  ///< Layer read.
  const std::int32_t* pages = nullptr;  ///< blocks to refresh
  const std::int32_t* fill = nullptr;  ///< tokens held by each listed page
  std::int32_t num_pages = 0;  ///< Pages in `pages`.
  float* bounds = nullptr;  ///< Output: [page][head][max, min][dim] floats.
};
static_assert(std::is_trivially_copyable_v<PageBoundsParams>);

/// Max and min of one (page, head, dim) over the page's tokens (shared by both backends).
KVCACHE_HOST_DEVICE inline void page_bounds_elem(const PageBoundsParams& p, std::int32_t entry, std::int32_t head,
                                                 std::int32_t d) noexcept {
  const std::int32_t page = p.pages[entry];
  if (page < 0 || page >= p.cache.num_blocks) return;
  const std::int32_t n = p.fill[entry] < p.cache.block_size ? p.fill[entry] : p.cache.block_size;
  float mx = -FLT_MAX, mn = FLT_MAX;
  for (std::int32_t t = 0; t < n; ++t) {
    const float v = load_elem(p.cache.dtype, p.cache.row(page, p.layer, 0, t, head), d);
    mx = v > mx ? v : mx;
    mn = v < mn ? v : mn;
  }
  float* out = p.bounds + (std::int64_t{page} * p.cache.num_kv_heads + head) * 2 * p.cache.head_dim;
  out[d] = mx;
  out[p.cache.head_dim + d] = mn;
}

/// What the host can see; shared by both launchers.
inline Status check_page_bounds_shape(const PageBoundsParams& p) noexcept {
  if (p.num_pages < 0) return Status{Errc::invalid_argument, "num_pages", p.num_pages, 0};
  if (!p.cache.base || (p.num_pages > 0 && (!p.pages || !p.fill || !p.bounds)))
    return Status{Errc::invalid_argument, "pointers", 0, 1};
  if (p.layer < 0 || p.layer >= p.cache.num_layers) return Status{Errc::invalid_argument, "layer", p.layer, p.cache.num_layers};
  return {};
}

/// Host backend: validates every page, then writes the bounds; nothing is written on an error.
inline Status page_bounds_host(const PageBoundsParams& p) noexcept {
  if (auto st = check_page_bounds_shape(p); !st) return st;
  for (std::int32_t e = 0; e < p.num_pages; ++e) {
    if (p.pages[e] < 0 || p.pages[e] >= p.cache.num_blocks) return Status{Errc::invalid_argument, "pages", e, p.cache.num_blocks};
    if (p.fill[e] < 0 || p.fill[e] > p.cache.block_size) return Status{Errc::invalid_argument, "fill", e, p.cache.block_size};
  }
  for (std::int32_t e = 0; e < p.num_pages; ++e)
    for (std::int32_t h = 0; h < p.cache.num_kv_heads; ++h)
      for (std::int32_t d = 0; d < p.cache.head_dim; ++d) page_bounds_elem(p, e, h, d);
  return {};
}

KVCACHE_END_NAMESPACE
