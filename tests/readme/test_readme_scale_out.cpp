// The scale-out page's snippets (docs/scale-out.md), run in fixtures that
// supply the engine's names: two caches with host pools (a prefill node and
// a decode node), a "NIXL read" that memcpys a plan, a peer to send to, a
// clock, and a ZMQ publisher that records its frames. Each is then checked
// against what the page promises.
#include <catch2/catch.hpp>

#include <kvcache/cache.hpp>
#include <kvcache/cache/hybrid.hpp>
#include <kvcache/transfer/handshake_wire.hpp>
#include <kvcache/transfer/transfer_holds.hpp>
#include <kvcache/transfer/transfer_plan.hpp>
#include <kvcache/wire/kv_events_wire.hpp>

#include <array>
#include <cstdint>
#include <cstring>
#include <span>
#include <stdexcept>
#include <vector>

namespace kv = kvcache;

namespace {

kv::CacheConfig node_config(std::int32_t events = 0) {
  return {.geometry = *kv::Geometry::make({.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .block_size = 16}),
          .num_blocks = 32, .max_sequences = 4, .max_blocks_per_sequence = 8, .event_capacity = events};
}

struct Node {
  kv::Cache<> cache;
  std::int64_t num_blocks = 32;
  std::vector<std::uint8_t> pool;
  std::uint64_t pool_address;
  explicit Node(std::int32_t events = 0)
      : cache(node_config(events)), pool(std::size_t(32 * cache.geometry().block_bytes())),
        pool_address(reinterpret_cast<std::uint64_t>(pool.data())) {}
};

std::vector<std::int32_t> make_prompt(std::int32_t n) {
  std::vector<std::int32_t> p(static_cast<std::size_t>(n));
  for (std::int32_t i = 0; i < n; ++i) p[std::size_t(i)] = 100 + i;
  return p;
}

// The decode engine's names the snippets call: a "NIXL read" that memcpys a
// plan (or fails), and what it decodes or recomputes.
struct DecodeEngine {
  bool transfer_works = true;
  kv::SeqId decoded{}, recomputed{};
  std::int64_t recompute_tokens = -1;
  bool nixl_read(std::span<const kv::TransferDesc> plan) {
    if (!transfer_works) return false;
    for (const auto& d : plan) std::memcpy(reinterpret_cast<void*>(d.local), reinterpret_cast<const void*>(d.remote), std::size_t(d.bytes));
    return true;
  }
  void decode_from(kv::SeqId s) { decoded = s; }
  void recompute(kv::SeqId s, std::span<const std::int32_t> rest) {
    recomputed = s;
    recompute_tokens = std::int64_t(rest.size());
  }
};

// The decode node, with the prefill node beside it in the same process.
struct DecodePage : Node, DecodeEngine {
  Node prefill;
  std::vector<std::int32_t> prompt = make_prompt(40);
  std::vector<std::uint8_t> peer_bytes;
  std::vector<kv::BlockId> remote_blocks;
  DecodePage() : Node(16) {
    const kv::SeqId s = *prefill.cache.add_sequence();
    std::vector<std::int32_t> slots(prompt.size());
    REQUIRE(prefill.cache.reserve(s, prompt, slots).ok());
    for (std::size_t i = 0; i < prefill.pool.size(); ++i) prefill.pool[i] = std::uint8_t(i % 251);  // the prefill's KV
    const auto row = *prefill.cache.table().blocks(s);
    remote_blocks.assign(row.begin(), row.end());
    kv::to_msgpack(*kv::describe_layout(prefill.cache.geometry(), 32, prefill.pool_address, {.engine_id = "prefill-0"}), peer_bytes);
  }
};

}  // namespace

TEST_CASE_METHOD(DecodePage, "docs scale-out: the decode node imports a peer's prompt and commits it") {
#include "snippets/disagg_decode.inc"
  REQUIRE(*cache.table().tokens(decoded) == 40);
  const auto row = *cache.table().blocks(decoded);
  const auto bytes = std::size_t(cache.geometry().block_bytes());
  for (std::size_t i = 0; i < row.size(); ++i)
    CHECK(std::memcmp(pool.data() + std::size_t(row[i]) * bytes, prefill.pool.data() + std::size_t(remote_blocks[i]) * bytes, bytes) == 0);
  std::vector<kv::BlockId> hit(8);
  CHECK(cache.match_prefix(prompt, {}, hit) == 2);  // published: the next request with this prefix hits
  CHECK(cache.check_invariants().ok());
}

TEST_CASE_METHOD(DecodePage, "docs scale-out: a failed transfer aborts the import and recomputes") {
  transfer_works = false;
#include "snippets/disagg_decode.inc"
  CHECK(recompute_tokens == 40);
  CHECK(*cache.table().tokens(recomputed) == 0);
  CHECK(cache.free_blocks() == 31);
  std::vector<kv::BlockEvent> ev(8);
  CHECK(cache.drain_events(ev) == 0);  // nothing was published
  CHECK(cache.check_invariants().ok());
}

TEST_CASE_METHOD(DecodePage, "docs scale-out: a peer with another block size is refused before any byte moves") {
  peer_bytes.clear();
  const auto other = *kv::Geometry::make({.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .block_size = 32});
  kv::to_msgpack(*kv::describe_layout(other, 32, prefill.pool_address, {}), peer_bytes);
  try {
#include "snippets/disagg_decode.inc"
    FAIL("no error");
  } catch (const std::runtime_error& e) {
    CHECK(std::string(e.what()) == "layout_mismatch: block_size=32 (limit 16)");
  }
  CHECK(cache.imports().size() == 0);
}

namespace {
// A hybrid model (full and a window of 12) on both nodes; the prefill node computed a 45-token prompt.
struct HybridPage : DecodeEngine {
  std::vector<std::int32_t> l0{0}, l1{1};
  kv::LayerGroupSpec specs[2] = {{.kind = kv::AttentionKind::full, .layers = l0, .num_kv_heads = 2, .head_dim = 8},
                                 {.kind = kv::AttentionKind::sliding_window, .layers = l1, .num_kv_heads = 2, .head_dim = 8, .window = 12}};
  kv::LayerGroups lg = *kv::LayerGroups::make({.groups = specs, .block_size = 4});
  kv::HybridCache<> hybrid{{.groups = lg, .num_blocks = 40, .max_sequences = 2, .max_tokens = 64}};
  kv::HybridCache<> peer{{.groups = lg, .num_blocks = 40, .max_sequences = 2, .max_tokens = 64}};
  std::vector<std::uint8_t> pool = std::vector<std::uint8_t>(std::size_t(lg.page_bytes() * 40)),
                            peer_pool = std::vector<std::uint8_t>(std::size_t(lg.page_bytes() * 40));
  std::vector<std::int32_t> prompt = make_prompt(45);
  kv::TransferPlanner planner{*kv::describe_layout(lg, 40, reinterpret_cast<std::uint64_t>(pool.data()), {}),
                              *kv::describe_layout(lg, 40, reinterpret_cast<std::uint64_t>(peer_pool.data()), {})};
  kv::SeqId peer_seq{};
  std::vector<std::int32_t> rows[2];
  HybridPage() {
    std::vector<std::int32_t> slots(2 * 45);
    peer_seq = peer.admit(prompt, slots)->seq;
    REQUIRE(peer.computed(peer_seq, 45).ok());
    for (std::size_t i = 0; i < peer_pool.size(); ++i) peer_pool[i] = std::uint8_t(i % 251);
    const kv::SeqId one[] = {peer_seq};
    for (std::int32_t g = 0; g < 2; ++g) {
      rows[g].resize(12);
      REQUIRE(peer.export_block_table(g, one, rows[g], 12).ok());
      rows[g].resize(std::size_t(kv::GroupRule::of(lg, g).row_blocks(45)));
    }
  }
  std::span<const std::int32_t> peer_row(std::int32_t g) const { return rows[g]; }
};
}  // namespace

TEST_CASE_METHOD(HybridPage, "docs scale-out: a hybrid decode node receives each group's blocks and commits") {
#include "snippets/disagg_hybrid.inc"
  CHECK(*hybrid.computed_tokens(decoded) == 45);
  CHECK(*hybrid.blocks_held(decoded, 0) == 12);
  CHECK(*hybrid.blocks_held(decoded, 1) == 4);  // a query at 45 reads 34 .. 45: blocks 8 .. 11
  const kv::SeqId one[] = {decoded};
  std::vector<std::int32_t> mine(12);
  for (std::int32_t g = 0; g < 2; ++g) {
    REQUIRE(hybrid.export_block_table(g, one, mine, 12).ok());
    for (std::size_t j = 0; j < rows[g].size(); ++j)
      if (mine[j] != kv::BlockPool::null_block)
        CHECK(std::memcmp(pool.data() + std::size_t(mine[j] * lg.page_bytes()), peer_pool.data() + std::size_t(rows[g][j] * lg.page_bytes()),
                          std::size_t(lg.page_bytes())) == 0);
  }
  CHECK(hybrid.check_invariants().ok());
}

TEST_CASE_METHOD(HybridPage, "docs scale-out: a hybrid import that fails is recomputed") {
  transfer_works = false;
#include "snippets/disagg_hybrid.inc"
  CHECK(recompute_tokens == 45);
  CHECK(hybrid.free_blocks() == 39);  // no local hit: the sequence holds nothing
  CHECK(hybrid.imports().size() == 0);
  CHECK(hybrid.check_invariants().ok());
}

namespace {
struct PrefillPage : Node {
  kv::SeqId seq{};
  std::vector<std::uint8_t> sent;
  std::int64_t clock = 1000;
  PrefillPage() {
    seq = *cache.add_sequence();
    std::vector<std::int32_t> slots(40);
    REQUIRE(cache.reserve(seq, make_prompt(40), slots).ok());
  }
  void send_to_peer(std::span<const std::uint8_t> b) { sent.assign(b.begin(), b.end()); }
  std::int64_t now_ms() const { return clock; }
};
}  // namespace

TEST_CASE_METHOD(PrefillPage, "docs scale-out: the prefill node holds a prompt's blocks until its reader has read them") {
#include "snippets/disagg_prefill.inc"
  CHECK(released);
  CHECK(holds.size() == 0);
  CHECK(cache.free_blocks() == 31);
  const auto back = kv::from_msgpack(sent);
  REQUIRE(back.ok());
  CHECK(back->id.engine_id == "prefill-0");
  CHECK(cache.check_invariants().ok());
}

namespace {
struct EventsPage : Node {
  std::string topic = "kv@node0";
  std::int64_t from = 0;
  std::vector<std::vector<std::vector<std::uint8_t>>> published, answered;
  EventsPage() : Node(64) {
    const kv::SeqId s = *cache.add_sequence();
    std::vector<std::int32_t> slots(40);
    const auto p = make_prompt(40);
    REQUIRE(cache.reserve(s, p, slots).ok());
    REQUIRE(cache.publish(s, p).ok());
  }
  double now_s() const { return 1.25; }
  void publish(const std::string& t, const std::array<std::uint8_t, 8>& seq, std::span<const std::uint8_t> p) {
    published.push_back({{t.begin(), t.end()}, {seq.begin(), seq.end()}, {p.begin(), p.end()}});
  }
  void answer(const std::array<std::uint8_t, 8>& seq, std::span<const std::uint8_t> p) {
    answered.push_back({{seq.begin(), seq.end()}, {p.begin(), p.end()}});
  }
};
}  // namespace

TEST_CASE_METHOD(EventsPage, "docs scale-out: a batch of events goes out as three frames, and replays") {
#include "snippets/kv_events_wire.inc"
  REQUIRE(published.size() == 1);
  CHECK(*kv::read_sequence_frame(published[0][1]) == 0);
  kv::MsgpackReader r(published[0][2]);
  CHECK(*r.array("batch") == 3);
  CHECK(*r.float64("ts") == 1.25);
  CHECK(*r.array("events") == 1);  // two stored blocks of one chain: one BlockStored
  CHECK(*r.array("stored") == 10);
  CHECK(*r.str("tag") == "BlockStored");
  CHECK(*r.array("hashes") == 2);
  REQUIRE(answered.size() == 2);  // the kept batch, then the end
  CHECK(answered[0][1] == published[0][2]);
  CHECK(*kv::read_sequence_frame(answered[1][0]) == -1);
  CHECK(answered[1][1].empty());
}
