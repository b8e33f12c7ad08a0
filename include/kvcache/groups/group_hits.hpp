// Prefix hits across layer groups: the longest prompt prefix every group can
// serve from the cache.
//
// The index is keyed by (hash, group): a block's chain hash (over the whole
// prefix, per block size, so groups of one size hash the prompt once) mixed
// with its group's id. Each group's rule says which blocks a hit of h tokens
// needs (GroupRule::hit_first_block). Full attention (and MLA) comes first:
// its chains are prefix-closed, so every h up to its longest run serves. The
// other kinds then shorten h in turn, each to the longest h' <= h it serves,
// until no group shortens it (a fixed point: h only falls). Hits are
// multiples of every caching group's block size, and leave at least one
// prompt token to compute (its logits pick the next token). Groups of one
// kind, size and span are looked up together: a block index counts as cached
// only when it is cached in every one of them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/core/block_hash.hpp"
#include "kvcache/pool/block_pool.hpp"
#include "kvcache/pool/hash_index.hpp"
#include "kvcache/config.hpp"
#include "kvcache/groups/group_rule.hpp"
#include "kvcache/groups/layer_groups.hpp"

KVCACHE_BEGIN_NAMESPACE

/// The index key of chain hash h in group g: another 128-bit value in every
/// group, which HashIndex places where it places h (its placement sum
/// lo ^ hi * kHiMix is kept). A block's keys in every group then share one
/// neighborhood of the index: publishing or recycling it in six groups
/// loads one or two cache lines there, not six (bench_hybrid's decode step).
constexpr BlockHash group_key(const BlockHash& h, std::int32_t g) noexcept {
  const auto tag = std::uint64_t(g) + 1;
  const std::uint64_t hi = fold_extra(h.hi, ~tag);
  return BlockHash{h.lo ^ (h.hi * HashIndex::kHiMix) ^ (hi * HashIndex::kHiMix), hi};
}

/// Finds hits (find) and keeps, until the next find, each group's hit blocks and the chain hash where the hit ends.
template <BlockHasher Hasher = FastBlockHasher>
class GroupHits {
 public:
  GroupHits() = default;
  /// Room for prompts of up to max_tokens in every group of lg.
  GroupHits(const LayerGroups& lg, std::int32_t max_tokens, Hasher hasher = {})
      : hasher_(hasher), align_(lg.hit_alignment()), groups_(std::size_t(lg.num_groups())) {
    for (std::int32_t g = 0; g < lg.num_groups(); ++g) {
      Group& x = groups_[std::size_t(g)];
      x.rule = GroupRule::of(lg, g);
      x.found.resize(std::size_t(x.rule.blocks_for(max_tokens)) + 1);
      for (std::int32_t o = 0; o <= g && x.rule.caches(); ++o) {  // its hash chain: the first caching group of its block size
        const GroupRule& r = groups_[std::size_t(o)].rule;
        if (x.chain < 0 && r.caches() && r.block_size == x.rule.block_size) x.chain = o;
        if (x.lookup < 0 && r == x.rule) x.lookup = o;
      }
      if (x.chain == g) x.hashes.resize(x.found.size());
      if (x.lookup == g) x.misses.resize(x.found.size() + 1);
      if (x.lookup >= 0) groups_[std::size_t(x.lookup)].members.push_back(g);
    }
  }

  /// The longest hit of `prompt` under `key` every group serves (0 when none);
  /// owner(b) names the group block b belongs to (a guard against a key of
  /// one group finding another group's block).
  template <class Owner>
  std::int64_t find(const BlockPool& pool, std::span<const std::int32_t> prompt, const PrefixKey& key, Owner&& owner) {
    const auto len = std::int64_t(prompt.size());
    std::int64_t h = len > 1 ? (len - 1) / align_ * align_ : 0;
    const BlockHash root = chain_root(key);
    for (std::int32_t g = 0; g < std::int32_t(groups_.size()); ++g) {
      Group& x = groups_[std::size_t(g)];
      x.blocks = x.rule.caches() ? h / x.rule.block_size : 0;
      if (!x.rule.caches()) continue;
      if (x.chain == g) {  // hash the prompt once per block size
        BlockHash parent = root;
        const std::int32_t B = x.rule.block_size;
        for (std::int64_t j = 0; j < x.blocks; ++j)
          parent = x.hashes[std::size_t(j)] = hasher_(parent, prompt.subspan(std::size_t(j * B), std::size_t(B)), key.extra);
      }
      if (!x.rule.chained()) {  // a window or chunk reads a few blocks before h: looked up when a candidate needs them
        x.known = x.blocks;
        continue;
      }
      const auto& hashes = groups_[std::size_t(x.chain)].hashes;
      std::int64_t j = 0;
      for (; j < x.blocks; ++j) {  // prefix-closed: the blocks past its first miss serve no hit
        const BlockId b = pool.lookup(group_key(hashes[std::size_t(j)], g));
        if (b < 0 || owner(b) != g) break;
        x.found[std::size_t(j)] = b;
      }
      std::fill(x.found.begin() + j, x.found.begin() + x.blocks, -1);
    }
    for (std::int32_t g = 0; g < std::int32_t(groups_.size()); ++g) {  // cached in every group of the lookup
      Group& x = groups_[std::size_t(g)];
      if (x.lookup != g || !x.rule.caches() || !x.rule.chained()) continue;
      x.misses[0] = 0;
      for (std::int64_t j = 0; j < x.blocks; ++j) {
        bool all = true;
        for (const std::int32_t m : x.members) all = all && groups_[std::size_t(m)].found[std::size_t(j)] >= 0;
        x.misses[std::size_t(j) + 1] = x.misses[std::size_t(j)] + !all;
      }
    }
    for (bool changed = true; changed && h > 0;) {  // full attention first: it only caps h
      changed = false;
      for (int pass = 0; pass < 2; ++pass)
        for (std::int32_t g = 0; g < std::int32_t(groups_.size()); ++g) {
          const Group& x = groups_[std::size_t(g)];
          if (x.lookup != g || !x.rule.caches() || x.rule.chained() != (pass == 0)) continue;
          std::int64_t served = h;
          while (served > 0 && !serves(g, served, pool, owner)) served -= align_;
          if (served < h) h = served, changed = true;
        }
    }
    hit_ = h;
    return h;
  }

  /// The last find's hit, in tokens.
  std::int64_t hit() const noexcept { return hit_; }
  /// Group g's blocks of the last hit: ids for the block indices
  /// [hit_first_block(hit), hit / block_size), the rest not needed.
  BlockId block(std::int32_t g, std::int64_t j) const noexcept { return groups_[std::size_t(g)].found[std::size_t(j)]; }
  /// Group g's chain hash at the end of the last hit (not keyed): where its chain goes on.
  BlockHash chain(std::int32_t g, const PrefixKey& key) const noexcept {
    const Group& x = groups_[std::size_t(g)];
    const std::int64_t n = hit_ / x.rule.block_size;
    return n == 0 ? chain_root(key) : groups_[std::size_t(x.chain)].hashes[std::size_t(n - 1)];
  }
  /// The group whose hash chain group g shares (the first caching group of its block size); -1 for a group that caches nothing.
  std::int32_t chain_owner(std::int32_t g) const noexcept { return groups_[std::size_t(g)].chain; }
  /// The block hasher (what an import's prompt digest is taken with).
  const Hasher& hasher() const noexcept { return hasher_; }
  /// Hash of one block continuing `parent` (the chain every group of this block size shares).
  BlockHash hash(const BlockHash& parent, std::span<const std::int32_t> tokens, std::uint64_t extra) const noexcept {
    return hasher_(parent, tokens, extra);
  }

 private:
  struct Group {
    GroupRule rule;
    std::int32_t chain = -1, lookup = -1;  // the group whose hashes it uses; whose lookup it joins
    std::int64_t blocks = 0;               // block indices looked up
    std::vector<BlockHash> hashes;         // its chain's hashes (chain owner only)
    std::vector<BlockId> found;            // [block index]: the cached block, or -1 (a window's: from `known` on)
    std::int64_t known = 0;                // a window's or chunk's blocks looked up: [known, blocks)
    std::vector<std::int32_t> misses;      // [j]: block indices below j not cached in every member (lookup owner only)
    std::vector<std::int32_t> members;     // the groups whose lookup this one runs, itself first (lookup owner only)
  };
  // Lookup group g (and the groups that join it) serves a hit of h tokens:
  // a chained rule by its misses, any other by looking up (once) the few blocks h needs.
  template <class Owner>
  bool serves(std::int32_t g, std::int64_t h, const BlockPool& pool, Owner& owner) noexcept {
    const Group& x = groups_[std::size_t(g)];
    const std::int64_t first = x.rule.hit_first_block(h), last = h / x.rule.block_size;
    if (first >= last) return true;
    if (x.rule.chained()) return x.misses[std::size_t(last)] - x.misses[std::size_t(first)] == 0;
    const auto& hashes = groups_[std::size_t(x.chain)].hashes;
    for (const std::int32_t m : x.members) {
      Group& y = groups_[std::size_t(m)];
      // found[j] is known for j >= y.known: candidates only fall, so what they read moves down.
      for (std::int64_t j = last - 1; j >= first; --j) {  // the latest first: a later block goes missing first
        if (j < y.known) {
          const BlockId b = pool.lookup(group_key(hashes[std::size_t(j)], m));
          y.found[std::size_t(j)] = b >= 0 && owner(b) == m ? b : -1;
          y.known = j;
        }
        if (y.found[std::size_t(j)] < 0) return false;
      }
    }
    return true;
  }

  Hasher hasher_{};
  std::int32_t align_ = 1;
  std::vector<Group> groups_;
  std::int64_t hit_ = 0;
};

KVCACHE_END_NAMESPACE
