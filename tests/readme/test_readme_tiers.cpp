// The memory-tiers page's snippet (docs/tiers.md), run in a fixture that
// supplies the engine's names (a prompt's block hashes, its device blocks,
// copies as the engine would make them), then checked against what it promises.
#include <catch2/catch.hpp>

#include <kvcache/cache.hpp>
#include <kvcache/tiers/disk_layout.hpp>
#include <kvcache/tiers/tiers.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <vector>

namespace kv = kvcache;
using std::int32_t;
using std::int64_t;

namespace {
// The engine of the tiers page: a block is 8 bytes (a uint64 of content), host
// memory holds whole blocks, the disk file is sparse (slot images by slot).
struct TiersPage {
  kv::GeometrySpec spec{.num_layers = 1, .num_kv_heads = 1, .head_dim = 4, .block_size = 16};
  int64_t block_bytes = 8;
  std::vector<kv::BlockHash> hashes;
  std::vector<int32_t> device_blocks, new_blocks;
  int64_t prompt_tokens = 8 * 16 + 5;
  std::vector<std::uint64_t> device = std::vector<std::uint64_t>(64), host = std::vector<std::uint64_t>(4096);
  std::map<int32_t, std::vector<std::byte>> file;  // disk slot -> its image
  std::map<int32_t, std::vector<std::byte>> tails;  // host slot -> the tail its last disk read brought
  TiersPage() {
    for (int32_t i = 0; i < 8; ++i) {
      hashes.push_back({std::uint64_t(1000 + i), 7});
      device_blocks.push_back(1 + i);
      new_blocks.push_back(20 + i);
      device[std::size_t(1 + i)] = 0xabc0 + std::uint64_t(i);  // a block's content
    }
  }
  std::span<std::byte> host_block(int32_t s) { return std::as_writable_bytes(std::span(&host[std::size_t(s)], 1)); }
  void copy_to_host(int32_t src, int32_t dst) { host[std::size_t(dst)] = device[std::size_t(src)]; }
  void copy_to_device(int32_t src, int32_t dst) { device[std::size_t(dst)] = host[std::size_t(src)]; }
  // pwritev of the host block and its sealed tail.
  void write_slot(const kv::DiskLayout& d, int32_t host_slot, int32_t disk_slot, const kv::BlockHash& h) {
    std::vector<std::byte> tail(std::size_t(d.tail_bytes()));
    REQUIRE(d.seal_tail(host_block(host_slot), tail, disk_slot, h).ok());
    auto& image = file[disk_slot];
    image.assign(host_block(host_slot).begin(), host_block(host_slot).end());
    image.insert(image.end(), tail.begin(), tail.end());
  }
  // preadv into the host block and a tail buffer.
  void read_slot(const kv::DiskLayout& d, int32_t disk_slot, int32_t host_slot) {
    const auto& image = file.at(disk_slot);
    std::copy_n(image.begin(), block_bytes, host_block(host_slot).begin());
    tails[host_slot].assign(image.begin() + block_bytes, image.begin() + block_bytes + d.tail_bytes());
  }
  std::function<kv::LandedSlot(const kv::BlockMove&)> landed_slot = [this](const kv::BlockMove& m) {
    return kv::LandedSlot{host_block(m.dst), tails.at(m.dst)};
  };
  // Other requests fill host memory: every block of the turn leaves it.
  void other_traffic(kv::Tiers& tiers) {
    std::vector<kv::BlockHash> others;
    std::vector<int32_t> ids;
    for (int32_t i = 0; i < 4096; ++i) others.push_back({std::uint64_t(50000 + i), 9}), ids.push_back(0);
    const kv::TierJob j = tiers.plan_store(kv::Tier::device, kv::Tier::host, others, ids).value();
    for (const kv::BlockMove& m : j.moves) host[std::size_t(m.dst)] = 0;
    REQUIRE(tiers.complete(j.id).ok());
  }
};
}  // namespace

TEST_CASE_METHOD(TiersPage, "docs tiers: a finished request's blocks offloaded to host memory and disk, and onboarded on the next turn") {
#include "snippets/tiers.inc"
  CHECK(file.size() == 8);
  SECTION("from host memory") {
#include "snippets/tiers_onboard.inc"
    CHECK(hit == kv::TierHits{.device = 0, .host = 8, .disk = 0});
    CHECK(landed == 8);
    for (int32_t i = 0; i < 8; ++i) CHECK(device[std::size_t(20 + i)] == 0xabc0 + std::uint64_t(i));
  }
  SECTION("from disk, through host memory, verified") {
    other_traffic(tiers);
#include "snippets/tiers_onboard.inc"
    CHECK(hit == kv::TierHits{.device = 0, .host = 0, .disk = 8});
    CHECK(landed == 8);
    for (int32_t i = 0; i < 8; ++i) CHECK(device[std::size_t(20 + i)] == 0xabc0 + std::uint64_t(i));
  }
  SECTION("a byte flipped on disk: the hit ends before that block") {
    other_traffic(tiers);
    file.at(tiers.disk().find(hashes[5]))[3] ^= std::byte{0x10};
#include "snippets/tiers_onboard.inc"
    CHECK(hit.disk == 8);
    CHECK(landed == 5);  // blocks 0 .. 4; the engine computes from block 5
    for (int32_t i = 0; i < 5; ++i) CHECK(device[std::size_t(20 + i)] == 0xabc0 + std::uint64_t(i));
    CHECK(tiers.disk().find(hashes[5]) == -1);  // never offered again
  }
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
