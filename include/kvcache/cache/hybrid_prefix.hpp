// What a hybrid cache publishes, and from what: the prefix-caching state of
// every (group, sequence). A group's full blocks are published once the
// forward pass computed them (HybridCache::computed), under their chain
// hash keyed by the group (group_key), as GroupHits looks them up.
//
// The token ids a publish hashes live in the slots they were reserved into
// (one int32 per pool slot, written beside the slot mapping), so nothing
// grows per sequence and a rollback needs no bookkeeping: the ids left are
// still in their slots. Groups of one rule (kind, block size, span) hold
// the same positions in blocks of the same indices, so the ids are kept in
// the blocks of the first of them alone (keeper(g)): a token reserved into
// six groups is written once per rule, not six times. Groups of one block size share one hash chain:
// mark a block computed, and it is hashed once, then published in each group
// of that size that holds it, group by group (a group's new blocks are one
// run of events, as vLLM publishes them). An import's window blocks that a
// peer never sent have no slots: their hashes are taken at import, and the
// chain jumps that gap when they are computed.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/core/block_hash.hpp"
#include "kvcache/pool/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/groups/group_hits.hpp"
#include "kvcache/groups/group_rows.hpp"
#include "kvcache/groups/group_rule.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// The publishing side of a HybridCache's prefix cache: chain hashes and published counts per (group, sequence).
class HybridPrefix {
 public:
  HybridPrefix() = default;
  /// State for `sequences` rows of `rows`' groups; with keep_ids, room for a
  /// token id per slot of `num_blocks` pages. chain_owner(g) names the group
  /// whose hash chain g shares (GroupHits::chain_owner), -1 for none.
  template <class ChainOwner>
  HybridPrefix(const std::vector<GroupRows>& rows, ChainOwner&& chain_owner, std::int32_t sequences, std::int32_t num_blocks,
               bool keep_ids)
      : groups_(std::int32_t(rows.size())) {
    std::size_t longest = 0;
    keeper_.resize(std::size_t(groups_));
    for (std::int32_t g = 0; g < groups_; ++g) {
      const GroupRule& r = rows[std::size_t(g)].rule();
      keeper_[std::size_t(g)] = g;
      for (std::int32_t o = g - 1; o >= 0; --o)
        if (rows[std::size_t(o)].rule() == r) keeper_[std::size_t(g)] = o;
      stride_ = std::max(stride_, r.block_size);
      longest = std::max(longest, std::size_t(rows[std::size_t(g)].max_blocks()));
      if (const std::int32_t c = chain_owner(g); c >= 0) {  // each chain (block size) and its groups, owner first
        if (c == g) chains_.push_back(Chain{r.block_size, {}});
        for (Chain& ch : chains_)
          if (ch.groups.empty() ? c == g : ch.groups.front() == c) ch.groups.push_back(g);
      }
    }
    const std::size_t n = std::size_t(groups_) * std::size_t(sequences);
    chain_.resize(n), published_.resize(n), gaps_.resize(n);
    if (keep_ids) ids_.resize(std::size_t(num_blocks) * std::size_t(stride_));
    hashes_.reserve(longest);
  }

  /// The largest group block size: the ids kept per page, the token ids a block event carries at most.
  std::int32_t max_block_size() const noexcept { return stride_; }
  /// The group whose blocks keep group g's token ids: the first group of g's
  /// rule. Its row holds a block wherever g's does (one rule, one shape: the
  /// same hits, windows, chunks, gaps and rollbacks); only an eviction can
  /// part them, and a sequence that evicted publishes nothing more.
  std::int32_t keeper(std::int32_t g) const noexcept { return keeper_[std::size_t(g)]; }
  /// Blocks of group g's row i published (a hit's blocks count as published).
  std::int32_t published(std::int32_t g, std::uint32_t i) const noexcept { return published_[at(g, i)]; }

  /// Row i starts empty, its chains at `root` (the sequence's key).
  void start(std::uint32_t i, const BlockHash& root) noexcept {
    for (std::int32_t g = 0; g < groups_; ++g) published_[at(g, i)] = 0, chain_[at(g, i)] = root, gaps_[at(g, i)] = {};
  }
  /// Group g's row i begins with `blocks` cached blocks, its chain at `chain` (a prefix hit).
  void adopt(std::int32_t g, std::uint32_t i, std::int32_t blocks, const BlockHash& chain) noexcept {
    published_[at(g, i)] = blocks, chain_[at(g, i)] = chain;
  }
  /// Token `id` was reserved into slot `offset` of page b, a keeper's (nothing without prefix caching).
  void keep(BlockId b, std::int64_t offset, std::int32_t id) noexcept {
    if (!ids_.empty()) ids_[std::size_t(b) * std::size_t(stride_) + std::size_t(offset)] = id;
  }
  /// The kept ids, [page][max_block_size()] (null without prefix caching): the slot loop's direct keep().
  std::int32_t* kept() noexcept { return ids_.empty() ? nullptr : ids_.data(); }
  /// Group g's row i never receives blocks [published, end) (an import's
  /// window); `hash` is the chain hash at end, taken from the prompt.
  void skip(std::int32_t g, std::uint32_t i, std::int32_t end, const BlockHash& hash) noexcept { gaps_[at(g, i)] = {end, hash}; }
  /// Row i's gaps are gone (an aborted import: the row is recomputed).
  void clear_gaps(std::uint32_t i) noexcept {
    for (std::int32_t g = 0; g < groups_; ++g) gaps_[at(g, i)] = {};
  }
  /// Group g's chain hash of row i where its published blocks end.
  const BlockHash& chain(std::int32_t g, std::uint32_t i) const noexcept { return chain_[at(g, i)]; }
  /// Group g's chain hash of row i where the blocks it holds unpublished
  /// begin: past an import's gap when it has one, else where its published ones end.
  const BlockHash& resume(std::int32_t g, std::uint32_t i) const noexcept {
    const Gap& x = gaps_[at(g, i)];
    return x.end > 0 ? x.hash : chain_[at(g, i)];
  }
  /// The n token ids kept in page b (meaningful with prefix caching, for a keeper's block).
  std::span<const std::int32_t> ids(BlockId b, std::int32_t n) const noexcept {
    return std::span(ids_).subspan(std::size_t(b) * std::size_t(stride_), std::size_t(n));
  }

  /// Row i's tokens [0, computed) were computed: each chain hashes its new
  /// full blocks once and every group of it publishes those it holds into
  /// `pool`. Fails only as BlockPool::publish does (not for blocks this
  /// state gave out: they are unhashed).
  template <class Hits>
  Status publish(BlockPool& pool, const std::vector<GroupRows>& rows, const Hits& hits, std::uint32_t i, std::int64_t computed,
                 const PrefixKey& key) noexcept {
    for (const Chain& ch : chains_) {
      const std::int32_t B = ch.block_size;
      const std::int64_t last = computed / B;
      bool behind = false;  // the common decode step: no block of this size filled since the last call
      for (const std::int32_t g : ch.groups) behind = behind || published_[at(g, i)] < last;
      if (!behind) continue;
      std::int64_t j0 = last;
      BlockHash parent{};
      for (const std::int32_t g : ch.groups) {
        if (Gap& x = gaps_[at(g, i)]; x.end > 0 && x.end <= last) {
          chain_[at(g, i)] = x.hash, published_[at(g, i)] = std::max(published_[at(g, i)], x.end), x = {};
        }
        if (published_[at(g, i)] < j0) j0 = published_[at(g, i)], parent = chain_[at(g, i)];
      }
      hashes_.clear();
      for (std::int64_t j = j0; j < last; ++j) {  // hashed once per block, from any group that holds it
        const BlockId b = holder(rows, ch, i, j);
        if (b == BlockPool::null_block) break;  // not reached: an import's gap is jumped above
        parent = hits.hash(parent, ids(b, B), key.extra);
        hashes_.push_back(parent);
      }
      const std::int64_t end = j0 + std::int64_t(hashes_.size());
      // Every group's index slots first: the inserts below then overlap their
      // cache misses instead of taking one after another (6 groups: 57 % of
      // this call was the first probe's load).
      for (const std::int32_t g : ch.groups)
        for (std::int64_t j = published_[at(g, i)]; j < end; ++j) pool.prefetch(group_key(hashes_[std::size_t(j - j0)], g));
      for (const std::int32_t g : ch.groups) {
        const auto row = rows[std::size_t(g)].row(i);
        const auto kept = rows[std::size_t(keeper(g))].row(i);  // where g's ids are
        const bool chained = rows[std::size_t(g)].rule().chained();
        for (std::int64_t j = published_[at(g, i)]; j < end; ++j) {
          const BlockHash h = hashes_[std::size_t(j - j0)];
          if (const BlockId b = row[std::size_t(j)]; b != BlockPool::null_block) {
            // Window and chunk blocks are chain roots: recycling an early one must not take the later ones.
            const BlockId before = j > 0 ? row[std::size_t(j - 1)] : BlockPool::null_block;
            const std::int32_t up = !chained || j == 0                  ? PrefixIndex::kChainRoot
                                    : before == BlockPool::null_block ? PrefixIndex::kUnknownParent
                                                                      : before;
            const StoredBlock info{.key = key, .block_extra = key.extra, .tokens = ids(kept[std::size_t(j)], B), .parent_block = up,
                                   .block_size = B, .group = g};
            if (auto p = pool.publish(b, group_key(h, g), group_key(chain_[at(g, i)], g), info); !p) return p.status();
          }
          chain_[at(g, i)] = h, published_[at(g, i)] = std::int32_t(j + 1);
        }
      }
    }
    return {};
  }

  /// Equal state (the hash scratch aside).
  friend bool operator==(const HybridPrefix& a, const HybridPrefix& b) {
    return a.keeper_ == b.keeper_ && a.chain_ == b.chain_ && a.published_ == b.published_ && a.gaps_ == b.gaps_ &&
           a.ids_ == b.ids_;
  }

 private:
  struct Chain {
    std::int32_t block_size = 0;
    std::vector<std::int32_t> groups;  // the chain's owner first
  };
  struct Gap {
    friend bool operator==(const Gap&, const Gap&) = default;
    std::int32_t end = 0;  // the first block past the gap (0: none)
    BlockHash hash{};      // the chain hash at its end
  };
  // [sequence][group]: a decode step's checks read a row's groups from one line, not one line a group.
  std::size_t at(std::int32_t g, std::uint32_t i) const noexcept { return std::size_t(i) * std::size_t(groups_) + std::size_t(g); }
  // The block keeping the ids of block j of row i, for a group of ch that
  // holds it and has not published it yet; null when none does.
  BlockId holder(const std::vector<GroupRows>& rows, const Chain& ch, std::uint32_t i, std::int64_t j) const noexcept {
    for (const std::int32_t g : ch.groups)
      if (published_[at(g, i)] <= j)
        if (rows[std::size_t(g)].row(i)[std::size_t(j)] != BlockPool::null_block)
          return rows[std::size_t(keeper(g))].row(i)[std::size_t(j)];
    return BlockPool::null_block;
  }

  std::int32_t groups_ = 0, stride_ = 1;
  std::vector<std::int32_t> keeper_;     // [group]: the group whose blocks keep its ids
  std::vector<Chain> chains_;
  std::vector<BlockHash> chain_;         // [seq][group]: the chain hash where its published blocks end
  std::vector<std::int32_t> published_;  // [seq][group]: blocks published
  std::vector<Gap> gaps_;                // [seq][group]: an import's window blocks never received
  std::vector<std::int32_t> ids_;        // [page][stride_]: the token id reserved into each slot
  std::vector<BlockHash> hashes_;        // publish(): one chain's new block hashes
};

KVCACHE_END_NAMESPACE
