// An eviction policy on head rows (a head-paged cache's participant). A
// head row's ring is never evicted; a token policy evicts from each row's
// global region (global_region.hpp), one stream of the policy per head row.
// Any other policy only bounds what a row holds (KeepAll).
#pragma once

#include <cstdint>
#include <span>

#include "kvcache/config.hpp"
#include "kvcache/eviction/global_region.hpp"
#include "kvcache/eviction/plan.hpp"
#include "kvcache/table/head_rows.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// A policy that does not evict from head rows: held for its bounds.
template <EvictionPolicy E>
class HeadEviction {
 public:
  static constexpr bool evicts = false;  ///< evict() and observe() do not exist.
  HeadEviction() = default;
  /// Takes the policy.
  explicit HeadEviction(E policy) : e_(std::move(policy)) {}
  /// Nothing to size.
  void bind(const EvictionShape&) noexcept {}
  const E& policy() const noexcept { return e_; }  ///< The policy.
  friend bool operator==(const HeadEviction&, const HeadEviction&) { return true; }

 private:
  [[no_unique_address]] E e_{};
};

/// A token policy on each head row's global region.
template <EvictionPolicy E>
  requires TokenEviction<E>
class HeadEviction<E> {
 public:
  static constexpr bool evicts = true;  ///< evict() runs the policy on the global regions.
  HeadEviction() = default;
  /// Takes the policy.
  explicit HeadEviction(E policy) : e_(std::move(policy)) {}
  /// Binds the policy to the head rows (shape.streams of up to shape.max_tokens
  /// tokens); the policy has one group (a head row is one kv-head), else ConfigError.
  void bind(const EvictionShape& shape) {
    if (e_.groups() != 1)
      throw ConfigError("kvcache::Cache", Status{Errc::invalid_argument, "eviction.groups (one per head row)", e_.groups(), 1});
    e_.bind(shape);
    region_.bind(shape.streams, shape.max_tokens);
  }
  const E& policy() const noexcept { return e_; }  ///< The policy.

  // --- hooks (cache/hooks.hpp) ---
  /// A fork's regions start where its parent's stand.
  template <class Heads>
  void forked(const Heads& h, SeqId parent, SeqId child) noexcept { region_.forked(h.admission, e_, parent, child); }
  /// s ended: its regions start over.
  template <class Heads>
  void freed(const Heads& h, SeqId s) noexcept { region_.freed(h.admission, e_, s); }
  /// A rollback: the regions take back their newest tokens.
  template <class Heads>
  void truncated(const Heads& h, SeqId s) noexcept { region_.truncated(h.admission, e_, s); }

  /// One layer's scores for every head row of s (cache.hpp's observe()).
  template <class A>
  Status observe(const PageTable& t, const BlockPool& pool, const A& a, SeqId s, std::int32_t layer, ScoreKind kind,
                 std::span<const float> values) noexcept
    requires ObservingEviction<E>
  {
    return region_.observe(t, pool, a, e_, s, layer, kind, values);
  }
  /// Evicts and compacts every head row's global region of s; changed(row, page) hears the rewritten pages.
  template <class A, class Changed>
  Result<EvictionResult> evict(PageTable& t, BlockPool& pool, A& a, SeqId s, std::span<SlotMove> moves,
                               Changed&& changed) noexcept {
    return region_.evict(t, pool, a, e_, s, moves, changed);
  }

  friend bool operator==(const HeadEviction& a, const HeadEviction& b) { return a.e_ == b.e_ && a.region_ == b.region_; }

 private:
  E e_{};
  GlobalRegion region_;
};

KVCACHE_END_NAMESPACE
