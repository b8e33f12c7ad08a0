// The fixed set of physical block ids: O(1) allocate / free, ref counts,
// and the "free but cached" state that prefix reuse needs.
//
// One intrusive queue (sentinel-linked, no allocation) holds every free
// block. Blocks freed without a published hash go to the front, blocks that
// still hold cached content go to the back, so allocation takes plain free
// blocks first and then recycles cached content least recently freed first.
// A prefix hit (retain of a cached block) takes it back out in O(1).
#pragma once

#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvcache/block_hash.hpp"
#include "kvcache/config.hpp"
#include "kvcache/events.hpp"
#include "kvcache/hash_index.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Physical block id (0: the null block).
using BlockId = std::int32_t;

/// The physical blocks: O(1) allocate / retain / release, ref counts, free-but-cached blocks and their hash index.
class BlockPool {
 public:
  /// Block 0 is the null block: never handed out, never freed. Padded writes
  /// and out-of-window table entries point at it.
  static constexpr BlockId null_block = 0;

  /// num_blocks includes the null block. event_capacity 0 disables events.
  explicit BlockPool(std::int32_t num_blocks, std::int32_t event_capacity = 0)
      : ref_(checked(num_blocks), 0),
        prev_(static_cast<std::size_t>(num_blocks) + 1),
        next_(static_cast<std::size_t>(num_blocks) + 1),
        hash_(static_cast<std::size_t>(num_blocks)),
        hstate_(static_cast<std::size_t>(num_blocks), kNoHash),
        index_(num_blocks),
        events_(event_capacity),
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
  /// Blocks that currently serve prefix hits (used or free-but-cached).
  std::int32_t num_published() const noexcept { return index_.size(); }

  /// True for an id allocate() can hand out (not the null block, inside the pool).
  bool valid(BlockId b) const noexcept { return b > null_block && b < sentinel_; }
  /// Holders of block b (0: free).
  std::int32_t ref_count(BlockId b) const noexcept { return ref_[static_cast<std::size_t>(b)]; }
  /// True when block b carries a content hash (published).
  bool has_hash(BlockId b) const noexcept { return hstate_[static_cast<std::size_t>(b)] != kNoHash; }
  /// True when block b's hash is in the index (a prefix lookup can find it).
  bool is_cached(BlockId b) const noexcept { return hstate_[static_cast<std::size_t>(b)] == kIndexed; }
  /// Block b's content hash (meaningful when has_hash(b)).
  const BlockHash& hash(BlockId b) const noexcept { return hash_[static_cast<std::size_t>(b)]; }

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
    if (--r == 0) {
      ++num_free_;
      if (is_cached(b)) {
        link_before(sentinel_, b);  // back: recycled last
        ++num_cached_;
      } else {
        hstate_[static_cast<std::size_t>(b)] = kNoHash;  // a duplicate's hash is useless once free
        link_before(next_[ix(sentinel_)], b);                // front: reused first
      }
    }
    return {};
  }

  /// Gives a used, full block its content hash (write-once). Returns true if the
  /// block now serves prefix hits, false if another block already holds that
  /// hash (the block keeps the hash for chaining but is not shared).
  Result<bool> publish(BlockId b, const BlockHash& h, const BlockHash& parent) noexcept {
    if (!valid(b)) return Status{Errc::invalid_argument, "block", b, sentinel_ - 1};
    if (ref_count(b) == 0) return Status{Errc::not_allocated, "block", b, 0};
    if (has_hash(b)) return Status{Errc::already_hashed, "block", b, 0};
    hash_[static_cast<std::size_t>(b)] = h;
    if (!index_.insert(h, b)) {
      hstate_[static_cast<std::size_t>(b)] = kHashed;
      return false;
    }
    hstate_[static_cast<std::size_t>(b)] = kIndexed;
    events_.push(BlockEvent{EventKind::stored, b, h, parent});
    return true;
  }

  /// The content of a used block is about to change: forget its hash.
  Status unpublish(BlockId b) noexcept {
    if (!valid(b)) return Status{Errc::invalid_argument, "block", b, sentinel_ - 1};
    if (ref_count(b) == 0) return Status{Errc::not_allocated, "block", b, 0};
    drop_hash(b);
    return {};
  }

  /// Block holding cached content with this hash, or -1.
  BlockId lookup(const BlockHash& h) const noexcept { return index_.find(h); }

  /// Forgets all cached content; refused while any block is in use (as vLLM).
  Status reset_prefix_cache() noexcept {
    if (num_used() > 0) return Status{Errc::blocks_in_use, "num_used", num_used(), 0};
    index_.clear();
    for (auto& s : hstate_) s = kNoHash;
    num_cached_ = 0;
    events_.push(BlockEvent{EventKind::all_cleared, -1, {}, {}});
    return {};
  }

  /// Moves up to out.size() pending events into out, oldest first; returns how many.
  std::int32_t drain_events(std::span<BlockEvent> out) noexcept { return events_.drain(out); }
  /// The pending block events.
  const EventQueue& events() const noexcept { return events_; }

  /// Full consistency check, O(capacity). For tests and debug builds.
  Status check() const {
    if (ref_[ix(null_block)] != 0 || hstate_[ix(null_block)] != kNoHash)
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
    std::int32_t indexed = 0;
    for (BlockId b = 1; b < sentinel_; ++b) {
      if ((ref_[ix(b)] == 0) != static_cast<bool>(queued[ix(b)]) || ref_[ix(b)] < 0)
        return Status{Errc::invariant_violated, "ref_count", b, ref_[ix(b)]};
      if (is_cached(b)) {
        ++indexed;
        if (index_.find(hash_[ix(b)]) != b) return Status{Errc::invariant_violated, "index_entry", b, 0};
      }
    }
    if (indexed != index_.size()) return Status{Errc::invariant_violated, "index_size", index_.size(), indexed};
    // free + used == capacity, by construction of num_used(); checked anyway.
    if (num_free_ + num_used() != sentinel_ - 1) return Status{Errc::invariant_violated, "conservation", 0, 0};
    return {};
  }

  friend bool operator==(const BlockPool&, const BlockPool&) = default;

 private:
  static constexpr std::uint8_t kNoHash = 0, kHashed = 1, kIndexed = 2;

  static constexpr std::size_t ix(std::int32_t i) noexcept { return static_cast<std::size_t>(i); }

  // Block 0 is the null block, so a usable pool has at least 2; every block
  // costs about 64 bytes of host bookkeeping (links, hash, ref count, index).
  static std::size_t checked(std::int32_t num_blocks) {
    if (num_blocks < 2) throw ConfigError("kvcache::BlockPool", Status{Errc::invalid_argument, "num_blocks", num_blocks, 2});
    return checked_elements("kvcache::BlockPool", "num_blocks", num_blocks, num_blocks, 64);
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
  void drop_hash(BlockId b) noexcept {
    auto& s = hstate_[static_cast<std::size_t>(b)];
    if (s == kIndexed) {
      index_.erase(hash_[ix(b)]);
      events_.push(BlockEvent{EventKind::removed, b, hash_[ix(b)], {}});
    }
    s = kNoHash;
  }
  BlockId take_front() noexcept {
    const BlockId b = next_[ix(sentinel_)];
    unlink(b);
    --num_free_;
    if (is_cached(b)) --num_cached_;
    drop_hash(b);  // lazy eviction of cached content happens here
    ref_[ix(b)] = 1;
    return b;
  }

  std::vector<std::int32_t> ref_;
  std::vector<BlockId> prev_, next_;  // size capacity + 1; the last node is the sentinel
  std::vector<BlockHash> hash_;
  std::vector<std::uint8_t> hstate_;
  HashIndex index_;
  EventQueue events_;
  BlockId sentinel_;
  std::int32_t num_free_ = 0;
  std::int32_t num_cached_ = 0;
};

KVCACHE_END_NAMESPACE
