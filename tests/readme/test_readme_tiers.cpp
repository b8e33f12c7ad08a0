// The memory-tiers page's snippet (docs/tiers.md), run in a fixture that
// supplies the engine's names (a prompt's block hashes, its device blocks,
// copies as the engine would make them), then checked against what it promises.
#include <catch2/catch.hpp>

#include <kvcache/cache.hpp>
#include <kvcache/cache/hybrid.hpp>
#include <kvcache/tiers/disk_layout.hpp>
#include <kvcache/tiers/group_tiers.hpp>
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

namespace {
// The hybrid section: full attention and a window of 8 in pages of 4 tokens.
// A page is 4 words; the forward pass writes, at each slot, a value of its
// group, its position and every token before it (as K/V is), so what a
// query reads is checked against the prompt.
struct GroupTiersPage {
  std::vector<int32_t> full_layers{0}, window_layers{1};
  kv::LayerGroupSpec specs[2] = {
      {.kind = kv::AttentionKind::full, .layers = full_layers, .num_kv_heads = 1, .head_dim = 8},
      {.kind = kv::AttentionKind::sliding_window, .layers = window_layers, .num_kv_heads = 1, .head_dim = 8, .window = 8}};
  kv::LayerGroups groups = kv::LayerGroups::make({.groups = specs, .block_size = 4}).value();
  kv::HybridCache<> cache{{.groups = groups, .num_blocks = 40, .max_sequences = 2, .max_tokens = 128, .prefill_chunk = 32}};
  std::vector<std::int64_t> device = std::vector<std::int64_t>(40 * 4), host = std::vector<std::int64_t>(512 * 4);
  std::vector<int32_t> conversation, next_prompt;
  kv::SeqId seq{}, served{};
  bool onboarded = false;

  static std::int64_t value(int32_t g, std::span<const int32_t> t, int64_t p) {
    std::uint64_t h = 0x9e37u + std::uint64_t(g);
    for (int64_t i = 0; i <= p; ++i) h = (h ^ std::uint64_t(t[std::size_t(i)])) * 1099511628211ull;
    return std::int64_t(h >> 1);
  }
  void copy_to_host(int32_t src, int32_t dst) { std::copy_n(device.begin() + src * 4, 4, host.begin() + dst * 4); }
  void copy_to_device(int32_t src, int32_t dst) {
    std::copy_n(host.begin() + src * 4, 4, device.begin() + dst * 4);
    onboarded = true;
  }
  void write(std::span<const int32_t> t, int64_t from, int32_t n, std::span<const int32_t> slots, int32_t stride) {
    for (int32_t g = 0; g < 2; ++g)
      for (int32_t i = 0; i < n; ++i) device[std::size_t(slots[std::size_t(g * stride + i)])] = value(g, t, from + i);
  }
  // The rest of `t` from `have` on, a chunk at a time.
  void prefill_of(kv::SeqId s, std::span<const int32_t> t, int64_t have) {
    while (have < int64_t(t.size())) {
      const auto n = int32_t(std::min<int64_t>(32, int64_t(t.size()) - have));
      std::vector<int32_t> slots(2 * std::size_t(n));
      REQUIRE(cache.reserve(s, t.subspan(std::size_t(have), std::size_t(n)), slots).ok());
      write(t, have, n, slots, n);
      have += n;
      REQUIRE(cache.computed(s, have).ok());
    }
    served = s;
  }
  void prefill(kv::SeqId s, std::span<const int32_t> rest) { prefill_of(s, next_prompt, int64_t(next_prompt.size() - rest.size())); }
  void admit_and_prefill(std::span<const int32_t> t) {
    std::vector<int32_t> slots(2 * t.size());
    const auto a = cache.admit(t, slots).value();
    write(t, a.cached_tokens, a.reserved, slots, int32_t(t.size()));
    REQUIRE(cache.computed(a.seq, a.cached_tokens + a.reserved).ok());
    prefill_of(a.seq, t, a.cached_tokens + a.reserved);
  }
  GroupTiersPage() {
    for (int32_t i = 0; i < 42; ++i) conversation.push_back(1000 + i * 7);
    admit_and_prefill(conversation);
    seq = served;
    next_prompt = conversation;
    for (int32_t i = 0; i < 10; ++i) next_prompt.push_back(3 + i);
  }
  // Other requests fill the device pool: its pages are recycled.
  void other_traffic() {
    std::vector<int32_t> other;
    for (int32_t i = 0; i < 120; ++i) other.push_back(50000 + i);
    admit_and_prefill(other);
    REQUIRE(cache.free(served).ok());
  }
  // Every group's last query reads the prompt's values.
  void check_reads(kv::SeqId s, std::span<const int32_t> t) {
    for (int32_t g = 0; g < 2; ++g) {
      const kv::GroupRule r = kv::GroupRule::of(groups, g);
      const auto row = cache.blocks(s, g).value();
      for (int64_t p = r.first_read(int64_t(t.size()) - 1); p < int64_t(t.size()); ++p)
        CHECK(device[std::size_t(row[std::size_t(r.div(p))] * 4 + r.mod(p))] == value(g, t, p));
    }
  }
};
}  // namespace

TEST_CASE_METHOD(GroupTiersPage, "docs group_tiers: a hybrid model's groups offloaded to host memory and onboarded on the next turn") {
#include "snippets/group_tiers.inc"
  CHECK(store.moves.size() == 10 + 2);  // the full group's 10 blocks; the window's that a hit at 40 reads (33 .. 39: blocks 8, 9)
  SECTION("the device forgot: every group's blocks come back from host memory") {
    other_traffic();
#include "snippets/group_tiers_onboard.inc"
    CHECK(hit.device_tokens == 0);
    CHECK(hit.tokens == 40);
    CHECK(hit.host == 12);
    CHECK(onboarded);
  }
  SECTION("the device still holds them: admit() serves them") {
#include "snippets/group_tiers_onboard.inc"
    CHECK(hit.tokens == hit.device_tokens);
    CHECK(hit.tokens == 40);
    CHECK(!onboarded);
  }
  check_reads(served, next_prompt);
  CHECK(cache.check_invariants().ok());
  CHECK(tiers.tiers().check_invariants().ok());
}
