// Average attention (Batch-Max): a token's score is its attention sum over
// the steps it has been held, divided by its age, current_position + 1 −
// token_position. Once a stream holds `budget` tokens, the `step` lowest-
// scoring ones leave (ties: the older token), as many times as it takes to
// drop below the budget again; in decode that is every `step` tokens, and the
// stream never holds more than budget tokens. Call evict() after every
// prefill chunk as well: with chunks of at most `step` tokens the prompt's
// peak stays below budget + step (blocks_needed(prompt, max_new, chunk)).
//
// Scores: attention_sums (groups == 1) or head_attention_sums, one row per
// group, each summed over the step's queries.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>

#include "kvcache/config.hpp"
#include "kvcache/eviction/token_state.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Configuration of AverageAttentionEviction.
struct AverageAttentionConfig {
  std::int32_t budget = 1024;  ///< held tokens that trigger an eviction
  std::int32_t step = 64;  ///< p: tokens evicted at a time (< budget)
  std::int32_t groups = 1;  ///< Independent choices sharing one page table (kv-heads, or layers x kv-heads).
};

/// Batch-Max average attention: evicts the `step` tokens with the lowest attention sum per age once a stream reaches
/// `budget`.
class AverageAttentionEviction : public TokenPolicyBase {
 public:
  /// Reads per-head or head-reduced attention sums.
  static constexpr Signals required_signals{Signals::head_attention_sums | Signals::attention_sums};

  /// Throws ConfigError for budget < 1, step outside 1..budget-1, or groups < 1.
  explicit AverageAttentionEviction(const AverageAttentionConfig& c) : TokenPolicyBase(c.groups), c_(c) {
    auto bad = [](const char* what, std::int64_t v, std::int64_t limit = 1) {
      throw ConfigError("kvcache::AverageAttentionEviction", Status{Errc::invalid_argument, what, v, limit});
    };
    if (c.budget < 1) bad("budget", c.budget);
    if (c.step < 1 || c.step >= c.budget) bad("step", c.step);
    if (c.groups < 1) bad("groups", c.groups);
  }
  /// The configuration.
  const AverageAttentionConfig& config() const noexcept { return c_; }

  /// budget - 1: what evict() leaves at most.
  std::int64_t max_tokens_after_eviction() const noexcept { return std::int64_t{c_.budget} - 1; }
  /// Tokens held after evict() once `appended` tokens were appended.
  std::int64_t max_tokens_held(std::int64_t appended) const noexcept {
    return std::min(appended, max_tokens_after_eviction());
  }
  /// Blocks that many tokens occupy at most (block size b).
  std::int64_t max_blocks_held(std::int64_t appended, std::int32_t b) const noexcept {
    return blocks_for_tokens(std::min<std::int64_t>(appended, c_.budget), b);
  }

  /// Adds one step's scores to every held token's sum.
  Status observe(std::uint32_t s, const Scores& sc, const StreamView& v) noexcept {
    if (auto st = check_rows(sc, groups_); !st) return st;
    add_rows(s, sc, v);
    return {};
  }
  /// Tokens the next evict() removes: multiples of `step` until below budget (0 below it).
  std::int32_t evict_count(std::uint32_t, const StreamView& v) const noexcept {
    if (v.held < c_.budget) return 0;
    return std::min(c_.step * ((v.held - c_.budget) / c_.step + 1), evictable(v, 0));
  }
  /// Writes group g's `out.size()` lowest sum-per-age tokens (ties: the older), ascending.
  void choose(std::uint32_t s, const StreamView& v, std::int32_t g, std::span<std::int32_t> out) noexcept {
    const std::int64_t now = v.appended;  // current position + 1
    st_.choose_lowest(s, g, v, out,
                      [&](float sum, std::int32_t pos, std::int32_t) { return sum / float(now - pos); },
                      [](std::int32_t) { return true; });
  }

 private:
  AverageAttentionConfig c_;
};
static_assert(TokenEviction<AverageAttentionEviction> && ObservingEviction<AverageAttentionEviction>);

KVCACHE_END_NAMESPACE
