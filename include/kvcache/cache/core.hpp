// What the token- and head-paged caches are built on: the geometry and the
// page table over the pool (pool_core.hpp, which HybridCache shares), with
// the configuration that sizes them. The two modes (token_paged.hpp,
// head_paged.hpp) derive from it and add their participants.
#pragma once

#include <concepts>
#include <cstdint>
#include <span>

#include "kvcache/pool/block_pool.hpp"
#include "kvcache/cache/pool_core.hpp"
#include "kvcache/config.hpp"
#include "kvcache/core/geometry.hpp"
#include "kvcache/table/page_table.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// What a Cache is built from: geometry and capacities.
struct CacheConfig {
  Geometry geometry{};  ///< block_size comes from here
  std::int32_t num_blocks = 0;  ///< pool capacity, null block included
  std::int32_t max_sequences = 0;  ///< Live sequences at once (handles).
  std::int32_t max_blocks_per_sequence = 0;  ///< Longest row, in blocks.
  std::int32_t event_capacity = 0;  ///< 0: no block events
  /// Publish full blocks as reserve() is given their token ids (prefix/block_tokens.hpp), not only through publish().
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
class CacheCore : public PoolCore<Pool> {
 public:
  /// The geometry the cache was built with.
  const Geometry& geometry() const noexcept { return geometry_; }
  /// Tokens per block.
  std::int32_t block_size() const noexcept { return table_.block_size(); }
  /// The page table (read-only): rows, front(), blocks().
  const Table& table() const noexcept { return table_; }
 protected:
  /// The pool of cfg.num_blocks blocks and a table of `streams` rows; throws ConfigError.
  CacheCore(const CacheConfig& cfg, std::int32_t streams)
      : PoolCore<Pool>(make_pool(cfg), hold_capacity(cfg.max_sequences, cfg.num_blocks)), geometry_(usable(cfg.geometry)),
        table_(this->pool_, streams, cfg.max_blocks_per_sequence, cfg.geometry.block_size()) {}

  /// The pools and the tables are equal (a mode's operator== adds its participants).
  bool same_core(const CacheCore& o) const { return this->same_pool(o) && table_ == o.table_; }

  Geometry geometry_;  ///< The geometry the cache was built with.
  Table table_;        ///< The page table (rows per sequence, or head rows).

 private:
  static const Geometry& usable(const Geometry& g) {
    if (g.block_bytes() == 0)
      throw ConfigError("kvcache::Cache", Status{Errc::invalid_argument, "geometry (empty: build it with Geometry::make)", 0, 1});
    return g;
  }
  static Pool make_pool(const CacheConfig& cfg) {
    (void)usable(cfg.geometry);  // its error first: the pool is sized by it
    check_pool_config("kvcache::Cache", cfg.num_blocks, cfg.max_sequences, cfg.event_capacity);  // the config's names, not the parts'
    if (cfg.max_blocks_per_sequence < 1)
      throw ConfigError("kvcache::Cache", Status{Errc::invalid_argument, "max_blocks_per_sequence", cfg.max_blocks_per_sequence, 1});
    if constexpr (std::same_as<Pool, BlockPool>) return BlockPool(cfg.num_blocks, cfg.event_capacity, cfg.geometry.block_size(), cfg.medium);
    else return Pool(cfg.num_blocks, cfg.event_capacity);
  }
};

KVCACHE_END_NAMESPACE
