// SnapKV: one-shot compression right after prefill. The attention of the
// prompt's last `window` queries (the observation window), summed over those
// queries, is max-pooled over `kernel` neighbouring tokens; each group keeps
// its `capacity` best-pooled prompt tokens plus the window, and the rest
// leave (ties: the older token). Later tokens are only appended: the policy
// runs once per stream, at the first evict() after an observe().
//
// Scores: head_attention_sums, one row per group (kv-head, or layer x
// kv-head), summed over the window's queries; attention_sums when groups == 1.
// Bound: none after the prompt (decode grows the stream), so the accounting
// is the appended count; SnapKV saves memory for the decode phase, and the
// prompt peak stays whole.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvcache/config.hpp"
#include "kvcache/eviction/token_state.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Configuration of SnapKVEviction.
struct SnapKVConfig {
  std::int32_t capacity = 1024;  ///< prompt tokens kept per group, besides the window
  std::int32_t window = 32;  ///< observation window: the prompt's last queries, always kept
  std::int32_t kernel = 7;  ///< max-pool width (odd; 1 = none)
  std::int32_t groups = 1;  ///< Independent choices sharing one page table (kv-heads, or layers x kv-heads).
};

/// SnapKV: one compression after prefill, keeping per group the `capacity` best pooled prompt tokens plus the window.
class SnapKVEviction : public TokenPolicyBase {
 public:
  /// Reads per-head or head-reduced attention sums of the window's queries.
  static constexpr Signals required_signals{Signals::head_attention_sums | Signals::attention_sums};

  /// Throws ConfigError for capacity or window < 1, an even or non-positive kernel, or groups < 1.
  explicit SnapKVEviction(const SnapKVConfig& c) : TokenPolicyBase(c.groups), c_(c) {
    auto bad = [](const char* what, std::int64_t v, std::int64_t limit = 1) {
      throw ConfigError("kvcache::SnapKVEviction", Status{Errc::invalid_argument, what, v, limit});
    };
    if (c.capacity < 1) bad("capacity", c.capacity);
    if (c.window < 1) bad("window", c.window);
    if (c.kernel < 1 || c.kernel % 2 == 0) bad("kernel", c.kernel);
    if (c.groups < 1) bad("groups", c.groups);
  }
  /// The configuration.
  const SnapKVConfig& config() const noexcept { return c_; }

  /// appended: decode tokens are only appended, so no bound after the prompt.
  std::int64_t max_tokens_held(std::int64_t appended) const noexcept { return appended; }
  /// Blocks `appended` tokens fill.
  std::int64_t max_blocks_held(std::int64_t appended, std::int32_t b) const noexcept { return blocks_for_tokens(appended, b); }
  /// INT64_MAX: no bound.
  std::int64_t max_tokens_after_eviction() const noexcept { return std::numeric_limits<std::int64_t>::max(); }

  /// Sizes the per-stream state: `streams` streams of up to `cap` tokens.
  void bind(const EvictionShape& shape) {
    TokenPolicyBase::bind(shape);
    state_.assign(std::size_t(shape.streams), fresh);
    pooled_.resize(std::size_t(shape.max_tokens));
  }
  /// Records the window's scores; the next evict() compresses once.
  Status observe(std::uint32_t s, const Scores& sc, const StreamView& v) noexcept {
    if (auto st = check_rows(sc, groups_); !st) return st;
    add_rows(s, sc, v);
    if (state_[s] == fresh) state_[s] = observed;
    return {};
  }
  /// Compressed once: true after the first evict() that followed an observe().
  bool compressed(std::uint32_t s) const noexcept { return state_[s] == done; }

  /// Tokens each group drops on the compressing evict() (0 before an observation and after the compression).
  std::int32_t evict_count(std::uint32_t s, const StreamView& v) const noexcept {
    if (state_[s] != observed) return 0;
    const std::int64_t over = std::int64_t{v.held} - c_.capacity - c_.window;
    return over <= 0 ? 0 : static_cast<std::int32_t>(std::min<std::int64_t>(over, evictable(v, c_.window)));
  }
  /// The one shot is spent at the first evict() after an observe(), even when
  /// the prompt already fits.
  void begin_eviction(std::uint32_t s, const StreamView& v) noexcept {
    if (state_[s] == observed) state_[s] = done;
    TokenPolicyBase::begin_eviction(s, v);
  }
  /// Before any compaction slot order is position order: pooling runs over
  /// the prompt's slots outside the window.
  void choose(std::uint32_t s, const StreamView& v, std::int32_t g, std::span<std::int32_t> out) noexcept {
    const std::int32_t n = v.held - c_.window, half = c_.kernel / 2;
    const float* sc = st_.scores(s, g);
    for (std::int32_t j = 0; j < n; ++j) {
      float m = sc[j];
      for (std::int32_t k = std::max(0, j - half); k <= std::min(n - 1, j + half); ++k) m = std::max(m, sc[k]);
      pooled_[std::size_t(j)] = m;
    }
    const std::int64_t window_from = v.appended - c_.window;
    st_.choose_lowest(s, g, v, out, [&](float, std::int32_t, std::int32_t slot) { return pooled_[std::size_t(slot)]; },
                      [&](std::int32_t pos) { return pos < window_from; });
  }
  /// Forgets stream s (compression state included).
  void reset(std::uint32_t s) noexcept {
    TokenPolicyBase::reset(s);
    state_[s] = fresh;
  }
  /// Copies stream from's state to stream to (fork).
  void copy_state(std::uint32_t from, std::uint32_t to) noexcept {
    TokenPolicyBase::copy_state(from, to);
    state_[to] = state_[from];
  }
  friend bool operator==(const SnapKVEviction& a, const SnapKVEviction& b) {
    return static_cast<const TokenPolicyBase&>(a) == b && a.state_ == b.state_;
  }

 private:
  enum : std::uint8_t { fresh, observed, done };
  SnapKVConfig c_;
  std::vector<std::uint8_t> state_;
  std::vector<float> pooled_;
};
static_assert(TokenEviction<SnapKVEviction> && ObservingEviction<SnapKVEviction>);

KVCACHE_END_NAMESPACE
