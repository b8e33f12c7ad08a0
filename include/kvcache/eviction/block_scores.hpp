// Score-based three-area block eviction (OpenVINO GenAI's cache eviction):
// a stream is [start | evictable | recent]; once it holds max + B tokens, the
// lowest-scoring whole blocks of the evictable area leave (ties to the lower
// block) until it fits max again. A partial last block counts as recent.
// Eviction edits the page table only; kept blocks that moved are reported
// with their position delta so the engine can re-rotate their keys (rope kernel).
//
// Scores: one float per held token per step, already summed over heads and
// the step's queries (what an attention kernel can emit). SUM accumulates
// them; NORM_SUM divides by each token's lifetime counter, which grows by the
// stream's length increase (a registration that does not lengthen the stream
// leaves counters unchanged). An optional forward max-pool smooths inputs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvcache/config.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// How scores accumulate: plain sum, or sum divided by the token's lifetime counter.
enum class Aggregation : std::uint8_t { sum, norm_sum };

/// Configuration of BlockScoreEviction: token counts that are multiples of the
/// cache's block size (the geometry's: the cache binds it, it is not repeated here).
struct BlockScoreConfig {
  std::int32_t start = 32;  ///< tokens never evicted at the front (a block multiple, > 0)
  std::int32_t recent = 128;  ///< tokens never evicted at the back (a block multiple, > 0)
  std::int32_t max = 672;  ///< tokens kept after eviction (a block multiple, > start + recent)
  Aggregation aggregation = Aggregation::norm_sum;  ///< sum, or norm_sum (divided by a lifetime counter).
  std::int32_t pool_window = 1;  ///< forward max-pool over incoming scores (1 = none)
};

/// OpenVINO GenAI's three-area block eviction: keeps start and recent areas and the best-scored blocks between.
class BlockScoreEviction {
 public:
  static constexpr Signals required_signals{Signals::attention_sums};  ///< Reads head-reduced attention sums.

  /// Throws ConfigError for sizes that are not positive or do not leave room
  /// between start and recent (block multiples are checked by bind()).
  explicit BlockScoreEviction(const BlockScoreConfig& c) : c_(c) {
    if (c.start <= 0) bad("start", c.start);
    if (c.recent <= 0) bad("recent", c.recent);
    if (c.max <= std::int64_t{c.start} + c.recent) bad("max", c.max, std::int64_t{c.start} + c.recent + 1);
    if (c.pool_window < 1) bad("pool_window", c.pool_window);
  }

  /// The configuration.
  const BlockScoreConfig& config() const noexcept { return c_; }
  /// Tokens per block the policy counts in: the geometry's, once bound (0 before).
  std::int32_t block_size() const noexcept { return b_; }

  // --- accounting: after the policy ran, a stream holds at most this -------
  /// Tokens held after evict() once `appended` tokens were appended.
  std::int64_t max_tokens_held(std::int64_t appended) const noexcept {
    return appended < std::int64_t{c_.max} + b_ ? appended : max_tokens_after_eviction();
  }
  /// Blocks held after evict() once `appended` tokens were appended.
  std::int64_t max_blocks_held(std::int64_t appended, std::int32_t block_size) const noexcept {
    return blocks_for_tokens(max_tokens_held(appended), block_size);
  }
  /// max + B - 1: the partial last block counts as recent.
  std::int64_t max_tokens_after_eviction() const noexcept { return std::int64_t{c_.max} + b_ - 1; }

  // --- state (the cache calls these) -----------------------------------------
  /// Takes the cache's block size, which start, recent and max must be
  /// multiples of (else ConfigError naming the value), and sizes the
  /// per-stream state once; nothing is allocated afterwards.
  void bind(const EvictionShape& shape) {
    const std::int32_t b = shape.block_size;
    if (b < 1) bad("block_size", b);
    if (c_.start % b) bad("start (a multiple of the block size)", c_.start, b);
    if (c_.recent % b) bad("recent (a multiple of the block size)", c_.recent, b);
    if (c_.max % b) bad("max (a multiple of the block size)", c_.max, b);
    if (std::int64_t{c_.max} + b > INT32_MAX) bad("max", c_.max, std::int64_t{INT32_MAX} - b);
    const std::int32_t streams = shape.streams, tokens_per_stream = shape.max_tokens;
    const std::size_t n = checked_elements("kvcache::BlockScoreEviction", "max_sequences*tokens_per_stream", streams,
                                           std::int64_t{streams} * tokens_per_stream, 8);
    b_ = b;
    cap_ = tokens_per_stream;
    acc_.assign(n, 0.0f);
    cnt_.assign(acc_.size(), 0);
    len_.assign(std::size_t(streams), 0);
    scratch_.resize(std::size_t(cap_ / b_ + 1));
  }

  /// Registers one step's scores for the stream's held tokens (scores.size()
  /// == tokens held). A NaN, a negative score or a wrong length is an error
  /// naming it, and nothing changes. (Standalone use; the cache validates and
  /// calls the Scores overload.)
  Status observe(std::uint32_t s, std::span<const float> scores) noexcept {
    const auto n = static_cast<std::int64_t>(scores.size());
    if (n > cap_) return Status{Errc::invalid_argument, "scores.size", n, cap_};
    if (n < len_[s]) return Status{Errc::invalid_argument, "scores.size", n, len_[s]};
    for (std::int64_t i = 0; i < n; ++i)
      if (!(scores[std::size_t(i)] >= 0.0f)) return Status{Errc::invalid_argument, "scores_at", i, 0};
    accumulate(s, scores.data(), n);
    return {};
  }
  /// Accumulates one score per held token (optionally max-pooled) into its block's score.
  Status observe(std::uint32_t s, const Scores& sc, const StreamView& v) noexcept {
    if (v.held < len_[s]) return Status{Errc::invalid_argument, "scores.size", v.held, len_[s]};
    accumulate(s, sc.values.data(), v.held);
    return {};
  }

  /// Logical blocks to evict from a stream holding `held` tokens, ascending,
  /// written to out; candidates start at first_candidate (the cache passes the
  /// block after the last shared one). Returns how many.
  Result<std::int32_t> plan(std::uint32_t s, const StreamView& v, std::span<std::int32_t> out) noexcept {
    return plan(s, v.held, v.first_candidate, out);
  }
  /// Writes the logical blocks to remove (ascending) to out; returns how many.
  Result<std::int32_t> plan(std::uint32_t s, std::int32_t held, std::int32_t first_candidate,
                            std::span<std::int32_t> out) noexcept {
    const std::int32_t b = b_;
    if (held < c_.max + b) return 0;
    const std::int32_t lo_area = c_.start / b, hi = held / b - c_.recent / b;
    const std::int32_t lo = std::max(lo_area, first_candidate);
    const std::int32_t n = std::min((hi - lo_area) - (c_.max - c_.start - c_.recent) / b, hi - lo);
    if (n <= 0) return 0;
    if (std::int64_t(out.size()) < n) return Status{Errc::buffer_too_small, "evicted", std::int64_t(out.size()), n};
    const float* acc = acc_.data() + std::size_t(s) * std::size_t(cap_);
    const std::int32_t* cnt = cnt_.data() + std::size_t(s) * std::size_t(cap_);
    auto* cand = scratch_.data();
    for (std::int32_t blk = lo; blk < hi; ++blk) {
      float score = 0.0f;
      for (std::int32_t t = blk * b; t < blk * b + b && t < len_[s]; ++t)
        score += c_.aggregation == Aggregation::sum ? acc[t] : acc[t] / float(cnt[t]);
      cand[blk - lo] = {score, blk};
    }
    std::nth_element(cand, cand + (n - 1), cand + (hi - lo));  // (score, block): ties to the lower block
    for (std::int32_t k = 0; k < n; ++k) out[std::size_t(k)] = cand[k].block;
    std::sort(out.begin(), out.begin() + n);
    return n;
  }

 private:
  void accumulate(std::uint32_t s, const float* in, std::int64_t n) noexcept {
    float* acc = acc_.data() + std::size_t(s) * std::size_t(cap_);
    std::int32_t* cnt = cnt_.data() + std::size_t(s) * std::size_t(cap_);
    const std::int32_t old = len_[s], grow = static_cast<std::int32_t>(n) - old;
    if (grow > 0)
      for (std::int32_t i = 0; i < old; ++i) cnt[i] += grow;      // lifetimes grow by the length increase
    for (std::int32_t j = 0; j < grow; ++j) cnt[old + j] = grow - j;  // new tokens: grow .. 1
    if (c_.pool_window == 1) {
      for (std::int64_t i = 0; i < n; ++i) acc[i] += in[i];
    } else {
      for (std::int64_t i = 0; i < n; ++i) {
        float v = in[i];
        for (std::int64_t w = 1; w < c_.pool_window && i + w < n; ++w) v = std::max(v, in[i + w]);
        acc[i] += v;
      }
    }
    len_[s] = static_cast<std::int32_t>(n);
  }

 public:
  /// The cache removed these logical blocks (ascending): scores move with them.
  void on_removed(std::uint32_t s, std::span<const std::int32_t> blocks) noexcept {
    float* acc = acc_.data() + std::size_t(s) * std::size_t(cap_);
    std::int32_t* cnt = cnt_.data() + std::size_t(s) * std::size_t(cap_);
    const std::int32_t b = b_, len = len_[s];
    std::int32_t out = 0;
    std::size_t k = 0;
    for (std::int32_t t = 0; t < len; ++t) {
      while (k < blocks.size() && (blocks[k] + 1) * b <= t) ++k;
      if (k < blocks.size() && blocks[k] * b <= t) continue;
      acc[out] = acc[t];
      cnt[out] = cnt[t];
      ++out;
    }
    std::fill(acc + out, acc + len, 0.0f);
    std::fill(cnt + out, cnt + len, 0);
    len_[s] = out;
  }
  /// The stream now holds `held` tokens (rollback): forget the rest.
  void on_truncate(std::uint32_t s, std::int32_t held) noexcept {
    if (held >= len_[s]) return;
    std::fill(acc_.begin() + std::ptrdiff_t(s) * cap_ + held, acc_.begin() + std::ptrdiff_t(s) * cap_ + len_[s], 0.0f);
    std::fill(cnt_.begin() + std::ptrdiff_t(s) * cap_ + held, cnt_.begin() + std::ptrdiff_t(s) * cap_ + len_[s], 0);
    len_[s] = held;
  }
  /// Forgets stream s.
  void reset(std::uint32_t s) noexcept { on_truncate(s, 0); }
  /// Copies stream from's scores and counters to stream to (fork).
  void copy_state(std::uint32_t from, std::uint32_t to) noexcept {
    std::copy_n(acc_.begin() + std::ptrdiff_t(from) * cap_, cap_, acc_.begin() + std::ptrdiff_t(to) * cap_);
    std::copy_n(cnt_.begin() + std::ptrdiff_t(from) * cap_, cap_, cnt_.begin() + std::ptrdiff_t(to) * cap_);
    len_[to] = len_[from];
  }

  /// Inspection (tests, debugging): the stream's registered tokens.
  std::span<const float> accumulators(std::uint32_t s) const noexcept {
    return {acc_.data() + std::size_t(s) * std::size_t(cap_), std::size_t(len_[s])};
  }
  /// Stream s's per-token lifetime counters (norm_sum), by slot.
  std::span<const std::int32_t> counters(std::uint32_t s) const noexcept {
    return {cnt_.data() + std::size_t(s) * std::size_t(cap_), std::size_t(len_[s])};
  }

  friend bool operator==(const BlockScoreEviction& a, const BlockScoreEviction& b) {
    return a.b_ == b.b_ && a.acc_ == b.acc_ && a.cnt_ == b.cnt_ && a.len_ == b.len_;
  }

 private:
  struct Candidate {
    float score;
    std::int32_t block;
    friend bool operator<(const Candidate& x, const Candidate& y) {
      return x.score != y.score ? x.score < y.score : x.block < y.block;
    }
  };
  [[noreturn]] static void bad(const char* what, std::int64_t v, std::int64_t limit = 1) {
    throw ConfigError("kvcache::BlockScoreEviction", Status{Errc::invalid_argument, what, v, limit});
  }

  BlockScoreConfig c_;
  std::int32_t b_ = 0;  // the cache's block size (bind)
  std::int32_t cap_ = 0;
  std::vector<float> acc_;
  std::vector<std::int32_t> cnt_;
  std::vector<std::int32_t> len_;
  std::vector<Candidate> scratch_;
};
static_assert(BlockEviction<BlockScoreEviction> && ObservingEviction<BlockScoreEviction>);

KVCACHE_END_NAMESPACE
