// A selection policy on per-sequence rows (a token-paged cache's
// participant). A dense policy is only held; a page-bounds policy (Quest)
// also hears every edit of a row that leaves key bounds stale
// (stale_rows.hpp) and answers the cache's selection calls.
#pragma once

#include <cstdint>
#include <span>

#include "kvcache/config.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/selection/page_bounds_selection.hpp"
#include "kvcache/selection/stale_rows.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// A dense selection policy (every query reads every page): held, never called.
template <SelectionPolicy S>
class RowSelection {
 public:
  using Arg = S;  ///< What the cache's constructor takes for it.
  RowSelection() = default;
  /// Takes the policy.
  explicit RowSelection(S policy) : s_(std::move(policy)) {}
  const S& policy() const noexcept { return s_; }  ///< The policy.
  friend bool operator==(const RowSelection&, const RowSelection&) { return true; }

 private:
  [[no_unique_address]] S s_{};
};

/// A page-bounds selection policy: bound to the cache's shape, told of every edit.
template <SelectionPolicy S>
  requires(S::kind == SelectionKind::page_bounds)
class RowSelection<S> : public BoundPageSelection<S> {
  using BoundPageSelection<S>::s_;

 public:
  using BoundPageSelection<S>::BoundPageSelection;

  // --- hooks (cache/hooks.hpp) ---
  /// A fork shares its parent's pages, stale ones included.
  template <class Rows>
  void forked(const Rows&, SeqId parent, SeqId child) noexcept { s_.stale().copy(parent.index, child.index); }
  /// s ended: nothing of it is stale.
  template <class Rows>
  void freed(const Rows&, SeqId s) noexcept { s_.stale().clear(s.index); }
  /// A reserve copied a shared tail: the copy's bounds are stale.
  template <class Rows>
  void reserved(const Rows& r, SeqId s, std::int32_t n, const BlockCopy& copy) noexcept {
    stale_rows::reserved(s_.stale(), r.table, s, n, copy);
  }
  /// A reserve_batch copied shared tails: their bounds are stale.
  template <class Rows>
  void reserved_batch(const Rows& r, std::span<const SeqId> seqs, std::span<const std::int32_t> counts,
                      std::span<const BlockCopy> copies) noexcept {
    stale_rows::reserved(s_.stale(), r.table, seqs, counts, copies);
  }
  /// An import's n received tokens landed: no page_bounds_update saw their
  /// keys, and the pages stay unbounded for any row that adopts them until listed.
  template <class Rows>
  void imported(const Rows& r, SeqId s, std::int32_t n) noexcept {
    if (n <= 0) return;
    const std::int32_t first = stale_rows::first_new_block(r.table, s, n);
    s_.stale().mark(s.index, first);
    this->mark_unbounded(r.table.blocks_unchecked(s).subspan(std::size_t(first)));
  }
  /// s adopted `hits` published pages (a prefix hit): one no listing has bounded yet is stale for s too.
  template <class Rows>
  void adopted(const Rows& r, SeqId s, std::int32_t hits) noexcept {
    if (const std::int32_t j = this->first_unbounded(r.table.blocks_unchecked(s).first(std::size_t(hits))); j >= 0)
      s_.stale().mark(s.index, j);
  }
  /// A rollback left a partial tail with the removed keys' extremes.
  template <class Rows>
  void truncated(const Rows& r, SeqId s, std::int32_t n) noexcept {
    if (n > 0) stale_rows::truncated(s_.stale(), r.table, r.pool, s);
  }
  /// An eviction rewrote or dropped pages of s.
  template <class Rows, class Result>
  void evicted(const Rows& r, SeqId s, const Result& result) noexcept {
    stale_rows::evicted(s_.stale(), s, result, r.table.block_size());
  }

  /// Lists and clears the stale pages of seqs (cache.hpp's stale_pages()).
  template <class Table, class Pool>
  Result<std::int32_t> stale_pages(const Table& t, const Pool& pool, std::span<const SeqId> seqs, const StaleSpans& out) noexcept {
    auto n = take_stale_pages(s_.stale(), t, pool, seqs, out);
    if (n) this->listed(out.pages.first(std::size_t(*n)));
    return n;
  }
  /// The policy's select() on rows.
  template <class Table>
  Result<std::int32_t> select(const Table& t, std::span<const SeqId> seqs, std::int32_t layer, std::span<const float> q,
                              const SelectSpans& out) noexcept {
    return s_.select(t, seqs, layer, q, out);
  }
  /// The policy's plan() on rows.
  template <class Table>
  Result<PageSelectParams> select_params(const Table& t, std::span<const SeqId> seqs, std::int32_t layer,
                                         const SelectPlanSpans& plan) const noexcept {
    return s_.plan(t, seqs, layer, plan);
  }
};

KVCACHE_END_NAMESPACE
