// Page-bounds selection: a policy that chooses, per (sequence, kv-head), the
// pages a query reads from per-page key bounds (QuestSelection). Its
// interface as a concept, the spans its calls write, and the listing of
// stale pages every write path feeds.
//
// The bounds store is caller memory: [layers][num_blocks][kv_heads][2][head_dim]
// floats (page_bounds.hpp's layout, one slice per layer), on the host for
// select(), anywhere for select_params() (the cache never reads it there).
// Who keeps it current, per write path (the engine runs the kernels):
//   reserve / reserve_batch   page_bounds_update on the returned slots, after
//                             the scatter (a token at a page's first slot
//                             starts the page afresh)
//   copy-on-write, compaction, block rotation, rollback of a partial tail
//                             the cache marks the pages stale; stale_pages()
//                             lists them (page, fill) for page_bounds
//   window front eviction     nothing: the first page's dead front slots
//                             keep their keys' extremes, a looser bound that
//                             still holds for every live key
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/config.hpp"
#include "kvcache/core/geometry.hpp"
#include "kvcache/kernels/params/page_select.hpp"
#include "kvcache/table/page_table.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/selection/stale_pages.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// What a page-bounds policy binds to (the cache fills it at construction).
struct SelectionShape {
  Geometry geometry{};                  ///< The pool's geometry (its layers are the store's slices).
  std::int32_t num_blocks = 0;          ///< Pool blocks.
  std::int32_t model_layers = 0;        ///< Layers the queries come from (a head-paged pool has one per block).
  std::int32_t streams = 0;             ///< Table streams (stale marks are per stream).
  std::int32_t max_rows = 0;            ///< Rows one select() call may have.
  std::int32_t max_blocks_per_row = 0;  ///< Longest row, in blocks.
  std::int32_t kv_heads = 0;            ///< The model's kv-heads per layer.
  /// Head-paged rows: leading pages every row reads (the ring), on top of the budget.
  std::int32_t ring_pages = 0;
};

/// Where select() writes the chosen pages: a head-folded CSR, row k × kv_heads + h
/// = kv-head h of seqs[k], each row's physical blocks in logical order.
struct SelectSpans {
  std::span<std::int32_t> indptr{};   ///< [seqs × kv_heads + 1]
  std::span<std::int32_t> indices{};  ///< the chosen blocks (at most seqs × kv_heads × budget pages)
};

/// Where select_params() writes a launch's inputs (pinned or device-visible
/// memory for a CUDA launch): the rows' pages and the output offsets.
struct SelectPlanSpans {
  std::span<std::int32_t> indptr{};      ///< [seqs + 1]: the rows' CSR offsets
  std::span<std::int32_t> indices{};     ///< every page of the rows, logical order
  std::span<std::int32_t> out_indptr{};  ///< [seqs × kv_heads + 1]: the selection's offsets
};

/// Where stale_pages() lists the pages to recompute: run page_bounds on them, every layer.
struct StaleSpans {
  std::span<std::int32_t> pages{};  ///< physical blocks
  std::span<std::int32_t> fill{};   ///< slots of each page to read (from slot 0)
};

template <class P>
concept PageBoundsSelection =
    SelectionPolicy<P> && P::kind == SelectionKind::page_bounds &&
    requires(P& p, const P& cp, const PageTable& t, const Geometry& g, std::span<const SeqId> seqs, std::int32_t i,
             std::span<const float> q, const SelectSpans& out, const SelectPlanSpans& plan) {
      typename P::Config;
      { p.bind(SelectionShape{}) } -> std::same_as<Status>;
      { p.stale() } -> std::same_as<StalePages&>;
      { cp.stale() } -> std::same_as<const StalePages&>;
      { cp.bounds(i) } -> std::same_as<std::span<float>>;
      { cp.plan(t, seqs, i, plan) } -> std::same_as<Result<PageSelectParams>>;
      { p.select(t, seqs, i, q, out) } -> std::same_as<Result<std::int32_t>>;
    };

/// Lists the stale pages of the rows each(f) calls f with, f(stream, blocks,
/// used slots, block size) (validated rows), as (page, fill), and marks them
/// clean; all or nothing: a buffer too small changes nothing. Returns pages
/// listed. A page shared with another row (a fork) is listed whole (fill =
/// block size): its rows may hold different counts of its tokens after a
/// rollback, and slots past a row's tokens only loosen the bound.
template <class Pool, class Each>
Result<std::int32_t> take_stale_rows(StalePages& stale, const Pool& pool, Each&& each, const StaleSpans& out) noexcept {
  std::int64_t n = 0;
  each([&](std::uint32_t stream, std::span<const BlockId> blocks, std::int64_t, std::int32_t) {
    for (std::int32_t j = stale.from(stream); j < std::int32_t(blocks.size()); ++j) n += blocks[std::size_t(j)] != BlockPool::null_block;
  });
  if (std::int64_t(out.pages.size()) < n) return Status{Errc::buffer_too_small, "pages", std::int64_t(out.pages.size()), n};
  if (std::int64_t(out.fill.size()) < n) return Status{Errc::buffer_too_small, "fill", std::int64_t(out.fill.size()), n};
  std::size_t w = 0;
  each([&](std::uint32_t stream, std::span<const BlockId> blocks, std::int64_t slots, std::int32_t B) {
    for (std::int32_t j = stale.from(stream); j < std::int32_t(blocks.size()); ++j) {
      if (blocks[std::size_t(j)] == BlockPool::null_block) continue;  // an eviction's hole holds no keys
      out.pages[w] = blocks[std::size_t(j)];
      const bool shared = pool.ref_count(blocks[std::size_t(j)]) > 1;
      out.fill[w++] = shared ? B : std::int32_t(std::min<std::int64_t>(B, slots - std::int64_t{j} * B));
    }
    stale.clear(stream);
  });
  return std::int32_t(w);  // a row listed twice is listed once
}

/// take_stale_rows over table t's rows `each` names (f(SeqId)): a row's used slots are its front and tokens.
template <class Table, class Pool, class Each>
Result<std::int32_t> take_stale_rows(StalePages& stale, const Table& t, const Pool& pool, Each&& each, const StaleSpans& out) noexcept {
  return take_stale_rows(
      stale, pool,
      [&](auto f) {
        each([&](SeqId s) { f(s.index, t.blocks_unchecked(s), std::int64_t{t.front_unchecked(s)} + t.tokens_unchecked(s), t.block_size()); });
      },
      out);
}

/// take_stale_rows over the rows of seqs (one per sequence); a bad handle is seqs_at.
template <class Table, class Pool>
Result<std::int32_t> take_stale_pages(StalePages& stale, const Table& t, const Pool& pool, std::span<const SeqId> seqs,
                                      const StaleSpans& out) noexcept {
  for (std::size_t k = 0; k < seqs.size(); ++k)
    if (auto st = t.validate(seqs[k]); !st) return Status{st.code(), "seqs_at", std::int64_t(k), 0};
  return take_stale_rows(stale, t, pool, [&](auto f) { for (const SeqId s : seqs) f(s); }, out);
}

/// A page-bounds policy bound to a cache: the policy, built from its Config
/// and bound to the cache's shape, and its bounds store by pool layer. The
/// participants over rows (row_selection.hpp) and over head rows
/// (head_selection.hpp) derive from it and add the hooks of their edits.
template <class S>
class BoundPageSelection {
  static_assert(PageBoundsSelection<S>, "kvcache::Cache: a page_bounds selection policy must model PageBoundsSelection "
                                        "(selection/page_bounds_selection.hpp)");

 public:
  using Arg = typename S::Config;  ///< What the cache's constructor takes for it.
  BoundPageSelection() = default;
  /// The policy, from its configuration.
  explicit BoundPageSelection(const Arg& cfg) : s_(cfg) {}
  /// Binds the policy to the cache's shape; throws ConfigError naming `cache` when it does not fit.
  void bind(const SelectionShape& shape, const char* cache = "kvcache::Cache") {
    if (auto st = s_.bind(shape); !st) throw ConfigError(cache, st);
    layers_ = shape.geometry.spec().num_layers;
    unbounded_.assign(std::size_t(std::max(0, shape.num_blocks)), false);
  }
  const S& policy() const noexcept { return s_; }  ///< The policy.
  /// One pool layer's slice of the page-bounds store (cache.hpp's page_bounds()).
  Result<std::span<float>> page_bounds(std::int32_t layer) const noexcept {
    if (layer < 0 || layer >= layers_) return Status{Errc::invalid_argument, "layer", layer, layers_};
    return s_.bounds(layer);
  }
  friend bool operator==(const BoundPageSelection& a, const BoundPageSelection& b) {
    return a.s_ == b.s_ && a.unbounded_ == b.unbounded_;
  }

 protected:
  // Pages whose keys arrived from outside (an import's received pages): no
  // page_bounds_update saw them, so their bounds stay stale until a
  // stale_pages() listing hands them out. Kept per page, not per row: the
  // import's pages are published at commit, so another row may adopt them
  // as a prefix hit (or the importing row may be freed) before any listing.
  /// The received pages among `blocks` have no bounds yet (null entries skipped).
  void mark_unbounded(std::span<const BlockId> blocks) noexcept {
    for (const BlockId b : blocks)
      if (b >= 0) unbounded_[std::size_t(b)] = true;
  }
  /// The first of `blocks` with no bounds yet, or -1.
  std::int32_t first_unbounded(std::span<const BlockId> blocks) const noexcept {
    for (std::size_t j = 0; j < blocks.size(); ++j)
      if (blocks[j] >= 0 && unbounded_[std::size_t(blocks[j])]) return std::int32_t(j);
    return -1;
  }
  /// The engine recomputes the listed pages (stale_pages()): their bounds will hold.
  void listed(std::span<const std::int32_t> pages) noexcept {
    for (const std::int32_t p : pages) unbounded_[std::size_t(p)] = false;
  }

  S s_{};                     ///< The policy (its stale pages are what the hooks mark).
  std::int32_t layers_ = 0;   ///< Pool layers: the store's slices.
  std::vector<bool> unbounded_;  ///< [num_blocks]: mark_unbounded's pages not yet listed.
};

KVCACHE_END_NAMESPACE
