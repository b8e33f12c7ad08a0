// One compaction move: the token in slot `src` moves to slot `dst`. Eviction
// plans, policies and the compaction kernel all speak it, so it sits below
// them all.
#pragma once

#include <cstdint>

#include "kvcache/config.hpp"

KVCACHE_BEGIN_NAMESPACE

/// A token's K/V moves from slot src to slot dst (slot = block * B + offset).
struct SlotMove {
  std::int32_t src = -1;  ///< slot read
  std::int32_t dst = -1;  ///< slot written
  friend constexpr bool operator==(const SlotMove&, const SlotMove&) = default;
};

KVCACHE_END_NAMESPACE
