// H2O (heavy-hitter oracle): every group (kv-head, or layer x kv-head) keeps
// the `recent` newest tokens plus the `heavy` tokens with the largest
// cumulative attention, the same budget per group. Once a stream holds more
// than heavy + recent tokens, each group drops its lowest-scoring older
// tokens (ties: the older token leaves) and the cache compacts.
//
// Scores: head_attention_sums, one row per group, summed over the step's
// queries (and the q-heads of a kv-head); attention_sums when groups == 1.
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

/// Configuration of H2OEviction.
struct H2OConfig {
  std::int32_t heavy = 128;  ///< heavy hitters kept per group
  std::int32_t recent = 128;  ///< newest tokens always kept
  std::int32_t groups = 1;  ///< independent choices sharing one page table
};

/// Heavy-hitter oracle: per group, the `heavy` tokens with the largest cumulative attention plus the `recent` newest.
class H2OEviction : public TokenPolicyBase {
 public:
  /// Reads per-head or head-reduced attention sums.
  static constexpr Signals required_signals{Signals::head_attention_sums | Signals::attention_sums};

  /// Throws ConfigError for heavy < 1, recent < 0 or groups < 1.
  explicit H2OEviction(const H2OConfig& c) : TokenPolicyBase(c.groups), c_(c) {
    auto bad = [](const char* what, std::int64_t v, std::int64_t limit = 1) {
      throw ConfigError("kvcache::H2OEviction", Status{Errc::invalid_argument, what, v, limit});
    };
    if (c.heavy < 1) bad("heavy", c.heavy);
    if (c.recent < 0) bad("recent", c.recent, 0);
    if (c.groups < 1) bad("groups", c.groups);
  }
  /// The configuration.
  const H2OConfig& config() const noexcept { return c_; }
  /// heavy + recent: tokens each group keeps.
  std::int64_t budget() const noexcept { return std::int64_t{c_.heavy} + c_.recent; }

  /// Tokens held after evict(): min(appended, budget()).
  std::int64_t max_tokens_held(std::int64_t appended) const noexcept { return std::min(appended, budget()); }
  /// One decode token sits in the cache before evict() runs.
  std::int64_t max_blocks_held(std::int64_t appended, std::int32_t b) const noexcept {
    return blocks_for_tokens(std::min(appended, budget() + 1), b);
  }
  /// budget().
  std::int64_t max_tokens_after_eviction() const noexcept { return budget(); }

  /// Adds one step's scores to every held token's cumulative attention.
  Status observe(std::uint32_t s, const Scores& sc, const StreamView& v) noexcept {
    if (auto st = check_rows(sc, groups_); !st) return st;
    add_rows(s, sc, v);
    return {};
  }
  /// Tokens each group drops on the next evict(): held - budget() (0 within budget).
  std::int32_t evict_count(std::uint32_t, const StreamView& v) const noexcept {
    if (v.held <= budget()) return 0;
    return std::min(v.held - static_cast<std::int32_t>(budget()), evictable(v, c_.recent));
  }
  /// Writes group g's lowest-scored older tokens (ties: the older), ascending.
  void choose(std::uint32_t s, const StreamView& v, std::int32_t g, std::span<std::int32_t> out) noexcept {
    const std::int64_t recent_from = v.appended - c_.recent;
    st_.choose_lowest(s, g, v, out, [](float score, std::int32_t, std::int32_t) { return score; },
                      [&](std::int32_t pos) { return pos < recent_from; });
  }

 private:
  H2OConfig c_;
};
static_assert(TokenEviction<H2OEviction> && ObservingEviction<H2OEviction>);

KVCACHE_END_NAMESPACE
