// The three policy hooks, typed by when they run, as concepts:
//   admission  - before a write: is this token's K/V persisted at all?
//   selection  - at read time: which pages does this query read?
//   eviction   - after writes: what leaves; and the bound accounting relies on.
// Each policy declares the score signals it needs; a cache that cannot supply
// them refuses the policy at compile time.
#pragma once

#include <concepts>
#include <cstdint>
#include <span>

#include "kvcache/config.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

// Signals an attention kernel (or a recomputation) can feed to policies.
struct Signals {
  std::uint32_t bits = 0;
  static constexpr std::uint32_t head_attention_sums = 1u << 0;  // per token, per head, summed over queries
  static constexpr std::uint32_t attention_sums = 1u << 1;       // per token, reduced over heads
  static constexpr std::uint32_t last_query_attention = 1u << 2;
  static constexpr std::uint32_t key_norms = 1u << 3;
  static constexpr std::uint32_t page_key_bounds = 1u << 4;      // per page, per head key min/max
  static constexpr std::uint32_t gate_scores = 1u << 5;

  constexpr bool covers(Signals need) const noexcept { return (need.bits & ~bits) == 0; }
  friend constexpr bool operator==(Signals, Signals) = default;
};

inline constexpr Signals no_signals{};

// One token about to be written, as admission sees it.
struct AdmissionQuery {
  std::int32_t layer = 0;
  std::int32_t head = 0;
  std::int64_t position = 0;
  float gate = 1.0f;  // gate score when Signals::gate_scores is provided
};

// One read: num_pages logical pages exist; at most budget may be read.
struct SelectionQuery {
  std::int32_t layer = 0;
  std::int32_t head = 0;
  std::int32_t num_pages = 0;
  std::int32_t budget = 0;
};

template <class P>
concept AdmissionPolicy = requires(const P& p, const AdmissionQuery& q) {
  { P::required_signals } -> std::convertible_to<Signals>;
  { p.admit(q) } -> std::same_as<bool>;
};

// select() writes the chosen logical page indices, ascending, to out and
// returns how many; out holds at least q.num_pages entries.
template <class P>
concept SelectionPolicy = requires(const P& p, const SelectionQuery& q, std::span<std::int32_t> out) {
  { P::required_signals } -> std::convertible_to<Signals>;
  { p.select(q, out) } -> std::same_as<std::int32_t>;
};

// The accounting contract: a stream that has appended n tokens holds at most
// max_tokens_held(n) tokens in at most max_blocks_held(n, B) blocks, after
// the policy has run; max_tokens_after_eviction() bounds any stream (INT64_MAX
// when the policy never evicts). Tests hold the cache to these numbers.
template <class P>
concept EvictionPolicy = requires(const P& p, std::int64_t n, std::int32_t block_size) {
  { P::required_signals } -> std::convertible_to<Signals>;
  { p.max_tokens_held(n) } -> std::same_as<std::int64_t>;
  { p.max_blocks_held(n, block_size) } -> std::same_as<std::int64_t>;
  { p.max_tokens_after_eviction() } -> std::same_as<std::int64_t>;
};

// An eviction policy that learns from scores and decides per stream. The
// cache sizes its state once (bind), feeds it (observe), asks it for logical
// blocks to drop (plan), and tells it what happened to the stream so its state
// moves with the cache (on_removed, on_truncate, reset, copy_state on fork).
template <class P>
concept ObservingEviction =
    EvictionPolicy<P> && requires(P& p, std::uint32_t s, std::int32_t n, std::span<const float> scores,
                                  std::span<std::int32_t> out, std::span<const std::int32_t> blocks) {
      p.bind(n, n);
      { p.observe(s, scores) } -> std::same_as<Status>;
      { p.plan(s, n, n, out) } -> std::same_as<Result<std::int32_t>>;
      p.on_removed(s, blocks);
      p.on_truncate(s, n);
      p.reset(s);
      p.copy_state(s, s);
    };

KVCACHE_END_NAMESPACE
