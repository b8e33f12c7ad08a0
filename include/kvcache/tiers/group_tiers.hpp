// Memory tiers under a hybrid cache: every layer group's blocks go to host
// memory and disk and come back (tiers.hpp does the planning). A block is
// named in every tier as the device prefix index names it: its chain hash,
// per block size, keyed by its group (group_key). A page has one size in
// every group (LayerGroups::page_bytes()), so one host tier and one disk
// file of pages serve all groups, and a block's group travels with it: the
// tiers' events name it.
//
// Each group moves what its next query reads, as an import receives it
// (cache/hybrid_imports.hpp): a full or MLA group every block of the prefix,
// a sliding-window group only the blocks of its last window, a chunked
// group those of the current chunk. A hit is the longest prefix every group
// serves, device blocks first: the device cache's match, extended while
// every group finds in host memory or on disk the blocks it would receive.
//
// Onboarding is an import from a local tier. cache.import(prompt[:hit])
// seals a row whose blocks past the device hit are pending; plan_onboard()
// loads them under the names import_keys() takes from the import's own
// tokens, so a load cannot put one prompt's K/V under another's name; and
// complete_onboard() commits the import when every block landed, or aborts
// it (the sequence keeps the device hit and the engine recomputes the rest).
// It is all or nothing: a group with part of its window is no use.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/core/block_hash.hpp"
#include "kvcache/pool/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/groups/group_hits.hpp"
#include "kvcache/groups/group_rule.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"
#include "kvcache/tiers/tiers.hpp"

KVCACHE_BEGIN_NAMESPACE

/// The tiers' sizes, in pages (LayerGroups::page_bytes() each). A tier of 0 pages is absent; a disk tier needs a host tier.
struct GroupTiersConfig {
  std::int32_t host_blocks = 0;     ///< Pages of pinned host memory the engine allocated.
  std::int32_t disk_blocks = 0;     ///< Pages of the disk file.
  std::int32_t max_jobs = 1024;     ///< Jobs in flight at most.
  std::int32_t event_capacity = 0;  ///< Events kept per tier (0: none); each names its group.
};

/// How far a prompt is cached over every group: the device cache's hit, then the tiers'.
struct GroupTierHits {
  std::int64_t device_tokens = 0;  ///< What every group serves from the device cache (HybridCache::match).
  std::int64_t tokens = 0;         ///< The whole hit (>= device_tokens): import prompt[:tokens] to onboard the rest.
  std::int32_t host = 0;           ///< Blocks to onboard, over every group, that host memory holds.
  std::int32_t disk = 0;           ///< Blocks to onboard that only disk holds (staged through host memory).
  friend constexpr bool operator==(const GroupTierHits&, const GroupTierHits&) = default;
};

/// What complete_onboard() did to the import.
struct OnboardResult {
  SeqId seq{};             ///< The sequence, usable now.
  bool committed = false;  ///< Every block landed: seq holds the whole hit. Else it holds the device hit only.
  std::int32_t tokens = 0; ///< Tokens seq holds, computed: reserve the rest of the prompt from here.
};

/// Host and disk tiers for the layer groups of one HybridCache (which must
/// outlive it): `GroupTiers tiers(cache, {...})`. Cache is the cache's type
/// (templated, so that tiers/ stays below cache/ in the include order).
template <class Cache>
class GroupTiers {
 public:
  /// Tiers for `cache`'s groups. ConfigError names a bad field of cfg, or a
  /// cache without prefix caching (no block has a name to find it by).
  GroupTiers(Cache& cache, const GroupTiersConfig& cfg)
      : cache_(cache), sizes_(block_sizes(cache)), tiers_(checked(cache, cfg), sizes_), groups_(std::size_t(cache.groups())) {
    for (std::int32_t g = 0; g < cache.groups(); ++g) {
      Group& x = groups_[std::size_t(g)];
      x.rule = GroupRule::of(cache.layer_groups(), g);
      const auto n = std::size_t(x.rule.row_blocks(cache.config().max_tokens));
      x.keys.resize(n), x.where.resize(n), x.misses.resize(n + 1);
      caches_all_ = caches_all_ && x.rule.caches();
      x.chain_owner = cache.chain_owner(g);  // it hashes the prompt for every group of its block size
      if (x.chain_owner == g) x.chain.resize(n);
    }
    keys_.reserve(std::size_t(cache.config().num_blocks)), dst_.reserve(keys_.capacity());
    offloads_.reserve(keys_.capacity());
    onboards_.reserve(std::size_t(cfg.max_jobs));
  }

  Tiers& tiers() noexcept { return tiers_; }              ///< The tiers: lookups by key, stores to disk, events, invariants.
  const Tiers& tiers() const noexcept { return tiers_; }  ///< The tiers.

  /// How far `prompt` (under `key`) is cached: the device cache's match,
  /// then the longest hit (a multiple of the groups' hit alignment, below
  /// the prompt's length) for which every group finds in host memory or on
  /// disk each block an import of the hit would receive (a window group its
  /// last window's blocks, a chunked group the current chunk's). A model
  /// with a cross-attention group gets the device hit only (its blocks have
  /// no names). A prompt's length is refused as HybridCache::check_prompt() refuses it.
  /// Changes nothing but scratch.
  Result<GroupTierHits> lookup(std::span<const std::int32_t> prompt, const PrefixKey& key = {}) {
    const auto len = std::int64_t(prompt.size());
    if (auto st = cache_.check_prompt(prompt); !st) return st;  // admit()'s words
    GroupTierHits hit{.device_tokens = cache_.match(prompt, key)};
    hit.tokens = hit.device_tokens;
    const std::int32_t align = cache_.layer_groups().hit_alignment();
    const std::int64_t cap = (len - 1) / align * align;
    if (!caches_all_ || !tiers_.has(Tier::host) || cap <= hit.device_tokens) return hit;
    for (std::int32_t g = 0; g < cache_.groups(); ++g) {  // the prompt hashed once per block size (every group caches)
      Group& x = groups_[std::size_t(g)];
      if (x.chain_owner == g) x.chain_blocks = *cache_.block_chain(g, prompt.first(std::size_t(cap)), key, x.chain);
      const Group& o = groups_[std::size_t(x.chain_owner)];
      for (std::int32_t j = 0; j < o.chain_blocks; ++j) {  // each block's tier asked once: the count below reads it back
        x.where[std::size_t(j)] = std::int8_t(where(group_key(o.chain[std::size_t(j)], g)));
        x.misses[std::size_t(j) + 1] = x.misses[std::size_t(j)] + (x.where[std::size_t(j)] == 0);
      }
    }
    std::int64_t h = cap;
    for (; h > hit.device_tokens; h -= align) {
      bool all = true;
      for (const Group& x : groups_) {
        const auto [first, last] = received(x.rule, hit.device_tokens, h);
        all = all && x.misses[std::size_t(last)] == x.misses[std::size_t(first)];
      }
      if (all) break;
    }
    if (h == hit.device_tokens) return hit;
    hit.tokens = h;
    for (const Group& x : groups_) {
      const auto [first, last] = received(x.rule, hit.device_tokens, h);
      for (std::int64_t j = first; j < last; ++j) (x.where[std::size_t(j)] == 1 ? hit.host : hit.disk) += 1;
    }
    return hit;
  }

  /// Offload: a store into host memory of the blocks of `seq` that a later
  /// prompt continuing it can hit, in every group: a full group's published
  /// blocks; a window's or a chunk's blocks that a hit at the last whole
  /// boundary reads, those its row already let go included while the device
  /// still caches them. The boundary: the tokens whose K/V are the prompt's
  /// (computed_before_eviction: all computed ones unless a policy evicted),
  /// rounded down to the hit alignment. `tokens`: the sequence's tokens (its
  /// first computed_tokens(seq) are read), checked against the names its published blocks carry:
  /// invalid_argument naming the block when they are another prompt's, so
  /// no block is offloaded under a name it does not hold. Blocks host memory
  /// holds or receives are skipped (Tiers::plan_store). The engine holds the
  /// moves' sources (cache.hold over their `src`) until it completes the job
  /// with tiers().complete(). Its errors, unknown_sequence, and
  /// invalid_argument for fewer tokens than are computed.
  Result<TierJob> plan_offload(SeqId seq, std::span<const std::int32_t> tokens, const PrefixKey& key = {}) {
    auto computed = cache_.computed_tokens(seq);
    if (!computed) return computed.status();
    if (std::int64_t(tokens.size()) < *computed)
      return Status{Errc::invalid_argument, "tokens (fewer than the sequence computed)", std::int64_t(tokens.size()), *computed};
    computed = cache_.computed_before_eviction(seq);  // past it the K/V is not the prompt's: named by nothing
    const BlockPool& pool = cache_.pool();
    const std::int64_t boundary = *computed / cache_.layer_groups().hit_alignment() * cache_.layer_groups().hit_alignment();
    for (std::int32_t g = 0; g < cache_.groups(); ++g) {  // first check every name, then plan: nothing changes on error
      Group& x = groups_[std::size_t(g)];
      if (!x.rule.caches()) continue;
      const std::int32_t n = *cache_.hash_chain(g, tokens.first(std::size_t(*computed)), key, x.keys);
      const auto row = *cache_.blocks(seq, g);
      for (std::int32_t j = 0; j < n; ++j)
        if (const BlockId b = row[std::size_t(j)]; b != BlockPool::null_block && pool.has_hash(b) && !(pool.hash(b) == x.keys[std::size_t(j)]))
          return Status{Errc::invalid_argument, "tokens (not this sequence's: the block of this index differs)", j, g};
    }
    offloads_.clear();
    for (std::int32_t g = 0; g < cache_.groups(); ++g) {
      const Group& x = groups_[std::size_t(g)];
      if (!x.rule.caches()) continue;
      const auto row = *cache_.blocks(seq, g);
      const std::int64_t n = *computed / x.rule.block_size;
      for (std::int64_t j = x.rule.frees() ? x.rule.skipped_blocks(boundary) : 0; j < n; ++j) {
        const BlockHash& k = x.keys[std::size_t(j)];
        BlockId b = row[std::size_t(j)];
        if (b == BlockPool::null_block || !pool.has_hash(b)) b = pool.lookup(k);  // let go by the row, still cached
        if (b < 0 || b == BlockPool::null_block) continue;
        offloads_.push_back(Offload{b, k, j > 0 ? x.keys[std::size_t(j - 1)] : group_key(chain_root(key), g), g});
      }
    }
    return tiers_.plan_store(Tier::device, Tier::host, offloads_);
  }

  /// Stages import `id`'s blocks that only disk holds into host memory: one
  /// Tiers::plan_load(disk, host, ...) over every group's received blocks
  /// (those host memory holds are skipped and pinned until it completes),
  /// completed with tiers().complete_disk_load(). Its errors, and import_keys'.
  Result<TierJob> plan_stage(std::uint64_t id) {
    if (auto st = gather(id); !st) return st;
    return tiers_.plan_load(Tier::disk, Tier::host, keys_);
  }

  /// Onboard: a load of import `id`'s received blocks, every group's, from
  /// host memory into the device blocks the import reserved, found by the
  /// names the import's own tokens give them (HybridCache::import_keys).
  /// All or nothing: out_of_blocks naming the blocks host memory holds when
  /// it lacks any (a hit evicted since lookup(), a disk block not staged):
  /// abort the import and recompute. invalid_argument for an import whose
  /// length is not whole blocks in every group (lookup()'s hits are).
  /// Complete it with complete_onboard().
  Result<TierJob> plan_onboard(std::uint64_t id) {
    if (auto st = gather(id); !st) return st;
    if (!tiers_.has(Tier::host)) return Status{Errc::invalid_argument, "host_blocks (no host tier)", 0, 1};
    std::int32_t found = 0;
    for (const BlockHash& k : keys_) found += tiers_.host().find(k) >= 0;
    if (found < std::int32_t(keys_.size()))
      return Status{Errc::out_of_blocks, "host blocks (of the hit: evicted since lookup, or on disk not staged)", found,
                    std::int64_t(keys_.size())};
    if (onboards_.size() == onboards_.capacity()) return Status{Errc::capacity_exceeded, "max_jobs", std::int64_t(onboards_.size()), 0};
    auto job = tiers_.plan_load(Tier::host, Tier::device, keys_, dst_);
    if (job) onboards_.push_back({job->id, id});
    return job;
  }

  /// The engine ran onboard job `job` (plan_onboard): every move but those at
  /// the indices in `failed` landed. When all landed the import is committed
  /// (its blocks published under their names); otherwise it is aborted: its
  /// sequence keeps the device hit, and the rest is recomputed. unknown_job
  /// for a job that is not an onboard in flight (one completed through
  /// tiers().complete() or abandoned by tiers().reset() is forgotten then:
  /// abort its import); Tiers::complete's errors for a bad `failed` change nothing.
  Result<OnboardResult> complete_onboard(std::uint64_t job, std::span<const std::int32_t> failed = {}) {
    const auto it = std::find_if(onboards_.begin(), onboards_.end(), [&](const Onboard& o) { return o.job == job; });
    if (it == onboards_.end()) return Status{Errc::unknown_job, "job (not an onboard in flight)", std::int64_t(job & 0xffffffffu), 0};
    auto landed = tiers_.complete(job, failed);
    if (!landed) {
      if (landed.status().code() == Errc::unknown_job) onboards_.erase(it);  // completed through tiers(), or reset: forgotten
      return landed.status();
    }
    const std::uint64_t import = it->import;
    onboards_.erase(it);
    if (failed.empty()) {
      auto c = cache_.land(import);  // planned from the cache's own lookup of the prompt
      if (!c) return c.status();
      return OnboardResult{c->seq, true, std::int32_t(*cache_.tokens(c->seq))};
    }
    auto a = cache_.abort_import(import);
    if (!a) return a.status();
    return OnboardResult{a->seq, false, a->cached_tokens};
  }

 private:
  struct Group {
    GroupRule rule;
    std::vector<BlockHash> keys;       // plan_offload(): the sequence's block names in this group
    std::vector<BlockHash> chain;      // lookup(): the prompt's chain before any group's key (chain owners only)
    std::int32_t chain_owner = -1;     // the group whose chain is this group's (HybridCache::chain_owner)
    std::int32_t chain_blocks = 0;     // lookup(): hashes in chain
    std::vector<std::int8_t> where;    // lookup(): where each block is (where()'s 1 host, 2 disk, 0 neither)
    std::vector<std::int32_t> misses;  // [j]: blocks below j that no tier holds
  };
  struct Onboard {
    std::uint64_t job = 0, import = 0;
  };
  static std::vector<std::int32_t> block_sizes(const Cache& c) {
    std::vector<std::int32_t> s;
    for (std::int32_t g = 0; g < c.groups(); ++g) s.push_back(c.layer_groups().block_size(g));
    return s;
  }
  static TiersConfig checked(const Cache& c, const GroupTiersConfig& cfg) {
    if (!c.config().prefix_caching)
      throw ConfigError("kvcache::GroupTiers", Status{Errc::invalid_argument, "prefix_caching (off: blocks have no names)", 0, 1});
    return TiersConfig{.host_blocks = cfg.host_blocks, .disk_blocks = cfg.disk_blocks,
                       .block_size = c.layer_groups().hit_alignment(), .max_jobs = cfg.max_jobs,
                       .event_capacity = cfg.event_capacity};
  }
  // 1 host, 2 disk only, 0 neither.
  int where(const BlockHash& k) const noexcept {
    if (tiers_.host().find(k) >= 0) return 1;
    return tiers_.has(Tier::disk) && tiers_.disk().find(k) >= 0 ? 2 : 0;
  }
  // The blocks [first, last) an import of h tokens receives in a group when the device serves d.
  static std::pair<std::int64_t, std::int64_t> received(const GroupRule& r, std::int64_t d, std::int64_t h) noexcept {
    const std::int64_t last = h / r.block_size;
    return {std::min(last, std::max(d / r.block_size, r.skipped_blocks(h))), last};
  }
  // keys_ and dst_: import id's received blocks over every group, their names and device blocks.
  Status gather(std::uint64_t id) {
    keys_.clear(), dst_.clear();
    for (std::int32_t g = 0; g < cache_.groups(); ++g) {
      auto blocks = cache_.import_blocks(id, g);
      if (!blocks) return blocks.status();
      const std::size_t at = keys_.size(), n = blocks->local.size();
      keys_.resize(at + n);
      auto named = cache_.import_keys(id, g, std::span(keys_).subspan(at));
      if (!named) return keys_.resize(at), named.status();
      if (std::size_t(*named) != n)
        return keys_.resize(at), Status{Errc::invalid_argument, "import (not whole blocks: a block without a name)", *named, std::int64_t(n)};
      dst_.insert(dst_.end(), blocks->local.begin(), blocks->local.end());
    }
    return {};
  }

  Cache& cache_;
  std::vector<std::int32_t> sizes_;  // each group's block size (the tiers' events)
  Tiers tiers_;
  std::vector<Group> groups_;
  bool caches_all_ = true;  // no cross group: every block has a name
  std::vector<BlockHash> keys_;
  std::vector<std::int32_t> dst_;
  std::vector<Offload> offloads_;
  std::vector<Onboard> onboards_;  // onboard jobs in flight and their imports
};

KVCACHE_END_NAMESPACE
