// The C++ NIXL adapter (transfer/nixl_link.hpp), built only where NIXL's
// headers and library are found: two agents in one process over UCX on
// 127.0.0.1 (TCP), a prefill pool and a decode pool in host memory. The
// decode side imports a prompt, reads the prefill side's blocks (prepared
// lists by descriptor id, then coalesced descriptors), and commits; the
// bytes match, the notification reaches the sender, and bad input (a
// malformed or mismatched peer, an unknown peer) is a typed error. The
// scale-out page's C++ NIXL snippet runs here too.
#include <catch2/catch.hpp>

#include <kvcache/cache.hpp>
#include <kvcache/transfer/nixl_link.hpp>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

using namespace kvcache;

namespace {

const Geometry kGeom = *Geometry::make({.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .block_size = 4});

// A cache with a host pool registered with its own agent.
struct Node {
  Cache<> cache;
  std::vector<std::uint8_t> pool;
  LayoutHandshake handshake;
  NixlLink link;
  Node(const char* name, std::uint32_t fill, const Geometry& g = kGeom)
      : cache({.geometry = g, .num_blocks = 16, .max_sequences = 4, .max_blocks_per_sequence = 8}),
        pool(std::size_t(*g.pool_bytes(16))),
        handshake(*describe_layout(g, 16, reinterpret_cast<std::uint64_t>(pool.data()),
                                   {.engine_id = name, .memory = MemoryKind::host})),
        link(handshake) {
    std::mt19937 rng(fill);
    for (auto& b : pool) b = std::uint8_t(rng());
  }
  std::span<const std::uint8_t> block(BlockId b) const {
    const auto n = std::size_t(cache.geometry().block_bytes());
    return std::span(pool).subspan(std::size_t(b) * n, n);
  }
};

void loopback() {  // before the first agent: UCX over TCP on this machine
  ::setenv("UCX_TLS", "tcp,self", 0);
  ::setenv("UCX_MODULES", "^ib", 0);
}

// Polls t on `link` until it ends; the peer's agent is progressed too (one
// process, no progress threads: the sender's engine loop would poll its notifications).
bool wait(NixlLink& link, NixlTransfer& t, NixlLink& peer, std::vector<std::pair<std::string, std::string>>& notes) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < end) {
    auto done = link.poll(t);
    REQUIRE(done.ok());
    REQUIRE(peer.notifications(notes).ok());
    if (*done) return true;
  }
  return false;
}

}  // namespace

TEST_CASE("nixl link: a decode agent reads a prefill agent's blocks, by prepared ids and coalesced") {
  loopback();
  Node prefill("prefill", 1), decode("decode", 2);
  REQUIRE(prefill.link.status().ok());
  REQUIRE(decode.link.status().ok());
  auto to_decode = prefill.link.metadata(), to_prefill = decode.link.metadata();
  REQUIRE(to_decode.ok());
  const std::string peer = *decode.link.add_peer(*to_decode);
  CHECK(peer == "prefill");
  CHECK(*prefill.link.add_peer(*to_prefill) == "decode");

  std::vector<std::int32_t> prompt(14);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = std::int32_t(i + 1);
  for (const bool prepared : {true, false}) {
    std::vector<BlockId> slots(prompt.size());
    auto adm = prefill.cache.admit(prompt, slots);
    REQUIRE(adm.ok());
    const auto remote = *prefill.cache.table().blocks(adm->seq);
    std::vector<BlockId> local(4);
    const ImportPlan imp = *decode.cache.import(prompt, local);
    const GroupBlocks gb{0, remote, std::span(local).first(std::size_t(imp.num_blocks)), imp.skip};
    auto t = decode.link.read(peer, std::span(&gb, 1), {}, prepared ? "read:1" : "read:2", prepared);
    REQUIRE(t.ok());
    NixlTransfer xfer = *t;
    std::vector<std::pair<std::string, std::string>> notes;
    REQUIRE(wait(decode.link, xfer, prefill.link, notes));
    const auto c = decode.cache.commit_import(imp.id, prompt);
    REQUIRE(c.ok());
    for (std::size_t i = 0; i < std::size_t(imp.num_blocks); ++i) {
      const auto a = prefill.block(remote[i + std::size_t(imp.skip)]), b = decode.block(local[i]);
      CHECK(std::memcmp(a.data(), b.data(), a.size()) == 0);
    }
    for (int i = 0; i < 100000 && notes.empty(); ++i) REQUIRE(prefill.link.notifications(notes).ok());
    REQUIRE(notes.size() == 1);
    CHECK(notes[0] == std::pair<std::string, std::string>{"decode", prepared ? "read:1" : "read:2"});
    REQUIRE(decode.cache.free(c->seq).ok());
    REQUIRE(prefill.cache.free(adm->seq).ok());
  }
  CHECK(decode.cache.check_invariants().ok());
}

TEST_CASE("nixl link: bad peers and reads are typed errors") {
  loopback();
  Node a("a", 3), b("b", 4, *Geometry::make({.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .block_size = 8}));
  auto md = b.link.metadata();
  REQUIRE(md.ok());
  const auto st = a.link.add_peer(*md);
  CHECK(st.status().code() == Errc::layout_mismatch);
  CHECK(st.status().what() == std::string("block_size"));
  const std::uint8_t short_msg[] = {1, 2, 3};
  CHECK(a.link.add_peer(short_msg).status() == Status{Errc::invalid_argument, "peer message (bytes)", 3, 8});
  std::vector<std::uint8_t> lying = *md;
  lying[7] = 0x7f;  // a metadata length past the message
  CHECK(a.link.add_peer(lying).status().what() == std::string("peer message (metadata bytes)"));
  const std::vector<std::int32_t> blocks{1};
  const GroupBlocks gb{0, blocks, blocks};
  CHECK(a.link.read("b", std::span(&gb, 1), {}).status().code() == Errc::unknown_job);
  NixlTransfer none;
  CHECK(a.link.poll(none).status().code() == Errc::unknown_job);
}

namespace {
// The page's names: this rank (decode) imports a prompt the prefill rank beside it holds.
struct NixlPage {
  Node prefill{"prefill-0", 5}, decode{"decode-0", 6};
  const LayoutHandshake& mine = decode.handshake;
  std::vector<std::uint8_t> peer_message = *prefill.link.metadata();
  std::vector<std::int32_t> prompt = std::vector<std::int32_t>(16, 7);
  std::vector<std::int32_t> remote, local = std::vector<std::int32_t>(4);
  GroupBlocks read{};
  std::uint64_t hold_id = 42;
  std::vector<std::pair<std::string, std::string>> notes;
  NixlPage() {
    loopback();
    std::vector<BlockId> slots(prompt.size());
    const SeqId s = prefill.cache.admit(prompt, slots)->seq;
    const auto row = *prefill.cache.table().blocks(s);
    remote.assign(row.begin(), row.end());
    const ImportPlan imp = *decode.cache.import(prompt, local);
    read = {0, remote, std::span(local).first(std::size_t(imp.num_blocks)), imp.skip};
  }
  void send_to_peer(const std::vector<std::uint8_t>& m) { REQUIRE(prefill.link.add_peer(m).ok()); }
  void engine_step() { REQUIRE(prefill.link.notifications(notes).ok()); }
};
}  // namespace

TEST_CASE_METHOD(NixlPage, "docs scale-out: the C++ NIXL snippet reads a peer's blocks") {
  namespace kv = kvcache;
  {  // the snippet makes this rank's link itself (the fixture's decode.link stays unused)
#include "snippets/nixl_link.inc"
  }
  for (std::size_t i = 0; i < local.size(); ++i) {
    const auto a = prefill.block(remote[i]), b = decode.block(local[i]);
    CHECK(std::memcmp(a.data(), b.data(), a.size()) == 0);
  }
  for (int i = 0; i < 100000 && notes.empty(); ++i) engine_step();
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].second == "read:42");
}
