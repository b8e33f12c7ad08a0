// Eviction that never evicts: the baseline; its bound is everything appended.
#pragma once

#include <cstdint>

#include "kvcache/config.hpp"
#include "kvcache/policy.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Eviction that never evicts (the default).
struct KeepAll {
  static constexpr Signals required_signals = no_signals;  ///< Reads no score signal.
  /// Everything appended stays.
  constexpr std::int64_t max_tokens_held(std::int64_t appended) const noexcept { return appended; }
  /// Blocks `appended` tokens fill.
  constexpr std::int64_t max_blocks_held(std::int64_t appended, std::int32_t block_size) const noexcept {
    return blocks_for_tokens(appended, block_size);
  }
  /// INT64_MAX: no bound.
  constexpr std::int64_t max_tokens_after_eviction() const noexcept { return INT64_MAX; }
};
static_assert(EvictionPolicy<KeepAll>);

KVCACHE_END_NAMESPACE
