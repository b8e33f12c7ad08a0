// A randomized harness for Tiers, shared by the tiers property test (a
// seeded generator, Catch's REQUIRE) and the fuzzer (its bytes, abort):
// random store and load plans over chains that share prefixes, lookups,
// completions with random failed moves in any order, and resets. Every copy
// is modelled: a plan's target blocks hold garbage from the plan on (the
// engine writes them), a landed move gets its source's content, a failed one
// stays garbage. After every call the invariants hold, a failed call changed
// nothing, a lookup changed nothing, every block a job reads still holds its
// hash when the copy runs, and every hash a tier finds sits in a block
// holding exactly it. pick(n) gives a value in [0, n); need(ok, what) fails
// the run when ok is false.
#pragma once

#include <kvcache/tiers/tiers.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace kvtest {

template <class Pick, class Need>
class TiersHarness {
 public:
  TiersHarness(Pick pick, Need need, const kvcache::TiersConfig& cfg)
      : pick_(pick), need_(need), t_(cfg),
        host_(std::size_t(cfg.host_blocks), garbage()), disk_(std::size_t(cfg.disk_blocks), garbage()) {}
  std::int64_t landed = 0, refused = 0;

  void step() {
    using kvcache::Tier;
    const kvcache::Tiers before = t_;
    const auto c = chain(std::uint64_t(pick(6)), 1 + pick(5));
    std::optional<kvcache::Result<kvcache::TierJob>> r;
    switch (pick(7)) {
      case 0: case 1: r = t_.plan_store(Tier::device, Tier::host, c, device_ids(c.size())); break;
      case 2: {
        std::vector<std::int32_t> src;
        for (const auto& h : c) src.push_back(t_.has(Tier::host) ? t_.host().find(h) : -1);
        r = t_.plan_store(Tier::host, Tier::disk, c, src);
        break;
      }
      case 3: r = t_.plan_load(Tier::host, Tier::device, c, device_ids(c.size())); break;
      case 4: r = t_.plan_load(Tier::disk, Tier::host, c); break;
      case 5: {
        std::vector<Tier> where(c.size());
        need(t_.lookup(c, 0, 1000, where).ok(), "lookup");
        need(t_ == before, "a lookup changed the tiers");
        break;
      }
      default: finish_one(); break;
    }
    if (r) {
      if (r->ok()) {
        jobs_.push_back({**r, {(*r)->moves.begin(), (*r)->moves.end()}, c});
        if ((*r)->to != Tier::device)
          for (const kvcache::BlockMove& m : (*r)->moves) content((*r)->to)[std::size_t(m.dst)] = garbage();
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
        if (pool.find(pool.hash(s)) == s) need(content(x)[std::size_t(s)] == pool.hash(s), "a tier serves a block not holding its hash");
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
  std::vector<kvcache::BlockHash>& content(kvcache::Tier x) { return x == kvcache::Tier::host ? host_ : disk_; }

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
        if (p.job.to != Tier::device)
          for (const kvcache::BlockMove& m : p.moves) content(p.job.to)[std::size_t(m.dst)] = garbage();
      for (const Planned& p : jobs_) need(t_.complete(p.job.id).status().code() == kvcache::Errc::unknown_job, "a job from before a reset completed");
      jobs_.clear();
      return;
    }
    const std::size_t k = std::size_t(pick(std::int32_t(jobs_.size())));
    const Planned p = jobs_[k];
    jobs_.erase(jobs_.begin() + std::ptrdiff_t(k));
    std::vector<std::int32_t> failed;
    for (std::size_t m = 0; m < p.moves.size(); ++m)
      if (pick(4) == 0) failed.push_back(std::int32_t(m));
    for (std::size_t m = 0; m < p.moves.size(); ++m) {  // the engine's copies
      const kvcache::BlockMove& mv = p.moves[m];
      const kvcache::BlockHash want = p.chain[std::size_t(mv.index)];
      const kvcache::BlockHash src = p.job.from == Tier::device ? want : content(p.job.from)[std::size_t(mv.src)];
      need(src == want, "a pinned source lost what the plan read");
      const bool bad = std::find(failed.begin(), failed.end(), std::int32_t(m)) != failed.end();
      if (p.job.to != Tier::device) content(p.job.to)[std::size_t(mv.dst)] = bad ? garbage() : src;
      landed += !bad;
    }
    const auto lead = t_.complete(p.job.id, failed);
    need(lead.ok(), "complete");
    need(*lead == (failed.empty() ? std::int32_t(p.moves.size()) : failed.front()), "complete's leading moves");
    need(t_.complete(p.job.id).status().code() == kvcache::Errc::unknown_job, "a second complete");
  }

  Pick pick_;
  Need need_;
  kvcache::Tiers t_;
  std::vector<kvcache::BlockHash> host_, disk_;
  std::vector<Planned> jobs_;
};

}  // namespace kvtest
