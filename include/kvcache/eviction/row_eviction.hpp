// An eviction policy run on per-sequence rows (a token-paged cache's
// participant): the policy with its per-stream state, the bound ledger that
// tells a legal state from a bug, and the scratch a token eviction needs.
// Everything the cache once decided on the policy's behalf lives here: which
// scores the policy takes, how far a rollback reaches, which plan a policy's
// kind runs, what a request needs over its life, and the bound invariant.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <type_traits>

#include "kvcache/config.hpp"
#include "kvcache/eviction/bound_ledger.hpp"
#include "kvcache/eviction/plan.hpp"
#include "kvcache/eviction/run.hpp"
#include "kvcache/eviction/scores_check.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// An eviction policy over per-sequence rows, with its ledger and scratch.
template <EvictionPolicy E>
class RowEviction {
 public:
  /// Policies that can leave a stream above its bound between calls: the ledger keeps where each stands.
  static constexpr bool ledgered = BlockEviction<E> || TokenEviction<E> || WindowEviction<E>;

  RowEviction() = default;
  /// Takes the policy.
  explicit RowEviction(E policy) : e_(std::move(policy)) {}

  /// Binds the policy to the cache's shape (its block size included: the
  /// policy is never given it twice) and sizes the ledger and the scratch
  /// (construction time); a policy that does not fit throws ConfigError.
  void bind(const EvictionShape& shape) {
    if constexpr (StatefulEviction<E>) e_.bind(shape);
    if constexpr (ledgered) ledger_.bind(shape.streams);
    if constexpr (TokenEviction<E>) {
      scratch_.chosen.resize(std::size_t(shape.max_tokens));
      scratch_.index_moves.resize(std::size_t(shape.max_tokens));
    }
  }
  /// The policy (read-only: positions, scores, config).
  const E& policy() const noexcept { return e_; }

  // --- hooks (cache/hooks.hpp) ---
  /// A fork: the child's state and ledger entry are its parent's.
  template <class Rows>
  void forked(const Rows&, SeqId parent, SeqId child) noexcept {
    if constexpr (StatefulEviction<E>) e_.copy_state(parent.index, child.index);
    if constexpr (ledgered) ledger_.copy(parent.index, child.index);
  }
  /// s ended: its state and ledger entry start over.
  template <class Rows>
  void freed(const Rows&, SeqId s) noexcept {
    if constexpr (StatefulEviction<E>) e_.reset(s.index);
    if constexpr (ledgered) ledger_.reset(s.index);
  }
  /// A rollback: the state is cut to what s holds, the ledger to what it appended.
  template <class Rows>
  void truncated(const Rows& r, SeqId s, std::int32_t) noexcept {
    if constexpr (StatefulEviction<E>) e_.on_truncate(s.index, r.table.tokens_unchecked(s));
    if constexpr (ledgered) ledger_.on_truncate(s.index, r.table.appended_unchecked(s));
  }

  /// Before a rollback of n tokens of s (validated): a token policy's
  /// compaction reorders the row, so a rollback reaches back only to the last
  /// evict() that evicted tokens; further is truncate_too_many naming the limit.
  template <class Table>
  Status check_truncate(const Table& t, SeqId s, std::int32_t n) const noexcept {
    if constexpr (TokenEviction<E>) {
      const std::int64_t limit = ledger_.rollback_limit(s.index, t.appended_unchecked(s));
      if (n > limit) return Status{Errc::truncate_too_many, "n_tokens", n, limit};
    }
    return {};
  }

  /// Validates one step's scores for s's held tokens (scores_check.hpp) and feeds them to the policy.
  template <class Table>
  Status observe(const Table& t, SeqId s, const Scores& sc) noexcept
    requires ObservingEviction<E>
  {
    if (auto st = t.validate(s); !st) return st;
    if (auto st = check_scores<E>(sc.kind, sc.rows, sc.values, std::int64_t{t.tokens_unchecked(s)} * sc.rows); !st) return st;
    return e_.observe(s.index, sc, EvictionRun::view(t, s, 0));
  }

  /// Runs the policy on s by its kind and records where s now stands. What
  /// leaves and what the engine must do:
  ///   block   chosen logical blocks leave the row (ascending, into out.blocks);
  ///           kept blocks that moved go to out.rotations (block, new index,
  ///           position delta) for key re-rotation. Shared blocks never move:
  ///           candidates start after the sequence's last shared block.
  ///   token   each group's tokens leave; the survivors are compacted: run
  ///           out.moves[out.group_moves[g] .. out.group_moves[g+1]) with the
  ///           compaction kernel on group g's heads before the next write. The
  ///           row then drops its tail. Tokens in shared blocks never leave.
  ///           group_moves (groups() + 1 entries) is required and always
  ///           written: a call with nothing to evict writes empty ranges.
  ///   window  the oldest tokens leave the front; blocks with no live token go
  ///           back to the pool. Nothing to run. `pending`: the last held
  ///           tokens whose attention has not run yet (evict between reserve
  ///           and attention); the window keeps what they need.
  template <class Table, class Pool>
  Result<EvictionResult> evict(Table& t, Pool& pool, SeqId s, const EvictionSpans& out, std::int32_t pending) noexcept {
    if (auto st = t.validate(s); !st) return st;
    const std::int32_t held = t.tokens_unchecked(s);
    if (pending < 0 || pending > held || (!WindowEviction<E> && pending != 0))
      return Status{Errc::invalid_argument, "pending_queries", pending, WindowEviction<E> ? held : 0};
    Result<EvictionResult> r = EvictionResult{};
    if constexpr (BlockEviction<E>) r = EvictionRun::blocks(t, pool, e_, s, out.blocks, out.rotations);
    else if constexpr (TokenEviction<E>) r = EvictionRun::tokens(t, pool, e_, scratch_, s, out.moves, out.group_moves);
    else if constexpr (WindowEviction<E>) r = EvictionRun::front(t, pool, e_, s, pending);
    if constexpr (ledgered)
      if (r) settle(t, pool, s, pending, TokenEviction<E> && r.value().tokens > 0);
    return r;
  }

  /// Pool blocks a request needs over its life (lengths checked by the
  /// caller): the prompt is held whole until the policy first runs, or, with
  /// prefill_chunk > 0, evicted after every chunk of at most that many tokens.
  std::int64_t blocks_needed(std::int64_t prompt_len, std::int64_t max_new, std::int64_t prefill_chunk,
                             std::int32_t block_size) const noexcept {
    std::int64_t peak = prompt_len;
    const std::int64_t after = e_.max_tokens_after_eviction();
    // A window's dead front slots (< B), and, when it evicts before attention,
    // the W − 1 + chunk it keeps for the previous chunk's queries.
    const std::int64_t chunk = std::min(prefill_chunk, prompt_len);
    const std::int64_t slack = WindowEviction<E> ? block_size - 1 + std::max<std::int64_t>(0, chunk - 1) : 0;
    if (chunk > 0 && after < prompt_len) peak = std::min(prompt_len, after + chunk + slack);
    return std::max(blocks_for_tokens(peak, block_size), e_.max_blocks_held(prompt_len + max_new, block_size));
  }

  /// Tokens s holds above its bound because shared blocks kept the last evict() from going lower.
  std::int64_t shared_excess(SeqId s) const noexcept {
    if constexpr (ledgered) return ledger_.at(s.index).excess;
    else return 0;
  }

  /// The eviction contract on every row: a stream holds no more than the
  /// policy's bound for what it appended as of its last evict(), plus the
  /// tokens reserved since and its shared excess; a stream the policy has
  /// fully met holds no more blocks than the policy advertised.
  template <class Table>
  Status check(const Table& t) const {
    Status bad{};
    t.for_each_stream([&](SeqId s) {
      const std::int64_t appended = t.appended_unchecked(s), held = t.tokens_unchecked(s);
      const std::int64_t blocks = std::int64_t(t.blocks_unchecked(s).size());
      BoundLedger::Entry e{.settled = appended};
      if constexpr (ledgered) e = ledger_.at(s.index);
      const std::int64_t limit = e_.max_tokens_held(e.settled) + (appended - e.settled) + e.excess;
      if (bad.ok() && held > limit) bad = Status{Errc::invariant_violated, "tokens_held", held, limit};
      const std::int64_t max_blocks = e_.max_blocks_held(appended, t.block_size());
      if (bad.ok() && e.settled == appended && e.excess == 0 && blocks > max_blocks)
        bad = Status{Errc::invariant_violated, "blocks_held", blocks, max_blocks};
    });
    return bad;
  }

  friend bool operator==(const RowEviction& a, const RowEviction& b) {
    if constexpr (StatefulEviction<E>)
      if (!(a.e_ == b.e_)) return false;
    if constexpr (ledgered) return a.ledger_ == b.ledger_;
    return true;
  }

 private:
  // The policy evicted: record where the stream now stands. Later pending
  // queries wait for attention; above the bound is legal only where shared
  // blocks stopped the policy.
  template <class Table, class Pool>
  void settle(const Table& t, const Pool& pool, SeqId s, std::int32_t pending, bool reordered) noexcept {
    const std::int64_t appended = t.appended_unchecked(s), held = t.tokens_unchecked(s);
    const std::int64_t settled = appended - std::max(0, pending - 1);
    const std::int64_t over = held - e_.max_tokens_held(settled) - (appended - settled);
    const bool pinned = over > 0 && EvictionRun::first_unshared_block(t, pool, s) > 0;
    ledger_.settle(s.index, settled, pinned ? over : 0, reordered, appended);
  }

  struct NoLedger {};  // distinct empty types: they may share one address
  struct NoScratch {};
  [[no_unique_address]] E e_{};
  [[no_unique_address]] std::conditional_t<ledgered, BoundLedger, NoLedger> ledger_;
  [[no_unique_address]] std::conditional_t<TokenEviction<E>, EvictionRun::TokenScratch, NoScratch> scratch_;
};

KVCACHE_END_NAMESPACE
