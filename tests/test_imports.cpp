// The receiver's and the sender's bookkeeping of a disaggregated prefill:
// import / commit / abort on the decode side (transfer/pending_imports.hpp,
// Cache<>::import) and transfer holds on the prefill side
// (transfer/transfer_holds.hpp), between two caches of one process whose
// pools a memcpy executor copies through a transfer plan. Every error names
// its value and changes nothing. The randomized runs (cache_property.hpp)
// import, commit and abort as well.
#include <catch2/catch.hpp>

#include <kvcache/cache.hpp>
#include <kvcache/transfer/transfer_holds.hpp>
#include <kvcache/transfer/transfer_plan.hpp>

#include <cstring>
#include <vector>

#include "device_cache_testing.hpp"

using namespace kvcache;
using kvtest::add_published;
using kvtest::blocks_of;
using kvtest::device_config;
using kvtest::prompt;

namespace {

// A cache with a host pool behind it.
struct Node {
  Cache<> cache;
  std::vector<std::uint8_t> pool;
  explicit Node(CacheConfig cfg) : cache(cfg), pool(std::size_t(*cfg.geometry.pool_bytes(cfg.num_blocks))) {}
  LayoutHandshake describe() const {
    return *describe_layout(cache.geometry(), std::int64_t(pool.size()) / cache.geometry().block_bytes(),
                            reinterpret_cast<std::uint64_t>(pool.data()), {.engine_id = "n"});
  }
  std::span<const std::uint8_t> block(BlockId b) const {
    const auto bytes = std::size_t(cache.geometry().block_bytes());
    return std::span(pool).subspan(std::size_t(b) * bytes, bytes);
  }
};

// Reads the sender's blocks of its row into the receiver's import blocks.
void transfer(const Node& from, const std::vector<BlockId>& remote, Node& to, const ImportPlan& imp, std::span<const BlockId> local) {
  const TransferPlanner planner(to.describe(), from.describe());
  REQUIRE(planner.status().ok());
  const GroupBlocks gb{0, remote, local.first(std::size_t(imp.num_blocks)), imp.skip};
  std::vector<TransferDesc> plan;
  REQUIRE(planner.plan(std::span(&gb, 1), {}, plan).ok());
  for (const TransferDesc& d : plan)
    std::memcpy(reinterpret_cast<void*>(d.local), reinterpret_cast<const void*>(d.remote), std::size_t(d.bytes));
}

}  // namespace

TEST_CASE("import: a peer's prompt arrives, commits, and serves as a prefix hit") {
  Node prefill(device_config(12)), decode(device_config(12, 16));
  const auto toks = prompt(14);  // 3 full blocks and a partial one
  const SeqId src = add_published(prefill.cache, toks);
  for (std::size_t i = 0; i < prefill.pool.size(); ++i) prefill.pool[i] = std::uint8_t(i * 13 + 5);  // "computed" KV

  std::vector<BlockId> blocks(8, -1);
  const auto imp = decode.cache.import(toks, blocks);
  REQUIRE(imp.ok());
  CHECK(imp->cached_tokens == 0);
  CHECK(imp->skip == 0);
  CHECK(imp->num_blocks == 4);
  CHECK(decode.cache.imports().size() == 1);
  CHECK(decode.cache.free_blocks() == 11 - 4);
  CHECK(decode.cache.check_invariants().ok());
  // Pending: nothing published, no prefix lookup finds the blocks, no event yet.
  std::vector<BlockId> hit(8);
  CHECK(decode.cache.match_prefix(toks, {}, hit) == 0);
  std::vector<BlockEvent> ev(16);
  CHECK(decode.cache.drain_events(ev) == 0);

  transfer(prefill, blocks_of(prefill.cache, src), decode, *imp, blocks);
  const auto done = decode.cache.commit_import(imp->id, toks);
  REQUIRE(done.ok());
  CHECK(done->published == 3);
  CHECK(decode.cache.imports().size() == 0);
  CHECK(decode.cache.check_invariants().ok());
  CHECK(*decode.cache.table().tokens(done->seq) == 14);
  CHECK(std::vector<BlockId>(blocks.begin(), blocks.begin() + 4) == blocks_of(decode.cache, done->seq));
  const auto src_blocks = blocks_of(prefill.cache, src);
  for (std::size_t i = 0; i < 4; ++i)
    CHECK(std::memcmp(decode.block(blocks[i]).data(), prefill.block(src_blocks[i]).data(), decode.block(0).size()) == 0);
  CHECK(decode.cache.drain_events(ev) == 3);  // stored, one per published block
  CHECK(ev[0].kind == EventKind::stored);
  CHECK(ev[0].hash == prefill.cache.pool().hash(src_blocks[0]));  // both sides name blocks alike
  CHECK(decode.cache.match_prefix(toks, {}, hit) == 3);

  // The sequence decodes like any other.
  std::int32_t slot = -1;
  const std::int32_t next = 99;
  REQUIRE(decode.cache.reserve(done->seq, std::span(&next, 1), std::span(&slot, 1)).ok());
  CHECK(slot == blocks[3] * 4 + 2);
  CHECK(decode.cache.check_invariants().ok());
}

TEST_CASE("import: a prefix the decode side holds is shared, and only the suffix is read") {
  Node prefill(device_config(12)), decode(device_config(12));
  const auto toks = prompt(14);
  const SeqId src = add_published(prefill.cache, toks);
  for (std::size_t i = 0; i < prefill.pool.size(); ++i) prefill.pool[i] = std::uint8_t(i * 31 + 1);
  const auto head = std::vector<std::int32_t>(toks.begin(), toks.begin() + 9);  // 2 full blocks and a partial
  const SeqId old = add_published(decode.cache, head);
  const auto old_blocks = blocks_of(decode.cache, old);
  REQUIRE(decode.cache.free(old).ok());

  std::vector<BlockId> blocks(8, -1);
  const auto imp = decode.cache.import(toks, blocks);
  REQUIRE(imp.ok());
  CHECK(imp->cached_tokens == 8);
  CHECK(imp->skip == 2);
  CHECK(imp->num_blocks == 2);
  CHECK(decode.cache.check_invariants().ok());
  transfer(prefill, blocks_of(prefill.cache, src), decode, *imp, blocks);
  const auto done = decode.cache.commit_import(imp->id, toks);
  REQUIRE(done.ok());
  const auto row = blocks_of(decode.cache, done->seq);
  CHECK(row[0] == old_blocks[0]);  // shared, not read
  CHECK(row[1] == old_blocks[1]);
  CHECK(row[2] == blocks[0]);
  const auto src_blocks = blocks_of(prefill.cache, src);
  CHECK(std::memcmp(decode.block(row[3]).data(), prefill.block(src_blocks[3]).data(), decode.block(0).size()) == 0);
  CHECK(done->published == 1);
}

TEST_CASE("import: abort returns the received blocks unpublished and says what to recompute") {
  Node decode(device_config(12, 16));
  const auto toks = prompt(14);
  const auto head = std::vector<std::int32_t>(toks.begin(), toks.begin() + 5);
  const SeqId old = add_published(decode.cache, head);  // block 0 of the prompt cached
  REQUIRE(decode.cache.free(old).ok());
  std::vector<BlockEvent> ev(16);
  (void)decode.cache.drain_events(ev);
  const std::int32_t free_before = decode.cache.free_blocks();

  std::vector<BlockId> blocks(8, -1);
  const auto imp = decode.cache.import(toks, blocks);
  REQUIRE(imp.ok());
  CHECK(imp->cached_tokens == 4);
  CHECK(decode.cache.free_blocks() == free_before - 4);  // the hit came out of the cached-free blocks too
  const auto ab = decode.cache.abort_import(imp->id);
  REQUIRE(ab.ok());
  CHECK(ab->cached_tokens == 4);
  CHECK(ab->recompute == 10);
  CHECK(decode.cache.imports().size() == 0);
  CHECK(decode.cache.check_invariants().ok());
  CHECK(*decode.cache.table().tokens(ab->seq) == 4);
  CHECK(decode.cache.free_blocks() == free_before - 1);  // the sequence keeps its hit
  CHECK(decode.cache.drain_events(ev) == 0);  // nothing was ever published
  std::vector<BlockId> hit(8);
  CHECK(decode.cache.match_prefix(toks, {}, hit) == 1);
  // The engine recomputes the rest on the same sequence.
  std::vector<std::int32_t> slots(10);
  REQUIRE(decode.cache.reserve(ab->seq, std::span(toks).subspan(4), slots).ok());
  REQUIRE(decode.cache.publish(ab->seq, toks).ok());
  CHECK(decode.cache.match_prefix(toks, {}, hit) == 3);
  CHECK(decode.cache.check_invariants().ok());
}

TEST_CASE("import: errors name the value and change nothing") {
  Node decode(device_config(6));
  const auto toks = prompt(14);
  std::vector<BlockId> blocks(8, -1);
  const Cache<> before = decode.cache;
  const auto expect = [&](const Status& st, Errc code, const char* what) {
    CHECK(st.code() == code);
    CHECK(std::string(st.what()) == what);
    CHECK(decode.cache == before);
  };
  expect(decode.cache.import(toks, std::span(blocks).first(3)).status(), Errc::buffer_too_small, "blocks");
  expect(decode.cache.import(prompt(30), blocks).status(), Errc::out_of_blocks, "n_blocks");
  expect(decode.cache.import({}, blocks).status(), Errc::invalid_argument, "prompt.size");
  expect(decode.cache.import(toks, blocks, {.max_new = 40}).status(), Errc::out_of_blocks,
         "lifetime_blocks (promises outstanding subtracted)");
  expect(decode.cache.commit_import(7, toks).status(), Errc::unknown_job, "import");
  expect(decode.cache.abort_import(7).status(), Errc::unknown_job, "import");

  const auto imp = decode.cache.import(toks, blocks);
  REQUIRE(imp.ok());
  const Cache<> pending = decode.cache;
  // The pending row's handle is not handed out; guessed, every call refuses it.
  Cache<> probe = before;
  const SeqId guessed = *probe.add_sequence();  // the handle the import took
  std::vector<std::int32_t> slots(4), table(8);
  CHECK(std::string(decode.cache.reserve(guessed, 1, slots).status().what()) == "seq (an import in flight)");
  CHECK(decode.cache.fork(guessed).status().code() == Errc::unknown_sequence);
  CHECK(decode.cache.export_block_table(std::span(&guessed, 1), table, 8).code() == Errc::unknown_sequence);
  CHECK(decode.cache.free(guessed).code() == Errc::unknown_sequence);
  CHECK(decode.cache.truncate(guessed, 1).code() == Errc::unknown_sequence);
  CHECK(decode.cache == pending);
  const auto h = decode.cache.hold(std::span(blocks).first(1));  // its blocks are in use: a hold is legal and harmless
  REQUIRE(h.ok());
  CHECK(decode.cache.release_hold(*h).ok());
  const Cache<> held_once = decode.cache;  // the holds' id counter moved on
  CHECK(decode.cache.commit_import(imp->id, prompt(13)).status().what() == std::string("prompt.size"));
  CHECK(decode.cache == held_once);
  REQUIRE(decode.cache.commit_import(imp->id, toks).ok());
  CHECK(decode.cache.commit_import(imp->id, toks).status().code() == Errc::unknown_job);  // exactly once
  CHECK(decode.cache.abort_import(imp->id).status().code() == Errc::unknown_job);

  // Every handle in use: an import needs one.
  Node full(device_config(30));
  for (int i = 0; i < 4; ++i) REQUIRE(full.cache.add_sequence().ok());
  CHECK(full.cache.import(toks, blocks).status().code() == Errc::capacity_exceeded);
}

TEST_CASE("import: the commit publishes only the tokens imported (issue 62: another prompt of the same length was accepted)") {
  // Before the fix: import tokens 1..9, commit with 11..19: ok, and a later
  // request for 11..19 hit blocks holding 1..9's K/V.
  Node decode(device_config(12, 16));
  const auto toks = prompt(9), other = prompt(9, 11);
  std::vector<BlockId> blocks(8, -1);
  const auto imp = decode.cache.import(toks, blocks);
  REQUIRE(imp.ok());
  const Cache<> pending = decode.cache;
  const auto wrong = decode.cache.commit_import(imp->id, other);
  CHECK(wrong.status().code() == Errc::invalid_argument);
  CHECK(std::string(wrong.status().what()) == "prompt (not the tokens imported)");
  CHECK(decode.cache == pending);
  // One token changed, anywhere (the partial tail included), or extras the import did not have.
  for (std::size_t i = 0; i < toks.size(); ++i) {
    auto one = toks;
    one[i] += 1000;
    CHECK(decode.cache.commit_import(imp->id, one).status().what() == std::string("prompt (not the tokens imported)"));
  }
  const ExtraKey image{.begin = 0, .end = 4, .key = 77};
  CHECK(decode.cache.commit_import(imp->id, toks, std::span(&image, 1)).status().what() == std::string("prompt (not the tokens imported)"));
  CHECK(decode.cache == pending);
  const auto done = decode.cache.commit_import(imp->id, toks);
  REQUIRE(done.ok());
  CHECK(done->published == 2);
  std::vector<BlockId> hit(8);
  CHECK(decode.cache.match_prefix(other, {}, hit) == 0);  // the other prompt never hits the imported K/V
  CHECK(decode.cache.match_prefix(toks, {}, hit) == 2);

  // An import with extras and a salt commits only with the same ones.
  const ExtraKey img{.begin = 2, .end = 6, .key = 5};
  const auto imp2 = decode.cache.import(other, blocks, {.key = {.salt = 3}, .extras = std::span(&img, 1)});
  REQUIRE(imp2.ok());
  CHECK(decode.cache.commit_import(imp2->id, other).status().what() == std::string("prompt (not the tokens imported)"));
  const ExtraKey img_other{.begin = 2, .end = 6, .key = 6};
  CHECK(decode.cache.commit_import(imp2->id, other, std::span(&img_other, 1)).status().what() ==
        std::string("prompt (not the tokens imported)"));
  CHECK(decode.cache.commit_import(imp2->id, other, std::span(&img, 1)).ok());
  CHECK(decode.cache.check_invariants().ok());
}

TEST_CASE("transfer holds: a finished prefill's blocks wait for every consumer, or the deadline") {
  Cache<> cache(device_config(9));
  TransferHolds holds;
  const auto toks = prompt(16);
  const SeqId s = add_published(cache, toks);
  const auto blocks = blocks_of(cache, s);
  const auto h = holds.hold(cache, s, 2, /*deadline=*/100);
  REQUIRE(h.ok());
  REQUIRE(cache.free(s).ok());  // the prefill is done; two decode ranks will read
  CHECK(cache.check_invariants().ok());
  CHECK(cache.free_blocks() == 4);
  const SeqId t = *cache.add_sequence();
  std::vector<std::int32_t> slots(16);
  REQUIRE(cache.reserve(t, 16, slots).ok());  // pressure takes none of the held blocks
  for (const std::int32_t slot : slots) CHECK(std::find(blocks.begin(), blocks.end(), slot / 4) == blocks.end());
  REQUIRE(cache.free(t).ok());

  CHECK(*holds.consumed(cache, *h, 0) == false);
  CHECK(holds.consumed(cache, *h, 0).status().what() == std::string("consumer (already read)"));
  CHECK(holds.consumed(cache, *h, 2).status().what() == std::string("consumer"));
  CHECK(cache.free_blocks() == 4);
  CHECK(*holds.consumed(cache, *h, 1) == true);  // the last reader: released
  CHECK(cache.free_blocks() == 8);
  CHECK(holds.size() == 0);
  CHECK(holds.consumed(cache, *h, 1).status().code() == Errc::unknown_job);
  CHECK(cache.check_invariants().ok());

  // A consumer that never reads: the deadline returns the blocks (still cached).
  const SeqId u = add_published(cache, toks);
  const auto g = holds.hold(cache, u, 1, 50);
  REQUIRE(g.ok());
  REQUIRE(cache.free(u).ok());
  std::vector<std::uint64_t> gone(4);
  CHECK(holds.expire(cache, 49, gone) == 0);
  CHECK(holds.expire(cache, 50, gone) == 1);
  CHECK(gone[0] == *g);
  CHECK(cache.free_blocks() == 8);
  std::vector<BlockId> hit(8);
  CHECK(cache.match_prefix(toks, {}, hit) == 3);
  CHECK(holds.consumed(cache, *g, 0).status().code() == Errc::unknown_job);  // a late notification is harmless

  CHECK(holds.hold(cache, u, 1, 0).status().code() == Errc::unknown_sequence);
  const std::vector<BlockId> bad{42};
  CHECK(holds.hold(cache, bad, 1, 0).status().what() == std::string("block"));
  CHECK(holds.hold(cache, blocks, 0, 0).status().what() == std::string("consumers"));
  CHECK(holds.hold(cache, blocks, 65, 0).status().what() == std::string("consumers"));
  CHECK(cache.holds().size() == 0);
  CHECK(cache.check_invariants().ok());
}

TEST_CASE("transfer holds: room from the cache, several in flight, each found and expired by its own id") {
  Cache<> cache(device_config(9));
  TransferHolds holds(cache);
  CHECK(holds.room() == cache.holds().room_holds());
  CHECK(TransferHolds(3).room() == 3);
  const SeqId s = add_published(cache, prompt(8));
  std::vector<std::uint64_t> ids;
  for (std::int64_t d = 0; d < 5; ++d) {  // deadlines 40, 10, 40, 10, 40 (five readers' holds on one prompt)
    const auto h = holds.hold(cache, s, 1, d % 2 ? 10 : 40);
    REQUIRE(h.ok());
    ids.push_back(*h);
  }
  REQUIRE(cache.free(s).ok());
  CHECK(holds.size() == 5);
  for (std::size_t i = 0; i < ids.size(); ++i) CHECK(holds.find(ids[i])->deadline == (i % 2 ? 10 : 40));
  REQUIRE(*holds.consumed(cache, ids[2], 0));  // one read in the middle: the others keep their entries
  CHECK(holds.find(ids[2]).status().code() == Errc::unknown_job);
  std::vector<std::uint64_t> gone(1);  // room for one id: every expired hold is still released and counted
  CHECK(holds.expire(cache, 10, gone) == 2);
  CHECK(gone[0] == ids[1]);  // in id order
  CHECK(holds.size() == 2);
  CHECK(holds.find(ids[0])->deadline == 40);
  CHECK(holds.find(ids[4])->deadline == 40);
  CHECK(holds.expire(cache, 40) == 2);
  CHECK(holds.size() == 0);
  CHECK(cache.holds().size() == 0);
  CHECK(cache.check_invariants().ok());
}

TEST_CASE("import without a blocks buffer: import_blocks lists the same blocks, group 0's, as on every cache") {
  Node a(device_config(12)), b(device_config(12));
  const auto toks = prompt(14);
  const std::vector<std::int32_t> head(toks.begin(), toks.begin() + 8);
  (void)add_published(a.cache, head);  // both hit its 2 blocks
  (void)add_published(b.cache, head);
  std::vector<BlockId> blocks(8, -1);
  const auto with = *a.cache.import(toks, blocks);
  const auto without = *b.cache.import(toks);
  CHECK(with.cached_tokens == 8);
  CHECK(without.cached_tokens == 8);
  CHECK(without.skip == 2);
  CHECK(without.num_blocks == with.num_blocks);
  const auto gb = *b.cache.import_blocks(without.id);
  CHECK(gb.group == 0);
  CHECK(gb.skip == without.skip);
  CHECK(std::vector<BlockId>(gb.local.begin(), gb.local.end()) ==
        std::vector<BlockId>(blocks.begin(), blocks.begin() + with.num_blocks));
  CHECK(a.cache == b.cache);  // the buffer is a copy: the caches agree
  const Cache<> before = b.cache;
  CHECK(b.cache.import_blocks(without.id, 1).status() == Status{Errc::invalid_argument, "group", 1, 0});
  CHECK(b.cache.import_blocks(without.id + 1).status().code() == Errc::unknown_job);
  CHECK(b.cache == before);
  REQUIRE(b.cache.commit_import(without.id, toks).ok());
  CHECK(b.cache.import_blocks(without.id).status().code() == Errc::unknown_job);
  CHECK(b.cache.check_invariants().ok());
}
