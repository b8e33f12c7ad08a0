// Device-side holds (pool/block_holds.hpp): a request finished or aborted while a
// transfer copies its blocks keeps them allocated until the job completes,
// on Cache<> and on HybridCache, with the tiers' jobs; every error names its
// value and changes nothing. The randomized runs (cache_property.hpp,
// hybrid_harness.hpp) hold and release as well.
#include <catch2/catch.hpp>

#include <kvcache/cache.hpp>
#include <kvcache/cache/hybrid.hpp>
#include <kvcache/tiers/tiers.hpp>

#include <vector>

#include "device_cache_testing.hpp"

using namespace kvcache;
using kvtest::add_published;
using kvtest::blocks_of;
using kvtest::prompt;

TEST_CASE("holds: a request finishing while its offload runs keeps its blocks until the job completes") {
  Cache<> cache(kvtest::device_config());
  Tiers tiers({.host_blocks = 8, .block_size = 4});
  const auto toks = prompt(16);
  const SeqId s = add_published(cache, toks);
  const auto blocks = blocks_of(cache, s);  // 4 full blocks, published
  std::vector<BlockHash> chain;
  for (const BlockId b : blocks) chain.push_back(cache.pool().hash(b));

  auto job = tiers.plan_store(Tier::device, Tier::host, chain, blocks);
  REQUIRE(job.ok());
  const auto hold = cache.hold(blocks);
  REQUIRE(hold.ok());
  REQUIRE(cache.free(s).ok());  // the request finished; the copy is still on the stream
  CHECK(cache.check_invariants().ok());
  CHECK(cache.free_blocks() == 4);  // 8 usable blocks, 4 held

  // Pressure: a new request takes every free block; none of the held ones.
  const SeqId t = *cache.add_sequence();
  std::vector<std::int32_t> slots(16);
  REQUIRE(cache.reserve(t, 16, slots).ok());
  for (const std::int32_t slot : slots) CHECK(std::find(blocks.begin(), blocks.end(), slot / 4) == blocks.end());
  std::vector<std::int32_t> more(1);
  CHECK(cache.reserve(t, 1, more).status().code() == Errc::out_of_blocks);

  REQUIRE(tiers.complete(job->id).ok());
  REQUIRE(cache.release_hold(*hold).ok());  // the copy is done: the blocks go back, still cached
  CHECK(cache.holds().size() == 0);
  CHECK(cache.check_invariants().ok());
  CHECK(cache.free_blocks() == 4);
  std::vector<BlockId> hit(8);
  CHECK(cache.match_prefix(toks, {}, hit) == 3);  // the last token is always computed
  std::vector<Tier> where(4);
  CHECK(tiers.lookup(chain, 0, 17, where)->host == 4);
}

TEST_CASE("holds: an onboard into an aborted request's blocks keeps them until it completes, then they come back empty") {
  Cache<> cache(kvtest::device_config());
  Tiers tiers({.host_blocks = 8, .block_size = 4});
  std::vector<BlockHash> chain{{11, 1}, {12, 1}, {13, 1}};
  auto store = tiers.plan_store(Tier::device, Tier::host, chain, std::vector<std::int32_t>{1, 2, 3});
  REQUIRE(tiers.complete(store->id).ok());

  const SeqId s = *cache.add_sequence();
  std::vector<std::int32_t> slots(12);
  REQUIRE(cache.reserve(s, 12, slots).ok());
  const auto blocks = blocks_of(cache, s);
  auto load = tiers.plan_load(Tier::host, Tier::device, chain, blocks);
  REQUIRE(load.ok());
  const auto hold = cache.hold(blocks);
  REQUIRE(cache.free(s).ok());  // aborted: the DMA into its blocks still runs
  CHECK(cache.free_blocks() == 5);
  const Cache<> before = cache;
  CHECK(cache.release_hold(*hold + 1).code() == Errc::unknown_job);  // a hold never given
  CHECK(cache == before);

  REQUIRE(tiers.complete(load->id).ok());
  REQUIRE(cache.release_hold(*hold).ok());
  CHECK(cache.free_blocks() == 8);
  CHECK(cache.prefix_stats().hashes == 0);  // never published: nothing to hit
  CHECK(cache.release_hold(*hold).code() == Errc::unknown_job);  // exactly once
  CHECK(cache.check_invariants().ok());
}

TEST_CASE("holds: a held tail block is copied on write, so a live row never writes into a hold") {
  Cache<> cache(kvtest::device_config());
  const SeqId s = *cache.add_sequence();
  std::vector<std::int32_t> slots(6);
  REQUIRE(cache.reserve(s, 6, slots).ok());  // block 2 of 4 tokens holds 2
  const auto blocks = blocks_of(cache, s);
  const auto hold = cache.hold(std::span(blocks).last(1));
  REQUIRE(hold.ok());
  std::vector<std::int32_t> one(1);
  const auto r = cache.reserve(s, 1, one);
  REQUIRE(r.ok());
  CHECK(r->copy.src == blocks.back());  // the engine copies the tail first
  CHECK(one[0] / 4 == r->copy.dst);
  CHECK(cache.holds().blocks() == 1);
  CHECK(cache.check_invariants().ok());
}

TEST_CASE("holds: bad blocks are refused, naming the block, and nothing changes") {
  Cache<> cache(kvtest::device_config());
  const SeqId s = add_published(cache, prompt(8));
  const auto blocks = blocks_of(cache, s);
  const Cache<> before = cache;
  const std::vector<BlockId> with_null{blocks[0], BlockPool::null_block};
  auto r = cache.hold(with_null);
  CHECK(r.status().code() == Errc::invalid_argument);
  CHECK(r.status().message().find("block") != std::string::npos);
  const std::vector<BlockId> past{blocks[0], 9};
  CHECK(cache.hold(past).status().code() == Errc::invalid_argument);
  const std::vector<BlockId> free_one{blocks[0], 5};  // never allocated: nothing to keep
  CHECK(cache.hold(free_one).status().code() == Errc::not_allocated);
  CHECK(cache == before);

  // A free but cached block may be held: it leaves the LRU, still a hit.
  REQUIRE(cache.free(s).ok());
  const auto h = cache.hold(blocks);
  REQUIRE(h.ok());
  CHECK(cache.free_blocks() == 6);
  CHECK(cache.check_invariants().ok());
  REQUIRE(cache.release_hold(*h).ok());
  CHECK(cache.free_blocks() == 8);
}

TEST_CASE("holds: room is taken at construction, past it the store grows, and out-of-order releases keep each hold's blocks") {
  Cache<> cache(kvtest::device_config());  // 4 sequences, 9 blocks: room for 8 holds of 18 block references
  CHECK(cache.holds().room_holds() == 8);
  CHECK(cache.holds().room_blocks() == 18);
  const SeqId s = add_published(cache, prompt(16));
  const auto blocks = blocks_of(cache, s);  // 4 blocks
  std::vector<std::uint64_t> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(*cache.hold(blocks));  // 16 references
  for (int i = 0; i < 4; ++i) ids.push_back(*cache.hold(std::span(blocks).first(std::size_t(i % 2))));  // 8 holds, 18 references
  CHECK(cache.holds().room_holds() == 8);  // within the room: nothing grew
  CHECK(cache.holds().room_blocks() == 18);
  for (int i = 0; i < 3; ++i) ids.push_back(*cache.hold(blocks));  // a shared prefix held past the room
  CHECK(cache.holds().size() == 11);
  CHECK(cache.holds().blocks() == 30);
  CHECK(cache.holds().room_holds() >= 11);
  CHECK(cache.holds().room_blocks() >= 30);
  CHECK(cache.pool().ref_count(blocks[0]) == 1 + 4 + 2 + 3);  // the row, and one per hold that has it
  CHECK(cache.check_invariants().ok());

  // Released out of order, the others keep their own blocks (they move down in the store).
  REQUIRE(cache.release_hold(ids[1]).ok());
  REQUIRE(cache.release_hold(ids[5]).ok());
  CHECK(cache.holds().size() == 9);
  CHECK(cache.holds().blocks() == 25);
  for (const std::size_t k : {0, 2, 3, 8, 9, 10})
    CHECK(std::vector<BlockId>(cache.holds().blocks_of(ids[k]).begin(), cache.holds().blocks_of(ids[k]).end()) == blocks);
  CHECK(cache.holds().blocks_of(ids[7]).size() == 1);
  CHECK(cache.holds().blocks_of(ids[4]).empty());
  CHECK(cache.holds().blocks_of(ids[1]).empty());
  CHECK(cache.release_hold(ids[1]).code() == Errc::unknown_job);
  CHECK(cache.check_invariants().ok());
  REQUIRE(cache.free(s).ok());
  for (const std::uint64_t id : ids)
    if (id != ids[1] && id != ids[5]) REQUIRE(cache.release_hold(id).ok());
  CHECK(cache.holds().size() == 0);
  CHECK(cache.free_blocks() == 8);  // every block back, the published ones still cached
  CHECK(cache.check_invariants().ok());
}

TEST_CASE("holds: a hybrid cache keeps a freed sequence's blocks of every group until the hold ends") {
  using kvcache::AttentionKind;
  const std::vector<std::int32_t> l0{0}, l1{1};
  const LayerGroupSpec g[] = {{.kind = AttentionKind::full, .layers = l0, .num_kv_heads = 1, .head_dim = 8},
                              {.kind = AttentionKind::sliding_window, .layers = l1, .num_kv_heads = 1, .head_dim = 8, .window = 8}};
  HybridCache<> cache({.groups = *LayerGroups::make({.groups = g, .block_size = 4}), .num_blocks = 13, .max_sequences = 2, .max_tokens = 32});
  const auto toks = prompt(16);
  std::vector<std::int32_t> slots(32);
  const auto a = cache.admit(toks, slots);
  REQUIRE(a.ok());
  REQUIRE(cache.computed(a->seq, 16).ok());
  std::vector<BlockId> blocks;
  for (std::int32_t grp = 0; grp < 2; ++grp) {
    std::vector<std::int32_t> row(8);
    const SeqId one[] = {a->seq};
    REQUIRE(cache.export_block_table(grp, one, row, 8).ok());
    for (const std::int32_t b : row)
      if (b != BlockPool::null_block) blocks.push_back(b);
  }
  const auto hold = cache.hold(blocks);
  REQUIRE(hold.ok());
  REQUIRE(cache.free(a->seq).ok());
  CHECK(cache.check_invariants().ok());
  CHECK(cache.free_blocks() == 12 - std::int32_t(blocks.size()));
  const HybridCache<> before = cache;
  CHECK(cache.release_hold(*hold + 7).code() == Errc::unknown_job);
  const std::vector<BlockId> bad{13};
  CHECK(cache.hold(bad).status().code() == Errc::invalid_argument);
  CHECK(cache == before);
  REQUIRE(cache.release_hold(*hold).ok());
  CHECK(cache.free_blocks() == 12);
  CHECK(cache.match(toks) == 12);  // the full blocks are still cached (the last token is computed)
  CHECK(cache.check_invariants().ok());
}
