// TOVA (token omission via attention): once a stream holds more than
// `budget` tokens, the tokens with the lowest attention from the step's last
// query, averaged over heads, leave (ties: the older token) until it holds
// budget again; one token per decode step, more after a prefill chunk. The
// cache compacts. One choice for all heads and layers (groups() == 1).
//
// Scores: last_query_attention, one row per (q- or kv-) head, each the
// softmax of the last query over the held tokens. Each observation replaces
// the previous one; tokens appended since the last observation score 0.
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

/// Configuration of TovaEviction.
struct TovaConfig {
  std::int32_t budget = 512;  ///< tokens kept
};

/// TOVA: drops the tokens the step's last query attends least (averaged over heads) once a stream holds more than
/// `budget`.
class TovaEviction : public TokenPolicyBase {
 public:
  /// Reads the last query's attention, one row per head.
  static constexpr Signals required_signals{Signals::last_query_attention};

  /// Throws ConfigError for budget < 1.
  explicit TovaEviction(const TovaConfig& c) : TokenPolicyBase(1), c_(c) {
    if (c.budget < 1) throw ConfigError("kvcache::TovaEviction", Status{Errc::invalid_argument, "budget", c.budget, 1});
  }
  /// The configuration.
  const TovaConfig& config() const noexcept { return c_; }

  /// min(appended, budget).
  std::int64_t max_tokens_held(std::int64_t appended) const noexcept { return std::min<std::int64_t>(appended, c_.budget); }
  /// Blocks held after evict() once `appended` tokens were appended.
  std::int64_t max_blocks_held(std::int64_t appended, std::int32_t b) const noexcept {
    return blocks_for_tokens(std::min<std::int64_t>(appended, std::int64_t{c_.budget} + 1), b);
  }
  /// budget.
  std::int64_t max_tokens_after_eviction() const noexcept { return c_.budget; }

  /// Stores the head-averaged last-query attention.
  Status observe(std::uint32_t s, const Scores& sc, const StreamView& v) noexcept {
    st_.sync(s, v);
    float* out = st_.scores(s, 0);
    std::fill(out, out + v.held, 0.0f);
    for (std::int32_t r = 0; r < sc.rows; ++r)
      for (std::int32_t j = 0; j < v.held; ++j) out[j] += sc.values[std::size_t(r) * std::size_t(v.held) + std::size_t(j)];
    const float inv = 1.0f / float(sc.rows);
    for (std::int32_t j = 0; j < v.held; ++j) out[j] *= inv;
    return {};
  }
  /// Tokens the next evict() drops: held - budget (0 within budget).
  std::int32_t evict_count(std::uint32_t, const StreamView& v) const noexcept {
    if (v.held <= c_.budget) return 0;
    return std::min(v.held - c_.budget, evictable(v, 0));
  }
  /// Writes the lowest-attended tokens (ties: the older), ascending.
  void choose(std::uint32_t s, const StreamView& v, std::int32_t g, std::span<std::int32_t> out) noexcept {
    st_.choose_lowest(s, g, v, out, [](float score, std::int32_t, std::int32_t) { return score; },
                      [](std::int32_t) { return true; });
  }

 private:
  TovaConfig c_;
};
static_assert(TokenEviction<TovaEviction> && ObservingEviction<TovaEviction>);

KVCACHE_END_NAMESPACE
