// Which pages of each sequence hold a page-bounds entry that no longer
// matches their keys. Appends keep bounds current on their own (the
// engine's page_bounds_update after the scatter); the edits that rewrite
// held slots (a copy-on-write block, a compaction, a rotation, a rollback's
// partial tail) mark the row stale from the first logical block they
// changed, and the engine recomputes those pages (page_bounds) before it
// selects. One int32 per sequence: the edits only ever change a row from
// some block to its end.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvcache/config.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Per sequence, the first logical block whose bounds are stale (none: INT32_MAX).
class StalePages {
 public:
  static constexpr std::int32_t none = INT32_MAX;  ///< Nothing stale.

  /// Sizes the table for `max_sequences` handles, all clean (allocates: construction time).
  void bind(std::int32_t max_sequences) { from_.assign(std::size_t(std::max(0, max_sequences)), none); }
  /// Blocks `from` and later of sequence `s` must be recomputed.
  void mark(std::uint32_t s, std::int32_t from) noexcept { from_[s] = std::min(from_[s], std::max(0, from)); }
  /// `k` blocks left the front of the row: logical indices shift down.
  void shift(std::uint32_t s, std::int32_t k) noexcept {
    if (from_[s] != none) from_[s] = std::max(0, from_[s] - k);
  }
  /// First stale logical block of s (none when clean).
  std::int32_t from(std::uint32_t s) const noexcept { return from_[s]; }
  /// s is clean again (its pages were recomputed, or it was freed).
  void clear(std::uint32_t s) noexcept { from_[s] = none; }
  /// A fork shares its parent's blocks, stale ones included.
  void copy(std::uint32_t src, std::uint32_t dst) noexcept { from_[dst] = from_[src]; }
  friend bool operator==(const StalePages&, const StalePages&) = default;

 private:
  std::vector<std::int32_t> from_;
};

KVCACHE_END_NAMESPACE
