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
// When the trim happens is the engine's choice; either way every query finds
// each key its window needs (the W − 1 before it, and itself):
//   after attention   evict(seq, {}): the stream keeps its last W tokens, and
//                     the next chunk's queries find them all.
//   before attention  evict(seq, {}, n) with the n tokens just reserved as
//                     pending queries: the stream keeps W − 1 + n tokens
//                     (what the chunk's earliest query needs; W when n = 1).
// The attention kernel's window mask (window_left = W − 1) then shows query
// q exactly the keys at positions max(0, q − W + 1) .. q.
// Accounting: tokens_held == min(appended, W) after evict() with n <= 1.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kvcache/config.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Keeps the last W tokens; dead blocks at the front go back to the pool (a ring of pages, no copy).
class SlidingWindow {
 public:
  static constexpr Signals required_signals = no_signals;  ///< Reads no score signal.

  /// A window of `window` tokens; throws ConfigError when it is below 1.
  explicit SlidingWindow(std::int32_t window) : w_(window) {
    if (window < 1) throw ConfigError("kvcache::SlidingWindow", Status{Errc::invalid_argument, "window", window, 1});
  }
  /// W.
  std::int32_t window() const noexcept { return w_; }

  /// min(appended, W).
  std::int64_t max_tokens_held(std::int64_t appended) const noexcept { return std::min<std::int64_t>(appended, w_); }
  /// window + 1 live tokens (one decode token before the trim) plus < B dead slots.
  std::int64_t max_blocks_held(std::int64_t appended, std::int32_t b) const noexcept {
    return std::min(blocks_for_tokens(appended, b), blocks_for_tokens(w_, b) + 1);
  }
  /// W.
  std::int64_t max_tokens_after_eviction() const noexcept { return w_; }
  /// Tokens to drop from the front of a stream holding `held`, the last
  /// `pending` of which are queries whose attention has not run yet.
  std::int32_t front_excess(std::int32_t held, std::int32_t pending) const noexcept {
    const std::int64_t keep = std::int64_t{w_} + std::max(0, pending - 1);
    return static_cast<std::int32_t>(std::max<std::int64_t>(0, held - keep));
  }

 private:
  std::int32_t w_;
};
static_assert(WindowEviction<SlidingWindow>);

KVCACHE_END_NAMESPACE
