// Where each stream stands against its eviction policy's bound, so that
// check_invariants() can tell a legal state from a bug:
//   - tokens reserved since the last evict() have not met the policy yet
//     (between reserve and evict a stream may sit above its bound);
//   - tokens that shared blocks pinned at the last evict() are reported as
//     the stream's shared excess, not as a violation;
//   - token policies reorder the row when they compact, so a rollback can
//     only reach back to the last compaction (newer tokens are still the
//     row's tail, in order).
// Sized once; the cache keeps it for policies that evict.
#pragma once

#include <cstdint>
#include <vector>

#include "kvcache/config.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Per stream: where the policy last met its bound, and how far sharing kept it above (see check_invariants).
class BoundLedger {
 public:
  /// What the ledger knows about one stream.
  struct Entry {
    std::int64_t settled = 0;       ///< `appended` as of the last evict(), less its pending queries
    std::int64_t excess = 0;        ///< tokens above the bound that shared blocks pinned at that evict()
    std::int64_t compacted_at = 0;  ///< `appended` at the last evict() that reordered the row
    friend constexpr bool operator==(const Entry&, const Entry&) = default;
  };

  /// Sizes the ledger for `streams` streams; nothing is allocated later.
  void bind(std::int32_t streams) {
    e_.assign(checked_elements("kvcache::BoundLedger", "max_sequences", streams, streams, static_cast<std::int64_t>(sizeof(Entry))), Entry{});
  }
  /// The stream's entry.
  const Entry& at(std::uint32_t s) const noexcept { return e_[s]; }

  /// An evict() ran: the stream has met its policy up to `settled` appended
  /// tokens, `excess` of its tokens are pinned above the bound by sharing,
  /// and (when `reordered`) its row no longer lists tokens by age.
  void settle(std::uint32_t s, std::int64_t settled, std::int64_t excess, bool reordered, std::int64_t appended) noexcept {
    e_[s].settled = settled;
    e_[s].excess = excess;
    if (reordered) e_[s].compacted_at = appended;
  }
  /// Tokens a rollback may remove: those appended since the last reorder.
  std::int64_t rollback_limit(std::uint32_t s, std::int64_t appended) const noexcept { return appended - e_[s].compacted_at; }
  /// A rollback left `appended` tokens appended.
  void on_truncate(std::uint32_t s, std::int64_t appended) noexcept {
    if (e_[s].settled > appended) e_[s].settled = appended;
  }
  /// The stream was freed.
  void reset(std::uint32_t s) noexcept { e_[s] = Entry{}; }
  /// A fork: the child stands where its parent stands.
  void copy(std::uint32_t from, std::uint32_t to) noexcept { e_[to] = e_[from]; }

  friend bool operator==(const BoundLedger&, const BoundLedger&) = default;

 private:
  std::vector<Entry> e_;
};

KVCACHE_END_NAMESPACE
