// Memory tiers: the scenarios of issue #32 (pending blocks invisible, stores
// that do not fit, pins under pressure, the chain's head kept recent, partial
// device hits, hits evicted between lookup and plan, one load for two
// requests, failures, resets, a full disk tier), every error naming its value
// with nothing changed, and a randomized run in which every hash a tier
// serves points at a block that holds exactly what was stored under it.
#include <catch2/catch.hpp>

#include <kvcache/tiers/disk_layout.hpp>
#include <kvcache/tiers/tiers.hpp>

#include "tiers_harness.hpp"

#include <algorithm>
#include <optional>
#include <random>
#include <string>
#include <vector>

using namespace kvcache;

namespace {

std::vector<BlockHash> chain(std::uint64_t seed, std::int32_t n) {
  std::vector<BlockHash> c;
  for (std::int32_t i = 0; i < n; ++i) c.push_back({seed * 1000003u + std::uint64_t(i) + 1, seed});
  return c;
}
std::vector<std::int32_t> ids(std::int32_t from, std::int32_t n) {
  std::vector<std::int32_t> v;
  for (std::int32_t i = 0; i < n; ++i) v.push_back(from + i);
  return v;
}
// A disk file in memory whose slots hold 16-byte blocks (a block's bytes are
// its hash) behind their trailers: stores seal them, loads hand them back to
// complete_disk_load as they are on disk (corrupt() flips a byte of one).
struct MemDisk {
  DiskLayout d;
  std::vector<std::vector<std::byte>> slots;
  explicit MemDisk(std::int32_t n) : d(*DiskLayout::make(16, n, 7, 64)), slots(std::size_t(n), std::vector<std::byte>(std::size_t(d.slot_bytes()))) {}
  void store(Tiers& t, const Result<TierJob>& j, std::span<const BlockHash> chain) {
    REQUIRE(j.ok());
    for (const BlockMove& m : j->moves) {
      auto& im = slots[std::size_t(m.dst)];
      std::memcpy(im.data(), &chain[std::size_t(m.index)], 16);
      REQUIRE(d.seal(im, m.dst, chain[std::size_t(m.index)]).ok());
    }
    REQUIRE(t.complete(j->id).ok());
  }
  Result<std::int32_t> load(Tiers& t, const TierJob& j, std::span<const std::int32_t> failed = {}) {
    return t.complete_disk_load(j.id, d, [&](const BlockMove& m) {
      const auto& im = slots[std::size_t(m.src)];
      return LandedSlot{std::span(im).first(16), std::span(im).subspan(16)};
    }, failed);
  }
  void corrupt(std::int32_t slot, std::size_t at) { slots[std::size_t(slot)][at] ^= std::byte{0x20}; }
};
// Stores a chain from the device into host memory and completes it.
void offload(Tiers& t, const std::vector<BlockHash>& c) {
  auto j = t.plan_store(Tier::device, Tier::host, c, ids(100, std::int32_t(c.size())));
  REQUIRE(j.ok());
  REQUIRE(t.complete(j->id).ok());
}

}  // namespace

TEST_CASE("tiers: a block being stored is invisible until its store completes, and a failed one never shows") {
  Tiers t({.host_blocks = 8, .block_size = 4});
  const auto c = chain(1, 3);
  std::vector<Tier> where(8);
  auto j = t.plan_store(Tier::device, Tier::host, c, ids(10, 3));
  REQUIRE(j.ok());
  CHECK(j->moves.size() == 3);
  CHECK(j->moves[1] == BlockMove{11, j->moves[1].dst, 1});
  CHECK(t.host().num_filling() == 3);
  CHECK(t.lookup(c, 0, 100, where)->host == 0);  // filling: not found
  CHECK(t.check_invariants().ok());
  // A second store of the same chain while the first runs moves nothing.
  auto again = t.plan_store(Tier::device, Tier::host, c, ids(20, 3));
  CHECK(again->moves.empty());
  CHECK(again->skipped == 3);
  const std::vector<BlockMove> moves(j->moves.begin(), j->moves.end());  // the span lives until complete()
  const std::int32_t failed[] = {1};
  CHECK(*t.complete(j->id, failed) == 1);  // the leading move landed
  CHECK(t.host().find(c[0]) == moves[0].dst);
  CHECK(t.host().find(c[1]) == -1);  // failed: never visible
  CHECK(t.host().find(c[2]) == moves[2].dst);  // stored unchained: visible though block 1 failed
  CHECK(t.lookup(c, 0, 100, where)->host == 1);  // a lookup walks the chain: block 1 is missing
  CHECK(t.complete(again->id).ok());
  CHECK(t.complete(j->id).status().code() == Errc::unknown_job);  // exactly once
  CHECK(t.check_invariants().ok());
}

TEST_CASE("tiers: lookup walks device, then host, then disk, leaves the last token, and has no side effects") {
  Tiers t({.host_blocks = 8, .disk_blocks = 8, .block_size = 4});
  const auto c = chain(2, 6);
  offload(t, c);
  auto d = t.plan_store(Tier::host, Tier::disk, std::span(c).subspan(3), std::vector<std::int32_t>{t.host().find(c[3]), t.host().find(c[4]), t.host().find(c[5])});
  REQUIRE(d.ok());
  REQUIRE(t.complete(d->id).ok());
  // Block 4 leaves host memory (a recycle): the host copy of 0..3 and 5 stay, block 4 is on disk.
  Tiers before = t;
  std::vector<Tier> where(6);
  const auto h = t.lookup(c, 2, 25, where);  // 25 tokens: at most 6 blocks of 4
  REQUIRE(h.ok());
  CHECK(*h == TierHits{.device = 2, .host = 4, .disk = 0});
  CHECK(where[1] == Tier::device);
  CHECK(where[2] == Tier::host);
  CHECK(t == before);  // no side effects
  CHECK(t.lookup(c, 2, 24, where)->blocks() == 5);  // 24 tokens: the last one is computed, so 5 blocks at most
  CHECK(t.lookup(c, 7, 100, where).status() == Status{Errc::invalid_argument, "device_blocks", 7, 6});
  CHECK(t.lookup(c, 0, 0, where).status() == Status{Errc::invalid_argument, "prompt_tokens", 0, 1});
  const std::vector<Tier> poisoned(6, Tier::disk);
  where = poisoned;
  CHECK(t.lookup(c, 0, 100, std::span(where).first(3)).status() == Status{Errc::buffer_too_small, "where", 3, 6});
  CHECK(where == poisoned);  // an error writes nothing
  // A `where` shorter than the cap but as long as the hit is filled alike.
  const auto partial = chain(3, 6);
  offload(t, std::vector<BlockHash>(partial.begin(), partial.begin() + 3));
  CHECK(*t.lookup(partial, 1, 100, std::span(where).first(3)) == TierHits{.device = 1, .host = 2, .disk = 0});
  CHECK(where[0] == Tier::device);
  CHECK(where[1] == Tier::host);
  CHECK(where[2] == Tier::host);
}

TEST_CASE("tiers: a block missing from host memory is served from disk, and a partial device hit loads only the rest") {
  Tiers t({.host_blocks = 4, .disk_blocks = 8, .block_size = 4});
  MemDisk disk(8);
  const auto c = chain(3, 4);
  offload(t, c);
  std::vector<std::int32_t> slots;
  for (const auto& h : c) slots.push_back(t.host().find(h));
  disk.store(t, t.plan_store(Tier::host, Tier::disk, c, slots), c);
  offload(t, chain(4, 2));  // recycles chain 3's two least recent blocks: its tail (stores leave the head most recent)
  std::vector<Tier> where(4);
  const auto h = *t.lookup(c, 1, 100, where);  // the device holds block 0
  CHECK(h == TierHits{.device = 1, .host = 1, .disk = 2});
  CHECK(where[1] == Tier::host);
  CHECK(where[2] == Tier::disk);
  CHECK(where[3] == Tier::disk);
  // The engine stages the hit past the device through host memory: the disk
  // blocks are read, the one host holds is skipped and stays pinned, so the
  // staging cannot recycle it; then the whole rest loads into the device.
  auto up = t.plan_load(Tier::disk, Tier::host, std::span(c).subspan(1));
  REQUIRE(up.ok());
  CHECK(up->moves.size() == 2);
  CHECK(up->skipped == 1);
  CHECK(t.host().holders(slots[1]) == 1);  // pinned until the staging completes
  CHECK(t.host().find(c[1]) == slots[1]);
  CHECK(t.check_invariants().ok());
  REQUIRE(*disk.load(t, *up) == 2);
  CHECK(t.host().holders(slots[1]) == 0);
  auto rest = t.plan_load(Tier::host, Tier::device, std::span(c).subspan(1), ids(51, 3));
  REQUIRE(rest.ok());
  CHECK(rest->moves.size() == 3);
  CHECK(*t.complete(rest->id) == 3);
  CHECK(*t.lookup(c, 0, 100, where) == TierHits{.device = 0, .host = 3, .disk = 1});  // staging recycled block 0 (the device has it)
  CHECK(t.check_invariants().ok());
}

TEST_CASE("tiers: disk blocks between host blocks are counted, named in `where`, and onboarded in two plans (issue 62)") {
  // Before the fix the docs read TierHits as leading runs (host first, then
  // disk) and planned one host load of hit.host blocks: with host holding A
  // and C and disk only B, that loaded A and C into the places of A and B.
  Tiers t({.host_blocks = 4, .disk_blocks = 4, .block_size = 4});
  MemDisk disk(4);
  const auto c = chain(21, 3);  // A, B, C
  const std::vector<BlockHash> b{c[1]}, a_c{c[0], c[2]};
  offload(t, b);
  const std::int32_t b_slot = t.host().find(c[1]);
  disk.store(t, t.plan_store(Tier::host, Tier::disk, b, std::span(&b_slot, 1)), b);
  offload(t, chain(22, 4));  // every host block: B leaves host memory
  offload(t, a_c);
  std::vector<Tier> where(3);
  const TierHits hit = *t.lookup(c, 0, 100, where);
  CHECK(hit == TierHits{.device = 0, .host = 2, .disk = 1});
  CHECK(where == std::vector<Tier>{Tier::host, Tier::disk, Tier::host});
  // Stage: B is read from disk; A and C are skipped and pinned.
  auto stage = t.plan_load(Tier::disk, Tier::host, c);
  REQUIRE(stage.ok());
  REQUIRE(stage->moves.size() == 1);
  CHECK(stage->moves[0].index == 1);
  CHECK(stage->skipped == 2);
  REQUIRE(*disk.load(t, *stage) == 1);
  // Load: all three, each into the device block reserved for its position.
  auto load = t.plan_load(Tier::host, Tier::device, c, ids(40, 3));
  REQUIRE(load.ok());
  REQUIRE(load->moves.size() == 3);
  for (std::int32_t i = 0; i < 3; ++i) {
    CHECK(load->moves[std::size_t(i)].dst == 40 + i);
    CHECK(load->moves[std::size_t(i)].src == t.host().find(c[std::size_t(i)]));
  }
  CHECK(*t.complete(load->id) == 3);
  CHECK(t.check_invariants().ok());
}

TEST_CASE("tiers: a hit evicted between lookup and plan shortens the plan, and pinned blocks survive pressure") {
  Tiers t({.host_blocks = 4, .block_size = 4});
  const auto a = chain(5, 4);
  offload(t, a);
  std::vector<Tier> where(4);
  CHECK(t.lookup(a, 0, 100, where)->host == 4);
  offload(t, chain(6, 2));  // recycles a's two least recent blocks: 2 and 3
  auto j = t.plan_load(Tier::host, Tier::device, a, ids(0, 4));
  REQUIRE(j.ok());
  CHECK(j->moves.size() == 2);  // shortened cleanly to what is still there
  CHECK(t.host().holders(j->moves[0].src) == 1);
  // Every host block is pinned or holds chain 6; storing 3 more cannot take the pinned ones.
  const auto c = chain(7, 3);
  const Tiers before = t;
  CHECK(t.plan_store(Tier::device, Tier::host, c, ids(0, 3)).status() == Status{Errc::out_of_blocks, "n_blocks", 3, 2});
  CHECK(t == before);
  auto two = t.plan_store(Tier::device, Tier::host, std::span(c).first(2), ids(0, 2));
  REQUIRE(two.ok());  // takes chain 6's blocks
  CHECK(t.host().find(a[0]) == j->moves[0].src);
  CHECK(t.host().find(chain(6, 2)[0]) == -1);
  CHECK(t.check_invariants().ok());
  REQUIRE(t.complete(j->id).ok());
  REQUIRE(t.complete(two->id).ok());
  CHECK(t.check_invariants().ok());
}

TEST_CASE("tiers: two requests loading the same disk blocks in one step move them once") {
  Tiers t({.host_blocks = 8, .disk_blocks = 8, .block_size = 4});
  MemDisk disk(8);
  const auto c = chain(8, 3);
  offload(t, c);
  std::vector<std::int32_t> slots;
  for (const auto& h : c) slots.push_back(t.host().find(h));
  disk.store(t, t.plan_store(Tier::host, Tier::disk, c, slots), c);
  Tiers fresh({.host_blocks = 8, .disk_blocks = 8, .block_size = 4});
  // Only the disk copy remains when host memory starts over: a reset does not forget content, so model it by filling host.
  offload(t, chain(9, 8));
  std::vector<Tier> where(3);
  REQUIRE(t.lookup(c, 0, 100, where)->disk == 3);
  auto first = t.plan_load(Tier::disk, Tier::host, c);
  auto second = t.plan_load(Tier::disk, Tier::host, c);
  REQUIRE(first.ok());
  REQUIRE(second.ok());
  CHECK(first->moves.size() == 3);
  CHECK(second->moves.empty());
  CHECK(second->skipped == 3);
  CHECK(disk.load(t, *second).ok());
  CHECK(t.lookup(c, 0, 100, where)->host == 0);  // still in flight
  CHECK(*disk.load(t, *first) == 3);
  CHECK(t.lookup(c, 0, 100, where)->host == 3);
  CHECK(t.check_invariants().ok());
}

TEST_CASE("tiers: failure at block k of an onboard, a disk tier full, and a reset with jobs in flight") {
  Tiers t({.host_blocks = 6, .disk_blocks = 3, .block_size = 4});
  const auto c = chain(10, 5);
  offload(t, c);
  auto dev = t.plan_load(Tier::host, Tier::device, c, ids(30, 5));
  const std::int32_t failed[] = {3, 4};
  CHECK(*t.complete(dev->id, failed) == 3);  // the engine publishes device blocks 0 .. 2 and recomputes from 3
  CHECK(t.host().find(c[3]) == -1);  // a block that failed to load is not offered again
  CHECK(t.host().find(c[2]) >= 0);
  offload(t, c);  // the recomputed blocks are stored again
  std::vector<std::int32_t> slots;
  for (const auto& h : c) slots.push_back(t.host().find(h));
  const Tiers before = t;
  CHECK(t.plan_store(Tier::host, Tier::disk, c, slots).status() == Status{Errc::out_of_blocks, "n_blocks", 5, 3});
  CHECK(t == before);
  auto disk = t.plan_store(Tier::host, Tier::disk, std::span(c).first(3), std::span(slots).first(3));
  REQUIRE(disk.ok());
  auto load = t.plan_load(Tier::host, Tier::device, c, ids(30, 5));
  REQUIRE(load.ok());
  CHECK(t.host().holders(slots[0]) == 2);  // pinned by both jobs
  t.reset();
  CHECK(t.jobs_in_flight() == 0);
  CHECK(t.host().holders(slots[0]) == 0);
  CHECK(t.disk().num_filling() == 0);
  CHECK(t.disk().find(c[0]) == -1);  // the abandoned store never shows
  CHECK(t.complete(disk->id).status().code() == Errc::unknown_job);  // harmless
  CHECK(t.complete(load->id).status().code() == Errc::unknown_job);
  CHECK(t.host().find(c[0]) == slots[0]);  // content stays
  CHECK(t.check_invariants().ok());
}

TEST_CASE("tiers: events name each tier's medium, for stored and recycled blocks") {
  Tiers t({.host_blocks = 2, .disk_blocks = 2, .block_size = 4, .event_capacity = 16});
  const auto c = chain(12, 2);
  offload(t, c);
  std::vector<std::int32_t> slots{t.host().find(c[0]), t.host().find(c[1])};
  REQUIRE(t.complete(t.plan_store(Tier::host, Tier::disk, c, slots)->id).ok());
  offload(t, chain(13, 1));  // recycles one of chain 12's host blocks
  std::vector<BlockEvent> ev(16);
  const std::int32_t n = t.drain_events(Tier::host, ev);
  REQUIRE(n == 4);  // stored c1, c0 (tail first), removed c1, stored chain 13's block
  CHECK(ev[0].kind == EventKind::stored);
  CHECK(ev[0].hash == c[1]);
  CHECK(ev[0].parent == c[0]);
  CHECK(ev[0].medium == Medium::cpu);
  CHECK(ev[2] == BlockEvent{.kind = EventKind::removed, .block = ev[0].block, .hash = c[1], .medium = Medium::cpu});
  CHECK(t.drain_events(Tier::disk, ev) == 2);
  CHECK(ev[0].medium == Medium::disk);
  CHECK(t.drain_events(Tier::host, ev) == 0);
  CHECK(Tiers({.host_blocks = 1}).drain_events(Tier::disk, ev) == 0);
}

TEST_CASE("tiers: bad input is refused, naming the value, and changes nothing") {
  Tiers t({.host_blocks = 4, .disk_blocks = 4, .block_size = 4, .max_jobs = 1});
  const auto c = chain(11, 2);
  offload(t, c);
  const Tiers before = t;
  CHECK(t.plan_store(Tier::device, Tier::disk, c, ids(0, 2)).status().what() ==
        std::string("route (stores go device to host, host to disk)"));
  CHECK(t.plan_load(Tier::disk, Tier::device, c, ids(0, 2)).status().what() ==
        std::string("route (loads go host to device, disk to host)"));
  CHECK(t.plan_store(Tier::device, Tier::host, c, ids(0, 1)).status() ==
        Status{Errc::invalid_argument, "src (one per chain block)", 1, 2});
  CHECK(t.plan_load(Tier::host, Tier::device, c, ids(0, 3)).status() ==
        Status{Errc::invalid_argument, "dst (one device block per chain block)", 3, 2});
  CHECK(t.complete(12345).status().code() == Errc::unknown_job);
  CHECK(t == before);
  auto j = t.plan_load(Tier::host, Tier::device, c, ids(0, 2));
  REQUIRE(j.ok());
  const Tiers one = t;
  CHECK(t.plan_load(Tier::host, Tier::device, c, ids(0, 2)).status() == Status{Errc::capacity_exceeded, "max_jobs", 1, 1});
  const std::int32_t bad[] = {2};
  CHECK(t.complete(j->id, bad).status() == Status{Errc::invalid_argument, "failed (a move index)", 2, 1});
  CHECK(t == one);
  const std::int32_t twice[] = {1, 1};
  CHECK(t.complete(j->id, twice).status() == Status{Errc::invalid_argument, "failed (an index listed twice)", 1, 1});
  CHECK(t == one);
  Tiers no_disk({.host_blocks = 2});
  CHECK(no_disk.plan_load(Tier::disk, Tier::host, c).status() == Status{Errc::invalid_argument, "from (no such tier)", 2, 0});
  CHECK(no_disk.plan_store(Tier::host, Tier::disk, c, ids(0, 2)).status() == Status{Errc::invalid_argument, "to (no such tier)", 2, 0});
  CHECK_THROWS_AS(no_disk.disk(), std::bad_optional_access);  // an absent tier is never read
  CHECK_THROWS_AS(Tiers({}).host(), std::bad_optional_access);
  // An empty job's failed index names that it has none (it read "limit -1").
  auto empty = no_disk.plan_load(Tier::host, Tier::device, {}, {});
  REQUIRE(empty.ok());
  CHECK(no_disk.complete(empty->id, std::span(twice, 1)).status() == Status{Errc::invalid_argument, "failed (the job has no moves)", 1, 0});
  CHECK_THROWS_AS(Tiers({.block_size = 0}), ConfigError);
  CHECK_THROWS_AS(Tiers({.host_blocks = -1}), ConfigError);
}

TEST_CASE("tiers: a disk tier needs a host tier, and a disk load completes only through the library's verification (issue 62)") {
  // Before the fix: Tiers({.host_blocks = 0, .disk_blocks = 4}), restore_disk,
  // then plan_load(disk, host) or plan_store(host, disk): a segmentation fault.
  try {
    Tiers bad({.host_blocks = 0, .disk_blocks = 4, .block_size = 16});
    FAIL("a disk tier without a host tier was accepted");
  } catch (const ConfigError& e) {
    CHECK(std::string(e.status().what()) == "disk_blocks (a disk tier needs a host tier: disk blocks reach the device through host memory)");
  }
  // Before the fix complete() published a disk load whether or not anyone verified its bytes.
  Tiers t({.host_blocks = 4, .disk_blocks = 4, .block_size = 4});
  MemDisk disk(4);
  const auto c = chain(31, 3);
  offload(t, c);
  std::vector<std::int32_t> slots;
  for (const auto& h : c) slots.push_back(t.host().find(h));
  disk.store(t, t.plan_store(Tier::host, Tier::disk, c, slots), c);
  offload(t, chain(32, 4));  // host memory forgets c
  std::vector<Tier> where(3);
  REQUIRE(t.lookup(c, 0, 100, where)->disk == 3);
  auto stage = t.plan_load(Tier::disk, Tier::host, c);
  REQUIRE(stage.ok());
  REQUIRE(stage->moves.size() == 3);
  const Tiers staged = t;
  CHECK(t.complete(stage->id).status() == Status{Errc::invalid_argument, "job (a disk load: complete_disk_load checks its slots)",
                                                  std::int64_t(stage->id & 0xffffffffu), 0});
  CHECK(t == staged);
  // The bytes change after they were written: block 1's payload, block 2's trailer.
  disk.corrupt(stage->moves[1].src, 3);
  disk.corrupt(stage->moves[2].src, std::size_t(disk.d.slot_bytes() - 5));
  const MemDisk other(2);  // a layout with fewer slots than the tier
  CHECK(t.complete_disk_load(stage->id, other.d, [&](const BlockMove&) { return LandedSlot{}; }).status() ==
        Status{Errc::invalid_argument, "layout.num_blocks (the disk tier's slots)", 2, 4});
  CHECK(t == staged);
  CHECK(*disk.load(t, *stage) == 1);  // only block 0 is published
  CHECK(t.host().find(c[0]) >= 0);
  CHECK(t.host().find(c[1]) == -1);
  CHECK(t.host().find(c[2]) == -1);
  CHECK(t.disk().find(c[1]) == -1);  // dropped: never offered again
  CHECK(t.disk().find(c[2]) == -1);
  CHECK(t.check_invariants().ok());
  // complete_disk_load takes only disk loads.
  auto dev = t.plan_load(Tier::host, Tier::device, std::span(c).first(1), ids(0, 1));
  REQUIRE(dev.ok());
  CHECK(disk.load(t, *dev).status().what() == std::string("job (not a disk load: complete() takes it)"));
  CHECK(*t.complete(dev->id) == 1);
}

TEST_CASE("tier pool: one index for filling and ready blocks, the least recently used recycled first") {
  TierPool p(Medium::cpu, 3, 16);
  const auto c = chain(9, 5);
  const std::int32_t a = p.begin_store(c[0]);
  CHECK(p.begin_store(c[0]) == -1);  // already filling: a second store takes nothing
  CHECK(p.state_of(c[0]) == -1);
  CHECK(p.filling(c[0]));
  CHECK(p.find(c[0]) == -1);  // invisible while filling
  CHECK(p.state_of(c[1]) == -2);
  const std::int32_t b = p.begin_store(c[1]), d = p.begin_store(c[2]);
  CHECK(p.num_free() == 0);
  CHECK(p.num_filling() == 3);
  CHECK(p.holders(b) == 1);
  REQUIRE(p.check().ok());
  p.commit_store(a, c[0], {}, 1, 8);
  p.commit_store(d, c[2], c[1], -1, 4);
  p.abort_store(b, c[1]);  // free again, never visible, and taken before any ready block
  CHECK(p.state_of(c[0]) == a);
  CHECK(p.find(c[2]) == d);
  CHECK(p.find(c[1]) == -1);
  CHECK_FALSE(p.filling(c[1]));
  CHECK(p.num_free() == 3);
  CHECK(p.num_ready() == 2);
  CHECK(p.num_published() == 2);
  CHECK(p.group(a) == 1);
  CHECK(p.begin_store(c[0]) == -1);  // ready: nothing taken
  const std::int32_t plain[] = {b};
  p.touch(plain);                    // a plain block stays first in line
  CHECK(p.begin_store(c[3]) == b);   // the plain block first
  const std::int32_t touched[] = {a};
  p.touch(touched);                  // a is now the most recent: d goes first
  CHECK(p.begin_store(c[4]) == d);
  CHECK(p.find(c[2]) == -1);         // recycled: its hash left the tier
  CHECK(p.num_ready() == 1);
  p.pin(a);
  CHECK(p.num_free() == 0);
  CHECK(p.num_ready() == 0);
  p.forget(a);                       // read back wrong: dropped, still pinned
  CHECK(p.find(c[0]) == -1);
  CHECK(p.num_published() == 0);
  p.unpin(a);
  CHECK(p.num_free() == 1);
  CHECK(p.num_ready() == 0);
  REQUIRE(p.check().ok());
  BlockEvent ev[8];
  REQUIRE(p.drain_events(ev) == 4);
  CHECK((ev[0].kind == EventKind::stored && ev[0].block == a + 1 && ev[0].hash == c[0] && ev[0].group == 1 && ev[0].block_size == 8));
  CHECK((ev[0].medium == Medium::cpu && ev[0].first));
  CHECK((ev[1].kind == EventKind::stored && ev[1].hash == c[2] && ev[1].parent == c[1] && ev[1].group == -1 && ev[1].block_size == 4));
  CHECK((ev[2].kind == EventKind::removed && ev[2].block == d + 1 && ev[2].hash == c[2]));
  CHECK((ev[3].kind == EventKind::removed && ev[3].block == a + 1 && ev[3].hash == c[0] && ev[3].group == 1));
  // A tier of one block: each store recycles the last (its hash is indexed
  // before the recycled one leaves: the index has room for both).
  TierPool one(Medium::cpu, 1);
  for (std::int32_t i = 0; i < 5; ++i) {
    REQUIRE(one.begin_store(c[std::size_t(i)]) == 0);
    one.commit_store(0, c[std::size_t(i)], {});
    CHECK(one.find(c[std::size_t(i)]) == 0);
    CHECK((i == 0 || one.find(c[std::size_t(i - 1)]) == -1));
    REQUIRE(one.check().ok());
  }
}

TEST_CASE("tier pool: a restore keeps a hash listed twice in its first slot, and queues the rest free first") {
  TierPool r(Medium::disk, 4, 8);
  const auto c = chain(4, 3);
  const std::int32_t slots[] = {2, 0, 3};
  const BlockHash hashes[] = {c[0], c[1], c[0]};
  const std::int32_t groups[] = {0, 1, 1}, sizes[] = {16, 32};
  const TierPool before = r;
  CHECK(r.restore(slots, hashes, groups, std::span(sizes, 1)) == Status{Errc::invalid_argument, "groups", 1, 0});
  CHECK(r == before);
  REQUIRE(r.restore(slots, hashes, groups, sizes).ok());
  CHECK(r.find(c[0]) == 2);
  CHECK(r.find(c[1]) == 0);
  CHECK(r.num_ready() == 2);
  CHECK(r.num_published() == 2);
  CHECK(r.group(0) == 1);
  REQUIRE(r.check().ok());
  BlockEvent ev[8];
  REQUIRE(r.drain_events(ev) == 2);
  CHECK((ev[0].hash == c[0] && ev[0].block == 3 && ev[0].block_size == 16 && ev[0].medium == Medium::disk));
  CHECK((ev[1].hash == c[1] && ev[1].group == 1 && ev[1].block_size == 32));
  const TierPool restored = r;
  CHECK(r.restore(slots, hashes).code() == Errc::blocks_in_use);
  TierPool empty(Medium::disk, 4);
  REQUIRE(empty.restore({}, {}).ok());  // restoring nothing leaves it unused
  CHECK(empty.restore(std::span(slots, 1), std::span(hashes, 1)).ok());
  CHECK(empty.find(c[0]) == 2);
  CHECK(r == restored);
  // Free slots first (1, then 3: the duplicate's), then the ready ones by slot.
  CHECK(r.begin_store(c[2]) == 1);
  CHECK(r.begin_store({77, 77}) == 3);
  CHECK(r.begin_store({78, 78}) == 0);
  CHECK(r.find(c[1]) == -1);
  CHECK(r.begin_store({79, 79}) == 2);
  CHECK(r.num_free() == 0);
  REQUIRE(r.check().ok());
}

// Random plans, lookups, completions with failed moves, resets and restarts
// over two tiers, every copy modelled (tests/tiers_harness.hpp, shared with fuzz_tiers).
TEST_CASE("tiers property: every hash a tier serves points at a block holding exactly it") {
  std::mt19937_64 rng(Catch::rngSeed() ^ 0x5eedULL);
  const auto pick = [&](std::int32_t n) { return std::int32_t(rng() % std::uint64_t(n)); };
  const auto need = [](bool ok, const char* what) {
    INFO(what);
    REQUIRE(ok);
  };
  std::int64_t landed = 0, refused = 0, rejected = 0, restarts = 0;
  for (int run = 0; run < 30; ++run) {
    // Every tenth run has no host tier (and so no disk tier): every plan naming one is refused, changing nothing.
    const std::int32_t host = run % 10 == 9 ? 0 : 3 + pick(8);
    const TiersConfig cfg{.host_blocks = host, .disk_blocks = host > 0 && pick(3) ? 3 + pick(10) : 0, .block_size = 4, .max_jobs = 6};
    kvtest::TiersHarness<decltype(pick), decltype(need)> h(pick, need, cfg);
    for (int op = 0; op < 300; ++op) h.step();
    landed += h.landed, refused += h.refused, rejected += h.rejected, restarts += h.restarts;
  }
  CHECK(landed > 300);
  CHECK(refused > 10);
  CHECK(rejected > 0);  // disk slots corrupted after they were written, caught by complete_disk_load (3 to 15 a seed)
  CHECK(restarts > 3);  // disk tiers rebuilt from their files' trailers
}
