// What an eviction step did, for the engine to act on.
#pragma once

#include <cstdint>
#include <span>

#include "kvcache/config.hpp"
#include "kvcache/core/slot_move.hpp"

KVCACHE_BEGIN_NAMESPACE

/// A kept block that moved up: its keys' positions changed by `delta` tokens
/// (negative), so an engine that re-rotates passes (block, delta) to the rope kernel.
struct BlockRotation {
  std::int32_t block = -1;  ///< physical block
  std::int32_t new_index = -1;  ///< its logical index after eviction
  std::int32_t delta = 0;  ///< position change of its tokens
  friend constexpr bool operator==(const BlockRotation&, const BlockRotation&) = default;
};

/// Where Cache::evict writes what the engine must act on; a policy kind uses
/// only its own spans (cache.hpp says which).
struct EvictionSpans {
  std::span<std::int32_t> blocks{};  ///< block policies: logical blocks removed
  std::span<BlockRotation> rotations{};  ///< block policies: kept blocks that moved
  std::span<SlotMove> moves{};  ///< token policies: compaction moves, group after group
  std::span<std::int32_t> group_moves{};  ///< token policies: groups() + 1 offsets into moves
};

/// What one evict() did.
struct EvictionResult {
  std::int32_t evicted = 0;  ///< blocks that left the row (written to blocks for block policies)
  std::int32_t rotations = 0;  ///< kept blocks that moved
  std::int32_t tokens = 0;  ///< tokens that left
  std::int32_t moves = 0;  ///< compaction moves written (all groups)
  /// Block and token policies: the lowest token index whose slot now holds
  /// another token or none (the pages from there on hold other keys: their
  /// key bounds go stale). Window policies: 0 (the front moved).
  std::int32_t first_changed = 0;
  /// Window policies: the tokens left the row's front (its logical blocks
  /// shift down by `evicted`); no held slot was rewritten.
  bool front = false;
};

KVCACHE_END_NAMESPACE
