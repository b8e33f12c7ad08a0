// Disaggregated decode on a hybrid cache (cache/hybrid_imports.hpp): a
// prefill node's layer groups (full, sliding window, chunked, cross, with
// different block sizes) read into a decode node's pending blocks through a
// transfer plan and a memcpy executor; commit compared byte for byte and as a
// prefix hit; abort with the hit's window kept by a hold; the sender's
// transfer hold over every group; every error naming its value and changing
// nothing. The randomized runs (hybrid_harness.hpp) import, commit and abort as well.
#include <catch2/catch.hpp>

#include <kvcache/cache/hybrid.hpp>
#include <kvcache/transfer/layout_handshake.hpp>
#include <kvcache/transfer/transfer_holds.hpp>
#include <kvcache/transfer/transfer_plan.hpp>

#include <cstring>
#include <random>
#include <vector>

using namespace kvcache;

namespace {

std::vector<std::int32_t> tokens(std::int32_t n, std::int32_t seed = 0) {
  std::vector<std::int32_t> v(static_cast<std::size_t>(n));
  for (std::int32_t i = 0; i < n; ++i) v[std::size_t(i)] = (i * 7919 + seed * 104729) % 50021;
  return v;
}

// Four groups over one page: full (block 4), a window of 12 and a chunk of 16
// (half the bytes per token: block 8), cross-attention over 10 encoder tokens.
struct Model {
  std::vector<std::int32_t> l0{0}, l1{1}, l2{2}, l3{3};
  LayerGroupSpec specs[4];
  LayerGroups lg;
  Model() {
    specs[0] = {.kind = AttentionKind::full, .layers = l0, .num_kv_heads = 2, .head_dim = 8};
    specs[1] = {.kind = AttentionKind::sliding_window, .layers = l1, .num_kv_heads = 2, .head_dim = 4, .window = 12};
    specs[2] = {.kind = AttentionKind::chunked_local, .layers = l2, .num_kv_heads = 2, .head_dim = 4, .chunk = 16};
    specs[3] = {.kind = AttentionKind::cross, .layers = l3, .num_kv_heads = 2, .head_dim = 8, .encoder_len = 10};
    lg = *LayerGroups::make({.groups = specs, .block_size = 4});
  }
};

// A hybrid cache with a host pool behind it.
struct Node {
  HybridCache<> cache;
  std::vector<std::uint8_t> pool;
  Node(const LayerGroups& lg, std::int32_t blocks)
      : cache({.groups = lg, .num_blocks = blocks, .max_sequences = 4, .max_tokens = 64}),
        pool(std::size_t(lg.page_bytes() * blocks)) {}
  LayoutHandshake describe() const {
    return *describe_layout(cache.layer_groups(), cache.config().num_blocks, reinterpret_cast<std::uint64_t>(pool.data()), {});
  }
  std::span<const std::uint8_t> page(BlockId b) const {
    const auto bytes = std::size_t(cache.layer_groups().page_bytes());
    return std::span(pool).subspan(std::size_t(b) * bytes, bytes);
  }
  std::vector<std::int32_t> row(SeqId s, std::int32_t g) const {
    std::vector<std::int32_t> r(64);
    const SeqId one[] = {s};
    REQUIRE(cache.export_block_table(g, one, r, 64).ok());
    return r;
  }
};

// The prefill node: prompt admitted and computed, its pages filled with bytes unique to the run.
SeqId prefill(Node& n, std::span<const std::int32_t> prompt, std::uint32_t seed) {
  std::vector<std::int32_t> slots(4 * prompt.size());
  auto a = n.cache.admit(prompt, slots);
  REQUIRE(a.ok());
  REQUIRE(n.cache.computed(a->seq, std::int64_t(prompt.size())).ok());
  std::mt19937 rng(seed);
  for (auto& b : n.pool) b = std::uint8_t(rng());
  return a->seq;
}

// Reads every group of import `id` from `from`'s row of s into `to`, as a NIXL READ would.
std::int64_t transfer(const Node& from, SeqId s, Node& to, std::uint64_t id) {
  const TransferPlanner planner(to.describe(), from.describe());
  REQUIRE(planner.status().ok());
  std::int64_t bytes = 0;
  for (std::int32_t g = 0; g < to.cache.groups(); ++g) {
    auto got = to.cache.import_blocks(id, g);
    REQUIRE(got.ok());
    GroupBlocks gb = *got;
    const auto remote = from.row(s, g);
    gb.remote = std::span(remote).first(std::size_t(GroupRule::of(from.cache.layer_groups(), g).row_blocks(*from.cache.tokens(s))));
    std::vector<TransferDesc> plan;
    auto n = planner.plan(std::span(&gb, 1), {}, plan);
    REQUIRE(n.ok());
    bytes += *n;
    for (const TransferDesc& d : plan)
      std::memcpy(reinterpret_cast<void*>(d.local), reinterpret_cast<const void*>(d.remote), std::size_t(d.bytes));
  }
  return bytes;
}

// Every live page `to`'s s received (past its `cached` tokens) equals `from`'s at the same block index.
void same_pages(const Node& from, SeqId fs, const Node& to, SeqId ts, std::int64_t cached = 0) {
  for (std::int32_t g = 0; g < to.cache.groups(); ++g) {
    const auto a = from.row(fs, g), b = to.row(ts, g);
    const bool cross = to.cache.layer_groups().spec(g).kind == AttentionKind::cross;
    for (auto j = std::size_t(cross ? 0 : cached / to.cache.layer_groups().block_size(g)); j < b.size(); ++j)
      if (b[j] != BlockPool::null_block) {
        INFO("group " << g << " block " << j);
        REQUIRE(a[j] != BlockPool::null_block);
        CHECK(std::memcmp(from.page(a[j]).data(), to.page(b[j]).data(), from.page(a[j]).size()) == 0);
      }
  }
}

}  // namespace

TEST_CASE("hybrid import: each group receives what its next query reads, and commits byte for byte") {
  const Model m;
  REQUIRE(m.lg.block_size(1) == 8);
  REQUIRE(m.lg.hit_alignment() == 8);
  Node p(m.lg, 64), d(m.lg, 64);
  const auto prompt = tokens(45, 1);
  const SeqId ps = prefill(p, prompt, 7);

  const std::int32_t free_before = d.cache.free_blocks();
  auto imp = d.cache.import(prompt);
  REQUIRE(imp.ok());
  CHECK(imp->cached_tokens == 0);
  // full: 12 blocks; window: a query at 45 reads 34 .. 45, blocks 4, 5 of 6; chunk: 32 .. 45, blocks 4, 5; cross: 3.
  CHECK(imp->num_blocks == 12 + 2 + 2 + 3);
  CHECK(d.cache.free_blocks() == free_before - imp->num_blocks);
  CHECK(d.cache.import_blocks(imp->id, 1)->skip == 4);
  CHECK(d.cache.import_blocks(imp->id, 2)->skip == 4);
  CHECK(d.cache.import_blocks(imp->id, 3)->skip == 0);
  CHECK(d.cache.imports().size() == 1);
  CHECK(d.cache.match(prompt) == 0);  // pending blocks are found by no lookup
  REQUIRE(d.cache.check_invariants().ok());

  // The sender holds every group's blocks for one reader, and may free the sequence at once.
  TransferHolds holds;
  const std::uint64_t hold = *holds.hold(p.cache, ps, 1, 100);
  CHECK(p.cache.holds().size() == 1);

  const std::int64_t bytes = transfer(p, ps, d, imp->id);
  CHECK(bytes == std::int64_t(imp->num_blocks) * m.lg.page_bytes());  // a page is one group's: its layer fills it
  auto c = d.cache.commit_import(imp->id, prompt);
  REQUIRE(c.ok());
  CHECK(c->published == 11 + 1 + 1);  // full blocks 0 .. 10; window and chunk block 4 (5 is partial); cross never
  CHECK(d.cache.imports().size() == 0);
  REQUIRE(d.cache.check_invariants().ok());
  same_pages(p, ps, d, c->seq);
  REQUIRE(*holds.consumed(p.cache, hold, 0));
  REQUIRE(p.cache.free(ps).ok());
  CHECK(p.cache.free_blocks() == 63);
  REQUIRE(p.cache.check_invariants().ok());

  // The window holds only what the query at 45 reads (34 .. 44): a hit of 40
  // would need 29 .. 39, so the prompt alone is no hit. The sequence decodes on,
  // and once 48 tokens are computed they are one.
  CHECK(d.cache.match(prompt) == 0);
  CHECK(*d.cache.computed_tokens(c->seq) == 45);
  std::vector<std::int32_t> slots(4);
  auto longer = prompt;
  for (const std::int32_t t : {99, 98, 97}) {
    const std::int32_t next[] = {t};
    REQUIRE(d.cache.advance(c->seq, next, slots).ok());
    longer.push_back(t);
  }
  REQUIRE(d.cache.computed(c->seq, 48).ok());
  REQUIRE(d.cache.check_invariants().ok());
  longer.push_back(1);
  CHECK(d.cache.match(longer) == 48);
}

TEST_CASE("hybrid import: a local prefix is shared, and abort keeps the hit's window for the recompute") {
  const Model m;
  Node p(m.lg, 64), d(m.lg, 64);
  const auto prompt = tokens(45, 2);
  const SeqId ps = prefill(p, prompt, 9);
  {  // The decode node computed the first 17 tokens once: 16 are a hit.
    std::vector<std::int32_t> slots(4 * 17);
    const auto a = d.cache.admit(std::span(prompt).first(17), slots);
    REQUIRE(d.cache.computed(a->seq, 17).ok());
    REQUIRE(d.cache.free(a->seq).ok());
  }
  for (const bool commit : {false, true}) {
    auto imp = d.cache.import(prompt);
    REQUIRE(imp.ok());
    CHECK(imp->cached_tokens == 16);
    // The window of the query at 45 lies past the hit: the hit's window (5 .. 15: blocks 0, 1) is held, not in the row.
    CHECK(d.cache.holds().size() == 1);
    CHECK(d.cache.import_blocks(imp->id, 0)->skip == 4);
    CHECK(d.cache.import_blocks(imp->id, 0)->local.size() == 8);
    CHECK(d.cache.import_blocks(imp->id, 1)->skip == 4);
    REQUIRE(d.cache.check_invariants().ok());
    transfer(p, ps, d, imp->id);
    if (commit) {
      const auto c = *d.cache.commit_import(imp->id, prompt);
      CHECK(d.cache.holds().size() == 0);
      same_pages(p, ps, d, c.seq, 16);
      REQUIRE(d.cache.check_invariants().ok());
      CHECK(d.cache.match(prompt) == 16);  // the window lacks 29 .. 39 for a hit of 40 (the first case)
      continue;
    }
    const auto a = *d.cache.abort_import(imp->id);
    CHECK(a.cached_tokens == 16);
    CHECK(a.recompute == 29);
    CHECK(d.cache.holds().size() == 0);
    // As admit() leaves a hit of 16: the full group's 4 blocks, the window's 0 and 1, the chunk's none (16 starts a chunk).
    CHECK(*d.cache.blocks_held(a.seq, 0) == 4);
    CHECK(*d.cache.blocks_held(a.seq, 1) == 2);
    CHECK(*d.cache.blocks_held(a.seq, 2) == 0);
    CHECK(*d.cache.blocks_held(a.seq, 3) == 0);
    CHECK(*d.cache.tokens(a.seq) == 16);
    REQUIRE(d.cache.check_invariants().ok());
    CHECK(d.cache.match(prompt) == 16);  // nothing received was published
    std::vector<std::int32_t> slots(4 * 29);
    REQUIRE(d.cache.reserve(a.seq, std::span(prompt).subspan(16), slots).ok());  // the recompute's room
    REQUIRE(d.cache.check_invariants().ok());
    REQUIRE(d.cache.free(a.seq).ok());  // never computed: the next round finds the same hit
  }
}

TEST_CASE("hybrid import: errors name the value and change nothing, and the pending row answers to no handle") {
  const Model m;
  Node d(m.lg, 40);
  const auto prompt = tokens(45, 3);
  const HybridCache<> before = d.cache;
  CHECK(d.cache.import(std::span(prompt).first(0)).status() == Status{Errc::invalid_argument, "prompt.size", 0, 1});
  const auto long_prompt = tokens(65);
  CHECK(d.cache.import(long_prompt).status().what() == std::string("n_tokens"));
  CHECK(d.cache.import(long_prompt).status().code() == Errc::capacity_exceeded);
  const ExtraKey extra[] = {{}};
  CHECK(d.cache.import(prompt, {.extras = extra}).status().code() == Errc::invalid_argument);
  CHECK(d.cache.import(prompt, {.max_new = 20}).status().what() == std::string("max_new"));
  CHECK(d.cache == before);
  const auto big = tokens(64, 4);  // 16 + 2 + 0 + 3 blocks: past the 20 the first import leaves

  auto imp = d.cache.import(prompt, {.max_new = 3});
  REQUIRE(imp.ok());
  CHECK(d.cache.promised_blocks() > 0);
  const HybridCache<> pending = d.cache;
  CHECK(d.cache.import(big).status().code() == Errc::out_of_blocks);
  {  // A promise past the free pool less the first import's promise: refused as admit() refuses it.
    const auto small = tokens(10, 9);
    const std::int64_t life = *d.cache.blocks_needed(10, 54);
    const std::int64_t room = d.cache.pool().num_free() - d.cache.promised_blocks();
    REQUIRE(life > room);
    REQUIRE(*d.cache.blocks_needed(10, 0) <= room);  // the prompt alone fits
    const Status over{Errc::out_of_blocks, "max_new (the lifetime need past the free pool less promises)", life, room};
    CHECK(d.cache.import(small, {.max_new = 54}).status() == over);
    CHECK(d.cache == pending);
    std::vector<std::int32_t> admit_slots(4 * 10);
    CHECK(d.cache.admit(small, admit_slots, {.max_new = 54}).status() == over);
    CHECK(d.cache == pending);
    HybridCache<> fits = d.cache;  // max_new 0: the prompt's blocks, within the room
    CHECK(fits.import(small, {.max_new = 0}).ok());
  }
  CHECK(d.cache.commit_import(imp->id + 1, prompt).status().code() == Errc::unknown_job);
  // The commit names the prompt imported, as on every cache: another length, other tokens or extras change nothing.
  CHECK(d.cache.commit_import(imp->id, std::span(prompt).first(44)).status() == Status{Errc::invalid_argument, "prompt.size", 44, 45});
  auto other = prompt;
  other[7] += 1;
  CHECK(d.cache.commit_import(imp->id, other).status() ==
        Status{Errc::invalid_argument, "prompt (not the tokens imported)", 45, 45});
  CHECK(d.cache.commit_import(imp->id, prompt, extra).status().what() == std::string("extras (a hybrid cache hashes no multimodal inputs)"));
  CHECK(d.cache == pending);
  CHECK(d.cache.abort_import(imp->id + 1).status().code() == Errc::unknown_job);
  CHECK(d.cache.import_blocks(imp->id + 1, 0).status().code() == Errc::unknown_job);
  CHECK(d.cache.import_blocks(imp->id, 4).status() == Status{Errc::invalid_argument, "group", 4, 3});
  CHECK(d.cache.import_blocks(imp->id, -1).status().what() == std::string("group"));
  // The handle commit will give: a copy learns it, the original refuses every call naming it.
  HybridCache<> copy = d.cache;
  const SeqId s = copy.commit_import(imp->id, prompt)->seq;
  std::vector<std::int32_t> slots(4);
  const std::int32_t one[] = {1};
  const SeqId seqs[] = {s};
  std::vector<std::int32_t> table(64);
  const Status sealed{Errc::unknown_sequence, "seq (an import in flight)", s.index, 0};
  CHECK(d.cache.reserve(s, one, slots).status() == sealed);
  CHECK(d.cache.advance(s, one, slots).status() == sealed);
  CHECK(d.cache.computed(s, 45) == sealed);
  CHECK(d.cache.truncate(s, 1) == sealed);
  CHECK(d.cache.free(s) == sealed);
  CHECK(d.cache.tokens(s).status() == sealed);
  CHECK(d.cache.export_block_table(0, seqs, table, 64) == sealed);
  std::vector<std::int32_t> blocks;
  CHECK(d.cache.live_blocks(s, blocks) == sealed);
  TransferHolds holds;
  CHECK(holds.hold(d.cache, s, 1, 0).status() == sealed);
  CHECK(d.cache == pending);
  REQUIRE(d.cache.check_invariants().ok());
  REQUIRE(d.cache.abort_import(imp->id).ok());
  CHECK(d.cache.abort_import(imp->id).status().code() == Errc::unknown_job);  // once
  REQUIRE(d.cache.free(s).ok());
  CHECK(d.cache.free_blocks() == before.free_blocks());
  REQUIRE(d.cache.check_invariants().ok());

  // Every handle taken: capacity_exceeded, nothing changes.
  Node full(m.lg, 64);
  std::vector<std::int32_t> s4(4 * 4);
  for (int i = 0; i < 4; ++i) REQUIRE(full.cache.admit(tokens(4, 10 + i), s4).ok());
  const HybridCache<> all = full.cache;
  CHECK(full.cache.import(prompt).status() == Status{Errc::capacity_exceeded, "max_sequences", 5, 4});
  CHECK(full.cache == all);
}

// Found by fuzz_hybrid: with a chunked prefill, an import whose local hit
// lies well before the prompt's end holds, while it is in flight, the hit's
// window (what an abort's recompute from the hit reads) beside the blocks
// the query past the prompt reads: more than a row's bound for one chunk in
// flight, and within it for the tokens it receives. Commit frees the first.
TEST_CASE("hybrid import: an import's row holds the abort's window beside the received blocks, within the invariants") {
  std::vector<std::int32_t> l0{0};
  const LayerGroupSpec spec[] = {{.kind = AttentionKind::sliding_window, .layers = l0, .num_kv_heads = 1, .head_dim = 8, .window = 12}};
  const LayerGroups lg = *LayerGroups::make({.groups = spec, .block_size = 4});
  HybridCache<> cache({.groups = lg, .num_blocks = 40, .max_sequences = 3, .max_tokens = 35, .prefill_chunk = 8});
  const auto prompt = tokens(30, 3);
  std::vector<std::int32_t> slots(17);
  auto a = *cache.admit(std::span(prompt).first(17), slots);  // 16 tokens computed and published: 4 blocks
  for (std::int64_t done = a.reserved; done < 17; done += 8) REQUIRE(cache.advance(a.seq, std::span(prompt).subspan(std::size_t(done), std::min<std::size_t>(8, 17 - std::size_t(done))), slots).ok());
  REQUIRE(cache.computed(a.seq, *cache.tokens(a.seq)).ok());
  REQUIRE(cache.free(a.seq).ok());
  auto imp = *cache.import(prompt);
  REQUIRE(imp.cached_tokens == 16);
  // Blocks 1 .. 3 for the query at 16 (an abort recomputes from there), 4 .. 7 received for the query at 30.
  REQUIRE(cache.usage(0).held == 7);
  REQUIRE(cache.check_invariants().ok());
  auto c = *cache.commit_import(imp.id, prompt);
  REQUIRE(*cache.blocks_held(c.seq, 0) == 4);  // the query at 30 reads 19 on: blocks 4 .. 7
  REQUIRE(cache.check_invariants().ok());
}
