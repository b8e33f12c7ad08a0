// Memory tiers under the device pool: a host tier and a disk tier
// (TierPool each), lookups across them, and transfer jobs the engine runs.
//
// The library plans, the engine copies: a plan is a list of block moves
// (source id, target id) the engine executes with block_copy,
// cudaMemcpyAsync or its own file I/O, on its own streams or threads, and
// then reports with complete(), exactly once per job. Until then the
// job holds what it touches: the blocks it reads are pinned (no store
// recycles them) and the blocks it fills are invisible to lookups. A failure
// never publishes a hash. A disk block reaches the device only through host
// memory, and a disk load completes only through complete_disk_load(),
// which checks every slot's trailer and checksum (disk_layout.hpp) before it
// publishes the block: no path publishes disk bytes the library did not check.
//
// Device blocks are the engine's: a store from the device reads blocks the
// engine keeps alive until complete(), and a load into the device writes
// blocks it reserved; it publishes (computed()) only the leading blocks
// complete() reports landed, and recomputes the rest.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <type_traits>
#include <vector>

#include "kvcache/core/block_hash.hpp"
#include "kvcache/config.hpp"
#include "kvcache/core/events.hpp"
#include "kvcache/status.hpp"
#include "kvcache/tiers/disk_layout.hpp"
#include "kvcache/tiers/tier_jobs.hpp"
#include "kvcache/tiers/tier_plan.hpp"
#include "kvcache/tiers/tier_pool.hpp"
#include "kvcache/tiers/write_policy.hpp"

KVCACHE_BEGIN_NAMESPACE

/// A host tier and a disk tier under the device pool, with the jobs in flight between them.
class Tiers {
 public:
  /// ConfigError names a bad field of cfg. `group_block_sizes` (GroupTiers
  /// passes its layer groups'): the tokens of a block of each group, what
  /// the events of a block stored with its group say (others: cfg.block_size).
  explicit Tiers(const TiersConfig& cfg, std::span<const std::int32_t> group_block_sizes = {})
      : cfg_(checked(cfg)),
        host_(make_tier(Medium::cpu, cfg.host_blocks, cfg.event_capacity)),
        disk_(make_tier(Medium::disk, cfg.disk_blocks, cfg.event_capacity)),
        jobs_(cfg.max_jobs),
        group_sizes_(group_block_sizes.begin(), group_block_sizes.end()) {}

  const TiersConfig& config() const noexcept { return cfg_; }  ///< The configuration.
  bool has(Tier t) const noexcept { return t == Tier::device || tier(t) != nullptr; }  ///< Whether tier t exists.
  /// The host tier's blocks; std::bad_optional_access when there is none (has(Tier::host) false).
  const TierPool& host() const { return host_.value(); }
  /// The disk tier's blocks; std::bad_optional_access when there is none (has(Tier::disk) false).
  const TierPool& disk() const { return disk_.value(); }
  std::int32_t jobs_in_flight() const noexcept { return jobs_.size(); }  ///< Jobs planned, not completed.
  std::uint32_t epoch() const noexcept { return jobs_.epoch(); }  ///< Resets so far.

  /// How far `chain` (the hashes of a prompt's full blocks, in order) is
  /// cached: `device_blocks` leading blocks the device cache holds (its
  /// match), then each next block from host memory when it is there, else
  /// from disk, until neither has it. Blocks being stored are not found. At
  /// most (prompt_tokens - 1) / block_size blocks: the last prompt token is
  /// always computed. where[i] is block i's tier; TierHits counts them. To
  /// onboard the hit, the engine stages its disk blocks with one
  /// plan_load(disk, host, hit) (it skips, and pins, those host memory
  /// holds), then loads all of them with plan_load(host, device, ...). No side effects.
  Result<TierHits> lookup(std::span<const BlockHash> chain, std::int32_t device_blocks, std::int64_t prompt_tokens,
                          std::span<Tier> where) const noexcept {
    if (prompt_tokens < 1) return Status{Errc::invalid_argument, "prompt_tokens", prompt_tokens, 1};
    const std::int64_t cap = std::min<std::int64_t>(std::int64_t(chain.size()), (prompt_tokens - 1) / cfg_.block_size);
    if (device_blocks < 0 || device_blocks > cap) return Status{Errc::invalid_argument, "device_blocks", device_blocks, cap};
    TierHits h{.device = device_blocks};
    // `where` sized for the cap (the usual case) is filled in the one walk;
    // a shorter one is checked against the hit first, so an error writes nothing.
    const bool direct = std::int64_t(where.size()) >= cap;
    std::int64_t i = device_blocks;
    for (; i < cap; ++i) {
      Tier t = Tier::host;
      if (host_ && host_->find(chain[std::size_t(i)]) >= 0) ++h.host;
      else if (disk_ && disk_->find(chain[std::size_t(i)]) >= 0) ++h.disk, t = Tier::disk;
      else break;
      if (direct) where[std::size_t(i)] = t;
    }
    if (std::int64_t(where.size()) < i) return Status{Errc::buffer_too_small, "where", std::int64_t(where.size()), i};
    for (std::int64_t j = device_blocks; !direct && j < i; ++j)
      where[std::size_t(j)] = host_ && host_->find(chain[std::size_t(j)]) >= 0 ? Tier::host : Tier::disk;
    std::fill(where.begin(), where.begin() + device_blocks, Tier::device);
    return h;
  }

  /// Offload: copy blocks `first ..` of a chain into tier `to` (host from the
  /// device, disk from host). src[i] holds chain[i] in tier `from`: device
  /// block ids the engine keeps until complete(), or host slots, which the
  /// job pins (a host slot that no longer holds its hash ends the plan
  /// there). Blocks the target holds or is receiving are skipped (kept
  /// recent there); the others get target blocks, least recently used ready
  /// blocks recycled first, never one this plan skips. All or nothing:
  /// out_of_blocks when they do not fit. `parent`: the hash before chain[0], for events.
  Result<TierJob> plan_store(Tier from, Tier to, std::span<const BlockHash> chain, std::span<const std::int32_t> src,
                             const BlockHash& parent = {}) {
    return store(from, to, chain, src, parent, {}, {});
  }

  /// plan_store() of blocks from any chains (a WritePolicy's choice):
  /// blocks[i].block holds blocks[i].hash in tier `from`, and its parent
  /// names the hash before it and its group the layer group (for the target tier's events).
  Result<TierJob> plan_store(Tier from, Tier to, std::span<const Offload> blocks) {
    off_hash_.clear(), off_src_.clear(), off_parent_.clear(), off_group_.clear();
    for (const Offload& o : blocks)
      off_hash_.push_back(o.hash), off_src_.push_back(o.block), off_parent_.push_back(o.parent), off_group_.push_back(o.group);
    return store(from, to, off_hash_, off_src_, BlockHash{}, off_parent_, off_group_);
  }

  /// Onboard: copy the cached blocks of `chain` from tier `from` into tier
  /// `to` (host to the device, disk to host; disk reaches the device through
  /// host memory). Each source is found by its hash now: the plan ends at the
  /// first block no longer there (a hit evicted since lookup()), so it may be
  /// shorter than chain, or empty. Sources are pinned until complete(). Into
  /// the device, dst[i] is the device block the engine reserved for chain[i].
  /// Into host (staging a disk hit), target slots are taken as for a store;
  /// blocks host memory already holds or is receiving are skipped, not an
  /// end (two requests load a block once), and the ones it holds stay pinned
  /// until the job completes, so that after it every block of the plan is in
  /// host memory for the host-to-device load. A disk load completes through
  /// complete_disk_load(), which verifies each slot.
  Result<TierJob> plan_load(Tier from, Tier to, std::span<const BlockHash> chain, std::span<const std::int32_t> dst = {},
                            const BlockHash& parent = {}) {
    if (!(from == Tier::host && to == Tier::device) && !(from == Tier::disk && to == Tier::host))
      return Status{Errc::invalid_argument, "route (loads go host to device, disk to host)", std::int64_t(from) * 3 + std::int64_t(to), 0};
    if (!has(from)) return Status{Errc::invalid_argument, "from (no such tier)", std::int64_t(from), 0};
    if (!has(to)) return Status{Errc::invalid_argument, "to (no such tier)", std::int64_t(to), 0};
    if (to == Tier::device && dst.size() != chain.size())
      return Status{Errc::invalid_argument, "dst (one device block per chain block)", std::int64_t(dst.size()), std::int64_t(chain.size())};
    if (auto st = jobs_.room(); !st) return st;
    TierPool& src_tier = *tier(from);
    scratch_.clear();
    for (const BlockHash& h : chain) {
      const bool staged = to == Tier::host && host_->state_of(h) != -2;  // held or filling: no read, skipped below
      const std::int32_t s = staged ? -1 : src_tier.find(h);
      if (s < 0 && !staged) break;
      scratch_.push_back(s);
    }
    const std::span<const BlockHash> found = chain.first(scratch_.size());
    if (to == Tier::host) {
      const std::vector<std::int32_t> src(scratch_.begin(), scratch_.end());
      return plan_into(*host_, from, to, found, src, parent, {}, {}, true);
    }
    Job& j = jobs_.add(from, to);
    for (std::size_t i = 0; i < found.size(); ++i) {
      src_tier.pin(scratch_[i]);
      j.moves.push_back({scratch_[i], dst[i], std::int32_t(i)});
      j.blocks.push_back({found[i], i == 0 ? parent : found[i - 1], src_tier.group(scratch_[i])});
    }
    return TierJobs::view(j);
  }

  /// The engine ran job `id`: every move but those at the indices in `failed`
  /// landed. Exactly once per job: unknown_job for an id never planned,
  /// already completed, or planned before a reset (harmless then). Blocks
  /// stored into a tier are published (visible to lookups) unless they
  /// failed; failed ones go back free, never visible. Sources are unpinned;
  /// a load's failed sources are dropped from their tier as well (a block
  /// that could not be read back intact is not offered again: a lost entry
  /// costs a recompute, a wrong one would serve wrong KV).
  /// Returns the leading moves that landed: into the device, the engine
  /// publishes those blocks and recomputes from the first failure on.
  /// A disk load (disk to host) completes through complete_disk_load():
  /// invalid_argument naming the job here.
  Result<std::int32_t> complete(std::uint64_t id, std::span<const std::int32_t> failed = {}) {
    auto j = jobs_.completing(id, failed);
    if (!j) return j.status();
    if ((*j)->from == Tier::disk)
      return Status{Errc::invalid_argument, "job (a disk load: complete_disk_load checks its slots)", std::int64_t(id & 0xffffffffu), 0};
    return finish(*j);
  }

  /// The engine ran disk load `id` (plan_load(disk, host, ...)): every move
  /// but those at the indices in `failed` was read, and landed(move) gives
  /// where its slot landed in host memory (a LandedSlot: the block's bytes,
  /// which the host tier's block now holds, and the slot's tail or trailer).
  /// The library verifies each read slot against `layout` (its trailer, the
  /// block's hash, this slot, the checksum of the bytes): one that fails is
  /// treated as a failed move, never published, and dropped from the disk
  /// tier. Returns the leading moves that landed intact. unknown_job as
  /// complete(); invalid_argument for a job that is not a disk load, a
  /// failed index outside the job, or a layout with fewer slots than the disk tier.
  template <class Landed>
    requires std::is_invocable_r_v<LandedSlot, Landed&, const BlockMove&>
  Result<std::int32_t> complete_disk_load(std::uint64_t id, const DiskLayout& layout, Landed&& landed,
                                          std::span<const std::int32_t> failed = {}) {
    auto j = jobs_.completing(id, failed);
    if (!j) return j.status();
    Job& job = **j;
    if (job.from != Tier::disk)
      return Status{Errc::invalid_argument, "job (not a disk load: complete() takes it)", std::int64_t(id & 0xffffffffu), 0};
    if (layout.num_blocks() < disk_->capacity())
      return Status{Errc::invalid_argument, "layout.num_blocks (the disk tier's slots)", layout.num_blocks(), disk_->capacity()};
    for (std::size_t i = 0; i < job.moves.size(); ++i) {
      if (jobs_.failed(i)) continue;
      const LandedSlot x = landed(job.moves[i]);
      if (!layout.verify(x.payload, x.tail, job.moves[i].src, job.blocks[i].hash).ok()) jobs_.fail(i);
    }
    return finish(*j);
  }

  /// Moves up to out.size() of tier t's pending block events into out, oldest
  /// first (stored when a store completes, removed when a block is recycled
  /// or dropped; each names the tier's medium: cpu or disk, and `block` is
  /// the slot + 1); returns how many. 0 for a tier without events or absent.
  std::int32_t drain_events(Tier t, std::span<BlockEvent> out) noexcept {
    TierPool* p = tier(t);
    return p ? p->drain_events(out) : 0;
  }

  /// A restarted engine's disk tier: slots[i] holds hashes[i] of layer group
  /// groups[i], read from the file's intact trailers (DiskLayout::sealed);
  /// groups empty names none (-1). A group names one of GroupTiers' groups
  /// when the tiers have them. Only before the disk tier is used
  /// (TierPool::restore's errors); changes nothing on error.
  Status restore_disk(std::span<const std::int32_t> slots, std::span<const BlockHash> hashes,
                      std::span<const std::int32_t> groups = {}) {
    if (!disk_) return Status{Errc::invalid_argument, "disk_blocks (no disk tier)", 0, 1};
    return disk_->restore(slots, hashes, groups, group_sizes_, cfg_.block_size);
  }

  /// Abandons every job in flight (the engine stopped or discarded their
  /// copies): blocks being filled go back free and unseen, pins are dropped,
  /// and their later completions are unknown_job.
  void reset() noexcept {
    jobs_.for_each([&](const Job& j) {
      if (TierPool* t = tier(j.to))
        for (std::size_t i = 0; i < j.moves.size(); ++i) t->abort_store(j.moves[i].dst, j.blocks[i].hash);
      release_sources(j);
    });
    jobs_.clear();
  }

  /// Every tier's invariants, and every pin and fill accounted for by exactly one job.
  Status check_invariants() const {
    for (const Tier t : {Tier::host, Tier::disk}) {
      const TierPool* p = tier(t);
      if (!p) continue;
      if (auto st = p->check(); !st) return st;
      std::vector<std::int32_t> holds(std::size_t(p->capacity()), 0);
      std::int32_t fills = 0;
      jobs_.for_each([&](const Job& j) {
        for (const BlockMove& m : j.moves) {
          if (j.from == t) ++holds[std::size_t(m.src)];
          if (j.to == t) ++holds[std::size_t(m.dst)], ++fills;
        }
        if (j.to == t)
          for (const std::int32_t s : j.pins) ++holds[std::size_t(s)];
      });
      for (std::int32_t s = 0; s < p->capacity(); ++s)
        if (holds[std::size_t(s)] != p->holders(s)) return Status{Errc::invariant_violated, "tier holders", s, p->holders(s)};
      if (fills != p->num_filling()) return Status{Errc::invariant_violated, "tier fills", fills, p->num_filling()};
    }
    return {};
  }

  /// Equal state: tiers, jobs, epoch (what error paths are tested against).
  friend bool operator==(const Tiers& a, const Tiers& b) {
    const auto same = [](const std::optional<TierPool>& x, const std::optional<TierPool>& y) { return x.has_value() == y.has_value() && (!x || *x == *y); };
    return same(a.host_, b.host_) && same(a.disk_, b.disk_) && a.jobs_ == b.jobs_;
  }

 private:
  using Job = TierJobs::Job;

  // plan_store(): each block's parent is parents[i], or (none given) the
  // chain's previous hash; its group groups[i], or (none given) the source tier's record.
  Result<TierJob> store(Tier from, Tier to, std::span<const BlockHash> chain, std::span<const std::int32_t> src,
                        const BlockHash& parent, std::span<const BlockHash> parents, std::span<const std::int32_t> groups) {
    if (!(from == Tier::device && to == Tier::host) && !(from == Tier::host && to == Tier::disk))
      return Status{Errc::invalid_argument, "route (stores go device to host, host to disk)", std::int64_t(from) * 3 + std::int64_t(to), 0};
    if (!has(from)) return Status{Errc::invalid_argument, "from (no such tier)", std::int64_t(from), 0};
    if (!has(to)) return Status{Errc::invalid_argument, "to (no such tier)", std::int64_t(to), 0};
    if (src.size() != chain.size()) return Status{Errc::invalid_argument, "src (one per chain block)", std::int64_t(src.size()), std::int64_t(chain.size())};
    if (auto st = jobs_.room(); !st) return st;
    std::size_t n = chain.size();
    if (from == Tier::host)  // sources must still hold their hashes
      for (std::size_t i = 0; i < n; ++i)
        if (src[i] < 0 || src[i] >= host_->capacity() || host_->find(chain[i]) != src[i]) n = i;
    return plan_into(*tier(to), from, to, chain.first(n), src.first(n), parent, parents.first(std::min(n, parents.size())),
                     groups.first(std::min(n, groups.size())));
  }
  static const TiersConfig& checked(const TiersConfig& c) {
    const auto fail = [](const char* what, std::int64_t v, std::int64_t lim) {
      throw ConfigError("kvcache::Tiers", Status{Errc::invalid_argument, what, v, lim});
    };
    if (c.host_blocks < 0) fail("host_blocks", c.host_blocks, 0);
    if (c.disk_blocks < 0) fail("disk_blocks", c.disk_blocks, 0);
    if (c.block_size < 1) fail("block_size", c.block_size, 1);
    if (c.max_jobs < 1) fail("max_jobs", c.max_jobs, 1);
    if (c.disk_blocks > 0 && c.host_blocks == 0)
      fail("disk_blocks (a disk tier needs a host tier: disk blocks reach the device through host memory)", c.disk_blocks, 0);
    return c;
  }
  static std::optional<TierPool> make_tier(Medium m, std::int32_t n, std::int32_t events) {
    return n > 0 ? std::optional<TierPool>(std::in_place, m, n, events) : std::nullopt;
  }
  TierPool* tier(Tier t) noexcept { return t == Tier::host && host_ ? &*host_ : t == Tier::disk && disk_ ? &*disk_ : nullptr; }
  const TierPool* tier(Tier t) const noexcept {
    return t == Tier::host && host_ ? &*host_ : t == Tier::disk && disk_ ? &*disk_ : nullptr;
  }
  std::int32_t block_size_of(std::int32_t group) const noexcept {
    return group >= 0 && std::size_t(group) < group_sizes_.size() ? group_sizes_[std::size_t(group)] : cfg_.block_size;
  }

  // A store or a disk-to-host load into tier t: skip what t holds or is
  // receiving, pin the sources (host or disk), all-or-nothing on t's room.
  // Each block's parent: parents[i], or (none given) the chain's previous
  // hash; its group: groups[i], or (none given) what the source tier records.
  // keep_pins (a staging load): the blocks t holds stay pinned until the job completes.
  Result<TierJob> plan_into(TierPool& t, Tier from, Tier to, std::span<const BlockHash> chain,
                            std::span<const std::int32_t> src, const BlockHash& parent, std::span<const BlockHash> parents,
                            std::span<const std::int32_t> groups, bool keep_pins = false) {
    // The blocks t already holds are pinned while the rest are allocated, so
    // the allocation cannot recycle a block this plan counts on.
    held_.clear(), state_.resize(chain.size());
    std::int32_t need = 0;  // a hash twice in the chain counts twice here and is stored once below
    for (std::size_t i = 0; i < chain.size(); ++i) {
      const std::int32_t s = t.state_of(chain[i]);  // each block's state, looked up once: its slot, or filling (-1), or new (-2)
      if (s >= 0) held_.push_back(s);
      need += s == -2;
      state_[i] = s;
    }
    scratch_.assign(held_.begin(), held_.end());
    std::sort(scratch_.begin(), scratch_.end());
    std::int32_t room = t.num_free();  // less the ready blocks about to be pinned
    for (std::size_t i = 0; i < scratch_.size(); ++i)
      room -= (i == 0 || scratch_[i] != scratch_[i - 1]) && t.holders(scratch_[i]) == 0;
    if (need > room) return Status{Errc::out_of_blocks, "n_blocks", need, room};
    for (const std::int32_t s : held_) t.pin(s);
    Job& j = jobs_.add(from, to);
    TierPool* s_tier = tier(from);
    for (std::size_t i = 0; i < chain.size(); ++i) {
      const BlockHash& h = chain[i];
      if (state_[i] != -2) continue;  // held or filling
      const std::int32_t dst = t.begin_store(h);
      if (dst < 0) continue;  // new, but listed before in this chain
      if (s_tier) s_tier->pin(src[i]);
      j.moves.push_back({src[i], dst, std::int32_t(i)});
      j.blocks.push_back({h, !parents.empty() ? parents[i] : i == 0 ? parent : chain[i - 1],
                          !groups.empty() ? groups[i] : s_tier ? s_tier->group(src[i]) : -1});
    }
    j.skipped = std::int32_t(chain.size() - j.moves.size());
    if (keep_pins) j.pins.assign(held_.begin(), held_.end());
    else
      for (auto it = held_.rbegin(); it != held_.rend(); ++it) t.unpin(*it);  // the chain's head ends most recent
    return TierJobs::view(j);
  }
  void release_sources(const Job& j) noexcept {
    if (TierPool* s = tier(j.from))
      for (auto it = j.moves.rbegin(); it != j.moves.rend(); ++it) s->unpin(it->src);  // the head ends most recent
    if (TierPool* t = tier(j.to))
      for (auto it = j.pins.rbegin(); it != j.pins.rend(); ++it) t->unpin(*it);
  }
  // The job's moves landed but those marked failed: stored blocks are published
  // (failed ones go back free), a load's failed sources are dropped from
  // their tier, pins end. Returns the leading moves that landed.
  std::int32_t finish(Job* it) {
    Job& j = *it;
    const auto n = std::int32_t(j.moves.size());
    std::int32_t lead = 0;
    while (lead < n && !jobs_.failed(std::size_t(lead))) ++lead;
    if (TierPool* t = tier(j.to))
      for (std::int32_t i = n - 1; i >= 0; --i) {  // the chain's head ends most recent in the LRU
        const BlockMove& m = j.moves[std::size_t(i)];
        const TierJobs::Moved& b = j.blocks[std::size_t(i)];
        if (jobs_.failed(std::size_t(i))) t->abort_store(m.dst, b.hash);
        else t->commit_store(m.dst, b.hash, b.parent, b.group, block_size_of(b.group));
      }
    // A block that could not be read back intact is not offered again.
    if (TierPool* s = tier(j.from); s && (j.to == Tier::device || j.from == Tier::disk))
      for (std::int32_t i = 0; i < n; ++i)
        if (jobs_.failed(std::size_t(i))) s->forget(j.moves[std::size_t(i)].src);
    release_sources(j);
    jobs_.remove(j);
    return lead;
  }

  TiersConfig cfg_;
  std::optional<TierPool> host_, disk_;
  TierJobs jobs_;  // the jobs in flight
  std::vector<std::int32_t> scratch_, held_, state_, off_src_, off_group_;
  std::vector<std::int32_t> group_sizes_;  // tokens of a block of each layer group (GroupTiers)
  std::vector<BlockHash> off_hash_, off_parent_;
};

KVCACHE_END_NAMESPACE
