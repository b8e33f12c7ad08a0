// A randomized harness for Tiers, shared by the tiers property test (a
// seeded generator, Catch's REQUIRE) and the fuzzer (its bytes, abort):
// random store and load plans over chains that share prefixes, lookups,
// completions with random failed moves in any order, resets, and restarts
// (host memory lost, the disk tier restored from the file's trailers). Every copy
// is modelled: a plan's target blocks hold garbage from the plan on (the
// engine writes them), a landed move gets its source's content, a failed one
// stays garbage. A host block's bytes are its hash; a disk slot is a real
// slot image (DiskLayout: those bytes, then the sealed trailer), and now and
// then one is corrupted on disk after it was written: the disk load that
// reads it must not publish it (complete_disk_load verifies every slot).
// After every call the invariants hold, a failed call changed nothing, a
// lookup changed nothing, every block a job reads still holds its hash when
// the copy runs, and every hash a tier finds sits in a block holding exactly
// it (on disk: a slot that verifies, unless corrupted since). pick(n) gives a
// value in [0, n); need(ok, what) fails the run when ok is false.
#pragma once

#include <kvcache/tiers/disk_layout.hpp>
#include <kvcache/tiers/tiers.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <vector>

namespace kvtest {

template <class Pick, class Need>
class TiersHarness {
 public:
  TiersHarness(Pick pick, Need need, const kvcache::TiersConfig& cfg)
      : pick_(pick), need_(need), t_(cfg),
        host_(std::size_t(cfg.host_blocks), garbage()),
        layout_(*kvcache::DiskLayout::make(sizeof(kvcache::BlockHash), std::max(cfg.disk_blocks, 1), 0x6a, 64)),
        disk_(std::size_t(cfg.disk_blocks), std::vector<std::byte>(std::size_t(layout_.slot_bytes()), std::byte{0xbd})),
        corrupt_(std::size_t(cfg.disk_blocks), 0) {}
  std::int64_t landed = 0, refused = 0, rejected = 0, restarts = 0;

  void step() {
    using kvcache::Tier;
    const kvcache::Tiers before = t_;
    const auto c = chain(std::uint64_t(pick(6)), 1 + pick(5));
    std::optional<kvcache::Result<kvcache::TierJob>> r;
    switch (pick(9)) {
      case 0: case 1: r = t_.plan_store(Tier::device, Tier::host, c, device_ids(c.size())); break;
      case 2: {
        std::vector<std::int32_t> src;
        for (const auto& h : c) src.push_back(t_.has(Tier::host) ? t_.host().find(h) : -1);
        r = t_.plan_store(Tier::host, Tier::disk, c, src);
        break;
      }
      case 3: r = t_.plan_load(Tier::host, Tier::device, c, device_ids(c.size())); break;
      case 4: case 6: r = t_.plan_load(Tier::disk, Tier::host, c); break;
      case 5: {
        std::vector<Tier> where(c.size());
        need(t_.lookup(c, 0, 1000, where).ok(), "lookup");
        need(t_ == before, "a lookup changed the tiers");
        if (!disk_.empty() && pick(2) == 0) {  // a byte of a stored slot changes on disk, behind the tiers' back
          const auto s = std::size_t(pick(std::int32_t(disk_.size())));
          if (t_.disk().find(t_.disk().hash(std::int32_t(s))) == std::int32_t(s)) corrupt(s);
        }
        break;
      }
      default: finish_one(); break;
    }
    if (r) {
      if (r->ok()) {
        jobs_.push_back({**r, {(*r)->moves.begin(), (*r)->moves.end()}, c});
        for (const kvcache::BlockMove& m : (*r)->moves) spoil((*r)->to, m.dst);
        if ((*r)->from == Tier::disk && !(*r)->moves.empty() && pick(2) == 0)  // the slot it will read goes bad first
          corrupt(std::size_t((*r)->moves[std::size_t(pick(std::int32_t((*r)->moves.size())))].src));
      } else {
        ++refused;
        need(t_ == before, "a failed plan changed the tiers");
      }
    }
    if (const kvcache::Status st = t_.check_invariants(); !st) need(false, st.message().c_str());
    for (const Tier x : {Tier::host, Tier::disk}) {
      if (!t_.has(x)) continue;
      const kvcache::TierPool& pool = x == Tier::host ? t_.host() : t_.disk();
      for (std::int32_t s = 0; s < pool.capacity(); ++s)
        if (pool.find(pool.hash(s)) == s) need(holds(x, s, pool.hash(s)), "a tier serves a block not holding its hash");
    }
  }

 private:
  struct Planned {  // a job's moves copied: its span ends with complete() or reset()
    kvcache::TierJob job;
    std::vector<kvcache::BlockMove> moves;
    std::vector<kvcache::BlockHash> chain;
  };
  static kvcache::BlockHash garbage() { return {0xbad, 0xbad}; }
  static std::vector<kvcache::BlockHash> chain(std::uint64_t seed, std::int32_t n) {
    std::vector<kvcache::BlockHash> c;
    for (std::int32_t i = 0; i < n; ++i) c.push_back({seed * 1000003u + std::uint64_t(i) + 1, seed});
    return c;
  }
  static std::vector<std::int32_t> device_ids(std::size_t n) {
    std::vector<std::int32_t> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = std::int32_t(i);
    return v;
  }
  std::int32_t pick(std::int32_t n) { return pick_(n); }
  void need(bool ok, const char* what) { need_(ok, what); }
  // One bit of disk slot s flips: in the block's bytes or in its trailer.
  void corrupt(std::size_t s) {
    const std::int32_t payload = std::int32_t(sizeof(kvcache::BlockHash)), trailer = std::int32_t(kvcache::DiskLayout::trailer_bytes);
    const std::int32_t at = pick(2) == 0 ? pick(payload) : std::int32_t(disk_[s].size()) - 1 - pick(trailer);
    disk_[s][std::size_t(at)] ^= std::byte{0x08};
    corrupt_[s] = 1;
  }
  // A plan's target block holds garbage until its copy lands.
  void spoil(kvcache::Tier x, std::int32_t b) {
    if (x == kvcache::Tier::host) host_[std::size_t(b)] = garbage();
    if (x == kvcache::Tier::disk) std::fill(disk_[std::size_t(b)].begin(), disk_[std::size_t(b)].end(), std::byte{0xbd}), corrupt_[std::size_t(b)] = 0;
  }
  // Block b of tier x holds h: host, its bytes; disk, a slot that verifies (or one corrupted since it was written).
  bool holds(kvcache::Tier x, std::int32_t b, const kvcache::BlockHash& h) const {
    if (x == kvcache::Tier::host) return host_[std::size_t(b)] == h;
    return corrupt_[std::size_t(b)] || layout_.verify(disk_[std::size_t(b)], b, h).ok();
  }
  // What block b of tier x holds, read (a disk slot's payload, whatever its trailer says).
  kvcache::BlockHash read(kvcache::Tier x, std::int32_t b) const {
    if (x == kvcache::Tier::host) return host_[std::size_t(b)];
    kvcache::BlockHash h;
    std::memcpy(&h, disk_[std::size_t(b)].data(), sizeof h);
    return h;
  }

  // Completes a job in flight (its copies first, some moves failing), or now and then resets.
  void finish_one() {
    using kvcache::Tier;
    if (jobs_.empty()) {
      need(t_.complete(12345).status().code() == kvcache::Errc::unknown_job, "complete of an unknown job");
      return;
    }
    if (pick(10) == 0) {
      t_.reset();
      for (const Planned& p : jobs_)  // abandoned copies may have written anything
        for (const kvcache::BlockMove& m : p.moves) spoil(p.job.to, m.dst);
      for (const Planned& p : jobs_) need(t_.complete(p.job.id).status().code() == kvcache::Errc::unknown_job, "a job from before a reset completed");
      jobs_.clear();
      if (t_.has(Tier::disk) && pick(4) == 0) restart();
      return;
    }
    const std::size_t k = std::size_t(pick(std::int32_t(jobs_.size())));
    const Planned p = jobs_[k];
    jobs_.erase(jobs_.begin() + std::ptrdiff_t(k));
    std::vector<std::int32_t> failed;
    for (std::size_t m = 0; m < p.moves.size(); ++m)
      if (pick(4) == 0) failed.push_back(std::int32_t(m));
    std::int32_t lead_want = std::int32_t(p.moves.size());
    std::vector<char> intact(p.moves.size(), 1);  // a disk slot read back verifies
    for (std::size_t m = 0; m < p.moves.size(); ++m) {  // the engine's copies
      const kvcache::BlockMove& mv = p.moves[m];
      const kvcache::BlockHash want = p.chain[std::size_t(mv.index)];
      const kvcache::BlockHash src = p.job.from == Tier::device ? want : read(p.job.from, mv.src);
      if (p.job.from == Tier::disk) intact[m] = layout_.verify(disk_[std::size_t(mv.src)], mv.src, want).ok();
      need(src == want || (p.job.from == Tier::disk && corrupt_[std::size_t(mv.src)]), "a pinned source lost what the plan read");
      const bool bad = std::find(failed.begin(), failed.end(), std::int32_t(m)) != failed.end();
      if (bad || !intact[m]) lead_want = std::min(lead_want, std::int32_t(m));
      if (p.job.to == Tier::host) host_[std::size_t(mv.dst)] = bad ? garbage() : src;  // a corrupt read lands corrupt
      if (p.job.to == Tier::disk && !bad) {  // the engine seals what it writes
        std::memcpy(disk_[std::size_t(mv.dst)].data(), &src, sizeof src);
        need(layout_.seal(disk_[std::size_t(mv.dst)], mv.dst, want, t_.host().group(mv.src)).ok(), "seal");
      }
      landed += !bad;
    }
    kvcache::Result<std::int32_t> lead = std::int32_t(0);
    if (p.job.from == Tier::disk) {
      need(t_.complete(p.job.id).status().code() == kvcache::Errc::invalid_argument, "complete() of a disk load");
      lead = t_.complete_disk_load(p.job.id, layout_, [&](const kvcache::BlockMove& mv) {
        return kvcache::LandedSlot{std::as_bytes(std::span(&host_[std::size_t(mv.dst)], 1)),
                                   std::span(disk_[std::size_t(mv.src)]).subspan(sizeof(kvcache::BlockHash))};
      }, failed);
    } else {
      lead = t_.complete(p.job.id, failed);
    }
    need(lead.ok(), "complete");
    need(*lead == lead_want, "complete's leading moves");
    for (std::size_t m = 0; m < p.moves.size(); ++m)
      if (!intact[m]) {
        ++rejected;
        need(t_.disk().find(p.chain[std::size_t(p.moves[m].index)]) != p.moves[m].src, "a slot that failed verification is still offered");
      }
    need(t_.complete(p.job.id).status().code() == kvcache::Errc::unknown_job, "a second complete");
  }

  // The engine restarts: host memory is lost, the disk file stays. New tiers
  // restore the disk tier from every slot whose trailer is intact (its hash
  // and group as sealed); step()'s checks then hold each restored block to
  // the slot it names (a slot corrupted in its bytes since is restored, and
  // its load must fail verification).
  void restart() {
    std::vector<std::int32_t> slots, groups;
    std::vector<kvcache::BlockHash> hashes;
    for (std::int32_t s = 0; s < std::int32_t(disk_.size()); ++s)
      if (const auto b = layout_.sealed(disk_[std::size_t(s)], s)) slots.push_back(s), hashes.push_back(b->hash), groups.push_back(b->group);
    kvcache::Tiers fresh(t_.config());
    need(fresh.restore_disk(slots, hashes, groups).ok(), "restore_disk");
    for (std::size_t i = 0; i < slots.size(); ++i)
      need(fresh.disk().find(hashes[i]) >= 0 && fresh.disk().group(slots[i]) == groups[i], "a restored slot is not found");
    t_ = fresh;
    std::fill(host_.begin(), host_.end(), garbage());
    ++restarts;
  }

  Pick pick_;
  Need need_;
  kvcache::Tiers t_;
  std::vector<kvcache::BlockHash> host_;  // each host block's bytes: the hash it holds
  kvcache::DiskLayout layout_;
  std::vector<std::vector<std::byte>> disk_;  // each disk slot's image
  std::vector<char> corrupt_;  // a slot changed on disk since it was written
  std::vector<Planned> jobs_;
};

}  // namespace kvtest
