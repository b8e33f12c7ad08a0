// How the cache carries out an eviction policy's plan on a stream, one
// function per kind of policy (policy.hpp): block (table edit + rotations),
// token (compaction moves, then the tail leaves), window (the front leaves).
// RowEviction validates the call and keeps the bound ledger; these do the edit.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/config.hpp"
#include "kvcache/eviction/compaction_plan.hpp"
#include "kvcache/eviction/plan.hpp"
#include "kvcache/table/page_table_edits.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/core/slot_move.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// The eviction steps RowEviction::evict runs (row_eviction.hpp).
struct EvictionRun {
  /// Buffers a token eviction needs, sized once by the cache (no allocation per call).
  struct TokenScratch {
    std::vector<std::int32_t> chosen;   ///< one group's evicted token indices
    std::vector<SlotMove> index_moves;  ///< its compaction in token indices
  };

  /// What a policy knows about stream s.
  template <class Table>
  static StreamView view(const Table& tab, SeqId s, std::int32_t first_candidate) noexcept {
    return {tab.tokens_unchecked(s), tab.appended_unchecked(s), first_candidate};
  }

  /// The block after the sequence's last shared one: nothing below it may move.
  template <class Table, class Pool>
  static std::int32_t first_unshared_block(const Table& tab, const Pool& pool, SeqId s) noexcept {
    const auto blocks = tab.blocks_unchecked(s);
    for (auto b = std::int32_t(blocks.size()); b-- > 0;)
      if (pool.ref_count(blocks[std::size_t(b)]) > 1) return b + 1;
    return 0;
  }

  /// Block policies: the chosen logical blocks leave; rotations for the kept blocks that moved.
  template <class Table, class Pool, class E>
  static Result<EvictionResult> blocks(Table& tab, Pool& pool, E& e, SeqId s, std::span<std::int32_t> evicted,
                                       std::span<BlockRotation> rotations) noexcept {
    const auto blocks = tab.blocks_unchecked(s);
    auto n = e.plan(s.index, view(tab, s, first_unshared_block(tab, pool, s)), evicted);
    if (!n) return n.status();
    if (*n == 0) return EvictionResult{};
    const std::int32_t first = evicted[0], moved = std::int32_t(blocks.size()) - first - *n;
    if (std::int64_t(rotations.size()) < moved)
      return Status{Errc::buffer_too_small, "rotations", std::int64_t(rotations.size()), moved};
    std::int32_t k = 0, r = 0;
    for (std::int32_t b = first; b < std::int32_t(blocks.size()); ++b) {
      if (k < *n && evicted[std::size_t(k)] == b) {
        ++k;
        continue;
      }
      rotations[std::size_t(r++)] = BlockRotation{blocks[std::size_t(b)], b - k, -k * tab.block_size()};
    }
    const auto chosen = std::span<const std::int32_t>(evicted.data(), std::size_t(*n));
    if (auto st = remove_blocks(tab, pool, s, chosen); !st) return st;  // a policy bug; nothing changed
    e.on_removed(s.index, chosen);
    return EvictionResult{.evicted = *n, .rotations = r, .tokens = *n * tab.block_size(), .first_changed = first * tab.block_size()};
  }

  /// Token policies: each group's chosen tokens leave; the survivors are compacted.
  template <class Table, class Pool, class E>
  static Result<EvictionResult> tokens(Table& tab, Pool& pool, E& e, TokenScratch& scratch, SeqId s,
                                       std::span<SlotMove> moves, std::span<std::int32_t> group_moves) noexcept {
    const std::int32_t groups = e.groups();
    if (std::int64_t(group_moves.size()) < std::int64_t{groups} + 1)
      return Status{Errc::buffer_too_small, "group_moves", std::int64_t(group_moves.size()), std::int64_t{groups} + 1};
    // A shared partial tail block pins every held token (fc == held).
    const std::int32_t fc = std::min(first_unshared_block(tab, pool, s) * tab.block_size(), tab.tokens_unchecked(s));
    const StreamView v = view(tab, s, fc);
    const std::int32_t count = std::max(0, e.evict_count(s.index, v));
    if (count > v.held - fc) return Status{Errc::invariant_violated, "evict_count", count, v.held - fc};
    const std::int64_t need = std::int64_t{groups} * count;
    if (std::int64_t(moves.size()) < need) return Status{Errc::buffer_too_small, "moves", std::int64_t(moves.size()), need};
    e.begin_eviction(s.index, v);  // validated: from here on the call succeeds
    if (count == 0) {  // an empty plan is empty ranges, never the last call's moves
      std::fill_n(group_moves.begin(), std::size_t(groups) + 1, 0);
      return EvictionResult{};
    }
    const auto blocks = tab.blocks_unchecked(s);
    const std::int32_t kept = v.held - count, bs = tab.block_size();
    auto slot = [&](std::int32_t t) { return blocks[std::size_t(t / bs)] * bs + t % bs; };
    std::int32_t off = 0, first_hole = v.held;
    const std::span<std::int32_t> chosen(scratch.chosen.data(), std::size_t(count));
    for (std::int32_t g = 0; g < groups; ++g) {
      e.choose(s.index, v, g, chosen);
      first_hole = std::min(first_hole, chosen[0]);
      std::int32_t m = 0;
      const std::int32_t holes = fill_holes(chosen, kept, [&](std::int32_t src, std::int32_t dst) {
        scratch.index_moves[std::size_t(m)] = SlotMove{src, dst};
        moves[std::size_t(off + m++)] = SlotMove{slot(src), slot(dst)};
      });
      group_moves[std::size_t(g)] = off;
      off += holes;
      e.on_compacted(s.index, g, std::span<const SlotMove>(scratch.index_moves.data(), std::size_t(holes)), kept);
    }
    group_moves[std::size_t(groups)] = off;
    (void)drop_tail(tab, pool, s, count, first_hole);
    return EvictionResult{.tokens = count, .moves = off, .first_changed = first_hole};
  }

  /// Window policies: the oldest tokens leave the front.
  template <class Table, class Pool, class E>
  static Result<EvictionResult> front(Table& tab, Pool& pool, E& e, SeqId s, std::int32_t pending) noexcept {
    const std::int32_t n = e.front_excess(tab.tokens_unchecked(s), pending);
    if (n <= 0) return EvictionResult{};
    const auto before = std::int32_t(tab.blocks_unchecked(s).size());
    (void)drop_front(tab, pool, s, n);
    return EvictionResult{.evicted = before - std::int32_t(tab.blocks_unchecked(s).size()), .tokens = n, .front = true};
  }

};

KVCACHE_END_NAMESPACE
