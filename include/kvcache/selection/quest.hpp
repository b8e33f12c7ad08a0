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

#include "kvcache/config.hpp"
#include "kvcache/geometry.hpp"
#include "kvcache/kernels/page_select.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/selection/page_bounds_selection.hpp"
#include "kvcache/selection/stale_pages.hpp"
#include "kvcache/sequence_id.hpp"
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

  /// Checks the config against the cache's geometry and sizes the scratch a
  /// select() call uses (allocates: construction time). Errors name the field.
  Status bind(const Geometry& g, std::int32_t num_blocks, std::int32_t max_sequences,
              std::int32_t max_blocks_per_sequence) {
    const GeometrySpec& s = g.spec();
    if (c_.first_pages < 0) return Status{Errc::invalid_argument, "first_pages", c_.first_pages, 0};
    if (c_.last_pages < 0) return Status{Errc::invalid_argument, "last_pages", c_.last_pages, 0};
    const std::int64_t forced = std::max<std::int64_t>(1, std::int64_t{c_.first_pages} + c_.last_pages);
    if (c_.token_budget < forced * s.block_size)
      return Status{Errc::invalid_argument, "token_budget (at least (first_pages + last_pages) x block_size)",
                    c_.token_budget, forced * s.block_size};
    if (c_.dense_layers < 0 || c_.dense_layers > s.num_layers)
      return Status{Errc::invalid_argument, "dense_layers", c_.dense_layers, s.num_layers};
    if (c_.query_group < 1) return Status{Errc::invalid_argument, "query_group", c_.query_group, 1};
    if (std::int64_t need = bounds_floats(g, num_blocks); std::int64_t(c_.bounds.size()) < need || !c_.bounds.data())
      return Status{Errc::buffer_too_small, "bounds (QuestSelection::bounds_floats)", std::int64_t(c_.bounds.size()), need};
    layers_ = s.num_layers, heads_ = s.num_kv_heads, dim_ = s.head_dim, blocks_ = num_blocks;
    max_seqs_ = std::max(0, max_sequences);
    stale_.bind(max_seqs_);
    rows_indptr_.assign(std::size_t(max_seqs_) + 1, 0);
    rows_indices_.assign(std::size_t(max_seqs_) * std::size_t(std::max(0, max_blocks_per_sequence)), 0);
    out_indptr_.assign(std::size_t(max_seqs_) * std::size_t(heads_) + 1, 0);
    scratch_.resize(page_select_scratch_bytes(max_blocks_per_sequence, heads_));
    return {};
  }

  /// The config.
  const QuestConfig& config() const noexcept { return c_; }
  /// Pages a (sequence, kv-head) reads at most in a sparse layer.
  std::int32_t budget_pages(std::int32_t block_size) const noexcept { return c_.token_budget / block_size; }
  /// One layer's slice of the store: [num_blocks][kv_heads][2][head_dim] (page_bounds' layout).
  std::span<float> bounds(std::int32_t layer) const noexcept {
    const std::size_t per = std::size_t(blocks_) * std::size_t(heads_) * 2 * std::size_t(dim_);
    return c_.bounds.subspan(std::size_t(layer) * per, per);
  }
  /// Per sequence, the pages whose bounds the engine must recompute.
  StalePages& stale() noexcept { return stale_; }
  /// Per sequence, the pages whose bounds the engine must recompute.
  const StalePages& stale() const noexcept { return stale_; }

  /// A page_select launch's inputs for one layer's queries of seqs: the rows'
  /// pages and the output offsets into `plan`, and every field of the
  /// returned params but queries, out_indices and scratch. Dense layers get a
  /// budget no row reaches (every page, no estimate). All checks come first:
  /// on an error nothing is written.
  template <class Table>
  Result<PageSelectParams> plan(const Table& t, std::span<const SeqId> seqs, std::int32_t layer,
                                const SelectPlanSpans& out) const noexcept {
    if (layer < 0 || layer >= layers_) return Status{Errc::invalid_argument, "layer", layer, layers_};
    std::int64_t pages = 0;
    for (std::size_t k = 0; k < seqs.size(); ++k) {
      if (auto st = t.validate(seqs[k]); !st) return Status{st.code(), "seqs_at", std::int64_t(k), 0};
      pages += std::int64_t(t.blocks_unchecked(seqs[k]).size());
    }
    const std::int64_t S = std::int64_t(seqs.size()), rows = S * heads_;
    if (pages * heads_ > INT32_MAX) return Status{Errc::invalid_argument, "pages x kv_heads (past int32)", pages * heads_, INT32_MAX};
    if (std::int64_t(out.indptr.size()) < S + 1) return Status{Errc::buffer_too_small, "indptr", std::int64_t(out.indptr.size()), S + 1};
    if (std::int64_t(out.indices.size()) < pages) return Status{Errc::buffer_too_small, "indices", std::int64_t(out.indices.size()), pages};
    if (std::int64_t(out.out_indptr.size()) < rows + 1)
      return Status{Errc::buffer_too_small, "out_indptr", std::int64_t(out.out_indptr.size()), rows + 1};
    std::int32_t at = 0;
    out.indptr[0] = 0;
    for (std::size_t k = 0; k < seqs.size(); ++k) {
      const auto blocks = t.blocks_unchecked(seqs[k]);
      std::copy(blocks.begin(), blocks.end(), out.indices.begin() + at);
      at += std::int32_t(blocks.size());
      out.indptr[k + 1] = at;
    }
    const std::int32_t budget = layer < c_.dense_layers ? INT32_MAX : budget_pages(t.block_size());
    (void)page_select_indptr(out.indptr.data(), std::int32_t(S), heads_, budget, out.out_indptr.data(), out.out_indptr.size());
    PageSelectParams p{};
    p.bounds = bounds(layer).data();
    p.num_blocks = blocks_;
    p.num_kv_heads = heads_;
    p.head_dim = dim_;
    p.group = c_.query_group;
    p.indptr = out.indptr.data();
    p.indices = out.indices.data();
    p.num_seqs = std::int32_t(S);
    p.num_pages = at;
    p.budget = budget;
    p.first_pages = c_.first_pages;
    p.last_pages = c_.last_pages;
    p.out_indptr = out.out_indptr.data();
    return p;
  }

  /// Host backend: the pages each (sequence, kv-head) of seqs reads for one
  /// layer's queries ([seqs][kv_heads][query_group][head_dim] fp32, post-RoPE)
  /// into `out`; returns the pages written. The store must be host memory.
  /// A wrong query count, a non-finite query or a buffer too small is an
  /// error naming it, and nothing is written. No allocation.
  template <class Table>
  Result<std::int32_t> select(const Table& t, std::span<const SeqId> seqs, std::int32_t layer,
                              std::span<const float> queries, const SelectSpans& out) noexcept {
    if (std::int64_t(seqs.size()) > max_seqs_) return Status{Errc::invalid_argument, "seqs.size", std::int64_t(seqs.size()), max_seqs_};
    const std::int64_t S = std::int64_t(seqs.size()), want = S * heads_ * c_.query_group * dim_;
    if (std::int64_t(queries.size()) != want) return Status{Errc::invalid_argument, "queries.size", std::int64_t(queries.size()), want};
    auto planned = plan(t, seqs, layer, {rows_indptr_, rows_indices_, out_indptr_});
    if (!planned) return planned.status();
    PageSelectParams p = *planned;
    const std::int64_t rows = S * heads_, chosen = out_indptr_[std::size_t(rows)];
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

  /// Same config, same stale marks (the store is the caller's memory).
  friend bool operator==(const QuestSelection& a, const QuestSelection& b) {
    return a.c_.token_budget == b.c_.token_budget && a.c_.first_pages == b.c_.first_pages &&
           a.c_.last_pages == b.c_.last_pages && a.c_.dense_layers == b.c_.dense_layers &&
           a.c_.query_group == b.c_.query_group && a.c_.bounds.data() == b.c_.bounds.data() && a.stale_ == b.stale_;
  }

 private:
  QuestConfig c_;
  std::int32_t layers_ = 0, heads_ = 0, dim_ = 0, blocks_ = 0, max_seqs_ = 0;
  StalePages stale_;
  std::vector<std::int32_t> rows_indptr_, rows_indices_, out_indptr_;  // select()'s plan
  std::vector<std::byte> scratch_;  // page_select_host's scores and order (4-byte aligned: operator new)
};
static_assert(PageBoundsSelection<QuestSelection>);

KVCACHE_END_NAMESPACE
