// Sliding window: a stream keeps its last `window` tokens. Paged, it is a
// ring of at most ceil(window / B) + 1 blocks: evict() drops the oldest tokens
// from the front of the row, a block that holds none of the window goes back
// to the pool (and is the next one allocated), and no byte is copied. The
// first block may keep up to B − 1 dead slots (PageTable::front): exports
// describe front + window slots, and the attention kernel's window mask
// (FlashInfer window_left = window − 1, FlashAttention window_size_left)
// hides them. Keys keep their original positions: rotate queries by the
// absolute position, not by the exported length.
//
// When the trim happens is the engine's choice: evict() after reserve() and
// before attention gives each query exactly `window` keys (itself included);
// evict() after attention gives the "window + 1 during attention" lag.
// Accounting: tokens_held == min(appended, window) after evict().
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kvcache/config.hpp"
#include "kvcache/policy.hpp"

KVCACHE_BEGIN_NAMESPACE

class SlidingWindow {
 public:
  static constexpr Signals required_signals = no_signals;

  explicit SlidingWindow(std::int32_t window) : w_(window) {
    if (window < 1) throw std::invalid_argument("kvcache::SlidingWindow: window=" + std::to_string(window));
  }
  std::int32_t window() const noexcept { return w_; }

  std::int64_t max_tokens_held(std::int64_t appended) const noexcept { return std::min<std::int64_t>(appended, w_); }
  // window + 1 live tokens (one decode token before the trim) plus < B dead slots.
  std::int64_t max_blocks_held(std::int64_t appended, std::int32_t b) const noexcept {
    return std::min((appended + b - 1) / b, (std::int64_t{w_} + b - 1) / b + 1);
  }
  std::int64_t max_tokens_after_eviction() const noexcept { return w_; }
  std::int32_t front_excess(std::int32_t held) const noexcept { return std::max(0, held - w_); }

 private:
  std::int32_t w_;
};
static_assert(WindowEviction<SlidingWindow>);

KVCACHE_END_NAMESPACE
