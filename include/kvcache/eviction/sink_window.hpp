// Sinks + window (StreamingLLM): the first `sinks` tokens stay for the
// stream's life, as do the last `window`; the oldest blocks between them
// leave whole, once a stream holds pinned + window + B tokens (pinned =
// sinks rounded up to whole blocks: a block is the unit, so up to B − 1
// tokens after the sinks are pinned with them). Eviction edits the page table
// only; the kept blocks that moved are reported with their position delta,
// which is what StreamingLLM's in-cache positions need (re-rotate the keys
// with the rope kernel, or store pre-RoPE keys and ignore it).
// Bound: pinned + window + B − 1 tokens.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>

#include "kvcache/config.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Configuration of SinkWindowEviction (in tokens; the block size is the
/// geometry's: the cache binds it).
struct SinkWindowConfig {
  std::int32_t sinks = 4;  ///< First tokens always kept (rounded up to whole blocks).
  std::int32_t window = 1024;  ///< Newest tokens always kept.
};

/// StreamingLLM: attention sinks plus a recent window, evicting whole blocks between them.
class SinkWindowEviction {
 public:
  static constexpr Signals required_signals = no_signals;  ///< Reads no score signal.

  /// Throws ConfigError for window < 1, sinks < 0, or a length past int32.
  explicit SinkWindowEviction(const SinkWindowConfig& c) : c_(c) {
    if (c.sinks < 0) bad("sinks", c.sinks, 0);
    if (c.window < 1) bad("window", c.window);
    if (std::int64_t{c.sinks} + c.window > INT32_MAX) bad("sinks+window", std::int64_t{c.sinks} + c.window, INT32_MAX);
  }
  /// Tokens per block the policy counts in: the geometry's, once bound (0 before).
  std::int32_t block_size() const noexcept { return b_; }
  /// The configuration.
  const SinkWindowConfig& config() const noexcept { return c_; }
  /// Sinks rounded up to whole blocks: tokens never evicted at the front.
  std::int32_t pinned() const noexcept { return b_ < 1 ? c_.sinks : (c_.sinks + b_ - 1) / b_ * b_; }

  /// pinned() + window + B - 1.
  std::int64_t max_tokens_after_eviction() const noexcept { return std::int64_t{pinned()} + c_.window + b_ - 1; }
  /// Tokens held after evict() once `appended` tokens were appended.
  std::int64_t max_tokens_held(std::int64_t appended) const noexcept {
    return std::min(appended, max_tokens_after_eviction());
  }
  /// Blocks held after evict() once `appended` tokens were appended.
  std::int64_t max_blocks_held(std::int64_t appended, std::int32_t b) const noexcept {
    return blocks_for_tokens(std::min(appended, max_tokens_after_eviction() + 1), b);
  }

  /// Takes the cache's block size (no per-stream state); ConfigError when
  /// the pinned blocks, the window and a block overflow a stream's int32 length.
  void bind(const EvictionShape& shape) {
    const std::int32_t b = shape.block_size;
    if (b < 1) bad("block_size", b);
    const std::int64_t pinned = (std::int64_t{c_.sinks} + b - 1) / b * b;
    if (pinned + c_.window + b > INT32_MAX) bad("sinks+window", pinned + c_.window + b, INT32_MAX);
    b_ = b;
  }
  /// Stateless: nothing to cut on rollback.
  void on_truncate(std::uint32_t, std::int32_t) noexcept {}
  /// Stateless: nothing to forget.
  void reset(std::uint32_t) noexcept {}
  /// Stateless: nothing to copy on fork.
  void copy_state(std::uint32_t, std::uint32_t) noexcept {}
  /// Stateless: nothing to update when blocks leave.
  void on_removed(std::uint32_t, std::span<const std::int32_t>) noexcept {}

  /// The oldest whole blocks after the pinned ones (and after shared blocks)
  /// that lie entirely before the window.
  Result<std::int32_t> plan(std::uint32_t, const StreamView& v, std::span<std::int32_t> out) const noexcept {
    const std::int32_t b = b_, p = pinned();
    if (v.held < std::int64_t{p} + c_.window + b) return 0;
    const std::int32_t lo = std::max(p / b, v.first_candidate), hi = (v.held - c_.window) / b;
    const std::int32_t n = std::min((v.held - p - c_.window) / b, hi - lo);
    if (n <= 0) return 0;
    if (std::int64_t(out.size()) < n) return Status{Errc::buffer_too_small, "evicted", std::int64_t(out.size()), n};
    for (std::int32_t k = 0; k < n; ++k) out[std::size_t(k)] = lo + k;
    return n;
  }
  friend bool operator==(const SinkWindowEviction& a, const SinkWindowEviction& b) { return a.b_ == b.b_; }

 private:
  [[noreturn]] static void bad(const char* what, std::int64_t v, std::int64_t limit = 1) {
    throw ConfigError("kvcache::SinkWindowEviction", Status{Errc::invalid_argument, what, v, limit});
  }

  SinkWindowConfig c_;
  std::int32_t b_ = 0;  // the cache's block size (bind)
};
static_assert(BlockEviction<SinkWindowEviction>);

KVCACHE_END_NAMESPACE
