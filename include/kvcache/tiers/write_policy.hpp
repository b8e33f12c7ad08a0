// When device blocks are offloaded to host memory: the three write policies
// SGLang's HiCache names, as ready-made choices over the device pool.
//
//   write_through          every block the device cache publishes, at once
//                          (its `stored` events): the host tier mirrors the
//                          device; the most PCIe traffic, no miss ever waits.
//   write_through_reused   a block once its hash has been used min_uses
//                          times (prompts that contained it: hits, or
//                          blocks computed again): only prefixes that came
//                          back are copied (HiCache's selective write-through).
//   write_back             a cached block just before the device pool
//                          recycles it: the least traffic; the copy must be
//                          ordered before the overwrite (the engine enqueues
//                          it on the stream that will write the block).
//
// The policy only chooses; Tiers::plan_store plans (and skips blocks host
// memory already holds or is receiving), the engine copies. It reads the
// pool, never changes it, and owns no thread.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/core/block_hash.hpp"
#include "kvcache/pool/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/core/events.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Which device blocks go to host memory, and when.
enum class WriteMode : std::uint8_t { write_through, write_through_reused, write_back };

/// A write policy's settings.
struct WritePolicyConfig {
  WriteMode mode = WriteMode::write_back;  ///< The policy.
  /// write_through_reused: uses a hash needs before its block is offloaded.
  std::int32_t min_uses = 2;
  /// write_through_reused: use counters kept (a power of two). Hashes that
  /// share a counter add up: a block may go early, never wrongly.
  std::int32_t counters = 1 << 16;
};

/// A device block to offload: its id, its hash and the hash before it in its chain (for the tier's events).
struct Offload {
  BlockId block = -1;  ///< The device block.
  BlockHash hash{};  ///< Its hash: its name in every tier.
  BlockHash parent{};  ///< The hash its chain continues from.
  std::int32_t group = -1;  ///< Its layer group (-1: none), what the tier's events name.
  friend constexpr bool operator==(const Offload&, const Offload&) = default;
};

/// Chooses the device blocks to offload; Tiers::plan_store(device, host,
/// offloads) plans their copy, one job per call.
class WritePolicy {
 public:
  /// ConfigError names a bad field of cfg.
  explicit WritePolicy(const WritePolicyConfig& cfg = {}) : cfg_(checked(cfg)) {
    if (cfg_.mode == WriteMode::write_through_reused) uses_.assign(std::size_t(cfg_.counters), 0);
  }

  const WritePolicyConfig& config() const noexcept { return cfg_; }  ///< The settings.

  /// write_through: the device cache published these blocks (its drained
  /// events; only `stored` ones count, the tier's own `removed` and
  /// `all_cleared` are skipped): each goes to out, in order. Other modes:
  /// none. buffer_too_small (changing nothing) when out is short.
  Result<std::int32_t> on_stored(std::span<const BlockEvent> events, std::span<Offload> out) const noexcept {
    if (cfg_.mode != WriteMode::write_through) return 0;
    std::int32_t n = 0;
    for (const BlockEvent& e : events) n += e.kind == EventKind::stored;
    if (std::int64_t(out.size()) < n) return Status{Errc::buffer_too_small, "out", std::int64_t(out.size()), n};
    n = 0;
    for (const BlockEvent& e : events)
      if (e.kind == EventKind::stored) out[std::size_t(n++)] = {e.block, e.hash, e.parent, e.group};
    return n;
  }

  /// write_through_reused: a request used these device blocks (its
  /// prompt's full blocks once written: the prefix hit and the blocks it
  /// computed). Each hashed block's use count goes up; those used min_uses
  /// times go to out (again on later uses: plan_store skips the blocks host
  /// memory holds). Other modes: none. buffer_too_small when out is shorter
  /// than blocks, invalid_argument naming a block outside the pool; nothing
  /// is counted then.
  Result<std::int32_t> on_use(const BlockPool& pool, std::span<const BlockId> blocks, std::span<Offload> out) noexcept {
    if (cfg_.mode != WriteMode::write_through_reused) return 0;
    if (out.size() < blocks.size()) return Status{Errc::buffer_too_small, "out", std::int64_t(out.size()), std::int64_t(blocks.size())};
    for (const BlockId b : blocks)
      if (!pool.valid(b)) return Status{Errc::invalid_argument, "blocks", b, pool.capacity() - 1};
    std::int32_t n = 0;
    for (const BlockId b : blocks) {
      if (!pool.has_hash(b)) continue;  // not published: nothing to name it by
      std::uint16_t& c = uses_[std::size_t(pool.hash(b).lo & std::uint64_t(cfg_.counters - 1))];
      if (c < UINT16_MAX) ++c;
      if (c >= cfg_.min_uses) out[std::size_t(n++)] = of(pool, b);
    }
    return n;
  }

  /// write_back: before a step allocates `allocations` blocks, the cached
  /// blocks those allocations will recycle, in order (BlockPool::next_recycled),
  /// at most out.size(). Other modes: none. Changes nothing.
  std::int32_t before_allocate(const BlockPool& pool, std::int32_t allocations, std::span<Offload> out) {
    if (cfg_.mode != WriteMode::write_back || out.empty() || allocations <= 0) return 0;
    ids_.resize(out.size());
    const std::int32_t n = pool.next_recycled(allocations, ids_);
    for (std::int32_t i = 0; i < n; ++i) out[std::size_t(i)] = of(pool, ids_[std::size_t(i)]);
    return n;
  }

  /// The use count a hash has now (write_through_reused; 0 otherwise).
  std::int32_t uses(const BlockHash& h) const noexcept {
    return uses_.empty() ? 0 : uses_[std::size_t(h.lo & std::uint64_t(cfg_.counters - 1))];
  }

 private:
  static const WritePolicyConfig& checked(const WritePolicyConfig& c) {
    const auto fail = [](const char* what, std::int64_t v, std::int64_t lim) {
      throw ConfigError("kvcache::WritePolicy", Status{Errc::invalid_argument, what, v, lim});
    };
    if (std::int32_t(c.mode) > std::int32_t(WriteMode::write_back)) fail("mode", std::int64_t(c.mode), std::int64_t(WriteMode::write_back));
    if (c.min_uses < 1 || c.min_uses > UINT16_MAX) fail("min_uses", c.min_uses, 1);
    if (c.counters < 1 || (c.counters & (c.counters - 1)) != 0 || c.counters > (1 << 26))
      fail("counters (a power of two up to 2^26)", c.counters, 1 << 16);
    return c;
  }
  // The parent and layer group its stored event named (a hybrid cache's blocks name their group).
  static Offload of(const BlockPool& pool, BlockId b) noexcept {
    return {b, pool.hash(b), pool.prefix_index().parent(b), pool.group(b)};
  }

  WritePolicyConfig cfg_;
  std::vector<std::uint16_t> uses_;
  std::vector<BlockId> ids_;  // before_allocate's scratch
};

KVCACHE_END_NAMESPACE
