// Token <-> block arithmetic for a block size. Block sizes (and local
// windows) are almost always powers of two: then it shifts and masks, since a
// division in a per-token or per-head loop costs more than the rest of it.
// By value: loops keep it in registers (stores into int32 fields could alias
// members of the owner and force reloads).
#pragma once

#include <bit>
#include <cstdint>

#include "kvcache/config.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Division and remainder by a block size, by shift and mask when it is a power of two.
struct BlockMath {
  std::int32_t size = 1;   ///< The divisor (>= 1).
  std::int32_t shift = 0;  ///< log2(size) when size is a power of two, else -1.
  /// The arithmetic for `size` (>= 1).
  static constexpr BlockMath of(std::int32_t size) noexcept {
    const auto u = static_cast<std::uint32_t>(size);
    return {size, std::has_single_bit(u) ? std::countr_zero(u) : -1};
  }
  /// x / size, for x >= 0.
  constexpr std::int32_t div(std::int64_t x) const noexcept {
    return static_cast<std::int32_t>(shift >= 0 ? x >> shift : x / size);
  }
  /// x % size, for x >= 0.
  constexpr std::int32_t mod(std::int32_t x) const noexcept { return shift >= 0 ? x & (size - 1) : x % size; }
  /// Blocks that `tokens` tokens fill.
  constexpr std::int32_t blocks_for(std::int64_t tokens) const noexcept { return div(tokens + size - 1); }
};

KVCACHE_END_NAMESPACE
