// Token eviction of a head-paged admission's global region (WriteGate + H2O,
// SnapKV, TOVA, average attention): each head row's global tokens are one
// stream of the token policy (its index is the row's table stream), with one
// group; the ring is never a candidate. Admitted tokens join the stream at
// its end, a rollback takes its newest back, and the policy's compaction
// keeps its chosen tokens in the region's first slots (the fewest moves:
// kept tokens past the new length fill the holes, so the region's order is
// no longer its positions' order after an eviction).
//
// The region's stream has no position counter of its own: `appended` counts
// tokens it ever took, less those rolled back, from the length seen at the
// last call (`seen`) and the region's length now.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/table/head_rows.hpp"
#include "kvcache/pool/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/eviction/compaction_plan.hpp"
#include "kvcache/eviction/plan.hpp"
#include "kvcache/eviction/scores_check.hpp"
#include "kvcache/table/page_table.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/core/slot_move.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Per head row: where the global region's token stream stands, and the scratch of an eviction.
class GlobalRegion {
 public:
  /// Sizes the counters for `streams` head rows of up to `cap` tokens (construction time).
  void bind(std::int32_t streams, std::int32_t cap) {
    appended_.assign(std::size_t(std::max(0, streams)), 0);
    seen_.assign(appended_.size(), 0);
    chosen_.resize(std::size_t(std::max(0, cap)));
    index_moves_.resize(chosen_.size());
  }

  /// The policy's view of head (layer, h) of s (validated): the region's tokens, its
  /// appended count, and the first one it may evict (past shared blocks).
  template <HeadPagedAdmission A>
  StreamView view(const PageTable& t, const BlockPool& pool, const A& a, SeqId s, std::int32_t layer, std::int32_t h) const noexcept {
    const std::uint32_t row = a.head_unchecked(s, layer, h).index;
    const std::int32_t g = a.head_state(s, layer, h)->global;
    return {g, appended_[row] + (g - seen_[row]), a.first_evictable(t, pool, s, layer, h)};
  }

  /// Feeds one layer's scores: `values` holds each kv-head's row in turn,
  /// one score per token the row holds (ring slots, then the global region,
  /// as export_heads_csr lays them out); the policy sees each row's global part.
  template <HeadPagedAdmission A, class E>
  Status observe(const PageTable& t, const BlockPool& pool, const A& a, E& e, SeqId s, std::int32_t layer, ScoreKind kind,
                 std::span<const float> values) noexcept {
    if (auto h = a.head(s, layer, 0); !h) return h.status();
    std::int64_t want = 0;
    for (std::int32_t h = 0; h < a.num_kv_heads(); ++h) want += t.tokens_unchecked(a.head_unchecked(s, layer, h));
    if (auto st = check_scores<E>(kind, 1, values, want); !st) return st;
    std::size_t at = 0;
    for (std::int32_t h = 0; h < a.num_kv_heads(); ++h) {
      const std::int32_t held = t.tokens_unchecked(a.head_unchecked(s, layer, h));
      const StreamView v = view(t, pool, a, s, layer, h);
      const auto global = values.subspan(at + std::size_t(held - v.held), std::size_t(v.held));
      at += std::size_t(held);
      if (auto st = e.observe(a.head_unchecked(s, layer, h).index, Scores{kind, global, 1}, v); !st) return st;
    }
    return {};
  }

  /// Runs the policy on every head row of s: each row's chosen global tokens
  /// leave and the survivors are compacted; the slot moves of every row go to
  /// `moves` (one compaction launch on the single-head pool runs them all).
  /// A buffer too small for the plan is an error, and nothing changes.
  /// changed(row, page) hears each row whose pages from `page` on now hold other tokens.
  template <HeadPagedAdmission A, class E, class Changed>
  Result<EvictionResult> evict(PageTable& t, BlockPool& pool, A& a, E& e, SeqId s, std::span<SlotMove> moves,
                               Changed&& changed) noexcept {
    if (auto h = a.head(s, 0, 0); !h) return h.status();
    const std::int32_t L = a.num_layers(), H = a.num_kv_heads();
    std::int64_t need = 0;
    for (std::int32_t l = 0; l < L; ++l)
      for (std::int32_t h = 0; h < H; ++h) {
        const StreamView v = view(t, pool, a, s, l, h);
        const std::int32_t count = std::max(0, e.evict_count(a.head_unchecked(s, l, h).index, v));
        if (count > v.held - v.first_candidate) return Status{Errc::invariant_violated, "evict_count", count, v.held - v.first_candidate};
        need += count;
      }
    if (std::int64_t(moves.size()) < need) return Status{Errc::buffer_too_small, "moves", std::int64_t(moves.size()), need};
    EvictionResult out{};
    const std::int32_t W = a.local_window(), B = t.block_size();
    for (std::int32_t l = 0; l < L; ++l)
      for (std::int32_t h = 0; h < H; ++h) {
        const SeqId row = a.head_unchecked(s, l, h);
        const StreamView v = view(t, pool, a, s, l, h);
        const std::int32_t count = std::max(0, e.evict_count(row.index, v));
        e.begin_eviction(row.index, v);  // even for 0: a one-shot policy spends its shot
        appended_[row.index] = v.appended;
        seen_[row.index] = v.held - count;
        if (count == 0) continue;
        const std::span<std::int32_t> chosen(chosen_.data(), std::size_t(count));
        e.choose(row.index, v, 0, chosen);
        const std::int32_t kept = v.held - count;
        const auto blocks = t.blocks_unchecked(row);
        const auto slot = [&](std::int32_t g) { return blocks[std::size_t((W + g) / B)] * B + (W + g) % B; };
        std::int32_t m = 0;
        const std::int32_t holes = fill_holes(chosen, kept, [&](std::int32_t src, std::int32_t dst) {
          index_moves_[std::size_t(m)] = SlotMove{src, dst};
          moves[std::size_t(out.moves + m++)] = SlotMove{slot(src), slot(dst)};
        });
        const std::span<const SlotMove> im(index_moves_.data(), std::size_t(holes));
        e.on_compacted(row.index, 0, im, kept);
        a.compact_global(t, pool, s, l, h, im, count, chosen[0]);
        changed(row, (W + chosen[0]) / B);
        out.moves += holes;
        out.tokens += count;
      }
    return out;
  }

  /// A rollback left head (layer, h) of s with its region's length now.
  template <HeadPagedAdmission A, class E>
  void truncated(const A& a, E& e, SeqId s) noexcept {
    for (std::int32_t l = 0; l < a.num_layers(); ++l)
      for (std::int32_t h = 0; h < a.num_kv_heads(); ++h) {
        const std::uint32_t row = a.head_unchecked(s, l, h).index;
        const std::int32_t g = a.head_state(s, l, h)->global;
        appended_[row] += g - seen_[row];
        seen_[row] = g;
        e.on_truncate(row, g);
      }
  }
  /// A fork's rows start where its parent's stand.
  template <HeadPagedAdmission A, class E>
  void forked(const A& a, E& e, SeqId parent, SeqId child) noexcept {
    for (std::int32_t l = 0; l < a.num_layers(); ++l)
      for (std::int32_t h = 0; h < a.num_kv_heads(); ++h) {
        const std::uint32_t from = a.head_unchecked(parent, l, h).index, to = a.head_unchecked(child, l, h).index;
        appended_[to] = appended_[from], seen_[to] = seen_[from];
        e.copy_state(from, to);
      }
  }
  /// A freed sequence's rows start over.
  template <HeadPagedAdmission A, class E>
  void freed(const A& a, E& e, SeqId s) noexcept {
    for (std::int32_t l = 0; l < a.num_layers(); ++l)
      for (std::int32_t h = 0; h < a.num_kv_heads(); ++h) {
        const std::uint32_t row = a.head_unchecked(s, l, h).index;
        appended_[row] = 0, seen_[row] = 0;
        e.reset(row);
      }
  }

  friend bool operator==(const GlobalRegion& x, const GlobalRegion& y) {
    return x.appended_ == y.appended_ && x.seen_ == y.seen_;
  }

 private:
  std::vector<std::int64_t> appended_;  // [row]: tokens the region took, less rollbacks, as of `seen_`
  std::vector<std::int32_t> seen_;      // [row]: the region's length at the last call
  std::vector<std::int32_t> chosen_;    // one row's evicted token indices (scratch)
  std::vector<SlotMove> index_moves_;   // its compaction in global token indices (scratch)
};

KVCACHE_END_NAMESPACE
