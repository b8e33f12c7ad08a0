// What an eviction step did, for the engine to act on.
#pragma once

#include <cstdint>

#include "kvcache/config.hpp"

KVCACHE_BEGIN_NAMESPACE

// A kept block that moved up: its keys' positions changed by `delta` tokens
// (negative), so an engine that re-rotates passes (block, delta) to the rope kernel.
struct BlockRotation {
  std::int32_t block = -1;      // physical block
  std::int32_t new_index = -1;  // its logical index after eviction
  std::int32_t delta = 0;       // position change of its tokens
  friend constexpr bool operator==(const BlockRotation&, const BlockRotation&) = default;
};

struct EvictionResult {
  std::int32_t evicted = 0;    // logical blocks removed (written to the caller's buffer)
  std::int32_t rotations = 0;  // kept blocks that moved
};

KVCACHE_END_NAMESPACE
