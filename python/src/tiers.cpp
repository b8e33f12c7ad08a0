// Memory tiers in Python: kv.Tiers (host and disk tiers, lookups, plans,
// completions), kv.TierJob (a plan's moves, copied out: they outlive the
// job), kv.WritePolicy (which device blocks to offload, and when) and
// kv.BlockPool (a cache's pool, read only: what the write policy reads),
// kv.DiskLayout (the disk file's slots: seal, verify) and the disk load's
// completion, which verifies every slot it read (Tiers.complete_disk_load),
// and kv.GroupTiers (a hybrid cache's groups in the tiers, with or without Quest: lookups, offloads,
// onboarding through an import; its .tiers is the kv.Tiers it plans with).
// Tiers are named by strings ("device", "host", "disk"); block hashes are
// uint64 arrays of [n, 2] (lo, hi), the layout of kv::BlockHash, read in place.
#include <kvcache/cache/hybrid.hpp>
#include <kvcache/eviction/block_scores.hpp>
#include <kvcache/eviction/sink_window.hpp>
#include <kvcache/selection/quest.hpp>
#include <kvcache/tiers/disk_layout.hpp>
#include <kvcache/tiers/group_tiers.hpp>
#include <kvcache/tiers/tiers.hpp>
#include <kvcache/tiers/write_policy.hpp>

#include <string>
#include <vector>

#include "bind_common.hpp"

namespace kvpy {

namespace {
static_assert(sizeof(kv::BlockHash) == 2 * sizeof(std::uint64_t));

kv::Tier tier_of(const std::string& t) {
  if (t == "device") return kv::Tier::device;
  if (t == "host") return kv::Tier::host;
  if (t == "disk") return kv::Tier::disk;
  require(false, "tier (device, host or disk)", -1, 2);
  return {};
}
const char* tier_name(kv::Tier t) {
  static const char* names[] = {"device", "host", "disk"};
  return names[std::size_t(t)];
}
// A chain of hashes: uint64 [n, 2] (or [2n]).
std::span<const kv::BlockHash> hashes_of(const Array<std::uint64_t>& a, const char* name) {
  require(a.size() % 2 == 0, name, std::int64_t(a.size()), 2);
  return {reinterpret_cast<const kv::BlockHash*>(a.data()), a.size() / 2};
}
nb::object hash_array(std::span<const kv::BlockHash> h) {
  auto out = new_array<std::uint64_t, 2>(h.size(), 2);
  std::memcpy(out.data(), h.data(), h.size_bytes());
  return nb::cast(out);
}
kv::BlockHash pair_hash(nb::handle h) {
  const auto p = nb::cast<std::pair<std::uint64_t, std::uint64_t>>(h);
  return {p.first, p.second};
}

// A plan, copied out of the tiers (TierJob::moves dies with the job).
struct Job {
  std::uint64_t id;
  kv::Tier from, to;
  nb::object moves;  // int32 [n, 3]: src, dst, index
  std::int32_t skipped;
};
Job job_of(const kv::TierJob& j) {
  auto m = new_array<std::int32_t, 2>(j.moves.size(), 3);
  static_assert(sizeof(kv::BlockMove) == 3 * sizeof(std::int32_t));
  std::memcpy(m.data(), j.moves.data(), j.moves.size_bytes());
  return {j.id, j.from, j.to, nb::cast(m), j.skipped};
}

// Offloads as the policy returns them: (blocks int32 [n], hashes uint64 [n, 2], parents uint64 [n, 2],
// groups int32 [n]: each block's layer group, -1 on a single-group cache), what Tiers.plan_store takes.
nb::object offloads(std::span<const kv::Offload> o) {
  auto blocks = new_array<std::int32_t>(o.size()), groups = new_array<std::int32_t>(o.size());
  auto hashes = new_array<std::uint64_t, 2>(o.size(), 2), parents = new_array<std::uint64_t, 2>(o.size(), 2);
  for (std::size_t i = 0; i < o.size(); ++i) {
    blocks.data()[i] = o[i].block, groups.data()[i] = o[i].group;
    hashes.data()[2 * i] = o[i].hash.lo, hashes.data()[2 * i + 1] = o[i].hash.hi;
    parents.data()[2 * i] = o[i].parent.lo, parents.data()[2 * i + 1] = o[i].parent.hi;
  }
  return nb::make_tuple(blocks, hashes, parents, groups);
}
kv::WriteMode mode_of(const std::string& m) {
  if (m == "write_through") return kv::WriteMode::write_through;
  if (m == "write_through_reused") return kv::WriteMode::write_through_reused;
  if (m == "write_back") return kv::WriteMode::write_back;
  require(false, "mode (write_through, write_through_reused, write_back)", -1, 2);
  return {};
}
// kv.GroupTiers over one compiled hybrid cache (kvcache.GroupTiers picks the
// class by the cache's: GroupTiers or GroupTiers_Quest).
template <class Hybrid>
void bind_group_tiers(nb::module_& m, const char* name) {
  using GroupTiers = kv::GroupTiers<Hybrid>;
  nb::class_<GroupTiers>(m, name)
      .def(
          "__init__",
          [](GroupTiers* self, Hybrid& cache, std::int32_t host_blocks, std::int32_t disk_blocks, std::int32_t max_jobs,
             std::int32_t event_capacity) {
            try {
              new (self) GroupTiers(cache, {.host_blocks = host_blocks, .disk_blocks = disk_blocks, .max_jobs = max_jobs,
                                            .event_capacity = event_capacity});
            } catch (const kv::ConfigError& e) {
              check(e.status());
            }
          },
          nb::arg("cache"), nb::arg("host_blocks") = 0, nb::arg("disk_blocks") = 0, nb::arg("max_jobs") = 1024,
          nb::arg("event_capacity") = 0, nb::keep_alive<1, 2>())  // the cache lives while the tiers do
      .def_prop_ro("tiers", [](GroupTiers& g) -> kv::Tiers& { return g.tiers(); }, nb::rv_policy::reference_internal)
      .def(
          "lookup",
          [](GroupTiers& g, nb::handle prompt, std::uint64_t salt, std::uint64_t extra) {
            Array<std::int32_t> p;
            in_arg(p, prompt, "prompt");
            const kv::GroupTierHits h = check(g.lookup(cspan(p), {salt, extra}));
            return std::make_tuple(h.device_tokens, h.tokens, h.host, h.disk);
          },
          nb::arg("prompt"), nb::arg("salt") = 0, nb::arg("extra") = 0)
      .def(
          "plan_offload",
          [](GroupTiers& g, std::uint64_t seq, nb::handle tokens, std::uint64_t salt, std::uint64_t extra) {
            Array<std::int32_t> t;
            in_arg(t, tokens, "tokens");
            return job_of(check(g.plan_offload(unpack(seq), cspan(t), {salt, extra})));
          },
          nb::arg("seq"), nb::arg("tokens"), nb::arg("salt") = 0, nb::arg("extra") = 0)
      .def("plan_stage", [](GroupTiers& g, std::uint64_t import) { return job_of(check(g.plan_stage(import))); }, nb::arg("import_id"))
      .def("plan_onboard", [](GroupTiers& g, std::uint64_t import) { return job_of(check(g.plan_onboard(import))); },
           nb::arg("import_id"))
      .def(
          "complete_onboard",
          [](GroupTiers& g, std::uint64_t job, nb::handle failed) {
            Array<std::int32_t> f;
            if (!failed.is_none()) in_arg(f, failed, "failed");
            const kv::OnboardResult r = check(g.complete_onboard(job, cspan(f)));
            return std::make_tuple(pack(r.seq), r.committed, r.tokens);
          },
          nb::arg("job"), nb::arg("failed") = nb::none());
}
}  // namespace

void register_tiers(nb::module_& m) {
  nb::class_<kv::BlockPool>(m, "BlockPool")
      .def_prop_ro("capacity", &kv::BlockPool::capacity)
      .def_prop_ro("num_free", &kv::BlockPool::num_free)
      .def_prop_ro("num_cached", &kv::BlockPool::num_cached)
      .def_prop_ro("num_used", &kv::BlockPool::num_used)
      .def("ref_count",
           [](const kv::BlockPool& p, std::int32_t b) {
             require(b >= 0 && b < p.capacity(), "block", b, p.capacity() - 1);
             return p.ref_count(b);
           })
      .def("hash",
           [](const kv::BlockPool& p, std::int32_t b) -> nb::object {
             require(b >= 0 && b < p.capacity(), "block", b, p.capacity() - 1);
             if (!p.has_hash(b)) return nb::none();
             return nb::cast(std::make_pair(p.hash(b).lo, p.hash(b).hi));
           })
      .def("group",
           [](const kv::BlockPool& p, std::int32_t b) -> nb::object {
             require(b >= 0 && b < p.capacity(), "block", b, p.capacity() - 1);
             if (!p.has_hash(b)) return nb::none();
             return nb::cast(p.group(b));
           })
      .def("next_recycled", [](const kv::BlockPool& p, std::int32_t allocations) {
        require(allocations >= 0, "allocations", allocations, 0);
        std::vector<kv::BlockId> out(std::size_t(std::min(allocations, p.capacity())));
        out.resize(std::size_t(p.next_recycled(allocations, out)));
        return out;
      });

  nb::class_<Job>(m, "TierJob")
      .def_ro("id", &Job::id)
      .def_prop_ro("from_tier", [](const Job& j) { return tier_name(j.from); })
      .def_prop_ro("to_tier", [](const Job& j) { return tier_name(j.to); })
      .def_ro("moves", &Job::moves)
      .def_ro("skipped", &Job::skipped);

  nb::class_<kv::Tiers>(m, "Tiers")
      .def(
          "__init__",
          [](kv::Tiers* self, std::int32_t host_blocks, std::int32_t disk_blocks, std::int32_t block_size, std::int32_t max_jobs,
             std::int32_t event_capacity) {
            try {
              new (self) kv::Tiers({.host_blocks = host_blocks, .disk_blocks = disk_blocks, .block_size = block_size,
                                    .max_jobs = max_jobs, .event_capacity = event_capacity});
            } catch (const kv::ConfigError& e) {
              check(e.status());
            }
          },
          nb::arg("host_blocks") = 0, nb::arg("disk_blocks") = 0, nb::arg("block_size") = 16, nb::arg("max_jobs") = 1024,
          nb::arg("event_capacity") = 0)
      .def("has", [](const kv::Tiers& t, const std::string& tier) { return t.has(tier_of(tier)); })
      .def_prop_ro("jobs_in_flight", &kv::Tiers::jobs_in_flight)
      .def_prop_ro("epoch", &kv::Tiers::epoch)
      .def("counts",
           [](const kv::Tiers& t, const std::string& tier) {
             const kv::Tier w = tier_of(tier);
             require(w != kv::Tier::device && t.has(w), "tier (host or disk, present)", std::int64_t(w), 2);
             const kv::TierPool& p = w == kv::Tier::host ? t.host() : t.disk();
             nb::dict d;
             d["capacity"] = p.capacity(), d["free"] = p.num_free(), d["ready"] = p.num_ready();
             d["filling"] = p.num_filling(), d["published"] = p.num_published();
             return d;
           })
      .def(
          "lookup",
          [](const kv::Tiers& t, nb::handle chain, std::int32_t device_blocks, std::int64_t prompt_tokens) {
            Array<std::uint64_t> c;
            in_arg(c, chain, "chain");
            const auto h = hashes_of(c, "chain");
            std::vector<kv::Tier> where(h.size());
            const auto hit = check(t.lookup(h, device_blocks, prompt_tokens, where));
            std::vector<std::string> names;
            for (std::int32_t i = 0; i < hit.blocks(); ++i) names.emplace_back(tier_name(where[std::size_t(i)]));
            return std::make_tuple(hit.device, hit.host, hit.disk, names);
          },
          nb::arg("chain"), nb::arg("device_blocks"), nb::arg("prompt_tokens"))
      .def(
          "plan_store",
          [](kv::Tiers& t, const std::string& from, const std::string& to, nb::handle chain, nb::handle src, nb::handle parents,
             nb::handle groups) {
            Array<std::uint64_t> c, pa;
            Array<std::int32_t> s, gr;
            in_arg(c, chain, "chain");
            in_arg(s, src, "src");
            const auto h = hashes_of(c, "chain");
            if (parents.is_none() && groups.is_none()) return job_of(check(t.plan_store(tier_of(from), tier_of(to), h, cspan(s))));
            std::span<const kv::BlockHash> ps;
            if (!parents.is_none()) {
              in_arg(pa, parents, "parents");
              ps = hashes_of(pa, "parents");
              require(ps.size() == h.size(), "parents (one per chain block)", std::int64_t(ps.size()), std::int64_t(h.size()));
            }
            if (!groups.is_none()) {
              in_arg(gr, groups, "groups");
              require(gr.size() == h.size(), "groups (one per chain block)", std::int64_t(gr.size()), std::int64_t(h.size()));
            }
            require(s.size() == h.size(), "src (one per chain block)", std::int64_t(s.size()), std::int64_t(h.size()));
            // Without parents each block's parent is the chain's previous hash, as plan_store(chain, src) gives it.
            std::vector<kv::Offload> o(h.size());
            for (std::size_t i = 0; i < h.size(); ++i)
              o[i] = {s.data()[i], h[i], !ps.empty() ? ps[i] : i > 0 ? h[i - 1] : kv::BlockHash{}, gr.size() ? gr.data()[i] : -1};
            return job_of(check(t.plan_store(tier_of(from), tier_of(to), o)));
          },
          nb::arg("from_tier"), nb::arg("to_tier"), nb::arg("chain"), nb::arg("src"), nb::arg("parents") = nb::none(),
          nb::arg("groups") = nb::none())
      .def(
          "plan_load",
          [](kv::Tiers& t, const std::string& from, const std::string& to, nb::handle chain, nb::handle dst) {
            Array<std::uint64_t> c;
            Array<std::int32_t> d;
            in_arg(c, chain, "chain");
            if (!dst.is_none()) in_arg(d, dst, "dst");
            return job_of(check(t.plan_load(tier_of(from), tier_of(to), hashes_of(c, "chain"), cspan(d))));
          },
          nb::arg("from_tier"), nb::arg("to_tier"), nb::arg("chain"), nb::arg("dst") = nb::none())
      .def(
          "complete",
          [](kv::Tiers& t, std::uint64_t id, nb::handle failed) {
            Array<std::int32_t> f;
            if (!failed.is_none()) in_arg(f, failed, "failed");
            return check(t.complete(id, cspan(f)));
          },
          nb::arg("job"), nb::arg("failed") = nb::none())
      .def(
          "complete_disk_load",
          [](kv::Tiers& t, const Job& job, const kv::DiskLayout& layout, nb::handle blocks, nb::handle tails, nb::handle failed) {
            // blocks [moves, block_bytes]: each move's block as it landed in host memory; tails [moves, tail_bytes or 64].
            Array<std::uint8_t> b, tl;
            Array<std::int32_t> f;
            in_arg(b, blocks, "blocks");
            in_arg(tl, tails, "tails");
            if (!failed.is_none()) in_arg(f, failed, "failed");
            const auto moves = std::size_t(nb::len(job.moves));
            const std::size_t bw = moves ? b.size() / moves : 0, tw = moves ? tl.size() / moves : 0;
            require(b.size() == moves * bw && std::int64_t(bw) >= layout.block_bytes(), "blocks (one row of block_bytes per move)",
                    std::int64_t(b.size()), std::int64_t(moves) * layout.block_bytes());
            require(tl.size() == moves * tw, "tails (one row per move)", std::int64_t(tl.size()), std::int64_t(moves));
            // Row k of blocks and tails is move k of the plan; a move's chain index names its row (one move per index).
            const auto mv = nb::cast<Numpy<std::int32_t, 2>>(job.moves);
            std::vector<std::size_t> row;
            for (std::size_t k = 0; k < moves; ++k) {
              const auto index = std::size_t(mv.data()[3 * k + 2]);
              if (row.size() <= index) row.resize(index + 1, 0);
              row[index] = k;
            }
            return check(t.complete_disk_load(job.id, layout, [&](const kv::BlockMove& m) {
              const std::size_t k = row[std::size_t(m.index)];
              return kv::LandedSlot{std::as_bytes(std::span(b.data() + k * bw, bw)), std::as_bytes(std::span(tl.data() + k * tw, tw))};
            }, cspan(f)));
          },
          nb::arg("job"), nb::arg("layout"), nb::arg("blocks"), nb::arg("tails"), nb::arg("failed") = nb::none())
      .def("reset", &kv::Tiers::reset)
      .def(
          "drain_events",
          [](kv::Tiers& t, const std::string& tier, std::int32_t max_events) {
            std::vector<kv::BlockEvent> ev(std::size_t(std::max(max_events, 0)));
            const auto n = t.drain_events(tier_of(tier), ev);
            nb::list out;
            for (std::int32_t i = 0; i < n; ++i) {
              const auto& e = ev[std::size_t(i)];
              nb::dict d;
              d["kind"] = e.kind == kv::EventKind::stored ? "stored" : e.kind == kv::EventKind::removed ? "removed" : "all_cleared";
              d["slot"] = e.block - 1, d["hash"] = std::make_pair(e.hash.lo, e.hash.hi);
              d["parent"] = std::make_pair(e.parent.lo, e.parent.hi);
              d["medium"] = e.medium == kv::Medium::cpu ? "cpu" : e.medium == kv::Medium::disk ? "disk" : "gpu";
              d["group"] = e.group, d["block_size"] = e.block_size;
              out.append(d);
            }
            return out;
          },
          nb::arg("tier"), nb::arg("max_events") = 1024)
      .def(
          "restore_disk",
          [](kv::Tiers& t, nb::handle slots, nb::handle hashes, nb::handle groups) {
            Array<std::int32_t> s, g;
            Array<std::uint64_t> h;
            in_arg(s, slots, "slots");
            in_arg(h, hashes, "hashes");
            if (!groups.is_none()) in_arg(g, groups, "groups");
            check(t.restore_disk(cspan(s), hashes_of(h, "hashes"), groups.is_none() ? std::span<const std::int32_t>{} : cspan(g)));
          },
          nb::arg("slots"), nb::arg("hashes"), nb::arg("groups") = nb::none())
      .def(
          "group",
          [](const kv::Tiers& t, const std::string& tier, std::int32_t slot) {
            const kv::Tier which = tier_of(tier);
            if (which == kv::Tier::device || !t.has(which))
              check(kv::Status{kv::Errc::invalid_argument, "tier (host or disk, present)", std::int64_t(which), 0});
            const kv::TierPool& p = which == kv::Tier::host ? t.host() : t.disk();
            if (slot < 0 || slot >= p.capacity()) check(kv::Status{kv::Errc::invalid_argument, "slot", slot, p.capacity() - 1});
            return p.group(slot);
          },
          nb::arg("tier"), nb::arg("slot"))
      .def("check_invariants", [](const kv::Tiers& t) { check(t.check_invariants()); });

  bind_group_tiers<kv::HybridCache<>>(m, "GroupTiers");
  bind_group_tiers<kv::HybridCache<kv::FastBlockHasher, kv::QuestSelection>>(m, "GroupTiers_Quest");
  bind_group_tiers<kv::HybridCache<kv::FastBlockHasher, kv::SelectAll, kv::SinkWindowEviction>>(m, "GroupTiers_SinkWindow");
  bind_group_tiers<kv::HybridCache<kv::FastBlockHasher, kv::SelectAll, kv::BlockScoreEviction>>(m, "GroupTiers_BlockScores");
  bind_group_tiers<kv::HybridCache<kv::FastBlockHasher, kv::QuestSelection, kv::SinkWindowEviction>>(m, "GroupTiers_Quest_SinkWindow");
  bind_group_tiers<kv::HybridCache<kv::FastBlockHasher, kv::QuestSelection, kv::BlockScoreEviction>>(m, "GroupTiers_Quest_BlockScores");

  nb::class_<kv::DiskLayout>(m, "DiskLayout")
      .def(
          "__init__",
          [](kv::DiskLayout* self, std::int64_t block_bytes, std::int32_t num_blocks, std::uint64_t digest, std::int64_t align) {
            new (self) kv::DiskLayout(check(kv::DiskLayout::make(block_bytes, num_blocks, digest, align)));
          },
          nb::arg("block_bytes"), nb::arg("num_blocks"), nb::arg("digest"), nb::arg("align") = 4096)
      .def_prop_ro("block_bytes", &kv::DiskLayout::block_bytes)
      .def_prop_ro("slot_bytes", &kv::DiskLayout::slot_bytes)
      .def_prop_ro("tail_bytes", &kv::DiskLayout::tail_bytes)
      .def_prop_ro("num_blocks", &kv::DiskLayout::num_blocks)
      .def_prop_ro("file_bytes", &kv::DiskLayout::file_bytes)
      .def_prop_ro("digest", &kv::DiskLayout::digest)
      .def("offset", &kv::DiskLayout::offset, nb::arg("slot"))
      .def(
          "seal_tail",
          [](const kv::DiskLayout& d, nb::handle block, std::int32_t slot, std::pair<std::uint64_t, std::uint64_t> hash,
             std::int32_t group) {
            Array<std::uint8_t> b;
            in_arg(b, block, "block");
            auto tail = new_array<std::uint8_t>(std::size_t(d.tail_bytes()));
            check(d.seal_tail(std::as_bytes(b.span()), std::as_writable_bytes(std::span(tail.data(), tail.size())), slot,
                              {hash.first, hash.second}, group));
            return tail;
          },
          nb::arg("block"), nb::arg("slot"), nb::arg("hash"), nb::arg("group") = -1)
      .def(
          "sealed",
          [](const kv::DiskLayout& d, nb::handle tail, std::int32_t slot) {
            Array<std::uint8_t> t;
            in_arg(t, tail, "tail");
            const kv::SealedBlock s = check(d.sealed(std::as_bytes(t.span()), slot));
            return std::make_pair(std::make_pair(s.hash.lo, s.hash.hi), s.group);
          },
          nb::arg("tail"), nb::arg("slot"))
      .def(
          "verify",
          [](const kv::DiskLayout& d, nb::handle block, nb::handle tail, std::int32_t slot, std::pair<std::uint64_t, std::uint64_t> hash) {
            Array<std::uint8_t> b, t;
            in_arg(b, block, "block");
            in_arg(t, tail, "tail");
            check(d.verify(std::as_bytes(b.span()), std::as_bytes(t.span()), slot, {hash.first, hash.second}));
          },
          nb::arg("block"), nb::arg("tail"), nb::arg("slot"), nb::arg("hash"));
  m.def("layout_digest", [](const kv::Geometry& g) { return kv::layout_digest(g.spec()); }, nb::arg("geometry"));

  nb::class_<kv::WritePolicy>(m, "WritePolicy")
      .def(
          "__init__",
          [](kv::WritePolicy* self, const std::string& mode, std::int32_t min_uses, std::int32_t counters) {
            try {
              new (self) kv::WritePolicy({.mode = mode_of(mode), .min_uses = min_uses, .counters = counters});
            } catch (const kv::ConfigError& e) {
              check(e.status());
            }
          },
          nb::arg("mode") = "write_back", nb::arg("min_uses") = 2, nb::arg("counters") = 1 << 16)
      .def(
          "on_stored",
          [](const kv::WritePolicy& p, const nb::list& events) {
            std::vector<kv::BlockEvent> ev;
            for (nb::handle e : events) {
              const auto kind = nb::cast<std::string>(e["kind"]);
              kv::BlockEvent b{.kind = kind == "stored" ? kv::EventKind::stored : kind == "removed" ? kv::EventKind::removed
                                                                                                     : kv::EventKind::all_cleared};
              if (b.kind == kv::EventKind::stored)
                b.block = nb::cast<std::int32_t>(e["block"]), b.hash = pair_hash(e["hash"]), b.parent = pair_hash(e["parent"]);
              if (nb::isinstance<nb::dict>(e) && nb::cast<nb::dict>(e).contains("group")) b.group = nb::cast<std::int32_t>(e["group"]);
              ev.push_back(b);
            }
            std::vector<kv::Offload> out(ev.size());
            out.resize(std::size_t(check(p.on_stored(ev, out))));
            return offloads(out);
          },
          nb::arg("events"))
      .def(
          "on_use",
          [](kv::WritePolicy& p, const kv::BlockPool& pool, nb::handle blocks) {
            Array<std::int32_t> b;
            in_arg(b, blocks, "blocks");
            std::vector<kv::Offload> out(b.size());
            out.resize(std::size_t(check(p.on_use(pool, cspan(b), out))));
            return offloads(out);
          },
          nb::arg("pool"), nb::arg("blocks"))
      .def(
          "before_allocate",
          [](kv::WritePolicy& p, const kv::BlockPool& pool, std::int32_t allocations) {
            std::vector<kv::Offload> out(std::size_t(std::clamp(allocations, 0, pool.capacity())));
            out.resize(std::size_t(p.before_allocate(pool, allocations, out)));
            return offloads(out);
          },
          nb::arg("pool"), nb::arg("allocations"))
      .def("uses", [](const kv::WritePolicy& p, nb::handle h) { return p.uses(pair_hash(h)); });
}

}  // namespace kvpy
