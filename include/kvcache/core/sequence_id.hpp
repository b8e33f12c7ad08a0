// Dense sequence (stream) handles with a generation counter: O(1) lookup
// without hashing, and a stale or freed handle is detected, never aliased.
#pragma once

#include <cstdint>

#include "kvcache/config.hpp"

KVCACHE_BEGIN_NAMESPACE

/// A sequence handle: row index plus generation, so a freed handle never aliases a new one.
struct SeqId {
  std::uint32_t index = UINT32_MAX;  ///< slot in the table
  std::uint32_t generation = 0;  ///< bumped each time the slot is freed
  friend constexpr bool operator==(const SeqId&, const SeqId&) = default;
};

/// A page-table row's blocks are copied before a write into a shared block.
struct BlockCopy {
  std::int32_t src = -1;  ///< Block to copy from.
  std::int32_t dst = -1;  ///< Block to copy to.
  friend constexpr bool operator==(const BlockCopy&, const BlockCopy&) = default;
};

KVCACHE_END_NAMESPACE
