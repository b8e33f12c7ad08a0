// Holds: blocks a transfer keeps alive after the sequence that owned them
// ended. An offload reads device blocks, an onboard writes them, and the
// copy runs on the engine's stream while the scheduler moves on: a request
// finished or aborted in the meantime must not hand its blocks to the next
// allocation until the copy completes (vLLM's connectors delay the free of a
// request whose transfers are in flight; Dynamo and LMCache shipped bugs
// where they did not). A hold is one more holder of each block in the pool,
// so a cached block stays cached and a plain one stays allocated; releasing
// the hold drops those holders tail first, as freeing a sequence does.
//
// Room taken at construction, so holds allocate nothing in a running engine
// (the caches' no-allocation promise): max_holds holds of max_blocks block
// references in all, which the caches derive from their configuration
// (hold_capacity()). Past that room a hold grows the store rather than fail:
// a prefill node whose decoders pull slowly, or many requests holding one
// shared prefix, may keep more, and a transfer must not fail for bookkeeping.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/config.hpp"
#include "kvcache/pool/block_pool.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// The holds a cache's transfers keep on its blocks, by id (never reused).
class BlockHolds {
 public:
  /// No room taken: the first hold allocates (a check's empty set of holds).
  BlockHolds() = default;
  /// Room for max_holds holds of max_blocks block references in all, taken now.
  BlockHolds(std::int32_t max_holds, std::int64_t max_blocks)
      : holds_(std::size_t(std::max(max_holds, 0))), blocks_(std::size_t(std::max<std::int64_t>(max_blocks, 0))) {}

  /// A new hold on `blocks` (in row order; a block may appear twice): each
  /// must be in use or free but cached (as BlockPool::retain takes them).
  /// All or nothing: an invalid block or a free one is an error naming it,
  /// and nothing changes. Returns the hold's id, which release() takes.
  /// Allocates only past the room taken at construction.
  template <class Pool>
  Result<std::uint64_t> hold(Pool& pool, std::span<const BlockId> blocks) {
    for (const BlockId b : blocks) {
      if (!pool.valid(b)) return Status{Errc::invalid_argument, "block", b, pool.capacity() - 1};
      if (pool.ref_count(b) == 0 && !pool.is_cached(b)) return Status{Errc::not_allocated, "block", b, 0};
    }
    const std::int64_t n = std::int64_t(blocks.size());
    if (std::size_t(n_holds_) == holds_.size()) holds_.resize(std::max<std::size_t>(8, 2 * holds_.size()));
    if (n > std::int64_t(blocks_.size()) - n_blocks_)
      blocks_.resize(std::max(std::size_t(n_blocks_ + n), 2 * blocks_.size()));
    const std::uint64_t id = ++next_;
    holds_[std::size_t(n_holds_++)] = Entry{id, n_blocks_, n};
    std::copy(blocks.begin(), blocks.end(), blocks_.begin() + n_blocks_);
    n_blocks_ += n;
    for (const BlockId b : blocks) (void)pool.retain(b);
    return id;
  }

  /// Ends hold `id`: its blocks lose this holder, the last block first (a
  /// chain's head stays most recent in the pool's LRU). An id never given,
  /// or already released, is unknown_job and changes nothing.
  template <class Pool>
  Status release(Pool& pool, std::uint64_t id) noexcept {
    Entry* e = find(id);
    if (e == nullptr) return Status{Errc::unknown_job, "hold", std::int64_t(id), std::int64_t(next_)};
    const auto first = blocks_.begin() + e->offset, last = first + e->count;
    for (auto b = last; b != first;) (void)pool.release(*--b);
    // Later holds' blocks move down over the gap, keeping ids and offsets in one order.
    std::copy(last, blocks_.begin() + n_blocks_, first);
    n_blocks_ -= e->count;
    const std::int64_t gone = e->count;
    Entry* end = holds_.data() + n_holds_;
    for (Entry* f = e + 1; f != end; ++f) f->offset -= gone;
    std::copy(e + 1, end, e);
    --n_holds_;
    return {};
  }

  /// Holds there is room for without allocating.
  std::int32_t room_holds() const noexcept { return std::int32_t(holds_.size()); }
  /// Block references there is room for without allocating.
  std::int64_t room_blocks() const noexcept { return std::int64_t(blocks_.size()); }
  /// Holds not yet released.
  std::int32_t size() const noexcept { return n_holds_; }
  /// Block references the holds keep (a block held twice counts twice).
  std::int64_t blocks() const noexcept { return n_blocks_; }
  /// The blocks of hold `id` (empty when there is no such hold).
  std::span<const BlockId> blocks_of(std::uint64_t id) const noexcept {
    const Entry* e = find(id);
    return e == nullptr ? std::span<const BlockId>{} : std::span<const BlockId>(blocks_.data() + e->offset, std::size_t(e->count));
  }
  /// Adds each held block's count to refs[block] (a cache's invariant check
  /// counts these holders beside its rows').
  void add_refs(std::span<std::int32_t> refs) const noexcept {
    for (std::int64_t i = 0; i < n_blocks_; ++i)
      if (std::size_t(blocks_[std::size_t(i)]) < refs.size()) ++refs[std::size_t(blocks_[std::size_t(i)])];
  }

  /// The same holds, ids and blocks (capacity aside).
  friend bool operator==(const BlockHolds& a, const BlockHolds& b) noexcept {
    return a.next_ == b.next_ && a.n_holds_ == b.n_holds_ && a.n_blocks_ == b.n_blocks_ &&
           std::equal(a.holds_.begin(), a.holds_.begin() + a.n_holds_, b.holds_.begin()) &&
           std::equal(a.blocks_.begin(), a.blocks_.begin() + a.n_blocks_, b.blocks_.begin());
  }

 private:
  struct Entry {
    std::uint64_t id = 0;
    std::int64_t offset = 0;  // into blocks_
    std::int64_t count = 0;
    friend bool operator==(const Entry&, const Entry&) = default;
  };
  // Holds in id order, which is also their blocks' order in blocks_ (a new
  // hold appends; a release closes its gap): a lookup is a binary search.
  Entry* find(std::uint64_t id) noexcept { return find_in(holds_.data(), n_holds_, id); }
  const Entry* find(std::uint64_t id) const noexcept { return find_in(holds_.data(), n_holds_, id); }
  template <class E>
  static E* find_in(E* first, std::int32_t n, std::uint64_t id) noexcept {
    E* end = first + n;
    E* e = std::lower_bound(first, end, id, [](const Entry& x, std::uint64_t v) { return x.id < v; });
    return e != end && e->id == id ? e : nullptr;
  }

  std::vector<Entry> holds_;     // sized at construction; the first n_holds_ are live
  std::vector<BlockId> blocks_;  // sized at construction; the first n_blocks_ are held
  std::int32_t n_holds_ = 0;
  std::int64_t n_blocks_ = 0;
  std::uint64_t next_ = 0;
};

/// The room a cache of max_sequences sequences over num_blocks blocks takes
/// for its holds: two per sequence (a finished request's offload in flight
/// while its slot serves the next, or a pending import's hits) and every
/// block twice over.
inline BlockHolds hold_capacity(std::int32_t max_sequences, std::int32_t num_blocks) {
  return BlockHolds(2 * std::max(max_sequences, 0), 2 * std::int64_t{std::max(num_blocks, 0)});
}

KVCACHE_END_NAMESPACE
