// The memory-tiers page's snippet (docs/tiers.md), run in a fixture that
// supplies the engine's names (a prompt's block hashes, its device blocks,
// copies as the engine would make them), then checked against what it promises.
#include <catch2/catch.hpp>

#include <kvcache/cache.hpp>
#include <kvcache/tiers/tiers.hpp>

#include <algorithm>

#include <cstdint>
#include <span>
#include <vector>

namespace kv = kvcache;
using std::int32_t;
using std::int64_t;

namespace {
struct TiersPage {
  std::vector<kv::BlockHash> hashes;
  std::vector<int32_t> device_blocks, new_blocks;
  int64_t prompt_tokens = 8 * 16 + 5;
  std::vector<std::uint64_t> device = std::vector<std::uint64_t>(64), host = std::vector<std::uint64_t>(4096);
  TiersPage() {
    for (int32_t i = 0; i < 8; ++i) {
      hashes.push_back({std::uint64_t(1000 + i), 7});
      device_blocks.push_back(1 + i);
      new_blocks.push_back(20 + i);
      device[std::size_t(1 + i)] = 0xabc0 + std::uint64_t(i);  // a block's content
    }
  }
  void copy_to_host(int32_t src, int32_t dst) { host[std::size_t(dst)] = device[std::size_t(src)]; }
  void copy_to_device(int32_t src, int32_t dst) { device[std::size_t(dst)] = host[std::size_t(src)]; }
};
}  // namespace

TEST_CASE_METHOD(TiersPage, "docs tiers: a finished request's blocks offloaded to host memory and onboarded on the next turn") {
#include "snippets/tiers.inc"
  CHECK(hit == kv::TierHits{.device = 0, .host = 8, .disk = 0});
  CHECK(landed == 8);
  for (int32_t i = 0; i < 8; ++i) CHECK(device[std::size_t(20 + i)] == 0xabc0 + std::uint64_t(i));
  CHECK(tiers.jobs_in_flight() == 0);
  CHECK(tiers.check_invariants().ok());
}

namespace {
// The write-back page: a device cache whose pool is full of cached blocks, a
// host tier, and a request whose offload is still running when it ends.
struct WriteBackPage {
  kv::Cache<> cache{{.geometry = *kv::Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = 8, .block_size = 4}),
                     .num_blocks = 9, .max_sequences = 4, .max_blocks_per_sequence = 8}};
  kv::Tiers tiers{{.host_blocks = 32, .block_size = 4}};
  std::int32_t need = 2;  // the pool's free blocks are all cached: both allocations recycle one
  std::vector<kv::BlockHash> chain = std::vector<kv::BlockHash>(4);
  std::vector<kv::BlockId> blocks;
  std::vector<kv::BlockHash> host_has = std::vector<kv::BlockHash>(32);
  kv::SeqId seq{};
  WriteBackPage() {
    std::vector<int32_t> toks(16), slots(16);
    for (int32_t i = 0; i < 16; ++i) toks[std::size_t(i)] = 1 + i;
    const kv::SeqId old = *cache.add_sequence();
    REQUIRE(cache.reserve(old, 16, slots).ok());
    REQUIRE(cache.publish(old, toks).ok());
    REQUIRE(cache.free(old).ok());  // 4 cached blocks behind 4 plain free ones
    seq = *cache.add_sequence();
    for (auto& t : toks) t += 100;
    REQUIRE(cache.reserve(seq, 16, slots).ok());  // takes the 4 plain ones
    REQUIRE(cache.publish(seq, toks).ok());
    REQUIRE(cache.hash_chain(toks, {}, chain) == 4);
    const auto row = *cache.table().blocks(seq);
    blocks.assign(row.begin(), row.end());
  }
  void copy_to_host(int32_t src, int32_t dst) { host_has[std::size_t(dst)] = cache.pool().hash(src); }
};
}  // namespace

TEST_CASE_METHOD(WriteBackPage, "docs tiers: write-back offloads what the next allocations recycle, and a hold outlives its request") {
#include "snippets/write_back.inc"
  REQUIRE(out.size() == 2);  // the two least recent cached blocks, now in host memory
  for (const kv::Offload& o : out) {
    CHECK(cache.pool().hash(o.block) == o.hash);
    CHECK(std::find(host_has.begin(), host_has.end(), o.hash) != host_has.end());
  }
  CHECK(cache.holds().size() == 0);
  CHECK(cache.free_blocks() == 8);  // the ended request's blocks came back with the hold's release
  std::vector<kv::Tier> where(4);
  CHECK(tiers.lookup(chain, 0, 17, where)->host == 4);
  for (std::size_t i = 0; i < 4; ++i) CHECK(std::find(host_has.begin(), host_has.end(), chain[i]) != host_has.end());
  CHECK(cache.check_invariants().ok());
  CHECK(tiers.check_invariants().ok());
}
