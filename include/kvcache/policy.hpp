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
#include "kvcache/core/slot_move.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Signals an attention kernel (or a recomputation) can feed to policies.
struct Signals {
  std::uint32_t bits = 0;  ///< The signals, as a bit set.
  static constexpr std::uint32_t head_attention_sums = 1u << 0;  ///< per token, per head, summed over queries
  static constexpr std::uint32_t attention_sums = 1u << 1;  ///< per token, reduced over heads
  /// Per token: the softmax of the step's last query, per head.
  static constexpr std::uint32_t last_query_attention = 1u << 2;
  static constexpr std::uint32_t key_norms = 1u << 3;  ///< Per token: the key's norm.
  static constexpr std::uint32_t page_key_bounds = 1u << 4;  ///< per page, per head key min/max
  static constexpr std::uint32_t gate_scores = 1u << 5;  ///< Per token: a learned write gate (admission).

  /// True when every signal in `need` is in this set.
  constexpr bool covers(Signals need) const noexcept { return (need.bits & ~bits) == 0; }
  friend constexpr bool operator==(Signals, Signals) = default;
};

inline constexpr Signals no_signals{};  ///< The empty signal set.

/// Blocks of `block_size` tokens that `tokens` tokens fill: ceil(tokens / B),
/// without the overflow of (tokens + B - 1) / B near INT64_MAX. 0 for
/// tokens <= 0 or block_size < 1.
constexpr std::int64_t blocks_for_tokens(std::int64_t tokens, std::int32_t block_size) noexcept {
  if (tokens <= 0 || block_size < 1) return 0;
  return tokens / block_size + (tokens % block_size != 0 ? 1 : 0);
}

/// How an admission policy takes part in writes (the cache's API follows it).
enum class AdmissionKind : std::uint8_t {
  /// Every token is written where reserve() puts it; the cache never calls the policy (AdmitAll: free).
  pass_through,
  /// The policy decides per token, by sequence and position, whether its K/V
  /// is written: reserve() takes room for the admitted tokens only and gives
  /// the others slot -1 (the scatter skips them); positions count every
  /// token. Such rows skip positions, so they are not prefixes: no prefix
  /// caching, no rollback (admission/row_admission.hpp).
  per_token,
  /// The policy owns one page-table stream per (sequence, layer, kv-head) and
  /// places every write itself: ring slot, promotion, global slot or none
  /// (WriteGate). The cache's writes are write(seq, layer, gates, ...).
  head_paged,
};

/// How a selection policy takes part in reads (the cache's API follows it).
enum class SelectionKind : std::uint8_t {
  /// Every query reads every page the row holds; the cache never calls the policy (SelectAll: free).
  dense,
  /// Each (sequence, kv-head) reads the pages whose key bounds score best
  /// against the step's queries (QuestSelection). The cache keeps a page-bounds
  /// store current across its write paths and answers select() with a
  /// head-folded CSR (selection/page_bounds_selection.hpp).
  page_bounds,
};

// Admission runs per write, per (layer, kv-head): the policy's kind says
// whether it is consulted at all (pass_through) or owns the placement of
// every token (head_paged; its full interface: table/head_rows.hpp).
template <class P>
concept AdmissionPolicy = requires {
  { P::required_signals } -> std::convertible_to<Signals>;
  { P::kind } -> std::convertible_to<AdmissionKind>;
};

// Selection runs per read: the policy's kind says whether it is consulted
// at all (dense) or chooses pages from key bounds (page_bounds; its full
// interface: selection/page_bounds_selection.hpp).
template <class P>
concept SelectionPolicy = requires {
  { P::required_signals } -> std::convertible_to<Signals>;
  { P::kind } -> std::convertible_to<SelectionKind>;
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

/// One step's attention scores for one stream, in a form attention kernels
/// emit: `rows` rows of one float per held token (slot order), row-major.
///   attention_sums        rows == 1: summed over heads and the step's queries
///   head_attention_sums   rows == the policy's groups (kv-heads, or layers x
///                         kv-heads): summed over each group's queries
///   last_query_attention  rows == heads: softmax of the step's last query
/// The cache checks the shape and rejects NaN or negative values before any
/// policy sees them.
enum class ScoreKind : std::uint8_t { attention_sums, head_attention_sums, last_query_attention };

/// True for the kinds ScoreKind names (a cast integer may name none).
constexpr bool valid_kind(ScoreKind k) noexcept {
  return k == ScoreKind::attention_sums || k == ScoreKind::head_attention_sums || k == ScoreKind::last_query_attention;
}

/// The largest score observe() accepts: scores are finite (an infinity would
/// turn sums and averages into NaN).
inline constexpr float kMaxScore = 3.40282346638528859812e+38F;

/// Index of the first value outside [lo, hi] (NaN counts as outside), or -1.
/// Scans branch-free first (it vectorizes): valid input, the common case, pays one pass.
inline std::int64_t first_outside(std::span<const float> v, float lo, float hi) noexcept {
  const float* in = v.data();
  bool ok = true;  // NaN fails both comparisons
  for (std::size_t i = 0; i < v.size(); ++i) ok &= (in[i] >= lo) & (in[i] <= hi);
  if (ok) return -1;
  for (std::size_t i = 0; i < v.size(); ++i)
    if (!(in[i] >= lo && in[i] <= hi)) return std::int64_t(i);
  return -1;
}

/// The signal a score form provides (empty for a value outside ScoreKind).
constexpr Signals signal_of(ScoreKind k) noexcept {
  switch (k) {
    case ScoreKind::attention_sums: return Signals{Signals::attention_sums};
    case ScoreKind::head_attention_sums: return Signals{Signals::head_attention_sums};
    case ScoreKind::last_query_attention: return Signals{Signals::last_query_attention};
  }
  return {};
}

/// One step's scores for one stream (see ScoreKind for the shapes).
struct Scores {
  ScoreKind kind = ScoreKind::attention_sums;  ///< Which form the values have.
  std::span<const float> values{};  ///< rows x held floats, row-major, finite and non-negative.
  std::int32_t rows = 1;  ///< Rows in values.
};

/// What a policy knows about a stream when it observes or plans.
struct StreamView {
  std::int32_t held = 0;  ///< live tokens
  std::int64_t appended = 0;  ///< tokens ever appended: the next token's position
  std::int32_t first_candidate = 0;  ///< nothing below this may leave (after shared blocks):
                                     // a block index for block policies, a token index for token policies
};

/// What a cache binds a stateful policy to, once, at construction: the
/// settings the policy must not be given twice (the block size is the
/// geometry's) and the capacities its state is sized for.
struct EvictionShape {
  std::int32_t streams = 0;     ///< Table streams (sequences, or head rows).
  std::int32_t max_tokens = 0;  ///< Most tokens one stream holds.
  std::int32_t block_size = 0;  ///< Tokens per block: the cache's geometry's.
};

// Per-stream state that moves with the cache: sized once (bind, which may
// throw ConfigError for a configuration that does not fit the shape), copied
// on fork, cut on rollback (on_truncate), cleared when the stream is freed.
template <class P>
concept StatefulEviction = EvictionPolicy<P> && requires(P& p, std::uint32_t s, std::int32_t n) {
  p.bind(EvictionShape{});
  p.on_truncate(s, n);
  p.reset(s);
  p.copy_state(s, s);
};

// A policy that learns from scores. It is handed validated scores only.
template <class P>
concept ObservingEviction = StatefulEviction<P> && requires(P& p, std::uint32_t s, const Scores& sc, const StreamView& v) {
  { p.observe(s, sc, v) } -> std::same_as<Status>;
};

// Drops whole logical blocks: a page-table edit, no data moves. plan() writes
// the blocks to drop (ascending) and returns how many.
template <class P>
concept BlockEviction = StatefulEviction<P> && requires(P& p, std::uint32_t s, const StreamView& v,
                                                        std::span<std::int32_t> out, std::span<const std::int32_t> blocks) {
  { p.plan(s, v, out) } -> std::same_as<Result<std::int32_t>>;
  p.on_removed(s, blocks);
};

// Drops single tokens; the cache compacts the survivors (compaction kernel).
// groups() streams of choices share one page table (kv-heads, or layers x
// kv-heads): each group picks its own tokens, all evict the same count.
// evict_count() only reads (the cache checks the caller's buffers against
// it); begin_eviction() then updates the stream's state for this call, even
// when the count is 0 (SnapKV's one shot is spent). choose() writes one
// group's count token indices (ascending, >= first_candidate); on_compacted()
// gets the group's moves as token indices (src -> dst) and the tokens kept.
template <class P>
concept TokenEviction = StatefulEviction<P> && requires(P& p, const P& cp, std::uint32_t s, const StreamView& v,
                                                        std::int32_t g, std::span<std::int32_t> out,
                                                        std::span<const SlotMove> moves) {
  { cp.groups() } -> std::same_as<std::int32_t>;
  { cp.evict_count(s, v) } -> std::same_as<std::int32_t>;
  p.begin_eviction(s, v);
  p.choose(s, v, g, out);
  p.on_compacted(s, g, moves, g);
};

// Keeps a trailing window: the cache drops front_excess(held, pending) tokens
// from the front of the stream (whole blocks go back to the pool; no data
// moves). `pending`: the last held tokens whose queries have not attended yet.
template <class P>
concept WindowEviction = EvictionPolicy<P> && requires(const P& p, std::int32_t held) {
  { p.front_excess(held, held) } -> std::same_as<std::int32_t>;
};

KVCACHE_END_NAMESPACE
