// Eviction that never evicts: the baseline; its bound is everything appended.
#pragma once

#include <cstdint>

#include "kvcache/config.hpp"
#include "kvcache/policy.hpp"

KVCACHE_BEGIN_NAMESPACE

struct KeepAll {
  static constexpr Signals required_signals = no_signals;
  constexpr std::int64_t max_tokens_held(std::int64_t appended) const noexcept { return appended; }
  constexpr std::int64_t max_blocks_held(std::int64_t appended, std::int32_t block_size) const noexcept {
    return blocks_for_tokens(appended, block_size);
  }
  constexpr std::int64_t max_tokens_after_eviction() const noexcept { return INT64_MAX; }
};
static_assert(EvictionPolicy<KeepAll>);

KVCACHE_END_NAMESPACE
