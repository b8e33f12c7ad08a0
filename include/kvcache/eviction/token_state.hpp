// Per-token state of token-granular policies: one score and the original
// position per (stream, group, slot). Slots follow the cache: new tokens are
// appended, and after a compaction slot p holds what slot order[p] held, so
// scores and positions move with their K/V. Sized once by bind().
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/config.hpp"
#include "kvcache/eviction/compaction_plan.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Per stream and group: the held tokens' scores and original positions, by slot.
class TokenState {
 public:
  /// Sizes the state: `streams` streams of up to `cap` tokens for `groups` groups; throws ConfigError past the
  /// bookkeeping limit.
  void bind(std::int32_t streams, std::int32_t cap, std::int32_t groups) {
    // One float score and one int32 position per (stream, group, slot).
    const std::size_t n = checked_elements("kvcache::TokenState", "max_sequences*groups*tokens_per_stream",
                                           std::int64_t{streams} * groups, std::int64_t{streams} * groups * cap, 8);
    cap_ = cap;
    groups_ = groups;
    score_.assign(n, 0.0f);
    pos_.assign(n, 0);
    len_.assign(std::size_t(streams), 0);
    cand_.resize(std::size_t(cap));
    mark_.assign(std::size_t(cap), 0);
  }
  /// Groups per stream.
  std::int32_t groups() const noexcept { return groups_; }
  /// Tokens stream s tracks.
  std::int32_t length(std::uint32_t s) const noexcept { return len_[s]; }

  /// Group g's scores of stream s, by slot.
  float* scores(std::uint32_t s, std::int32_t g) noexcept { return score_.data() + at(s, g); }
  /// Group g's scores of stream s, by slot.
  const float* scores(std::uint32_t s, std::int32_t g) const noexcept { return score_.data() + at(s, g); }
  /// Group g's original token positions of stream s, by slot.
  const std::int32_t* positions(std::uint32_t s, std::int32_t g) const noexcept { return pos_.data() + at(s, g); }

  /// Tokens appended since the last call join with score 0; the newest held
  /// token sits at position appended - 1.
  void sync(std::uint32_t s, const StreamView& v) noexcept {
    const std::int32_t old = len_[s];
    if (v.held <= old) return;
    for (std::int32_t g = 0; g < groups_; ++g) {
      std::int32_t* pos = pos_.data() + at(s, g);
      for (std::int32_t j = old; j < v.held; ++j) pos[j] = static_cast<std::int32_t>(v.appended - (v.held - j));
    }
    len_[s] = v.held;
  }

  /// Writes the `out.size()` eligible slots of group g in [v.first_candidate,
  /// v.held) with the lowest key(score, position), ascending by slot. Ties go
  /// to the older token. The caller guarantees enough eligible slots.
  template <class Key, class Eligible>
  void choose_lowest(std::uint32_t s, std::int32_t g, const StreamView& v, std::span<std::int32_t> out, Key key,
                     Eligible eligible) noexcept {
    const float* sc = scores(s, g);
    const std::int32_t* pos = positions(s, g);
    const auto k = static_cast<std::int32_t>(out.size());
    if (k <= kSmall) {  // decode: one pass keeping the k lowest in a max-heap
      Candidate* heap = cand_.data();
      std::int32_t n = 0;
      for (std::int32_t j = v.first_candidate; j < v.held; ++j) {
        if (!eligible(pos[j])) continue;
        const Candidate c{key(sc[j], pos[j], j), pos[j], j};
        if (n < k) {
          heap[n++] = c;
          std::push_heap(heap, heap + n);
        } else if (c < heap[0]) {
          std::pop_heap(heap, heap + n);
          heap[n - 1] = c;
          std::push_heap(heap, heap + n);
        }
      }
      for (std::int32_t i = 0; i < k; ++i) out[std::size_t(i)] = heap[i].slot;
      std::sort(out.begin(), out.end());
      return;
    }
    std::int32_t n = 0;
    for (std::int32_t j = v.first_candidate; j < v.held; ++j)
      if (eligible(pos[j])) cand_[std::size_t(n++)] = {key(sc[j], pos[j], j), pos[j], j};
    if (k < n) std::nth_element(cand_.begin(), cand_.begin() + (k - 1), cand_.begin() + n);
    for (std::int32_t i = 0; i < k; ++i) mark_[std::size_t(cand_[std::size_t(i)].slot)] = 1;
    std::int32_t o = 0;  // ascending by slot without a sort
    for (std::int32_t j = v.first_candidate; j < v.held; ++j)
      if (mark_[std::size_t(j)]) {
        out[std::size_t(o++)] = j;
        mark_[std::size_t(j)] = 0;
      }
  }

  /// Group g's compaction: slot m.dst now holds what slot m.src held (token
  /// indices); the stream keeps n tokens once the last group is done.
  void compact(std::uint32_t s, std::int32_t g, std::span<const SlotMove> moves, std::int32_t n) noexcept {
    float* sc = scores(s, g);
    std::int32_t* pos = pos_.data() + at(s, g);
    for (const SlotMove& m : moves) {  // sources are all >= n: nothing read is overwritten
      sc[m.dst] = sc[m.src];
      pos[m.dst] = pos[m.src];
    }
    std::fill(sc + n, sc + len_[s], 0.0f);
    std::fill(pos + n, pos + len_[s], 0);
    if (g == groups_ - 1) len_[s] = n;
  }
  /// Keeps the first `held` tokens of stream s (rollback).
  void truncate(std::uint32_t s, std::int32_t held) noexcept {
    if (held >= len_[s]) return;
    for (std::int32_t g = 0; g < groups_; ++g) {
      std::fill(scores(s, g) + held, scores(s, g) + len_[s], 0.0f);
      std::fill(pos_.data() + at(s, g) + held, pos_.data() + at(s, g) + len_[s], 0);
    }
    len_[s] = held;
  }
  /// Copies stream from's state to stream to (fork).
  void copy(std::uint32_t from, std::uint32_t to) noexcept {
    const auto span = std::ptrdiff_t(groups_) * cap_;
    std::copy_n(score_.begin() + std::ptrdiff_t(at(from, 0)), span, score_.begin() + std::ptrdiff_t(at(to, 0)));
    std::copy_n(pos_.begin() + std::ptrdiff_t(at(from, 0)), span, pos_.begin() + std::ptrdiff_t(at(to, 0)));
    len_[to] = len_[from];
  }

  friend bool operator==(const TokenState& a, const TokenState& b) {
    return a.score_ == b.score_ && a.pos_ == b.pos_ && a.len_ == b.len_;
  }

 private:
  static constexpr std::int32_t kSmall = 32;
  struct Candidate {
    float key;
    std::int32_t pos, slot;
    friend bool operator<(const Candidate& x, const Candidate& y) {
      return x.key != y.key ? x.key < y.key : x.pos < y.pos;
    }
  };
  std::size_t at(std::uint32_t s, std::int32_t g) const noexcept {
    return (std::size_t(s) * std::size_t(groups_) + std::size_t(g)) * std::size_t(cap_);
  }
  std::int32_t cap_ = 0, groups_ = 1;
  std::vector<float> score_;
  std::vector<std::int32_t> pos_;
  std::vector<std::int32_t> len_;
  std::vector<Candidate> cand_;
  std::vector<std::uint8_t> mark_;
};

/// Scores of one group from a validated Scores view: row g, or the single row
/// when the form has one row for every group.
inline std::span<const float> group_row(const Scores& sc, std::int32_t g, std::int32_t held) noexcept {
  const std::int32_t r = sc.rows == 1 ? 0 : g;
  return sc.values.subspan(std::size_t(r) * std::size_t(held), std::size_t(held));
}

/// The rows a policy with `groups` groups accepts: one per group, or a single
/// reduced row (attention_sums) that every group shares.
inline Status check_rows(const Scores& sc, std::int32_t groups) noexcept {
  if (sc.kind == ScoreKind::attention_sums ? sc.rows != 1 : sc.rows != groups)
    return Status{Errc::invalid_argument, "scores.rows", sc.rows, sc.kind == ScoreKind::attention_sums ? 1 : groups};
  return {};
}

/// The hooks every token policy shares (the cache calls them; tests inspect
/// scores and positions). A policy derives from it and adds its rule.
class TokenPolicyBase {
 public:
  /// A token policy with `groups` independent choices per stream.
  explicit TokenPolicyBase(std::int32_t groups) : groups_(groups) {}
  /// Sizes the per-stream state: `streams` streams of up to `cap` tokens.
  void bind(const EvictionShape& shape) { st_.bind(shape.streams, shape.max_tokens, groups_); }
  /// Independent choices per stream (kv-heads, or layers x kv-heads).
  std::int32_t groups() const noexcept { return groups_; }
  /// Moves group g's scores and positions with the compaction moves; the group keeps `kept` tokens.
  void on_compacted(std::uint32_t s, std::int32_t g, std::span<const SlotMove> moves, std::int32_t kept) noexcept {
    st_.compact(s, g, moves, kept);
  }
  /// Keeps the first `held` tokens of stream s (rollback).
  void on_truncate(std::uint32_t s, std::int32_t held) noexcept { st_.truncate(s, held); }
  /// Forgets stream s.
  void reset(std::uint32_t s) noexcept { st_.truncate(s, 0); }
  /// Copies stream from's state to stream to (fork).
  void copy_state(std::uint32_t from, std::uint32_t to) noexcept { st_.copy(from, to); }
  /// Tokens appended since the last observe join the state (score 0).
  void begin_eviction(std::uint32_t s, const StreamView& v) noexcept { st_.sync(s, v); }

  /// Group g's scores and original positions, by slot.
  std::span<const float> scores(std::uint32_t s, std::int32_t g) const noexcept {
    return {st_.scores(s, g), std::size_t(st_.length(s))};
  }
  /// Group g's original token positions of stream s, by slot: what the engine's memory must hold after compaction.
  std::span<const std::int32_t> positions(std::uint32_t s, std::int32_t g) const noexcept {
    return {st_.positions(s, g), std::size_t(st_.length(s))};
  }
  friend bool operator==(const TokenPolicyBase& a, const TokenPolicyBase& b) { return a.st_ == b.st_; }

 protected:
  /// Adds (or with replace, stores) each group's row to its scores.
  void add_rows(std::uint32_t s, const Scores& sc, const StreamView& v, bool replace = false) noexcept {
    st_.sync(s, v);
    for (std::int32_t g = 0; g < groups_; ++g) {
      const auto row = group_row(sc, g, v.held);
      float* acc = st_.scores(s, g);
      if (replace) std::copy(row.begin(), row.end(), acc);
      else
        for (std::int32_t j = 0; j < v.held; ++j) acc[j] += row[std::size_t(j)];
    }
  }
  /// Token candidates at or after first_candidate, less `protect` of them.
  static std::int32_t evictable(const StreamView& v, std::int32_t protect) noexcept {
    const std::int32_t candidates = v.held - v.first_candidate;
    return candidates - std::min(protect, candidates);
  }

  std::int32_t groups_;  ///< Independent choices per stream.
  TokenState st_;  ///< Scores and positions of every stream.
};

KVCACHE_END_NAMESPACE
