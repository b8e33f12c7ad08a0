// Page metadata for page selection (Quest): per page and kv-head, the
// element-wise max and min of the keys held. bounds layout:
// [num_blocks][kv_heads][2][head_dim] float, [..][0][d] = max, [..][1][d] =
// min. An empty page gets (-FLT_MAX, +FLT_MAX).
//   page_bounds         recomputes listed pages from their keys (after a
//                       compaction, a rotation, a copy, a rollback)
//   page_bounds_update  folds just-written tokens into their pages' bounds,
//                       incrementally (after an appending scatter: a token at
//                       a page's first slot starts the page afresh; or after a
//                       rewrite without that, leaving a looser, still upper, bound)
// Quantized keys (group scales, 4-bit codes) enter dequantized, as
// load_pool_elem reads them; an engine-held scale is not applied (the bounds
// are in the stored units, as the element-wise dtypes' are).
// Max and min are exact, so the order tokens are folded in does not matter:
// a CUDA launch folding them in any order gives the host's floats.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "kvcache/kernels/detail/common.hpp"
#include "kvcache/kernels/detail/quant_rows.hpp"
#include "kvcache/kernels/detail/rows.hpp"

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

namespace bounds_math {
// Keys enter the bounds with -0 made +0 (x + 0 does it), so no two zeros of
// different signs ever meet: a plain max and min then give the same bits in
// any order, which is what the CUDA atomics of page_bounds_update need.
/// x with -0 made +0.
KVCACHE_HOST_DEVICE inline float canonical(float x) noexcept { return x + 0.0f; }
}  // namespace bounds_math

/// Element d of a key row as the bounds see it (load_pool_elem: dequantized
/// for a quantized pool).
KVCACHE_HOST_DEVICE inline float page_key_elem(const PoolView& v, std::int32_t page, std::int32_t layer, std::int32_t token,
                                               std::int32_t head, std::int32_t d) noexcept {
  const std::byte* codes = v.row(page, layer, 0, token, head);
  if (!quantized_side(v, 0)) return load_elem(v.dtype, codes, d);
  return load_pool_elem(v, 0, codes, row_entries(v, page, layer, 0, token, head), d);
}

/// Max and min of one (page, head, dim) over the page's tokens (shared by both backends).
KVCACHE_HOST_DEVICE inline void page_bounds_elem(const PageBoundsParams& p, std::int32_t entry, std::int32_t head,
                                                 std::int32_t d) noexcept {
  const std::int32_t page = p.pages[entry];
  if (page < 0 || page >= p.cache.num_blocks) return;
  const std::int32_t n = p.fill[entry] < p.cache.block_size ? p.fill[entry] : p.cache.block_size;
  float mx = -FLT_MAX, mn = FLT_MAX;
  for (std::int32_t t = 0; t < n; ++t) {
    const float v = bounds_math::canonical(page_key_elem(p.cache, page, p.layer, t, head, d));
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
  if (auto st = check_pool_rows(p.cache, "cache.dtype"); !st) return st;
  return {};
}

/// Parameters of page_bounds_update: the tokens a write just stored, by slot.
struct PageBoundsUpdateParams {
  PoolView cache{};                     ///< The pool (the keys are already written).
  std::int32_t layer = 0;               ///< Layer written.
  const std::int32_t* slots = nullptr;  ///< Slot of each written token (negative: skipped, as scatter does).
  std::int64_t num_tokens = 0;          ///< Entries in `slots`.
  float* bounds = nullptr;              ///< [num_blocks][kv_heads][2][head_dim]: updated in place.
  /// Appends (reserve's slots): a page's first slot is written only into a
  /// fresh page, so a token there resets the page's bounds before the fold.
  /// False for rewrites of live slots (ring slots, compaction targets): the
  /// replaced keys' extremes stay, a looser bound that still holds. (A
  /// head-paged row's ring pages are always read and never ranked, so a
  /// write that folds ring slots with true, restarting a ring page, is harmless.)
  bool first_slot_starts_page = true;
};
static_assert(std::is_trivially_copyable_v<PageBoundsUpdateParams>);


/// What the host can see of an update; shared by both launchers.
inline Status check_page_bounds_update_shape(const PageBoundsUpdateParams& p) noexcept {
  if (p.num_tokens < 0) return Status{Errc::invalid_argument, "num_tokens", p.num_tokens, 0};
  if (!p.cache.base || (p.num_tokens > 0 && (!p.slots || !p.bounds))) return Status{Errc::invalid_argument, "pointers", 0, 1};
  if (p.layer < 0 || p.layer >= p.cache.num_layers) return Status{Errc::invalid_argument, "layer", p.layer, p.cache.num_layers};
  if (auto st = check_pool_rows(p.cache, "cache.dtype"); !st) return st;
  return {};
}

/// Host backend of page_bounds_update: validates every slot, then resets the
/// pages whose first slot was written (first_slot_starts_page) and folds
/// every token's key in; nothing is written on an error.
inline Status page_bounds_update_host(const PageBoundsUpdateParams& p) noexcept {
  if (auto st = check_page_bounds_update_shape(p); !st) return st;
  const std::int64_t slots_in_pool = p.cache.num_blocks * p.cache.block_size;
  for (std::int64_t t = 0; t < p.num_tokens; ++t)
    if (p.slots[t] >= slots_in_pool) return Status{Errc::invalid_argument, "slots_at", t, slots_in_pool};
  const std::int32_t H = p.cache.num_kv_heads, D = p.cache.head_dim, B = p.cache.block_size;
  for (std::int64_t t = 0; t < p.num_tokens && p.first_slot_starts_page; ++t)  // first: fresh pages start afresh
    if (p.slots[t] >= 0 && p.slots[t] % B == 0) {
      float* out = p.bounds + std::int64_t{p.slots[t] / B} * H * 2 * D;
      for (std::int32_t h = 0; h < H; ++h, out += 2 * D) {
        std::fill_n(out, D, -FLT_MAX);
        std::fill_n(out + D, D, FLT_MAX);
      }
    }
  float key[1024];  // one head's key, converted once (head_dim is at most 1024 here; longer in chunks)
  for (std::int64_t t = 0; t < p.num_tokens; ++t) {
    if (p.slots[t] < 0) continue;
    const std::int32_t page = p.slots[t] / B, off = p.slots[t] % B;
    for (std::int32_t h = 0; h < H; ++h) {
      float* out = p.bounds + (std::int64_t{page} * H + h) * 2 * D;
      const std::byte* k = p.cache.row(page, p.layer, 0, off, h);
      const std::byte* entries = quantized_side(p.cache, 0) ? row_entries(p.cache, page, p.layer, 0, off, h) : nullptr;
      for (std::int32_t d0 = 0; d0 < D; d0 += 1024) {  // 1024 is whole groups of every size
        const std::int32_t n = D - d0 < 1024 ? D - d0 : 1024;
        load_pool_span(p.cache, 0, k, entries, d0, n, key);
        float* hi = out + d0;
        float* lo = out + D + d0;
        for (std::int32_t d = 0; d < n; ++d) {  // vectorizes: plain max and min
          const float v = bounds_math::canonical(key[d]);
          hi[d] = v > hi[d] ? v : hi[d];
          lo[d] = v < lo[d] ? v : lo[d];
        }
      }
    }
  }
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
