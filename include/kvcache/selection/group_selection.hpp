// A selection policy on a hybrid model's global layers (HybridCache's
// participant). The full and MLA groups grow with the context, so that is
// where a page-bounds policy (Quest) pays: a query of a global layer reads
// its best-bounded pages within the budget. Window and chunked groups keep
// their own retention: a query there reads only the few pages its rule holds.
//
// The global layers are the layers of every full and MLA group, counted in
// model order: slice k of the bounds store is the k-th of them, and the
// store is [global layers][num_blocks][kv_heads][2][head_dim] floats
// (global_geometry() gives the Geometry QuestSelection::bounds_floats takes).
// One pool serves every group, so a page id names one page of one group and
// the store needs no group index. The global groups must share kv_heads and
// head_dim (the store's shape); their block sizes may differ.
//
// Stale pages, per write path (the engine runs the kernels, as on Cache<>):
//   admit / reserve / advance  page_bounds_update on the returned slots of
//                              each global group, after the scatter
//   commit_import              the received pages: stale_pages() lists them,
//                              for every row that adopts one as a prefix hit
//                              before a listing too
//   truncate                   a partial tail keeps the removed keys' extremes:
//                              listed unless still published or shared
//   evict (a block policy)     nothing: a hole rewrites no page; the policy
//                              plans on the row's live pages (RowView), and
//                              a listing skips the holes
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/pool/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/core/geometry.hpp"
#include "kvcache/groups/group_rows.hpp"
#include "kvcache/groups/layer_groups.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/selection/page_bounds_selection.hpp"
#include "kvcache/selection/stale_rows.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE


/// The bounds store's shape for a layout's global layers: num_layers = the
/// full and MLA groups' layers, their kv_heads and head_dim, the largest of
/// their block sizes. invalid_argument names a layout with no global group,
/// or global groups whose kv_heads or head_dim differ.
inline Result<Geometry> global_geometry(const LayerGroups& lg) noexcept {
  std::int32_t layers = 0, block = 1, first = -1;
  for (std::int32_t g = 0; g < lg.num_groups(); ++g) {
    if (!global_kind(lg.spec(g).kind)) continue;
    if (first < 0) first = g;
    const LayerGroupSpec &a = lg.spec(first), &b = lg.spec(g);
    if (b.num_kv_heads != a.num_kv_heads)
      return Status{Errc::invalid_argument, "num_kv_heads (global groups share the bounds store's shape)", b.num_kv_heads, a.num_kv_heads};
    if (b.head_dim != a.head_dim)
      return Status{Errc::invalid_argument, "head_dim (global groups share the bounds store's shape)", b.head_dim, a.head_dim};
    layers += lg.layers_in(g);
    block = std::max(block, lg.block_size(g));
  }
  if (first < 0) return Status{Errc::invalid_argument, "groups (no full or MLA group to select on)", lg.num_groups(), 0};
  const LayerGroupSpec& s = lg.spec(first);
  return Geometry::make({.num_layers = layers, .num_kv_heads = s.num_kv_heads, .head_dim = s.head_dim, .block_size = block});
}

/// A dense selection (every query reads every page): held, never called, no space.
template <SelectionPolicy S>
class GroupSelection {
 public:
  using Arg = S;  ///< What the cache's constructor takes for it.
  static constexpr bool selects = false;  ///< The cache answers no selection call.
  GroupSelection() = default;
  /// Takes the policy.
  explicit GroupSelection(S policy) : s_(std::move(policy)) {}
  void bind(const LayerGroups&, std::int32_t, std::int32_t, std::int32_t) {}  ///< Nothing to bind.
  const S& policy() const noexcept { return s_; }  ///< The policy.
  void freed(std::uint32_t) noexcept {}  ///< A row ended: nothing to hear.
  void received(std::span<const GroupRows>, std::uint32_t, std::int64_t) noexcept {}  ///< An import landed: nothing to hear.
  void adopted(std::span<const GroupRows>, std::uint32_t) noexcept {}  ///< A prefix hit: nothing to hear.
  void truncated(std::span<const GroupRows>, const BlockPool&, std::uint32_t, std::int64_t) noexcept {}  ///< A rollback: nothing to hear.
  friend bool operator==(const GroupSelection&, const GroupSelection&) { return true; }

 private:
  [[no_unique_address]] S s_{};
};

/// A page-bounds policy on the global layers: bound to the layout, told of the edits that leave bounds stale.
template <SelectionPolicy S>
  requires(S::kind == SelectionKind::page_bounds)
class GroupSelection<S> : public BoundPageSelection<S> {
  using BoundPageSelection<S>::s_;

 public:
  using BoundPageSelection<S>::BoundPageSelection;
  static constexpr bool selects = true;  ///< The cache answers page_bounds, stale_pages, select, select_params.

  /// Maps model layers to store slices and binds the policy (construction
  /// time); ConfigError when the layout has no global group, its global
  /// groups differ in shape, or the policy does not fit.
  void bind(const LayerGroups& lg, std::int32_t num_blocks, std::int32_t max_sequences, std::int32_t max_tokens) {
    auto geometry = global_geometry(lg);
    if (!geometry) throw ConfigError("kvcache::HybridCache (selection)", geometry.status());
    slice_.assign(std::size_t(lg.num_layers()), -1);
    std::int32_t longest = 0, k = 0;
    for (std::int32_t l = 0; l < lg.num_layers(); ++l) {
      const std::int32_t g = lg.layer_slot(l).group;
      if (!global_kind(lg.spec(g).kind)) continue;
      slice_[std::size_t(l)] = k++;
      group_of_.push_back(g);
      longest = std::max(longest, std::int32_t(blocks_for_tokens(max_tokens, lg.block_size(g))));
    }
    for (std::int32_t g = 0; g < lg.num_groups(); ++g)
      if (global_kind(lg.spec(g).kind)) globals_.push_back(g);
    seqs_ = max_sequences;
    compact_.resize(std::size_t(longest));
    BoundPageSelection<S>::bind({.geometry = *geometry, .num_blocks = num_blocks, .model_layers = k,
                                 .streams = max_sequences * std::int32_t(globals_.size()), .max_rows = max_sequences,
                                 .max_blocks_per_row = longest, .kv_heads = geometry->spec().num_kv_heads},
                                "kvcache::HybridCache (selection)");
  }

  /// Model layer `layer`'s slice of the store: invalid_argument for a layer
  /// outside the model or in a window, chunked or cross group.
  Result<std::span<float>> page_bounds(std::int32_t layer) const noexcept {
    auto k = slice(layer);
    if (!k) return k.status();
    return s_.bounds(*k);
  }

  // --- the cache's edits ---
  /// Row i ended: nothing of it is stale.
  void freed(std::uint32_t i) noexcept {
    for (std::size_t k = 0; k < globals_.size(); ++k) s_.stale().clear(stream(k, i));
  }
  /// An import of row i landed: its pages past the first `cached` tokens
  /// hold K no page_bounds_update saw.
  void received(std::span<const GroupRows> rows, std::uint32_t i, std::int64_t cached) noexcept {
    for (std::size_t k = 0; k < globals_.size(); ++k) {
      const GroupRows& r = rows[std::size_t(globals_[k])];
      const auto first = std::int32_t(cached / r.rule().block_size);
      if (first >= std::int32_t(r.row(i).size())) continue;
      s_.stale().mark(stream(k, i), first);
      this->mark_unbounded(r.row(i).subspan(std::size_t(first)));  // published at commit: a hit may adopt them first
    }
  }
  /// Row i was admitted holding prefix hits only: a hit page whose received
  /// keys no listing has bounded yet is stale for row i too.
  void adopted(std::span<const GroupRows> rows, std::uint32_t i) noexcept {
    for (std::size_t k = 0; k < globals_.size(); ++k)
      if (const std::int32_t j = this->first_unbounded(rows[std::size_t(globals_[k])].row(i)); j >= 0) s_.stale().mark(stream(k, i), j);
  }
  /// Row i was rolled back to `tokens`: a partial tail keeps the removed
  /// keys' extremes (recomputed unless another holder may read it whole).
  void truncated(std::span<const GroupRows> rows, const BlockPool& pool, std::uint32_t i, std::int64_t tokens) noexcept {
    for (std::size_t k = 0; k < globals_.size(); ++k) {
      const GroupRows& r = rows[std::size_t(globals_[k])];
      stale_rows::truncated_tail(s_.stale(), stream(k, i), r.row(i), tokens, r.rule().block_size, pool);
    }
  }

  // --- the calls (HybridCache forwards them; `validate` checks a handle, `tokens` gives a row's length) ---
  /// Lists and clears the stale pages of seqs' global rows (row by row, group
  /// by group) as (page, fill); all or nothing; a bad handle is seqs_at.
  template <class Validate, class Tokens>
  Result<std::int32_t> stale_pages(std::span<const GroupRows> rows, const BlockPool& pool, Validate&& validate, Tokens&& tokens,
                                   std::span<const SeqId> seqs, const StaleSpans& out) noexcept {
    for (std::size_t k = 0; k < seqs.size(); ++k)
      if (auto st = validate(seqs[k]); !st) return Status{st.code(), "seqs_at", std::int64_t(k), 0};
    auto n = take_stale_rows(
        s_.stale(), pool,
        [&](auto f) {
          for (const SeqId s : seqs)
            for (std::size_t k = 0; k < globals_.size(); ++k) {
              const GroupRows& r = rows[std::size_t(globals_[k])];
              f(stream(k, s.index), r.row(s.index), std::int64_t{tokens(s.index)}, r.rule().block_size);
            }
        },
        out);
    if (n) this->listed(out.pages.first(std::size_t(*n)));
    return n;
  }
  /// The policy's select() on model layer `layer`'s group rows.
  template <class Validate>
  Result<std::int32_t> select(std::span<const GroupRows> rows, Validate&& validate, std::span<const SeqId> seqs, std::int32_t layer,
                              std::span<const float> q, const SelectSpans& out) noexcept {
    auto k = slice(layer);
    if (!k) return k.status();
    return s_.select(RowView<Validate>{rows[std::size_t(group_of_[std::size_t(*k)])], validate, compact_}, seqs, *k, q, out);
  }
  /// The policy's plan() on model layer `layer`'s group rows.
  template <class Validate>
  Result<PageSelectParams> select_params(std::span<const GroupRows> rows, Validate&& validate, std::span<const SeqId> seqs,
                                         std::int32_t layer, const SelectPlanSpans& plan) const noexcept {
    auto k = slice(layer);
    if (!k) return k.status();
    return s_.plan(RowView<Validate>{rows[std::size_t(group_of_[std::size_t(*k)])], validate, compact_}, seqs, *k, plan);
  }

  friend bool operator==(const GroupSelection& a, const GroupSelection& b) { return a.s_ == b.s_; }

 private:
  // One group's rows as the table a page-bounds policy plans on: a row an
  // eviction left holes in is its live blocks, compacted into `compact`
  // (valid until the next call: the policy reads each row at once).
  template <class Validate>
  struct RowView {
    const GroupRows& rows;
    Validate& check;
    std::vector<BlockId>& compact;
    Status validate(SeqId s) const noexcept { return check(s); }
    std::span<const BlockId> blocks_unchecked(SeqId s) const noexcept {
      if (rows.holes(s.index) == 0) return rows.row(s.index);
      return {compact.data(), std::size_t(rows.copy_live(s.index, compact.begin()) - compact.begin())};
    }
    std::int32_t block_size() const noexcept { return rows.rule().block_size; }
  };
  Result<std::int32_t> slice(std::int32_t layer) const noexcept {
    if (layer < 0 || layer >= std::int32_t(slice_.size())) return Status{Errc::invalid_argument, "layer", layer, std::int64_t(slice_.size())};
    if (slice_[std::size_t(layer)] < 0)
      return Status{Errc::invalid_argument, "layer (in a window, chunked or cross group: selection acts on full and MLA groups)", layer, 0};
    return slice_[std::size_t(layer)];
  }
  std::uint32_t stream(std::size_t k, std::uint32_t i) const noexcept { return std::uint32_t(k) * std::uint32_t(seqs_) + i; }

  std::vector<std::int32_t> slice_;     // [model layer]: its store slice, -1 outside the global groups
  std::vector<std::int32_t> group_of_;  // [slice]: the group whose rows its queries read
  std::vector<std::int32_t> globals_;   // the full and MLA groups, in group order
  std::int32_t seqs_ = 0;
  mutable std::vector<BlockId> compact_;  // a row with eviction holes, as RowView hands it to the policy
};

KVCACHE_END_NAMESPACE
