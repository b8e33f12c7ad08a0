#include <catch2/catch.hpp>

#include <kvcache/block_pool.hpp>

#include <algorithm>
#include <array>
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
  CHECK(ev[0] == BlockEvent{EventKind::stored, b[0], h(10), h(0)});
  CHECK(ev[1] == BlockEvent{EventKind::stored, b[1], h(11), h(10)});
  CHECK(ev[2] == BlockEvent{EventKind::removed, b[1], h(11), {}});
}

TEST_CASE("publish is write-once, a duplicate hash keeps the first block") {
  BlockPool p(5, 8);
  const BlockId a = *p.allocate_one(), b = *p.allocate_one();
  REQUIRE(*p.publish(a, h(1), h(0)));
  auto dup = p.publish(b, h(1), h(0));
  REQUIRE(dup.ok());
  CHECK_FALSE(*dup);
  CHECK(p.has_hash(b));
  CHECK_FALSE(p.is_cached(b));
  CHECK(p.lookup(h(1)) == a);
  {
    const BlockPool before = p;
    auto again = p.publish(a, h(2), h(0));
    CHECK(again.status().code() == Errc::already_hashed);
    CHECK(p == before);
  }
  REQUIRE(p.release(b).ok());  // a freed duplicate holds nothing worth caching
  CHECK_FALSE(p.has_hash(b));
  CHECK(p.num_cached() == 0);
  require_ok(p);
  {
    const BlockPool before = p;
    CHECK(p.publish(b, h(3), h(0)).status().code() == Errc::not_allocated);
    CHECK(p == before);
  }
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
