// One lower tier of KV memory (pinned host memory, a file): a pool of the
// caller's blocks named by the same content hashes as the device prefix
// cache, with its own cached-free LRU (the core's BlockPool, which already
// keeps recycled content least recently freed first).
//
// A block has one of four states. Free: in the LRU, with or without a hash
// (a hash means it still serves lookups until a store recycles it). Filling:
// allocated for a store in flight, its hash not yet published, so a lookup
// cannot see it (a failed store never becomes visible). Ready: published and
// free to evict. Pinned: read by a job in flight, out of the LRU, so no store
// can recycle it. Blocks are published unchained: evicting one never takes
// the blocks after it with it (the device tier may still hold the ones before).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/core/block_hash.hpp"
#include "kvcache/pool/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/pool/hash_index.hpp"
#include "kvcache/core/events.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Blocks of one lower tier; ids are the caller's slots 0 .. capacity()-1.
class TierPool {
 public:
  /// `num_blocks` blocks of `medium` (cpu: pinned host memory; disk: a file);
  /// event_capacity > 0 keeps stored/removed events naming the medium.
  /// ConfigError when num_blocks < 1.
  TierPool(Medium medium, std::int32_t num_blocks, std::int32_t event_capacity = 0)
      : pool_(checked(num_blocks) + 1, event_capacity, 0, medium), filling_(num_blocks),
        medium_(medium) {}

  Medium medium() const noexcept { return medium_; }  ///< The tier's medium.
  std::int32_t capacity() const noexcept { return pool_.capacity() - 1; }  ///< Blocks (slots) in the tier.
  /// Blocks a store can take now: plain free ones, then ready ones least recently used first.
  std::int32_t num_free() const noexcept { return pool_.num_free(); }
  /// Free blocks still holding a hash: what lookups find and stores recycle.
  std::int32_t num_ready() const noexcept { return pool_.num_cached(); }
  /// Blocks of stores in flight (allocated, not visible).
  std::int32_t num_filling() const noexcept { return filling_.size(); }
  /// Distinct ready or pinned blocks with a hash.
  std::int32_t num_published() const noexcept { return pool_.num_published(); }
  /// Holders of slot s: 0 free or ready, 1 filling, the readers when pinned (a filling block has no reader).
  std::int32_t holders(std::int32_t s) const noexcept { return pool_.ref_count(s + 1); }

  /// The slot holding `h`, ready or pinned; -1 when absent or still being filled. No side effects.
  std::int32_t find(const BlockHash& h) const noexcept {
    const BlockId b = pool_.lookup(h);
    return b < 0 ? -1 : b - 1;
  }
  /// True while a store of `h` is in flight.
  bool filling(const BlockHash& h) const noexcept { return filling_.find(h) >= 0; }
  /// Slot s's hash (meaningful when find() returned s).
  const BlockHash& hash(std::int32_t s) const noexcept { return pool_.hash(s + 1); }
  /// The layer group of the block slot s holds (-1: none named): what its events name (the pool keeps it).
  std::int32_t group(std::int32_t s) const noexcept { return pool_.group(s + 1); }

  /// Moves up to out.size() pending events into out (block = the slot + 1: the pool's id), oldest first.
  std::int32_t drain_events(std::span<BlockEvent> out) noexcept { return pool_.drain_events(out); }

  /// The pool's own invariants (free + used = capacity, the LRU, the index),
  /// and every filling block used once and unpublished. Who holds the others
  /// is the coordinator's to check (Tiers::check_invariants: one hold per job).
  Status check() const {
    if (auto st = pool_.check(); !st) return st;
    Status st{};
    filling_.for_each([&](const IndexKey&, BlockId b) {
      if (st && (pool_.ref_count(b) != 1 || pool_.has_hash(b))) st = Status{Errc::invariant_violated, "filling", b - 1, pool_.ref_count(b)};
    });
    return st;
  }
  friend bool operator==(const TierPool& a, const TierPool& b) {
    return a.pool_ == b.pool_ && a.filling_ == b.filling_ && a.medium_ == b.medium_;
  }

  /// Rebuilds an unused tier from what survived a restart: slots[i] holds
  /// hashes[i] of layer group groups[i] (a disk file's intact trailers;
  /// groups empty: none named), ready to be found; the other slots are free.
  /// Their stored events name the group and its tokens: group_block_sizes[g]
  /// when the tier's blocks have groups (a group must then be one of them),
  /// else `block_size`. blocks_in_use unless the tier was never used;
  /// invalid_argument naming a slot outside it or listed twice, a list of
  /// another length, or a group outside -1 .. the last. Changes nothing on error.
  Status restore(std::span<const std::int32_t> slots, std::span<const BlockHash> hashes, std::span<const std::int32_t> groups = {},
                 std::span<const std::int32_t> group_block_sizes = {}, std::int32_t block_size = 0) {
    if (slots.size() != hashes.size()) return Status{Errc::invalid_argument, "hashes (one per slot)", std::int64_t(hashes.size()), std::int64_t(slots.size())};
    if (!groups.empty() && groups.size() != slots.size())
      return Status{Errc::invalid_argument, "groups (one per slot, or none)", std::int64_t(groups.size()), std::int64_t(slots.size())};
    const std::int64_t last = group_block_sizes.empty() ? INT16_MAX : std::int64_t(group_block_sizes.size()) - 1;
    for (const std::int32_t g : groups)
      if (g < -1 || g > last) return Status{Errc::invalid_argument, "groups", g, last};
    if (pool_.num_free() != capacity() || pool_.num_published() != 0 || pool_.counters() != PoolCounters{})
      return Status{Errc::blocks_in_use, "tier (restore needs an unused one)", capacity() - pool_.num_free(), 0};
    std::vector<char> seen(std::size_t(capacity()), 0);
    for (const std::int32_t s : slots) {
      if (s < 0 || s >= capacity()) return Status{Errc::invalid_argument, "slots", s, capacity() - 1};
      if (seen[std::size_t(s)]++) return Status{Errc::invalid_argument, "slots (listed twice)", s, 0};
    }
    std::vector<BlockId> all(static_cast<std::size_t>(capacity()));
    (void)pool_.allocate(all);  // every block: ids 1 .. capacity
    for (std::size_t i = 0; i < slots.size(); ++i) {
      const std::int32_t g = groups.empty() ? -1 : groups[i];
      const std::int32_t tokens = g >= 0 && std::size_t(g) < group_block_sizes.size() ? group_block_sizes[std::size_t(g)] : block_size;
      (void)pool_.publish(slots[i] + 1, hashes[i], {},
                          StoredBlock{.parent_block = PrefixIndex::kChainRoot, .block_size = tokens, .group = g});
    }
    for (BlockId b = 1; b <= capacity(); ++b) (void)pool_.release(b);
    return {};
  }

  // The coordinator's steps (tiers.hpp), each after its own checks: a store
  // takes a block for h (recycling the least recently used ready block) and
  // publishes or abandons it; a read pins a ready block and unpins it.

  /// A block for a store of h (the caller checked num_free() and that h is neither found nor filling).
  std::int32_t begin_store(const BlockHash& h) noexcept {
    const BlockId b = *pool_.allocate_one();
    (void)filling_.insert(h, b);
    return b - 1;
  }
  /// The store of h into slot s completed: h becomes visible, the block
  /// ready; its events name `group` and its `block_size` tokens.
  void commit_store(std::int32_t s, const BlockHash& h, const BlockHash& parent, std::int32_t group = -1,
                    std::int32_t block_size = 0) noexcept {
    filling_.erase(h);
    (void)pool_.publish(s + 1, h, parent,
                        StoredBlock{.parent_block = PrefixIndex::kChainRoot, .block_size = block_size, .group = group});
    (void)pool_.release(s + 1);
  }
  /// The store of h into slot s failed or was abandoned: the block goes back free, never visible.
  void abort_store(std::int32_t s, const BlockHash& h) noexcept {
    filling_.erase(h);
    (void)pool_.release(s + 1);
  }
  /// A reader holds slot s (ready or already pinned): no store recycles it.
  void pin(std::int32_t s) noexcept { (void)pool_.retain(s + 1); }
  /// A reader is done with slot s.
  void unpin(std::int32_t s) noexcept { (void)pool_.release(s + 1); }
  /// A reader could not read slot s intact: its hash is dropped (the caller then unpins it).
  void forget(std::int32_t s) noexcept { (void)pool_.unpublish(s + 1); }
  /// Marks slots used, the last first, so a chain's head is the most recent and evicted last.
  void touch(std::span<const std::int32_t> slots) noexcept {
    for (auto it = slots.rbegin(); it != slots.rend(); ++it)
      if (pool_.ref_count(*it + 1) == 0) (void)pool_.retain(*it + 1), (void)pool_.release(*it + 1);
  }

 private:
  static std::int32_t checked(std::int32_t n) {
    if (n < 1 || n == INT32_MAX) throw ConfigError("kvcache::TierPool", Status{Errc::invalid_argument, "num_blocks", n, 1});
    return n;
  }
  BlockPool pool_;
  HashIndex filling_;  // stores in flight, by hash: sized once, no allocation per store
  Medium medium_;
};

KVCACHE_END_NAMESPACE
