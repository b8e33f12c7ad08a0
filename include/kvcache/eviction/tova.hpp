// TOVA (token omission via attention): once a stream holds more than
// `budget` tokens, the tokens with the lowest attention from the step's last
// query, averaged over heads, leave (ties: the older token) until it holds
// budget again; one token per decode step, more after a prefill chunk. The
// cache compacts. `groups` independent choices: 1 (one for all heads and
// layers), or the number of layers (the paper's rule: each layer chooses
// from its own heads' average).
//
// Scores: last_query_attention, rows = groups x heads per group (group-major),
// each the softmax of the last query over the held tokens; group g averages
// its rows. Each observation replaces the previous one; tokens appended
// since the last observation score 0.
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
  std::int32_t groups = 1;    ///< independent choices sharing one page table (1, or layers)
};

/// TOVA: drops the tokens the step's last query attends least (averaged over heads) once a stream holds more than
/// `budget`.
class TovaEviction : public TokenPolicyBase {
 public:
  /// Reads the last query's attention, one row per head.
  static constexpr Signals required_signals{Signals::last_query_attention};

  /// Throws ConfigError for budget < 1 or groups < 1.
  explicit TovaEviction(const TovaConfig& c) : TokenPolicyBase(c.groups), c_(c) {
    if (c.budget < 1) throw ConfigError("kvcache::TovaEviction", Status{Errc::invalid_argument, "budget", c.budget, 1});
    if (c.groups < 1) throw ConfigError("kvcache::TovaEviction", Status{Errc::invalid_argument, "groups", c.groups, 1});
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

  /// Stores each group's head-averaged last-query attention; rows not a
  /// multiple of groups() is invalid_argument naming scores.rows.
  Status observe(std::uint32_t s, const Scores& sc, const StreamView& v) noexcept {
    if (sc.rows % groups_ != 0) return Status{Errc::invalid_argument, "scores.rows", sc.rows, groups_};
    st_.sync(s, v);
    const std::int32_t per = sc.rows / groups_;
    const float inv = 1.0f / float(per);
    for (std::int32_t g = 0; g < groups_; ++g) {
      float* out = st_.scores(s, g);
      std::fill(out, out + v.held, 0.0f);
      for (std::int32_t r = g * per; r < (g + 1) * per; ++r)
        for (std::int32_t j = 0; j < v.held; ++j)
          out[j] += sc.values[std::size_t(r) * std::size_t(v.held) + std::size_t(j)];
      for (std::int32_t j = 0; j < v.held; ++j) out[j] *= inv;
    }
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
