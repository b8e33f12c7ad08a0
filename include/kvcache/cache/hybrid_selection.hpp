// The selection calls of a HybridCache whose global layers (its full and MLA
// groups) carry a page-bounds policy: the same calls as Cache<>'s
// (page_bounds, stale_pages, select, select_params), with `layer` a model
// layer of a full or MLA group. What the policy decides and which edits
// leave bounds stale live in selection/group_selection.hpp; a dense policy
// adds no call.
#pragma once

#include <cstdint>
#include <span>

#include "kvcache/config.hpp"
#include "kvcache/kernels/params/page_select.hpp"
#include "kvcache/selection/group_selection.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// A dense selection: the policy alone.
template <class Cache, class Selection>
class HybridSelection {
 public:
  /// The selection policy.
  const Selection& selection() const noexcept { return static_cast<const Cache&>(*this).selection_.policy(); }
};

/// A page-bounds selection on the global layers (HybridCache derives from it and befriends it).
template <class Cache, class Selection>
  requires(GroupSelection<Selection>::selects)
class HybridSelection<Cache, Selection> {
 public:
  /// The selection policy.
  const Selection& selection() const noexcept { return self().selection_.policy(); }
  /// Model layer `layer`'s slice of the page-bounds store: invalid_argument
  /// for a layer outside the model or in a window, chunked or cross group.
  Result<std::span<float>> page_bounds(std::int32_t layer) const noexcept { return self().selection_.page_bounds(layer); }
  /// Lists and clears the pages of seqs' global rows whose bounds are stale
  /// (received by an import, a rolled-back tail): run page_bounds on them,
  /// every global layer, before select(). All or nothing; returns pages listed.
  Result<std::int32_t> stale_pages(std::span<const SeqId> seqs, const StaleSpans& out) noexcept {
    Cache& c = static_cast<Cache&>(*this);
    return c.selection_.stale_pages(c.rows_, c.pool_, checker(), [&c](std::uint32_t i) { return c.seqs_[i].reserved; }, seqs, out);
  }
  /// Host selection for model layer `layer` (of a full or MLA group): the
  /// pages each (sequence, kv-head) of seqs reads, as a head-folded CSR (the
  /// policy's select(), e.g. QuestSelection::select, on that group's rows).
  Result<std::int32_t> select(std::span<const SeqId> seqs, std::int32_t layer, std::span<const float> queries,
                              const SelectSpans& out) noexcept {
    Cache& c = static_cast<Cache&>(*this);
    return c.selection_.select(c.rows_, checker(), seqs, layer, queries, out);
  }
  /// A page_select launch's inputs for model layer `layer`: its group's rows
  /// and the output offsets (the policy's plan()).
  Result<PageSelectParams> select_params(std::span<const SeqId> seqs, std::int32_t layer, const SelectPlanSpans& plan) const noexcept {
    return self().selection_.select_params(self().rows_, checker(), seqs, layer, plan);
  }

 private:
  auto checker() const noexcept {
    return [this](SeqId id) { return self().validate(id); };
  }
  const Cache& self() const noexcept { return static_cast<const Cache&>(*this); }
};

KVCACHE_END_NAMESPACE
