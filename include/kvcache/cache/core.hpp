// What every cache is built on, whatever its rows: the geometry, the block
// pool and the page table, with the configuration that sizes them. The two
// modes (token_paged.hpp, head_paged.hpp) derive from it and add their
// participants.
#pragma once

#include <concepts>
#include <cstdint>
#include <span>

#include "kvcache/block_holds.hpp"
#include "kvcache/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/events.hpp"
#include "kvcache/geometry.hpp"
#include "kvcache/page_table.hpp"
#include "kvcache/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// What a Cache is built from: geometry and capacities.
struct CacheConfig {
  Geometry geometry{};  ///< block_size comes from here
  std::int32_t num_blocks = 0;  ///< pool capacity, null block included
  std::int32_t max_sequences = 0;  ///< Live sequences at once (handles).
  std::int32_t max_blocks_per_sequence = 0;  ///< Longest row, in blocks.
  std::int32_t event_capacity = 0;  ///< 0: no block events
  /// Publish full blocks as reserve() is given their token ids (block_tokens.hpp), not only through publish().
  bool publish_on_reserve = false;
  Medium medium = Medium::gpu;  ///< The tier block events name.
};

template <class P>
concept BlockAllocator = requires(P& p, const P& cp, std::span<BlockId> out, BlockId b) {
  { p.allocate(out) } -> std::same_as<Status>;
  { p.retain(b) } -> std::same_as<Status>;
  { p.release(b) } -> std::same_as<Status>;
  { cp.num_free() } -> std::convertible_to<std::int32_t>;
  { cp.check() } -> std::same_as<Status>;
};

template <class T, class P>
concept BlockTableFor = requires(T& t, const T& ct, P& p, SeqId s, std::span<std::int32_t> slots) {
  { t.reserve(p, s, std::int32_t{1}, slots) } -> std::same_as<Result<ReserveInfo>>;
  { t.release(p, s) } -> std::same_as<Status>;
  { ct.tokens(s) } -> std::same_as<Result<std::int32_t>>;
  { ct.check(p) } -> std::same_as<Status>;
};

/// The geometry, the pool and the table of a cache: `streams` table rows of
/// cfg.max_blocks_per_sequence blocks.
template <class Pool, class Table>
class CacheCore {
 public:
  /// The geometry the cache was built with.
  const Geometry& geometry() const noexcept { return geometry_; }
  /// Tokens per block.
  std::int32_t block_size() const noexcept { return table_.block_size(); }
  /// The block pool (read-only).
  const Pool& pool() const noexcept { return pool_; }
  /// The page table (read-only): rows, front(), blocks().
  const Table& table() const noexcept { return table_; }
  /// Blocks allocate() can hand out now (plain free + free-but-cached).
  std::int32_t free_blocks() const noexcept { return pool_.num_free(); }
  /// Moves pending block events (stored / removed / all_cleared) into out; returns how many.
  std::int32_t drain_events(std::span<BlockEvent> out) noexcept { return pool_.drain_events(out); }
  /// drain_events() with each stored block's token ids: event i's block_size ids at token_ids[i * block_size()].
  Result<std::int32_t> drain_events(std::span<BlockEvent> out, std::span<std::int32_t> token_ids) noexcept {
    return pool_.drain_events(out, token_ids);
  }

  /// Keeps `blocks` (device block ids: in use, or free but cached) allocated
  /// until release_hold(): what a transfer job that reads or writes them
  /// needs when their sequence is freed before the copy completes (an offload
  /// of a finished request, an onboard of an aborted one). All or nothing;
  /// an invalid or free block is an error naming it. Returns the hold's id.
  Result<std::uint64_t> hold(std::span<const BlockId> blocks) { return holds_.hold(pool_, blocks); }
  /// The copy is done: hold `id`'s blocks lose this holder (a block no row
  /// holds becomes free, cached when it has a hash). unknown_job for an id
  /// never given or already released; nothing changes then.
  Status release_hold(std::uint64_t id) noexcept { return holds_.release(pool_, id); }
  /// The holds not yet released.
  const BlockHolds& holds() const noexcept { return holds_; }

 protected:
  /// The pool of cfg.num_blocks blocks and a table of `streams` rows; throws ConfigError.
  CacheCore(const CacheConfig& cfg, std::int32_t streams)
      : geometry_(usable(cfg.geometry)), pool_(make_pool(cfg)),
        table_(pool_, streams, cfg.max_blocks_per_sequence, cfg.geometry.block_size()) {}

  /// The pools and the tables are equal (a mode's operator== adds its participants).
  bool same_core(const CacheCore& o) const { return pool_ == o.pool_ && table_ == o.table_ && holds_ == o.holds_; }

  Geometry geometry_;  ///< The geometry the cache was built with.
  Pool pool_;          ///< The block pool.
  Table table_;        ///< The page table (rows per sequence, or head rows).
  BlockHolds holds_;   ///< Blocks transfers keep after their rows let go.

 private:
  static const Geometry& usable(const Geometry& g) {
    if (g.block_bytes() == 0)
      throw ConfigError("kvcache::Cache", Status{Errc::invalid_argument, "geometry (empty: build it with Geometry::make)", 0, 1});
    return g;
  }
  static Pool make_pool(const CacheConfig& cfg) {
    if constexpr (std::same_as<Pool, BlockPool>) return BlockPool(cfg.num_blocks, cfg.event_capacity, cfg.geometry.block_size(), cfg.medium);
    else return Pool(cfg.num_blocks, cfg.event_capacity);
  }
};

KVCACHE_END_NAMESPACE
