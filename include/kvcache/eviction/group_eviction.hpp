// An eviction policy on a hybrid model's global layers (HybridCache's
// participant). The full and MLA groups grow with the context; the window
// and chunked groups keep their own retention. A block policy (StreamingLLM's
// sinks + window, OpenVINO's three-area block scores) runs on each global
// group's rows, one stream per (sequence, group), each group with its own
// block size.
//
// An evicted block leaves a hole in the row (the null block): the blocks
// after it keep their index, so their keys keep the positions they were
// rotated at, and a hole is never rewritten. The policy plans on the row as
// Cache<>'s table would hold it (its live blocks, consecutively); what
// kernels read is that same compacted row (hybrid_exports.hpp). Nothing is
// re-rotated and no data moves, so a block other rows share is let go by
// this row alone: its bytes stay, published or not.
//
// Blocks computed after a sequence evicts hold K/V of a context that is not
// the prompt's, so the cache publishes none of them (every group's: a window
// layer's keys read the global layers' outputs).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "kvcache/config.hpp"
#include "kvcache/eviction/plan.hpp"
#include "kvcache/eviction/scores_check.hpp"
#include "kvcache/groups/group_rows.hpp"
#include "kvcache/groups/layer_groups.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/pool/block_pool.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// No eviction on the layer groups (KeepAll): held, never called, no space.
template <EvictionPolicy E>
class GroupEviction {
 public:
  static constexpr bool evicts = false;  ///< The cache answers no eviction call.
  GroupEviction() = default;
  /// Takes the policy.
  explicit GroupEviction(E policy) : e_(std::move(policy)) {}
  void bind(const LayerGroups&, std::int32_t, std::int32_t) {}  ///< Nothing to bind.
  const E& policy() const noexcept { return e_; }  ///< The policy.
  void freed(std::uint32_t) noexcept {}  ///< A row ended: nothing to forget.
  void truncated(std::span<const GroupRows>, std::uint32_t, std::int64_t) noexcept {}  ///< A rollback: nothing to cut.
  /// Group g's lifetime blocks: the group rule's own bound, `plain`.
  std::int64_t blocks_needed(std::int32_t, std::int64_t plain, std::int64_t, std::int64_t, std::int64_t) const noexcept {
    return plain;
  }
  friend bool operator==(const GroupEviction&, const GroupEviction&) { return true; }

 private:
  [[no_unique_address]] E e_{};
};

/// A block policy on the full and MLA groups: one bound copy per group, one stream per sequence.
template <EvictionPolicy E>
  requires BlockEviction<E>
class GroupEviction<E> {
 public:
  static constexpr bool evicts = true;  ///< The cache answers evict() (and observe() for a policy that reads scores).

  /// Takes the policy (unbound: the cache binds a copy per global group).
  explicit GroupEviction(E policy) : e_(std::move(policy)) {}

  /// One copy of the policy per full or MLA group, bound to its block size
  /// and max_sequences streams of max_tokens (construction time);
  /// ConfigError when the layout has no global group or the policy does not fit.
  void bind(const LayerGroups& lg, std::int32_t max_sequences, std::int32_t max_tokens) {
    for (std::int32_t g = 0; g < lg.num_groups(); ++g) {
      if (!global_kind(lg.spec(g).kind)) continue;
      globals_.push_back(g);
      policies_.push_back(e_);
      policies_.back().bind(EvictionShape{.streams = max_sequences, .max_tokens = max_tokens, .block_size = lg.block_size(g)});
    }
    if (globals_.empty())
      throw ConfigError("kvcache::HybridCache (eviction)",
                        Status{Errc::invalid_argument, "groups (no full or MLA group to evict on)", lg.num_groups(), 0});
    index_.assign(std::size_t(lg.num_groups()), -1);
    for (std::size_t k = 0; k < globals_.size(); ++k) index_[std::size_t(globals_[k])] = std::int32_t(k);
    std::int32_t longest = 0;
    for (const std::int32_t g : globals_) longest = std::max(longest, std::int32_t(blocks_for_tokens(max_tokens, lg.block_size(g))));
    live_.resize(std::size_t(longest));
    scratch_.resize(std::size_t(longest));
    counts_.resize(globals_.size());
  }

  const E& policy() const noexcept { return e_; }  ///< The policy as given (unbound).
  /// Group g's bound copy: invalid_argument for a group that is not full or MLA.
  Result<const E*> policy(std::int32_t g) const noexcept {
    if (auto k = slot(g); !k) return k.status();
    else return &policies_[std::size_t(*k)];
  }
  /// The full and MLA groups, in group order.
  std::span<const std::int32_t> globals() const noexcept { return globals_; }

  // --- the cache's edits ---
  /// Row i ended: every group's stream starts over.
  void freed(std::uint32_t i) noexcept {
    for (E& p : policies_) p.reset(i);
  }
  /// Row i was rolled back to `tokens` positions: each stream is cut to what its row holds.
  void truncated(std::span<const GroupRows> rows, std::uint32_t i, std::int64_t tokens) noexcept {
    for (std::size_t k = 0; k < globals_.size(); ++k)
      policies_[k].on_truncate(i, held(rows[std::size_t(globals_[k])], i, tokens));
  }
  /// Group g's lifetime blocks under the policy: the prompt held whole until
  /// the policy first runs (with a prefill chunk, after every chunk), then
  /// the policy's bound for the request's length; never past the rule's `plain`.
  std::int64_t blocks_needed(std::int32_t g, std::int64_t plain, std::int64_t prompt_len, std::int64_t max_new,
                             std::int64_t chunk) const noexcept {
    const std::int32_t k = index_[std::size_t(g)];
    if (k < 0) return plain;
    const E& p = policies_[std::size_t(k)];
    const std::int32_t b = p.block_size();
    std::int64_t peak = prompt_len;
    if (const std::int64_t after = p.max_tokens_after_eviction(); chunk > 0 && after < prompt_len)
      peak = std::min(prompt_len, after + std::min(chunk, prompt_len));
    return std::min(plain, std::max(blocks_for_tokens(peak, b), p.max_blocks_held(prompt_len + max_new, b)));
  }

  // --- the calls (HybridCache forwards them, its handle checked) ---
  /// Group g's scores for row i's held tokens (in the order the compacted
  /// row holds them: export_group_csr's), validated, to the policy.
  Status observe(std::span<const GroupRows> rows, std::uint32_t i, std::int64_t tokens, std::int32_t g,
                 const Scores& sc) noexcept
    requires ObservingEviction<E>
  {
    auto k = slot(g);
    if (!k) return k.status();
    const StreamView v = view(rows[std::size_t(g)], i, tokens);
    if (auto st = check_scores<E>(sc.kind, sc.rows, sc.values, std::int64_t{v.held} * sc.rows); !st) return st;
    return policies_[std::size_t(*k)].observe(i, sc, v);
  }

  /// Runs the policy on every global group of row i: each plans on its
  /// compacted row, then the chosen blocks become holes. out.blocks gets
  /// their block indices (positions / block size), group after group in
  /// globals() order. Blocks holding a token not yet computed (at or past
  /// `computed`) never leave: a plan naming one is invalid_argument (run the
  /// policy after the forward pass); one outside the row or out of order is
  /// invariant_violated. All or nothing: every group plans before any edit.
  Result<EvictionResult> evict(std::span<GroupRows> rows, BlockPool& pool, std::uint32_t i, std::int64_t tokens,
                               std::int64_t computed, const EvictionSpans& out) noexcept {
    std::int64_t at = 0, short_by = 0;  // short_by: blocks past out.blocks (every group still plans, to name the whole need)
    for (std::size_t k = 0; k < globals_.size(); ++k) {  // plan every group first: nothing changes on error
      const GroupRows& r = rows[std::size_t(globals_[k])];
      const std::span<std::int32_t> room = short_by > 0 ? std::span<std::int32_t>{} : out.blocks.subspan(std::size_t(at));
      auto n = policies_[k].plan(i, view(r, i, tokens), room);
      if (!n && n.status().code() == Errc::buffer_too_small) {
        short_by += n.status().limit();
        continue;
      }
      if (!n) return n.status();
      if (auto st = check_plan(r, i, computed, room.first(std::size_t(*n))); !st) return st;
      counts_[k] = *n;
      at += *n;
    }
    if (short_by > 0) return Status{Errc::buffer_too_small, "blocks", std::int64_t(out.blocks.size()), at + short_by};
    EvictionResult res{.first_changed = std::int32_t(std::min<std::int64_t>(tokens, INT32_MAX))};
    at = 0;
    for (std::size_t k = 0; k < globals_.size(); ++k) {
      GroupRows& r = rows[std::size_t(globals_[k])];
      const std::span<std::int32_t> chosen = out.blocks.subspan(std::size_t(at), std::size_t(counts_[k]));
      const std::int32_t b = r.rule().block_size;
      live_indices(r, i);
      std::copy(chosen.begin(), chosen.end(), scratch_.begin());  // the policy hears its own (compacted) indices
      for (std::int32_t& c : chosen) c = live_[std::size_t(c)];    // the engine hears the row's
      for (const std::int32_t j : chosen) r.punch(pool, i, j);
      policies_[k].on_removed(i, std::span<const std::int32_t>(scratch_.data(), chosen.size()));
      if (counts_[k] > 0) res.first_changed = std::min(res.first_changed, chosen[0] * b);
      res.evicted += counts_[k];
      res.tokens += counts_[k] * b;
      at += counts_[k];
    }
    if (res.evicted == 0) res.first_changed = 0;
    return res;
  }

  friend bool operator==(const GroupEviction& a, const GroupEviction& b) {
    if constexpr (requires(const E& x) { x == x; }) return a.policies_ == b.policies_;
    else return true;
  }

 private:
  Result<std::int32_t> slot(std::int32_t g) const noexcept {
    if (g < 0 || g >= std::int32_t(index_.size())) return Status{Errc::invalid_argument, "group", g, std::int64_t(index_.size()) - 1};
    if (index_[std::size_t(g)] < 0)
      return Status{Errc::invalid_argument, "group (a window, chunked or cross group: eviction acts on full and MLA groups)", g, 0};
    return index_[std::size_t(g)];
  }
  // Tokens of row i's live blocks, `tokens` reserved.
  static std::int32_t held(const GroupRows& r, std::uint32_t i, std::int64_t tokens) noexcept {
    return std::int32_t(tokens - r.not_held(i));
  }
  static StreamView view(const GroupRows& r, std::uint32_t i, std::int64_t tokens) noexcept {
    return {held(r, i, tokens), tokens, 0};
  }
  // live_[c] = the row index of row i's c-th live block.
  void live_indices(const GroupRows& r, std::uint32_t i) noexcept {
    const auto row = r.row(i);
    std::size_t c = 0;
    for (std::int32_t j = r.first_live(i); j < std::int32_t(row.size()); ++j)
      if (row[std::size_t(j)] != BlockPool::null_block) live_[c++] = j;
  }
  // A plan is ascending compacted indices of live, wholly computed blocks.
  Status check_plan(const GroupRows& r, std::uint32_t i, std::int64_t computed, std::span<const std::int32_t> plan) noexcept {
    live_indices(r, i);
    const std::int32_t live = r.live(i), b = r.rule().block_size;
    for (std::size_t c = 0; c < plan.size(); ++c) {
      if (plan[c] < 0 || plan[c] >= live || (c > 0 && plan[c] <= plan[c - 1]))
        return Status{Errc::invariant_violated, "evicted (the policy's plan)", plan[c], live};
      if (std::int64_t{live_[std::size_t(plan[c])] + 1} * b > computed)
        return Status{Errc::invalid_argument, "tokens not computed (the plan takes a block holding one: evict after computed())",
                      std::int64_t{live_[std::size_t(plan[c])] + 1} * b, computed};
    }
    return {};
  }
  E e_;
  std::vector<E> policies_;             // [k]: bound to globals_[k]'s block size
  std::vector<std::int32_t> globals_;   // the full and MLA groups
  std::vector<std::int32_t> index_;     // [group]: its k, -1 for the others
  std::vector<std::int32_t> live_, scratch_, counts_;  // one call's scratch, sized at bind
};

KVCACHE_END_NAMESPACE
