// Quest (arXiv 2406.10774): query-aware page selection. Every page keeps,
// per kv-head, the element-wise max and min of its keys; a query's upper
// bound on q·k over a page is Σ_d max(q_d·kmax_d, q_d·kmin_d) (the max over
// a kv-head's query heads under GQA), and each (sequence, kv-head) reads
// its best-bounded pages within a token budget: budget / block_size pages,
// the first pages (sinks) and the last pages (the partial page, the local
// window) always among them, ties to the lower page (page_select.hpp).
// Layers below dense_layers read every page (the paper keeps its first two
// layers dense). Quest saves bandwidth, not memory: every page stays
// resident and a query reads only the chosen ones.
//
//   std::vector<float> store(QuestSelection::bounds_floats(geometry, num_blocks));
//   Cache<BlockPool, PageTable, AdmitAll, QuestSelection> cache(cfg, {}, {.token_budget = 256, .bounds = store});
//   cache.select(seqs, layer, queries, {indptr, indices});   // host backend
//   auto p = cache.select_params(seqs, layer, plan);          // a CUDA launch's inputs
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/table/head_rows.hpp"
#include "kvcache/config.hpp"
#include "kvcache/core/geometry.hpp"
#include "kvcache/kernels/page_select.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/selection/page_bounds_selection.hpp"
#include "kvcache/selection/stale_pages.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// What QuestSelection is built from.
struct QuestConfig {
  std::int32_t token_budget = 0;  ///< Tokens a query reads at most: token_budget / block_size pages, forced ones included.
  std::int32_t first_pages = 1;   ///< Leading pages always read (attention sinks).
  std::int32_t last_pages = 1;    ///< Trailing pages always read: the partial page, and any local pages.
  std::int32_t dense_layers = 2;  ///< Layers [0, dense_layers) read every page.
  std::int32_t query_group = 1;   ///< Query heads per kv-head (GQA): the bound is the max over them.
  std::span<float> bounds{};      ///< The store, caller memory: at least bounds_floats(geometry, num_blocks) floats.
};

/// Quest's page selection over a per-page key-bounds store (page_bounds_selection.hpp).
class QuestSelection {
 public:
  using Config = QuestConfig;  ///< What the cache's constructor takes.
  static constexpr Signals required_signals{Signals::page_key_bounds};  ///< Reads the pages' key bounds.
  static constexpr SelectionKind kind = SelectionKind::page_bounds;   ///< Chooses pages from key bounds.

  /// A policy over `c` (implicit, so a Cache's constructor takes the config as it is).
  QuestSelection(const QuestConfig& c) : c_(c) {}  // NOLINT(google-explicit-constructor)

  /// Floats of the bounds store for a pool: layers × num_blocks × kv_heads × 2 × head_dim.
  static std::int64_t bounds_floats(const Geometry& g, std::int64_t num_blocks) noexcept {
    const GeometrySpec& s = g.spec();
    return std::int64_t{s.num_layers} * num_blocks * s.num_kv_heads * 2 * s.head_dim;
  }

  /// Checks the config against the cache's shape and sizes the scratch a
  /// select() call uses (allocates: construction time). Errors name the field.
  Status bind(const SelectionShape& shape) {
    const GeometrySpec& s = shape.geometry.spec();
    if (c_.first_pages < 0) return Status{Errc::invalid_argument, "first_pages", c_.first_pages, 0};
    if (c_.last_pages < 0) return Status{Errc::invalid_argument, "last_pages", c_.last_pages, 0};
    const std::int64_t forced = std::max<std::int64_t>(1, std::int64_t{c_.first_pages} + c_.last_pages);
    if (c_.token_budget < forced * s.block_size)
      return Status{Errc::invalid_argument, "token_budget (at least (first_pages + last_pages) x block_size)",
                    c_.token_budget, forced * s.block_size};
    if (c_.dense_layers < 0 || c_.dense_layers > shape.model_layers)
      return Status{Errc::invalid_argument, "dense_layers", c_.dense_layers, shape.model_layers};
    if (c_.query_group < 1) return Status{Errc::invalid_argument, "query_group", c_.query_group, 1};
    if (std::int64_t need = bounds_floats(shape.geometry, shape.num_blocks); std::int64_t(c_.bounds.size()) < need || !c_.bounds.data())
      return Status{Errc::buffer_too_small, "bounds (QuestSelection::bounds_floats)", std::int64_t(c_.bounds.size()), need};
    slices_ = s.num_layers, page_heads_ = s.num_kv_heads, dim_ = s.head_dim, blocks_ = shape.num_blocks;
    layers_ = shape.model_layers, heads_ = shape.kv_heads, ring_pages_ = shape.ring_pages;
    max_rows_ = std::max(0, shape.max_rows);
    stale_.bind(shape.streams);
    const std::size_t longest = std::size_t(std::max(0, shape.max_blocks_per_row));
    rows_indptr_.assign(std::size_t(max_rows_) + 1, 0);
    rows_indices_.assign(std::size_t(max_rows_) * longest, 0);
    out_indptr_.assign(std::size_t(max_rows_) * std::size_t(page_heads_) + 1, 0);
    scratch_.resize(page_select_scratch_bytes(shape.max_blocks_per_row, page_heads_));
    return {};
  }

  /// The config.
  const QuestConfig& config() const noexcept { return c_; }
  /// Pages a (sequence, kv-head) reads at most in a sparse layer (head-paged: on top of its ring).
  std::int32_t budget_pages(std::int32_t block_size) const noexcept { return c_.token_budget / block_size; }
  /// One slice of the store: [num_blocks][kv_heads][2][head_dim] (page_bounds'
  /// layout), per pool layer (a head-paged pool has one, for every model layer).
  std::span<float> bounds(std::int32_t slice) const noexcept {
    const std::size_t per = std::size_t(blocks_) * std::size_t(page_heads_) * 2 * std::size_t(dim_);
    return c_.bounds.subspan(std::size_t(slice) * per, per);
  }
  /// Per table stream, the pages whose bounds the engine must recompute.
  StalePages& stale() noexcept { return stale_; }
  /// Per table stream, the pages whose bounds the engine must recompute.
  const StalePages& stale() const noexcept { return stale_; }

  /// A page_select launch's inputs for one layer's queries of seqs (one row
  /// per sequence): the rows' pages and the output offsets into `plan`, and
  /// every field of the returned params but queries, out_indices and
  /// scratch. Dense layers get a budget no row reaches (every page, no
  /// estimate). All checks come first: on an error nothing is written.
  template <class Table>
  Result<PageSelectParams> plan(const Table& t, std::span<const SeqId> seqs, std::int32_t layer,
                                const SelectPlanSpans& out) const noexcept {
    for (std::size_t k = 0; k < seqs.size(); ++k)
      if (auto st = t.validate(seqs[k]); !st) return Status{st.code(), "seqs_at", std::int64_t(k), 0};
    return plan_rows(t, std::int64_t(seqs.size()), [&](auto f) { for (const SeqId s : seqs) f(s); }, layer, out);
  }
  /// plan() over a head-paged admission's rows: row k × kv_heads + h is head
  /// h of seqs[k] in `layer`, one head per page; every row's ring pages are
  /// read on top of the budget.
  template <class Table, class Admission>
  Result<PageSelectParams> plan_heads(const Table& t, const Admission& a, std::span<const SeqId> seqs, std::int32_t layer,
                                      const SelectPlanSpans& out) const noexcept {
    if (layer < 0 || layer >= layers_) return Status{Errc::invalid_argument, "layer", layer, layers_};
    auto rows = head_rows::count(a, seqs, layer);
    if (!rows) return rows.status();
    return plan_rows(t, *rows, [&](auto f) { head_rows::each(a, seqs, layer, [&](std::int64_t, SeqId h) { f(h); }); }, layer, out);
  }

  /// Host backend: the pages each (sequence, kv-head) of seqs reads for one
  /// layer's queries ([seqs][kv_heads][query_group][head_dim] fp32, post-RoPE)
  /// into `out`; returns the pages written. The store must be host memory.
  /// A wrong query count, a non-finite query or a buffer too small is an
  /// error naming it, and nothing is written. No allocation.
  template <class Table>
  Result<std::int32_t> select(const Table& t, std::span<const SeqId> seqs, std::int32_t layer,
                              std::span<const float> queries, const SelectSpans& out) noexcept {
    if (std::int64_t(seqs.size()) > max_rows_) return Status{Errc::invalid_argument, "seqs.size", std::int64_t(seqs.size()), max_rows_};
    if (auto st = check_queries(std::int64_t(seqs.size()), queries); !st) return st;
    return run(plan(t, seqs, layer, {rows_indptr_, rows_indices_, out_indptr_}), queries, out);
  }
  /// select() over a head-paged admission's rows (as plan_heads()).
  template <class Table, class Admission>
  Result<std::int32_t> select_heads(const Table& t, const Admission& a, std::span<const SeqId> seqs, std::int32_t layer,
                                    std::span<const float> queries, const SelectSpans& out) noexcept {
    const std::int64_t rows = std::int64_t(seqs.size()) * heads_;
    if (rows > max_rows_) return Status{Errc::invalid_argument, "seqs.size", std::int64_t(seqs.size()), max_rows_ / std::max(1, heads_)};
    if (auto st = check_queries(std::int64_t(seqs.size()), queries); !st) return st;
    return run(plan_heads(t, a, seqs, layer, {rows_indptr_, rows_indices_, out_indptr_}), queries, out);
  }

  /// Same config, same stale marks (the store is the caller's memory).
  friend bool operator==(const QuestSelection& a, const QuestSelection& b) {
    return a.c_.token_budget == b.c_.token_budget && a.c_.first_pages == b.c_.first_pages &&
           a.c_.last_pages == b.c_.last_pages && a.c_.dense_layers == b.c_.dense_layers &&
           a.c_.query_group == b.c_.query_group && a.c_.bounds.data() == b.c_.bounds.data() && a.stale_ == b.stale_;
  }

 private:
  Status check_queries(std::int64_t seqs, std::span<const float> queries) const noexcept {
    const std::int64_t want = seqs * heads_ * c_.query_group * dim_;
    if (std::int64_t(queries.size()) != want) return Status{Errc::invalid_argument, "queries.size", std::int64_t(queries.size()), want};
    return {};
  }

  // The plan over `rows` rows that each(f) calls f with, in row order (validated streams).
  template <class Table, class Each>
  Result<PageSelectParams> plan_rows(const Table& t, std::int64_t rows, Each&& each, std::int32_t layer,
                                     const SelectPlanSpans& out) const noexcept {
    if (layer < 0 || layer >= layers_) return Status{Errc::invalid_argument, "layer", layer, layers_};
    std::int64_t pages = 0;
    each([&](SeqId r) { pages += std::int64_t(t.blocks_unchecked(r).size()); });
    const std::int64_t out_rows = rows * page_heads_;
    if (pages * page_heads_ > INT32_MAX)
      return Status{Errc::invalid_argument, "pages x kv_heads (past int32)", pages * page_heads_, INT32_MAX};
    if (std::int64_t(out.indptr.size()) < rows + 1) return Status{Errc::buffer_too_small, "indptr", std::int64_t(out.indptr.size()), rows + 1};
    if (std::int64_t(out.indices.size()) < pages) return Status{Errc::buffer_too_small, "indices", std::int64_t(out.indices.size()), pages};
    if (std::int64_t(out.out_indptr.size()) < out_rows + 1)
      return Status{Errc::buffer_too_small, "out_indptr", std::int64_t(out.out_indptr.size()), out_rows + 1};
    std::int32_t at = 0;
    std::size_t k = 0;
    out.indptr[0] = 0;
    each([&](SeqId r) {
      const auto blocks = t.blocks_unchecked(r);
      std::copy(blocks.begin(), blocks.end(), out.indices.begin() + at);
      at += std::int32_t(blocks.size());
      out.indptr[++k] = at;
    });
    // A head-paged row reads its ring on top of the budget: the ring pages count as leading forced pages.
    const std::int32_t budget = layer < c_.dense_layers ? INT32_MAX : ring_pages_ + budget_pages(t.block_size());
    (void)page_select_indptr(out.indptr.data(), std::int32_t(rows), page_heads_, budget, out.out_indptr.data(),
                             out.out_indptr.size());
    PageSelectParams p{};
    p.bounds = bounds(slices_ == 1 ? 0 : layer).data();
    p.num_blocks = blocks_;
    p.num_kv_heads = page_heads_;
    p.head_dim = dim_;
    p.group = c_.query_group;
    p.indptr = out.indptr.data();
    p.indices = out.indices.data();
    p.num_seqs = std::int32_t(rows);
    p.num_pages = at;
    p.budget = budget;
    p.first_pages = ring_pages_ + c_.first_pages;
    p.last_pages = c_.last_pages;
    p.out_indptr = out.out_indptr.data();
    return p;
  }

  // Runs a host plan with the caller's queries into `out`.
  Result<std::int32_t> run(Result<PageSelectParams> planned, std::span<const float> queries, const SelectSpans& out) noexcept {
    if (!planned) return planned.status();
    PageSelectParams p = *planned;
    const std::int64_t rows = std::int64_t{p.num_seqs} * page_heads_, chosen = out_indptr_[std::size_t(rows)];
    if (std::int64_t(out.indptr.size()) < rows + 1) return Status{Errc::buffer_too_small, "indptr", std::int64_t(out.indptr.size()), rows + 1};
    if (std::int64_t(out.indices.size()) < chosen) return Status{Errc::buffer_too_small, "indices", std::int64_t(out.indices.size()), chosen};
    p.queries = queries.data();
    p.out_indices = out.indices.data();
    p.scratch = scratch_.data();
    p.scratch_bytes = scratch_.size();
    if (auto st = page_select_host(p); !st) return st;
    std::copy_n(out_indptr_.begin(), rows + 1, out.indptr.begin());
    return std::int32_t(chosen);
  }

  QuestConfig c_;
  std::int32_t slices_ = 0, page_heads_ = 0, dim_ = 0, blocks_ = 0, layers_ = 0, heads_ = 0, ring_pages_ = 0, max_rows_ = 0;
  StalePages stale_;
  std::vector<std::int32_t> rows_indptr_, rows_indices_, out_indptr_;  // select()'s plan
  std::vector<std::byte> scratch_;  // page_select_host's scores and order (4-byte aligned: operator new)
};
static_assert(PageBoundsSelection<QuestSelection>);

KVCACHE_END_NAMESPACE
