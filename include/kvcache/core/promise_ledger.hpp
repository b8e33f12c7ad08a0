// The scheduler's ledger, one per cache: the blocks each sequence was
// promised over its life (its blocks_needed, recorded by admit() with
// max_new, an import, or promise()). Admission by lifetime need counts the
// free pool less what is still owed, so a running request never has to be
// preempted for one admitted after it. Every cache keeps its promises here,
// with the same checks and the same words.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvcache/config.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Lifetime blocks promised per handle slot; a slot with no sequence owes nothing (0).
class PromiseLedger {
 public:
  PromiseLedger() = default;
  /// `slots` handle slots, nothing promised (sized once: no allocation after).
  explicit PromiseLedger(std::int32_t slots) : promised_(std::size_t(slots > 0 ? slots : 0), 0) {}

  /// Blocks promised to slot s (0: none).
  std::int64_t promised(std::uint32_t s) const noexcept { return promised_[s]; }
  /// The scheduler's promise(): slot s will hold up to `blocks` (at most
  /// `row_blocks`, the most one sequence can hold: more is never owed; 0
  /// withdraws it). A negative or larger value is invalid_argument naming it; nothing changes then.
  Status promise(std::uint32_t s, std::int64_t blocks, std::int64_t row_blocks) noexcept {
    if (blocks < 0) return Status{Errc::invalid_argument, "blocks", blocks, 0};
    if (blocks > row_blocks) return Status{Errc::invalid_argument, "blocks", blocks, row_blocks};
    promised_[s] = blocks;
    return {};
  }
  /// A promise its caller already checked against the free pool (admit()'s, an import's lifetime need).
  void record(std::uint32_t s, std::int64_t blocks) noexcept { promised_[s] = blocks; }
  /// Slot s's sequence ended: it owes nothing.
  void forget(std::uint32_t s) noexcept { promised_[s] = 0; }
  /// A fork: the child carries its parent's promise.
  void copy(std::uint32_t parent, std::uint32_t child) noexcept { promised_[child] = promised_[parent]; }

  /// Blocks still owed: each promise less the blocks its sequence holds now
  /// (held(slot)), never below 0. O(slots); slots with no promise are skipped unread.
  template <class Held>
  std::int64_t outstanding(Held&& held) const noexcept {
    std::int64_t owed = 0;
    for (std::size_t i = 0; i < promised_.size(); ++i)
      if (promised_[i] != 0) owed += std::max<std::int64_t>(0, promised_[i] - std::int64_t(held(std::uint32_t(i))));
    return owed;
  }

  /// invariant_violated naming a slot with no live sequence (live(slot) false) that still owes a promise.
  template <class Live>
  Status check(Live&& live) const noexcept {
    for (std::size_t i = 0; i < promised_.size(); ++i)
      if (promised_[i] != 0 && !live(std::uint32_t(i))) return Status{Errc::invariant_violated, "promise (a free handle)", std::int64_t(i), promised_[i]};
    return {};
  }

  friend bool operator==(const PromiseLedger&, const PromiseLedger&) = default;

 private:
  std::vector<std::int64_t> promised_;  // [slot]
};

KVCACHE_END_NAMESPACE
