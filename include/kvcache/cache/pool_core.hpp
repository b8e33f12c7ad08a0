// What every cache has beside its rows, whatever they are: the block pool
// with its block events, and the holds transfers keep on its blocks.
// CacheCore (the token- and head-paged caches) and HybridCache both derive
// from it, so these calls are one implementation with one behaviour.
#pragma once

#include <cstdint>
#include <span>
#include <utility>

#include "kvcache/pool/block_holds.hpp"
#include "kvcache/config.hpp"
#include "kvcache/core/events.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// The fields every cache's configuration has (CacheConfig, HybridConfig),
/// checked once with the same words: ConfigError from `who` naming the first
/// bad one (the pool's blocks, the null block included; the sequence handles;
/// the block event ring, 0 for none).
inline void check_pool_config(const char* who, std::int32_t num_blocks, std::int32_t max_sequences, std::int32_t event_capacity) {
  const auto fail = [who](const char* what, std::int64_t v, std::int64_t limit) {
    throw ConfigError(who, Status{Errc::invalid_argument, what, v, limit});
  };
  if (num_blocks < 2) fail("num_blocks", num_blocks, 2);
  if (max_sequences < 1) fail("max_sequences", max_sequences, 1);
  if (event_capacity < 0) fail("event_capacity", event_capacity, 0);
}

/// A cache's pool, its block events and its holds.
template <class Pool>
class PoolCore {
 public:
  /// The block pool (read-only).
  const Pool& pool() const noexcept { return pool_; }
  /// Blocks allocate() can hand out now (plain free + free-but-cached).
  std::int32_t free_blocks() const noexcept { return pool_.num_free(); }
  /// Moves pending block events (stored / removed / all_cleared) into out; returns how many.
  std::int32_t drain_events(std::span<BlockEvent> out) noexcept { return pool_.drain_events(out); }
  /// drain_events() with each stored block's token ids: event i's ids at
  /// token_ids[i * the pool's tokens per event] (the block size; a hybrid
  /// cache's largest group block size).
  Result<std::int32_t> drain_events(std::span<BlockEvent> out, std::span<std::int32_t> token_ids) noexcept {
    return pool_.drain_events(out, token_ids);
  }

  /// Keeps `blocks` (device block ids: in use, or free but cached) allocated
  /// until release_hold(): what a transfer job that reads or writes them
  /// needs when their sequence is freed before the copy completes (an offload
  /// of a finished request, an onboard of an aborted one). All or nothing;
  /// an invalid or free block is an error naming it. Returns the hold's id.
  /// Allocates nothing within the room taken at construction (hold_capacity:
  /// two holds per sequence, twice the pool's blocks in references); past
  /// it the store grows.
  Result<std::uint64_t> hold(std::span<const BlockId> blocks) { return holds_.hold(pool_, blocks); }
  /// The copy is done: hold `id`'s blocks lose this holder (a block no row
  /// holds becomes free, cached when it has a hash). unknown_job for an id
  /// never given or already released; nothing changes then.
  Status release_hold(std::uint64_t id) noexcept { return holds_.release(pool_, id); }
  /// The holds not yet released.
  const BlockHolds& holds() const noexcept { return holds_; }

 protected:
  /// Takes the cache's pool (built from its checked configuration) and its
  /// holds' room (hold_capacity of the same configuration).
  PoolCore(Pool pool, BlockHolds holds) : pool_(std::move(pool)), holds_(std::move(holds)) {}
  /// The pools and their holds are equal.
  bool same_pool(const PoolCore& o) const { return pool_ == o.pool_ && holds_ == o.holds_; }

  Pool pool_;          ///< The block pool.
  BlockHolds holds_;   ///< Blocks transfers keep after their rows let go.
};

KVCACHE_END_NAMESPACE
