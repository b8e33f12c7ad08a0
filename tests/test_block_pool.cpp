#include <catch2/catch.hpp>

#include <kvcache/pool/block_pool.hpp>

#include <algorithm>
#include <array>
#include <random>
#include <vector>

using namespace kvcache;

namespace {
void require_ok(const BlockPool& p) {
  auto st = p.check();
  INFO(st.message());
  REQUIRE(st.ok());
}
// The call must fail with `code` naming `what`, and leave the pool as it was.
template <class F>
void require_fails_unchanged(BlockPool& p, Errc code, const char* what, F&& call) {
  const BlockPool before = p;
  const Status st = call();
  INFO(st.message());
  REQUIRE(st.code() == code);
  REQUIRE(std::string(st.what()) == what);
  REQUIRE(p == before);
}
BlockHash h(std::uint64_t v) { return BlockHash{v, v * 31}; }
}  // namespace

TEST_CASE("pool construction rejects a pool without room past the null block") {
  CHECK_THROWS_WITH(BlockPool(1), Catch::Contains("num_blocks=1"));
  CHECK_THROWS_WITH(BlockPool(-5), Catch::Contains("num_blocks=-5"));
}

TEST_CASE("allocate hands out every block but the null block, exactly once") {
  BlockPool p(9);
  std::array<BlockId, 8> out{};
  REQUIRE(p.allocate(out).ok());
  std::sort(out.begin(), out.end());
  CHECK(out == std::array<BlockId, 8>{1, 2, 3, 4, 5, 6, 7, 8});
  CHECK(p.num_free() == 0);
  CHECK(p.num_used() == 8);
  require_ok(p);
  auto none = p.allocate_one();
  CHECK(none.status().code() == Errc::out_of_blocks);
}

TEST_CASE("allocate is all or nothing") {
  BlockPool p(6);
  std::array<BlockId, 3> three{};
  REQUIRE(p.allocate(three).ok());
  std::array<BlockId, 3> more{-7, -7, -7};
  require_fails_unchanged(p, Errc::out_of_blocks, "n_blocks", [&] { return p.allocate(more); });
  CHECK(more == std::array<BlockId, 3>{-7, -7, -7});  // output untouched too
  require_ok(p);
}

TEST_CASE("retain / release: ref counts, and bad ids change nothing") {
  BlockPool p(5);
  const BlockId b = *p.allocate_one();
  REQUIRE(p.retain(b).ok());
  CHECK(p.ref_count(b) == 2);
  REQUIRE(p.release(b).ok());
  CHECK(p.num_used() == 1);
  REQUIRE(p.release(b).ok());
  CHECK(p.num_used() == 0);
  require_ok(p);
  require_fails_unchanged(p, Errc::not_allocated, "block", [&] { return p.release(b); });
  require_fails_unchanged(p, Errc::not_allocated, "block", [&] { return p.retain(b); });  // free, not cached
  require_fails_unchanged(p, Errc::invalid_argument, "block", [&] { return p.retain(BlockPool::null_block); });
  require_fails_unchanged(p, Errc::invalid_argument, "block", [&] { return p.release(5); });
  require_fails_unchanged(p, Errc::invalid_argument, "block", [&] { return p.release(-1); });
}

TEST_CASE("free-but-cached: recycled last, least recently freed first, and a hit takes it back") {
  BlockPool p(6, 32);
  std::array<BlockId, 5> b{};
  REQUIRE(p.allocate(b).ok());
  REQUIRE(*p.publish(b[0], h(10), h(0)));
  REQUIRE(*p.publish(b[1], h(11), h(10)));
  REQUIRE(p.release(b[1]).ok());  // cached, freed first
  REQUIRE(p.release(b[0]).ok());  // cached, freed second
  REQUIRE(p.release(b[2]).ok());  // plain free
  require_ok(p);
  CHECK(p.num_free() == 3);
  CHECK(p.num_cached() == 2);
  CHECK(p.lookup(h(10)) == b[0]);

  // A prefix hit takes a cached block back without allocation.
  REQUIRE(p.retain(b[0]).ok());
  CHECK(p.num_cached() == 1);
  CHECK(p.ref_count(b[0]) == 1);
  require_ok(p);

  // Allocation uses plain free blocks before cached content.
  CHECK(*p.allocate_one() == b[2]);
  CHECK(p.lookup(h(11)) == b[1]);
  // Then recycles the cached block, dropping its hash and reporting it.
  CHECK(*p.allocate_one() == b[1]);
  CHECK(p.lookup(h(11)) == -1);
  require_ok(p);

  std::array<BlockEvent, 8> ev{};
  REQUIRE(p.drain_events(ev) == 3);
  CHECK(ev[0] == BlockEvent{.kind = EventKind::stored, .block = b[0], .hash = h(10), .parent = h(0), .first = true});
  CHECK(ev[1] == BlockEvent{.kind = EventKind::stored, .block = b[1], .hash = h(11), .parent = h(10)});
  CHECK(ev[2] == BlockEvent{.kind = EventKind::removed, .block = b[1], .hash = h(11)});
}

TEST_CASE("next_recycled names the cached blocks the next allocations take, in order, and changes nothing") {
  BlockPool p(8);
  std::array<BlockId, 7> b{};
  REQUIRE(p.allocate(b).ok());
  for (std::uint64_t i = 0; i < 4; ++i) REQUIRE(*p.publish(b[i], h(20 + i), h(0)));
  REQUIRE(p.release(b[2]).ok());  // cached, least recently freed
  REQUIRE(p.release(b[5]).ok());  // plain: taken first, loses nothing
  REQUIRE(p.release(b[0]).ok());  // cached
  REQUIRE(p.release(b[3]).ok());  // cached, most recent
  const BlockPool before = p;
  std::array<BlockId, 8> out{};
  CHECK(p.next_recycled(1, out) == 0);  // the plain block
  CHECK(p.next_recycled(3, out) == 2);
  CHECK(out[0] == b[2]);
  CHECK(out[1] == b[0]);
  CHECK(p.next_recycled(100, out) == 3);
  CHECK(p.next_recycled(100, std::span(out).first(1)) == 1);
  CHECK(p == before);
  std::array<BlockId, 3> taken{};
  REQUIRE(p.allocate(taken).ok());  // what it said: b[5], then b[2] and b[0] recycled
  CHECK(taken == std::array<BlockId, 3>{b[5], b[2], b[0]});
  CHECK(p.lookup(h(22)) == -1);
  CHECK(p.lookup(h(23)) == b[3]);
}

TEST_CASE("next_recycled names the blocks a recycle drops with it: a parent's cached children lose their content too (issue 62)") {
  // Before the fix: the chain 950 -> 951 -> 952 -> 953 on blocks 1..4,
  // released 3, 1, 4, 2: next_recycled(4) named [3, 1] while allocate(4)
  // took 5, 6 and 3, which dropped 4 (chained from 3) to the front, and then 4.
  BlockPool p(7);
  std::array<BlockId, 6> b{};
  REQUIRE(p.allocate(b).ok());
  for (std::size_t i = 0; i < 4; ++i) REQUIRE(*p.publish(b[i], h(950 + i), i == 0 ? h(0) : h(950 + i - 1)));
  REQUIRE(p.release(b[4]).ok());  // plain: taken first
  REQUIRE(p.release(b[5]).ok());
  for (const std::size_t i : {2u, 0u, 3u, 1u}) REQUIRE(p.release(b[i]).ok());
  const BlockPool before = p;
  std::array<BlockId, 8> out{};
  REQUIRE(p.next_recycled(4, out) == 2);
  CHECK(out[0] == b[2]);
  CHECK(out[1] == b[3]);  // chained from b[2]: its content goes with it
  CHECK(p.next_recycled(5, out) == 4);  // then b[0], and b[1] chained from it
  CHECK(p.next_recycled(100, out) == 4);
  CHECK(std::vector<BlockId>(out.begin(), out.begin() + 4) == std::vector<BlockId>{b[2], b[3], b[0], b[1]});
  CHECK(p.next_recycled(4, std::span(out).first(1)) == 1);
  CHECK(p == before);
  std::array<BlockId, 4> taken{};
  REQUIRE(p.allocate(taken).ok());
  CHECK(taken == std::array<BlockId, 4>{b[5], b[4], b[2], b[3]});  // plain ones first (the last freed in front)
  CHECK(p.lookup(h(950)) == b[0]);  // the rest is still cached, as predicted
  CHECK(p.lookup(h(951)) == b[1]);
}

TEST_CASE("next_recycled agrees with allocate on random pools: every cached block an allocation destroys was named first") {
  std::mt19937_64 rng(Catch::rngSeed() ^ 0x4ecULL);
  for (int run = 0; run < 300; ++run) {
    BlockPool p(2 + std::int32_t(rng() % 14));
    std::vector<BlockId> used;
    std::uint64_t next_hash = 1;
    for (int op = 0; op < 40; ++op) {
      if (rng() % 3 == 0 && !used.empty()) {  // release one
        const std::size_t i = rng() % used.size();
        REQUIRE(p.release(used[i]).ok());
        used.erase(used.begin() + std::ptrdiff_t(i));
        continue;
      }
      const std::int32_t k = 1 + std::int32_t(rng() % 3);
      if (k > p.num_free()) continue;
      // Predict, then allocate: the cached blocks whose hashes vanish are exactly the named ones.
      std::vector<BlockId> named(16);
      named.resize(std::size_t(p.next_recycled(k, named)));
      std::vector<BlockId> cached_free;
      for (BlockId x = 1; x < p.capacity(); ++x)
        if (p.ref_count(x) == 0 && p.has_hash(x)) cached_free.push_back(x);
      std::vector<BlockId> fresh(static_cast<std::size_t>(k));
      REQUIRE(p.allocate(fresh).ok());
      std::vector<BlockId> lost;
      for (const BlockId x : cached_free)
        if (!p.has_hash(x)) lost.push_back(x);
      std::sort(named.begin(), named.end());
      CHECK(named == lost);
      // Publish some as chains off random cached or used parents.
      for (const BlockId x : fresh) {
        used.push_back(x);
        if (rng() % 4 == 0) continue;
        BlockHash parent = h(0);
        if (!used.empty() && rng() % 2) {
          const BlockId up = used[rng() % used.size()];
          if (up != x && p.has_hash(up)) parent = p.hash(up);
        }
        (void)p.publish(x, h(1000 + next_hash++), parent);
      }
      REQUIRE(p.check().ok());
    }
  }
}

TEST_CASE("publish is write-once, and a copy of a cached hash serves hits once the first copy goes") {
  BlockPool p(6, 8);
  const BlockId a = *p.allocate_one(), b = *p.allocate_one();
  REQUIRE(*p.publish(a, h(1), h(0)));
  auto dup = p.publish(b, h(1), h(0));
  REQUIRE(dup.ok());
  CHECK_FALSE(*dup);  // not new to the cache: no stored event
  CHECK(p.has_hash(b));
  CHECK(p.is_cached(b));
  CHECK(p.lookup(h(1)) == a);
  CHECK(p.num_published() == 1);
  CHECK(p.counters().copies == 1);
  {
    const BlockPool before = p;
    auto again = p.publish(a, h(2), h(0));
    CHECK(again.status().code() == Errc::already_hashed);
    CHECK(p == before);
  }
  // The first copy is freed while the second is held: the hash stays, served by b.
  REQUIRE(p.release(a).ok());
  CHECK_FALSE(p.has_hash(a));  // redundant while b holds the content: plain free
  CHECK(p.num_cached() == 0);
  CHECK(p.lookup(h(1)) == b);
  require_ok(p);
  {
    const BlockPool before = p;
    CHECK(p.publish(a, h(3), h(0)).status().code() == Errc::not_allocated);
    CHECK(p == before);
  }
  std::array<BlockEvent, 8> ev{};
  REQUIRE(p.drain_events(ev) == 1);  // one hash stored, none removed
  CHECK(ev[0].kind == EventKind::stored);
}

TEST_CASE("a free cached block is its hash's only copy: a new used copy replaces it") {
  BlockPool p(6, 8);
  const BlockId d = *p.allocate_one();
  REQUIRE(*p.publish(d, h(5), h(0)));
  REQUIRE(p.release(d).ok());
  CHECK(p.num_cached() == 1);
  const BlockId e = *p.allocate_one();  // a plain free block, not d
  REQUIRE(e != d);
  CHECK_FALSE(*p.publish(e, h(5), h(0)));
  CHECK(p.lookup(h(5)) == e);  // hits take the used copy: nothing leaves the free pool
  CHECK_FALSE(p.has_hash(d));
  CHECK(p.num_cached() == 0);
  require_ok(p);
}

TEST_CASE("the cache stays prefix-closed: recycling a chain's last parent drops its children") {
  BlockPool p(8, 16);
  std::array<BlockId, 3> c{};
  REQUIRE(p.allocate(c).ok());
  REQUIRE(*p.publish(c[0], h(20), h(0)));
  REQUIRE(*p.publish(c[1], h(21), h(20)));
  REQUIRE(*p.publish(c[2], h(22), h(21)));
  // The parent is freed before its children (a window dropping the front):
  // it reaches the front of the queue first.
  REQUIRE(p.release(c[0]).ok());
  REQUIRE(p.release(c[2]).ok());
  require_ok(p);
  // Take every plain free block, then one more: c[0] is recycled.
  std::vector<BlockId> plain(std::size_t(p.num_free() - p.num_cached()));
  REQUIRE(p.allocate(plain).ok());
  CHECK(*p.allocate_one() == c[0]);
  // No block stays reachable-by-hash under a missing parent.
  CHECK(p.lookup(h(20)) == -1);
  CHECK(p.lookup(h(21)) == -1);  // used by its holder, but no longer a hit
  CHECK(p.lookup(h(22)) == -1);  // free: back to plain
  CHECK_FALSE(p.has_hash(c[1]));
  CHECK_FALSE(p.has_hash(c[2]));
  CHECK(p.num_cached() == 0);
  CHECK(p.counters().recycled == 1);
  CHECK(p.counters().invalidated == 2);
  CHECK(*p.allocate_one() == c[2]);  // the invalidated free block is plain: reused first
  require_ok(p);
  std::array<BlockEvent, 8> ev{};
  REQUIRE(p.drain_events(ev) == 6);
  for (int i = 3; i < 6; ++i) CHECK(ev[std::size_t(i)].kind == EventKind::removed);
  CHECK(ev[3].hash == h(20));
}

TEST_CASE("unpublishing a parent whose content changes drops its cached children") {
  BlockPool p(6, 8);
  std::array<BlockId, 2> c{};
  REQUIRE(p.allocate(c).ok());
  REQUIRE(*p.publish(c[0], h(30), h(0)));
  REQUIRE(*p.publish(c[1], h(31), h(30)));
  REQUIRE(p.release(c[1]).ok());  // a rollback released the child, cached
  REQUIRE(p.unpublish(c[0]).ok());  // the parent is rewritten
  CHECK(p.lookup(h(31)) == -1);
  CHECK(p.num_cached() == 0);
  require_ok(p);
}

TEST_CASE("reset_prefix_cache is refused while blocks are in use") {
  BlockPool p(4, 8);
  const BlockId a = *p.allocate_one();
  REQUIRE(*p.publish(a, h(5), h(0)));
  require_fails_unchanged(p, Errc::blocks_in_use, "num_used", [&] { return p.reset_prefix_cache(); });
  REQUIRE(p.release(a).ok());
  REQUIRE(p.reset_prefix_cache().ok());
  CHECK(p.lookup(h(5)) == -1);
  CHECK(p.num_cached() == 0);
  CHECK(p.num_free() == 3);
  require_ok(p);
  std::array<BlockEvent, 4> ev{};
  REQUIRE(p.drain_events(ev) == 2);
  CHECK(ev[1].kind == EventKind::all_cleared);
}
