// Write policies (tiers/write_policy.hpp) over a real device cache and the
// tiers: write-through offloads what the device publishes, with its events'
// parents; write-through filtered by reuse waits for min_uses hits;
// write-back names exactly the blocks the next allocations recycle. Bad
// settings and short buffers are refused, naming the value, changing nothing.
#include <catch2/catch.hpp>

#include <kvcache/cache.hpp>
#include <kvcache/tiers/tiers.hpp>
#include <kvcache/tiers/write_policy.hpp>

#include <string>
#include <vector>

#include "device_cache_testing.hpp"

using namespace kvcache;
using kvtest::add_published;
using kvtest::prompt;

TEST_CASE("write policy: write-through offloads every published block, naming the parents the device's events named") {
  Cache<> cache(kvtest::device_config(9, 64));
  Tiers tiers({.host_blocks = 16, .block_size = 4, .event_capacity = 16});
  WritePolicy policy({.mode = WriteMode::write_through});
  const SeqId s = add_published(cache, prompt(12));
  std::vector<BlockEvent> ev(16);
  ev.resize(std::size_t(cache.drain_events(ev)));
  REQUIRE(ev.size() == 3);
  std::vector<Offload> out(3);
  CHECK(policy.on_stored(ev, std::span(out).first(2)).status().code() == Errc::buffer_too_small);
  const auto n = policy.on_stored(ev, out);
  REQUIRE(n.ok());
  REQUIRE(*n == 3);
  const auto blocks = *cache.table().blocks(s);
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(out[i].block == blocks[i]);
    CHECK(out[i].hash == cache.pool().hash(blocks[i]));
    CHECK(out[i].parent == ev[i].parent);
  }
  auto job = tiers.plan_store(Tier::device, Tier::host, out);
  REQUIRE(job.ok());
  CHECK(job->moves.size() == 3);
  CHECK(job->moves[1].src == blocks[1]);
  REQUIRE(tiers.complete(job->id).ok());
  std::vector<BlockEvent> host_ev(16);
  REQUIRE(tiers.drain_events(Tier::host, host_ev) == 3);
  for (std::size_t i = 0; i < 3; ++i) {  // the host tier names the same chain links (stored tail first)
    const BlockEvent& e = host_ev[2 - i];
    CHECK(e.hash == ev[i].hash);
    CHECK(e.parent == ev[i].parent);
    CHECK(e.medium == Medium::cpu);
  }
  // The other policies ignore publications.
  CHECK(*WritePolicy({.mode = WriteMode::write_back}).on_stored(ev, out) == 0);
  CHECK(*WritePolicy({.mode = WriteMode::write_through_reused}).on_stored(ev, out) == 0);
}

TEST_CASE("write policy: write-through filtered by reuse offloads a block once min_uses prompts used it") {
  Cache<> cache(kvtest::device_config(9, 64));
  Tiers tiers({.host_blocks = 16, .block_size = 4});
  WritePolicy policy({.mode = WriteMode::write_through_reused, .min_uses = 2});
  const auto toks = prompt(12);
  (void)add_published(cache, toks);
  std::vector<BlockId> hit(8);
  const auto h = std::int32_t(cache.match_prefix(toks, {}, hit));  // 2: the last token is computed
  REQUIRE(h == 2);
  const auto blocks = std::span(hit).first(std::size_t(h));
  std::vector<Offload> out(2);
  CHECK(*policy.on_use(cache.pool(), blocks, out) == 0);  // one hit: not yet
  CHECK(policy.uses(cache.pool().hash(blocks[0])) == 1);
  CHECK(policy.on_use(cache.pool(), blocks, std::span(out).first(1)).status().code() == Errc::buffer_too_small);
  const BlockId bad[] = {blocks[0], 0};
  CHECK(policy.on_use(cache.pool(), bad, out).status() == Status{Errc::invalid_argument, "blocks", 0, 8});
  CHECK(policy.uses(cache.pool().hash(blocks[0])) == 1);  // the refused calls counted nothing
  REQUIRE(*policy.on_use(cache.pool(), blocks, out) == 2);
  CHECK(out[0].block == blocks[0]);
  CHECK(out[1].parent == cache.pool().hash(blocks[0]));
  auto job = tiers.plan_store(Tier::device, Tier::host, out);
  REQUIRE(job.ok());
  CHECK(job->moves.size() == 2);
  REQUIRE(tiers.complete(job->id).ok());
  // A third hit lists them again; the store skips what host memory holds.
  REQUIRE(*policy.on_use(cache.pool(), blocks, out) == 2);
  auto again = tiers.plan_store(Tier::device, Tier::host, out);
  REQUIRE(again.ok());
  CHECK(again->moves.empty());
  CHECK(again->skipped == 2);
  REQUIRE(tiers.complete(again->id).ok());
}

TEST_CASE("write policy: write-back names the cached blocks the next allocations recycle, before they do") {
  Cache<> cache(kvtest::device_config(9, 64));
  Tiers tiers({.host_blocks = 16, .block_size = 4});
  WritePolicy policy({.mode = WriteMode::write_back});
  const auto toks = prompt(16);
  const SeqId s = add_published(cache, toks);
  const auto blocks = std::vector<BlockId>(cache.table().blocks(s)->begin(), cache.table().blocks(s)->end());
  REQUIRE(cache.free(s).ok());  // 4 cached blocks in the LRU, after 4 plain free ones
  std::vector<Offload> out(8);
  CHECK(policy.before_allocate(cache.pool(), 4, out) == 0);  // the plain free blocks go first
  const Cache<> before = cache;
  const auto n = policy.before_allocate(cache.pool(), 6, out);
  CHECK(cache == before);
  REQUIRE(n == 2);
  CHECK(out[0].block == blocks[3]);  // freed tail first: the tail is least recent
  CHECK(out[1].block == blocks[2]);
  auto job = tiers.plan_store(Tier::device, Tier::host, std::span(out).first(2));
  REQUIRE(job.ok());
  // The step allocates; the copies ran first on its stream.
  const SeqId t = *cache.add_sequence();
  std::vector<std::int32_t> slots(24);
  REQUIRE(cache.reserve(t, 24, slots).ok());
  REQUIRE(tiers.complete(job->id).ok());
  CHECK(cache.pool().lookup(out[0].hash) < 0);  // recycled on the device...
  std::vector<Tier> where(4);
  std::vector<BlockHash> chain;
  for (std::size_t i = 0; i < 4; ++i) chain.push_back(before.pool().hash(blocks[i]));
  CHECK(tiers.lookup(chain, 2, 17, where)->host == 2);  // ...and served from host memory
  CHECK(*WritePolicy({.mode = WriteMode::write_through}).on_use(cache.pool(), blocks, out) == 0);
  CHECK(WritePolicy({.mode = WriteMode::write_through}).before_allocate(cache.pool(), 8, out) == 0);
}

TEST_CASE("write policy: bad settings are refused, naming the field") {
  const auto refuses = [](const WritePolicyConfig& c, const char* field) {
    try {
      WritePolicy p(c);
      FAIL("accepted " << field);
    } catch (const ConfigError& e) {
      CHECK(std::string(e.what()).find(field) != std::string::npos);
    }
  };
  refuses({.mode = WriteMode(7)}, "mode");
  refuses({.mode = WriteMode::write_through_reused, .min_uses = 0}, "min_uses");
  refuses({.mode = WriteMode::write_through_reused, .counters = 1000}, "counters");
  refuses({.mode = WriteMode::write_through_reused, .counters = 0}, "counters");
}

TEST_CASE("hash_chain names a prompt's blocks as the device cache publishes them, the chain every tier looks up") {
  Cache<> cache(kvtest::device_config(9, 64));
  const auto toks = prompt(14);
  const PrefixKey key{.salt = 5, .extra = 9};
  const ExtraKey image[] = {{.begin = 5, .end = 7, .key = 77}};
  const SeqId s = *cache.add_sequence();
  std::vector<std::int32_t> slots(toks.size());
  REQUIRE(cache.reserve(s, std::int32_t(toks.size()), slots).ok());
  // publish() hashes under the sequence's key: add_sequence() without a prompt has the empty one.
  REQUIRE(cache.publish(s, toks, image).ok());
  std::vector<BlockHash> chain(8);
  REQUIRE(cache.hash_chain(toks, {}, chain, image) == 3);  // full blocks only
  const auto blocks = *cache.table().blocks(s);
  for (std::size_t i = 0; i < 3; ++i) CHECK(chain[i] == cache.pool().hash(blocks[i]));
  std::vector<BlockHash> other(8);
  REQUIRE(cache.hash_chain(toks, key, other, image) == 3);
  CHECK(other[0] != chain[0]);  // another tenant's chain never names these blocks
  REQUIRE(cache.hash_chain(toks, {}, other) == 3);
  CHECK(other[0] == chain[0]);  // the image enters only the blocks it overlaps: block 1
  CHECK(other[1] != chain[1]);
  CHECK(cache.hash_chain(toks, {}, std::span(other).first(2)) == 2);
  CHECK(hash_chain(FastBlockHasher{}, toks, 0, {}, other) == 0);
}
