// The words of the tiers' plans (tiers.hpp): where a block lives, how far
// a chain is cached, the moves a job asks the engine to copy, and the
// configuration that sizes the tiers.
#pragma once

#include <cstdint>
#include <span>

#include "kvcache/config.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Where a block lives: device memory (the cache's pool), pinned host memory, a disk file.
enum class Tier : std::uint8_t { device, host, disk };

/// The tiers' sizes. A tier of 0 blocks is absent; a disk tier needs a host tier.
struct TiersConfig {
  std::int32_t host_blocks = 0;  ///< Blocks of pinned host memory the engine allocated.
  std::int32_t disk_blocks = 0;  ///< Blocks of the disk file.
  std::int32_t block_size = 16;  ///< Tokens per block (a lookup leaves the last prompt token to compute).
  std::int32_t max_jobs = 1024;  ///< Jobs in flight at most.
  std::int32_t event_capacity = 0;  ///< Events kept per tier (0: none).
};

/// How far a prompt's chain of block hashes is cached: the hit is its
/// first blocks() blocks, each served by the fastest tier holding it.
/// Disk blocks may sit between host ones (lookup()'s `where` says which).
struct TierHits {
  std::int32_t device = 0;  ///< Leading blocks in the device cache (the caller's count).
  std::int32_t host = 0;  ///< Blocks of the hit after them that host memory holds.
  std::int32_t disk = 0;  ///< Blocks of the hit after them that only disk holds (staged through host memory).
  std::int32_t blocks() const noexcept { return device + host + disk; }  ///< The whole hit.
  friend constexpr bool operator==(const TierHits&, const TierHits&) = default;
};

/// One block to copy: its id in the source tier and in the target tier (a
/// device block id, or a host or disk slot), and which block of the plan's chain it is.
struct BlockMove {
  std::int32_t src = -1;  ///< Source block.
  std::int32_t dst = -1;  ///< Target block.
  std::int32_t index = -1;  ///< Its place in the chain the plan was given.
  friend constexpr bool operator==(const BlockMove&, const BlockMove&) = default;
};

/// A planned transfer. `moves` stays valid until the job is completed or the tiers are reset.
struct TierJob {
  std::uint64_t id = 0;  ///< What complete() takes.
  Tier from = Tier::device;  ///< Source tier.
  Tier to = Tier::host;  ///< Target tier.
  std::span<const BlockMove> moves{};  ///< In chain order (a store leaves out the blocks it skips).
  std::int32_t skipped = 0;  ///< Blocks left out: the target holds them or is already receiving them.
};

KVCACHE_END_NAMESPACE
