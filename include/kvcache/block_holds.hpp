// Holds: blocks a transfer keeps alive after the sequence that owned them
// ended. An offload reads device blocks, an onboard writes them, and the
// copy runs on the engine's stream while the scheduler moves on: a request
// finished or aborted in the meantime must not hand its blocks to the next
// allocation until the copy completes (vLLM's connectors delay the free of a
// request whose transfers are in flight; Dynamo and LMCache shipped bugs
// where they did not). A hold is one more holder of each block in the pool,
// so a cached block stays cached and a plain one stays allocated; releasing
// the hold drops those holders tail first, as freeing a sequence does.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <span>
#include <vector>

#include "kvcache/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// The holds a cache's transfers keep on its blocks, by id (never reused).
class BlockHolds {
 public:
  /// A new hold on `blocks` (in row order; a block may appear twice): each
  /// must be in use or free but cached (as BlockPool::retain takes them).
  /// All or nothing: an invalid block or a free one is an error naming it,
  /// and nothing changes. Returns the hold's id, which release() takes.
  template <class Pool>
  Result<std::uint64_t> hold(Pool& pool, std::span<const BlockId> blocks) {
    for (const BlockId b : blocks) {
      if (!pool.valid(b)) return Status{Errc::invalid_argument, "block", b, pool.capacity() - 1};
      if (pool.ref_count(b) == 0 && !pool.is_cached(b)) return Status{Errc::not_allocated, "block", b, 0};
    }
    const std::uint64_t id = ++next_;
    auto& held = holds_[id];
    held.assign(blocks.begin(), blocks.end());
    for (const BlockId b : held) (void)pool.retain(b);
    blocks_ += std::int64_t(held.size());
    return id;
  }

  /// Ends hold `id`: its blocks lose this holder, the last block first (a
  /// chain's head stays most recent in the pool's LRU). An id never given,
  /// or already released, is unknown_job and changes nothing.
  template <class Pool>
  Status release(Pool& pool, std::uint64_t id) noexcept {
    const auto it = holds_.find(id);
    if (it == holds_.end()) return Status{Errc::unknown_job, "hold", std::int64_t(id), std::int64_t(next_)};
    for (auto b = it->second.rbegin(); b != it->second.rend(); ++b) (void)pool.release(*b);
    blocks_ -= std::int64_t(it->second.size());
    holds_.erase(it);
    return {};
  }

  /// Holds not yet released.
  std::int32_t size() const noexcept { return std::int32_t(holds_.size()); }
  /// Block references the holds keep (a block held twice counts twice).
  std::int64_t blocks() const noexcept { return blocks_; }
  /// The blocks of hold `id` (empty when there is no such hold).
  std::span<const BlockId> blocks_of(std::uint64_t id) const noexcept {
    const auto it = holds_.find(id);
    return it == holds_.end() ? std::span<const BlockId>{} : std::span<const BlockId>(it->second);
  }
  /// Adds each held block's count to refs[block] (a cache's invariant check
  /// counts these holders beside its rows').
  void add_refs(std::span<std::int32_t> refs) const noexcept {
    for (const auto& [id, held] : holds_)
      for (const BlockId b : held)
        if (std::size_t(b) < refs.size()) ++refs[std::size_t(b)];
  }

  friend bool operator==(const BlockHolds&, const BlockHolds&) = default;

 private:
  std::map<std::uint64_t, std::vector<BlockId>> holds_;  // ordered: equal states compare equal
  std::uint64_t next_ = 0;
  std::int64_t blocks_ = 0;
};

KVCACHE_END_NAMESPACE
