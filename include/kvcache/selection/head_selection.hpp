// A selection policy on head rows (a head-paged cache's participant: Quest
// over WriteGate). A dense policy is only held; a page-bounds policy hears
// every head-paged edit that leaves key bounds stale (stale_heads.hpp) and
// answers the cache's selection calls over head rows.
#pragma once

#include <cstdint>
#include <span>

#include "kvcache/config.hpp"
#include "kvcache/table/head_rows.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/selection/page_bounds_selection.hpp"
#include "kvcache/selection/row_selection.hpp"
#include "kvcache/selection/stale_heads.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// A dense selection policy over head rows: held, never called.
template <SelectionPolicy S>
class HeadSelection : public RowSelection<S> {
 public:
  using RowSelection<S>::RowSelection;
};

/// A page-bounds selection policy over head rows: bound to the cache's shape, told of every edit.
template <SelectionPolicy S>
  requires(S::kind == SelectionKind::page_bounds)
class HeadSelection<S> : public BoundPageSelection<S> {
  using BoundPageSelection<S>::s_;

 public:
  using BoundPageSelection<S>::BoundPageSelection;

  // --- hooks (cache/hooks.hpp) ---
  /// A fork's head rows share their parent's pages, stale ones included.
  template <class Heads>
  void forked(const Heads& h, SeqId parent, SeqId child) noexcept { stale_heads::forked(s_.stale(), h.admission, parent, child); }
  /// s ended: nothing of its head rows is stale.
  template <class Heads>
  void freed(const Heads& h, SeqId s) noexcept { stale_heads::freed(s_.stale(), h.admission, s); }
  /// Writes to layers [first, last) of seqs copied these shared blocks first.
  template <class Heads>
  void written(const Heads& h, std::span<const SeqId> seqs, std::int32_t first, std::int32_t last,
               std::span<const BlockCopy> copies) noexcept {
    stale_heads::copied(s_.stale(), h.table, h.admission, seqs, first, last, copies);
  }
  /// A deferred write of n tokens was replayed: the device's promotions are stale.
  template <class Heads>
  void reconciled(const Heads& h, SeqId s, std::int32_t layer, std::int32_t n) noexcept {
    stale_heads::reconciled(s_.stale(), h.table, h.admission, s, layer, n);
  }
  /// A rollback left partial global tails with the removed keys' extremes.
  template <class Heads>
  void truncated(const Heads& h, SeqId s) noexcept { stale_heads::truncated(s_.stale(), h.table, h.pool, h.admission, s); }
  /// An eviction rewrote a head row's pages from first_page on.
  template <class Heads>
  void region_compacted(const Heads&, SeqId row, std::int32_t first_page) noexcept { s_.stale().mark(row.index, first_page); }

  /// Lists and clears the stale pages of every head row of seqs.
  template <class Table, class Pool, class A>
  Result<std::int32_t> stale_pages(const Table& t, const Pool& pool, const A& a, std::span<const SeqId> seqs,
                                   const StaleSpans& out) noexcept {
    if (auto rows = head_rows::count(a, seqs, -1); !rows) return rows.status();
    return take_stale_rows(s_.stale(), t, pool, [&](auto f) { head_rows::each(a, seqs, -1, [&](std::int64_t, SeqId h) { f(h); }); },
                           out);
  }
  /// The policy's select_heads().
  template <class Table, class A>
  Result<std::int32_t> select(const Table& t, const A& a, std::span<const SeqId> seqs, std::int32_t layer,
                              std::span<const float> q, const SelectSpans& out) noexcept {
    return s_.select_heads(t, a, seqs, layer, q, out);
  }
  /// The policy's plan_heads().
  template <class Table, class A>
  Result<PageSelectParams> select_params(const Table& t, const A& a, std::span<const SeqId> seqs, std::int32_t layer,
                                         const SelectPlanSpans& plan) const noexcept {
    return s_.plan_heads(t, a, seqs, layer, plan);
  }
};

KVCACHE_END_NAMESPACE
