// The fixed set of physical block ids: O(1) allocate / free, ref counts,
// and the "free but cached" state that prefix reuse needs.
//
// One intrusive queue (sentinel-linked, no allocation) holds every free
// block. Blocks freed without a published hash go to the front, blocks that
// still hold cached content go to the back, so allocation takes plain free
// blocks first and then recycles cached content least recently freed first.
// A prefix hit (retain of a cached block) takes it back out in O(1).
//
// Which blocks hold which hash is the PrefixIndex's (pool/prefix_index.hpp): copies
// of one hash all serve hits, and the cache stays prefix-closed. A free block
// with a hash is always its hash's only copy: when a second copy exists, the
// one freed is redundant and goes back plain.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvcache/core/block_hash.hpp"
#include "kvcache/config.hpp"
#include "kvcache/core/events.hpp"
#include "kvcache/pool/prefix_index.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Physical block id (0: the null block).
using BlockId = std::int32_t;

/// What a stored event reports about a block published with publish().
struct StoredBlock {
  PrefixKey key{};  ///< The publishing sequence's salt and extra.
  std::uint64_t block_extra = 0;  ///< The extra key hashed into this block.
  std::span<const std::int32_t> tokens{};  ///< The block's token ids.
  /// A block known to hold the parent hash (the row's previous block), PrefixIndex::kChainRoot for a chain's
  /// first block, or PrefixIndex::kUnknownParent: saves the pool a lookup.
  std::int32_t parent_block = PrefixIndex::kUnknownParent;
  std::int32_t block_size = 0;  ///< Tokens in the block (0: the pool's event_tokens).
  std::int32_t group = -1;      ///< The layer group the block belongs to (-1: none); its events name it.
};

/// Lifetime counters of a pool's cached content.
struct PoolCounters {
  std::int64_t stored = 0;  ///< Hashes that entered the cache (stored events).
  std::int64_t copies = 0;  ///< Publishes of a hash already cached (a second copy, no event).
  std::int64_t recycled = 0;  ///< Free-but-cached blocks taken for new content.
  std::int64_t invalidated = 0;  ///< Blocks that lost their hash because their content or their parent's went.
  friend constexpr bool operator==(const PoolCounters&, const PoolCounters&) = default;
};

/// The physical blocks: O(1) allocate / retain / release, ref counts, free-but-cached blocks and their hash index.
class BlockPool {
 public:
  /// Block 0 is the null block: never handed out, never freed. Padded writes
  /// and out-of-window table entries point at it.
  static constexpr BlockId null_block = 0;

  /// num_blocks includes the null block. event_capacity 0 disables events;
  /// each event keeps up to event_tokens token ids (the block size) and names `medium`.
  explicit BlockPool(std::int32_t num_blocks, std::int32_t event_capacity = 0, std::int32_t event_tokens = 0,
                     Medium medium = Medium::gpu)
      : ref_(checked(num_blocks), 0),
        prev_(static_cast<std::size_t>(num_blocks) + 1),
        next_(static_cast<std::size_t>(num_blocks) + 1),
        prefix_(num_blocks),
        events_(event_capacity, event_tokens, medium),
        marks_{std::vector<std::uint32_t>(static_cast<std::size_t>(num_blocks), 0u)},
        group_(static_cast<std::size_t>(num_blocks), -1),
        sentinel_(num_blocks) {
    prev_[ix(sentinel_)] = next_[ix(sentinel_)] = sentinel_;
    for (BlockId b = 1; b < num_blocks; ++b) link_before(sentinel_, b);
    num_free_ = num_blocks - 1;
  }

  std::int32_t capacity() const noexcept { return sentinel_; }  ///< null block included
  /// Blocks allocate() can hand out now: plain free + free-but-cached.
  std::int32_t num_free() const noexcept { return num_free_; }
  /// Free blocks that still hold a published hash (a prefix hit can reuse them).
  std::int32_t num_cached() const noexcept { return num_cached_; }
  /// Blocks with a ref count above 0.
  std::int32_t num_used() const noexcept { return sentinel_ - 1 - num_free_; }
  /// Distinct hashes that serve prefix hits (each held by used or free-but-cached blocks).
  std::int32_t num_published() const noexcept { return prefix_.size(); }
  /// Lifetime counters: hashes stored, copies, cached blocks recycled, blocks invalidated.
  const PoolCounters& counters() const noexcept { return counters_; }
  /// Which blocks hold which hash (read-only).
  const PrefixIndex& prefix_index() const noexcept { return prefix_; }

  /// True for an id allocate() can hand out (not the null block, inside the pool).
  bool valid(BlockId b) const noexcept { return b > null_block && b < sentinel_; }
  /// Holders of block b (0: free).
  std::int32_t ref_count(BlockId b) const noexcept { return ref_[static_cast<std::size_t>(b)]; }
  /// True when block b carries a content hash (published).
  bool has_hash(BlockId b) const noexcept { return prefix_.has(b); }
  /// True when a prefix lookup of b's hash finds b or a copy of it (every hashed block).
  bool is_cached(BlockId b) const noexcept { return prefix_.has(b); }
  /// Block b's content hash (meaningful when has_hash(b)).
  const BlockHash& hash(BlockId b) const noexcept { return prefix_.hash(b); }
  /// The layer group block b was published in (StoredBlock::group; -1: none
  /// named, as a uniform cache's blocks; meaningful when has_hash(b)).
  std::int32_t group(BlockId b) const noexcept { return group_[ix(b)]; }

  /// All-or-nothing: fills every entry of `out` with a fresh block (ref 1) or
  /// fails with out_of_blocks and changes nothing.
  Status allocate(std::span<BlockId> out) noexcept {
    const auto n = static_cast<std::int64_t>(out.size());
    if (n > num_free_) return Status{Errc::out_of_blocks, "n_blocks", n, num_free_};
    for (auto& b : out) b = take_front();
    return {};
  }

  /// One block with ref count 1; out_of_blocks when none is free.
  Result<BlockId> allocate_one() noexcept {
    if (num_free_ == 0) return Status{Errc::out_of_blocks, "n_blocks", 1, 0};
    return take_front();
  }

  /// The cached blocks whose content the next `allocations` allocations
  /// would lose, in that order, written to out (at most out.size()); returns
  /// how many. A write-back tier offloads them one step ahead, so no
  /// allocation waits on a copy. Plain free blocks go first and lose nothing;
  /// recycling a cached block also drops every free block chained from it
  /// (they lose their content with it, go to the queue's front and are the
  /// next allocations' blocks), so they follow it here. Changes nothing.
  std::int32_t next_recycled(std::int32_t allocations, std::span<BlockId> out) const noexcept {
    const std::uint32_t stamp = marks_.next();
    std::int32_t n = 0, front = 0;  // front: dropped blocks the next allocations take first
    BlockId b = next_[ix(sentinel_)];
    for (std::int32_t k = 0; k < allocations && std::size_t(n) < out.size(); ++k) {
      if (front > 0) {
        --front;
        continue;
      }
      while (b != sentinel_ && marks_.seen[ix(b)] == stamp) b = next_[ix(b)];  // dropped earlier: taken from the front
      if (b == sentinel_) break;
      const BlockId x = b;
      b = next_[ix(b)];
      if (!has_hash(x)) continue;
      marks_.seen[ix(x)] = stamp;
      out[std::size_t(n++)] = x;
      prefix_.for_each_chained(x, [&](std::int32_t d) {
        if (ref_[ix(d)] != 0 || marks_.seen[ix(d)] == stamp) return;  // in use: it keeps its bytes
        marks_.seen[ix(d)] = stamp;
        ++front;
        if (std::size_t(n) < out.size()) out[std::size_t(n++)] = d;
      });
    }
    return n;
  }

  /// Adds a holder. Valid on a used block, or on a free-but-cached one (a
  /// prefix hit takes it back from the queue).
  Status retain(BlockId b) noexcept {
    if (!valid(b)) return Status{Errc::invalid_argument, "block", b, sentinel_ - 1};
    auto& r = ref_[static_cast<std::size_t>(b)];
    if (r == 0) {
      if (!is_cached(b)) return Status{Errc::not_allocated, "block", b, 0};
      unlink(b);
      --num_free_;
      --num_cached_;
    }
    ++r;
    return {};
  }

  /// Drops a holder; at zero the block becomes free (cached if it has content).
  Status release(BlockId b) noexcept {
    if (!valid(b)) return Status{Errc::invalid_argument, "block", b, sentinel_ - 1};
    auto& r = ref_[static_cast<std::size_t>(b)];
    if (r == 0) return Status{Errc::not_allocated, "block", b, 0};
    if (r == 1 && has_hash(b) && !prefix_.alone(b)) drop(b);  // a live copy keeps the hash: this one is redundant
    if (--r == 0) {
      ++num_free_;
      if (has_hash(b)) {
        link_before(sentinel_, b);  // back: recycled last
        ++num_cached_;
      } else {
        link_before(next_[ix(sentinel_)], b);  // front: reused first
      }
    }
    return {};
  }

  /// Gives a used, full block its content hash (write-once); `parent` is the
  /// hash its chain continues (a chain root when no block holds it). Returns
  /// true when the hash is new to the cache (a stored event), false when b
  /// joins as a copy of a cached hash: the copy serves hits too once the
  /// others go. A free copy already cached is redundant then and goes back plain.
  Result<bool> publish(BlockId b, const BlockHash& h, const BlockHash& parent, const StoredBlock& info = {}) noexcept {
    if (!valid(b)) return Status{Errc::invalid_argument, "block", b, sentinel_ - 1};
    if (ref_count(b) == 0) return Status{Errc::not_allocated, "block", b, 0};
    if (has_hash(b)) return Status{Errc::already_hashed, "block", b, 0};
    group_[ix(b)] = static_cast<std::int16_t>(info.group);  // what its events and group() name
    if (const BlockId twin = prefix_.insert(b, h, parent, info.parent_block); twin >= 0) {
      ++counters_.copies;
      if (ref_count(twin) == 0) drop(twin);  // a free twin is its hash's only other copy
      return false;
    }
    ++counters_.stored;
    events_.push(BlockEvent{.kind = EventKind::stored, .block = b, .hash = h, .parent = parent,
                            .first = prefix_.is_root(b), .key = info.key, .block_extra = info.block_extra,
                            .block_size = info.block_size > 0 ? info.block_size : events_.tokens_per_event(),
                            .group = info.group},
                 info.tokens);
    return true;
  }

  /// The content of a used block is about to change: forget its hash (and,
  /// when no copy keeps it, the hashes of every block chained from it).
  Status unpublish(BlockId b) noexcept {
    if (!valid(b)) return Status{Errc::invalid_argument, "block", b, sentinel_ - 1};
    if (ref_count(b) == 0) return Status{Errc::not_allocated, "block", b, 0};
    if (has_hash(b)) drop(b);
    return {};
  }

  /// Starts loading the index slot a publish or lookup of h touches first.
  void prefetch(const BlockHash& h) const noexcept { prefix_.prefetch(h); }
  /// A block holding cached content with this hash (a used copy when one exists), or -1.
  BlockId lookup(const BlockHash& h) const noexcept { return prefix_.find(h); }

  /// Forgets all cached content; refused while any block is in use (as vLLM).
  Status reset_prefix_cache() noexcept {
    if (num_used() > 0) return Status{Errc::blocks_in_use, "num_used", num_used(), 0};
    prefix_.clear();
    num_cached_ = 0;
    events_.push(BlockEvent{.kind = EventKind::all_cleared});
    return {};
  }

  /// Moves up to out.size() pending events into out, oldest first; returns how many.
  std::int32_t drain_events(std::span<BlockEvent> out) noexcept { return events_.drain(out); }
  /// drain_events() with each stored block's token ids (tokens_per_event() per event).
  Result<std::int32_t> drain_events(std::span<BlockEvent> out, std::span<std::int32_t> token_ids) noexcept {
    return events_.drain(out, token_ids);
  }
  /// The pending block events.
  const EventQueue& events() const noexcept { return events_; }

  /// Full consistency check, O(capacity). For tests and debug builds.
  Status check() const {
    if (ref_[ix(null_block)] != 0 || has_hash(null_block))
      return Status{Errc::invariant_violated, "null_block", ref_[ix(null_block)], 0};
    std::vector<char> queued(static_cast<std::size_t>(sentinel_), 0);
    std::int32_t n = 0, cached = 0;
    for (BlockId b = next_[ix(sentinel_)]; b != sentinel_; b = next_[ix(b)]) {
      if (!valid(b) || queued[ix(b)] || prev_[ix(next_[ix(b)])] != b || n > sentinel_)
        return Status{Errc::invariant_violated, "queue_link", b, n};
      queued[ix(b)] = 1;
      ++n;
      if (ref_[ix(b)] != 0) return Status{Errc::invariant_violated, "queued_ref", b, ref_[ix(b)]};
      if (is_cached(b)) ++cached;
      else if (has_hash(b)) return Status{Errc::invariant_violated, "free_hashed", b, 0};
    }
    if (n != num_free_) return Status{Errc::invariant_violated, "num_free", num_free_, n};
    if (cached != num_cached_) return Status{Errc::invariant_violated, "num_cached", num_cached_, cached};
    for (BlockId b = 1; b < sentinel_; ++b)
      if ((ref_[ix(b)] == 0) != static_cast<bool>(queued[ix(b)]) || ref_[ix(b)] < 0)
        return Status{Errc::invariant_violated, "ref_count", b, ref_[ix(b)]};
    // A free block with a hash is its hash's only copy, so a lookup that has a
    // used copy to offer returns it (a hit on it takes nothing from the free pool).
    if (auto st = prefix_.check([&](std::int32_t b) { return ref_[ix(b)]; }); !st) return st;
    // free + used == capacity, by construction of num_used(); checked anyway.
    if (num_free_ + num_used() != sentinel_ - 1) return Status{Errc::invariant_violated, "conservation", 0, 0};
    return {};
  }

  friend bool operator==(const BlockPool&, const BlockPool&) = default;

 private:
  // next_recycled()'s scratch: a stamp per block (no allocation per call),
  // never part of the pool's state.
  struct Marks {
    std::vector<std::uint32_t> seen;
    std::uint32_t stamp = 0;
    std::uint32_t next() noexcept {
      if (++stamp == 0) std::fill(seen.begin(), seen.end(), 0u), stamp = 1;
      return stamp;
    }
    friend bool operator==(const Marks&, const Marks&) noexcept { return true; }
  };
  static constexpr std::size_t ix(std::int32_t i) noexcept { return static_cast<std::size_t>(i); }

  // Block 0 is the null block, so a usable pool has at least 2; every block
  // costs about 166 bytes of host bookkeeping (links, ref count, hash and
  // parent, rings, two index slots of two entries each, next_recycled's
  // mark, the layer group).
  static std::size_t checked(std::int32_t num_blocks) {
    if (num_blocks < 2) throw ConfigError("kvcache::BlockPool", Status{Errc::invalid_argument, "num_blocks", num_blocks, 2});
    return checked_elements("kvcache::BlockPool", "num_blocks", num_blocks, num_blocks, 166);
  }

  void link_before(BlockId at, BlockId b) noexcept {
    const BlockId p = prev_[ix(at)];
    next_[ix(p)] = b;
    prev_[ix(b)] = p;
    next_[ix(b)] = at;
    prev_[ix(at)] = b;
  }
  void unlink(BlockId b) noexcept {
    next_[ix(prev_[ix(b)])] = next_[ix(b)];
    prev_[ix(next_[ix(b)])] = prev_[ix(b)];
  }
  // b loses its hash; so does every block chained from it when b was its
  // hash's last copy. Free blocks of the cascade stop being cached content:
  // they move to the front of the queue, to be reused first.
  void drop(BlockId b) noexcept {
    prefix_.erase(b, [&](BlockId x, bool gone) {
      if (gone)
        events_.push(BlockEvent{.kind = EventKind::removed, .block = x, .hash = prefix_.hash(x),
                                .group = group_[ix(x)]});
      if (x != b) ++counters_.invalidated;
      if (ref_[ix(x)] == 0) {  // free-but-cached (a cascade, or a redundant twin)
        unlink(x);
        link_before(next_[ix(sentinel_)], x);
        --num_cached_;
      }
    });
  }
  BlockId take_front() noexcept {
    const BlockId b = next_[ix(sentinel_)];
    unlink(b);
    --num_free_;
    ref_[ix(b)] = 1;
    if (has_hash(b)) {  // lazy eviction of cached content happens here
      --num_cached_;
      ++counters_.recycled;
      drop(b);
    }
    return b;
  }

  std::vector<std::int32_t> ref_;
  std::vector<BlockId> prev_, next_;  // size capacity + 1; the last node is the sentinel
  PrefixIndex prefix_;
  EventQueue events_;
  mutable Marks marks_;
  std::vector<std::int16_t> group_;  // [block]: the layer group it was published in (-1: none)
  PoolCounters counters_{};
  BlockId sentinel_;
  std::int32_t num_free_ = 0;
  std::int32_t num_cached_ = 0;
};

KVCACHE_END_NAMESPACE
