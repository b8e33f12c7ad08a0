// Block events of a hybrid cache: routers see each group's stored and
// removed blocks, keyed by (hash, group) as the prefix index is, with the
// block's own size and token ids, and on the wire each event names its
// group_idx (vLLM's KVEventBatch).
#include <catch2/catch.hpp>

#include <kvcache/cache/hybrid.hpp>
#include <kvcache/wire/kv_events_wire.hpp>

#include <map>
#include <vector>

using namespace kvcache;

namespace {

std::vector<std::int32_t> tokens(std::int32_t n, std::int32_t seed) {
  std::vector<std::int32_t> v(static_cast<std::size_t>(n));
  for (std::int32_t i = 0; i < n; ++i) v[std::size_t(i)] = (i * 7919 + seed * 104729) % 50021;
  return v;
}

// Full attention in pages of 8 tokens, a window of 8 in pages of 4 (twice the bytes per token): two chains.
struct TwoSizes {
  std::vector<std::int32_t> l0{0}, l1{1};
  LayerGroupSpec specs[2];
  LayerGroups lg;
  TwoSizes() {
    specs[0] = {.kind = AttentionKind::full, .layers = l0, .num_kv_heads = 1, .head_dim = 8};
    specs[1] = {.kind = AttentionKind::sliding_window, .layers = l1, .num_kv_heads = 2, .head_dim = 8, .window = 8};
    lg = *LayerGroups::make({.groups = specs, .block_size = 4});
  }
};

// Admits `prompt` whole and computes it.
SeqId prefill(HybridCache<>& c, const std::vector<std::int32_t>& prompt) {
  std::vector<std::int32_t> slots(std::size_t(c.groups()) * prompt.size());
  auto a = c.admit(prompt, slots);
  REQUIRE(a.ok());
  REQUIRE(c.computed(a->seq, std::int64_t(prompt.size())).ok());
  REQUIRE(c.check_invariants().ok());
  return a->seq;
}

}  // namespace

TEST_CASE("hybrid events: each group's stored blocks, with their group, size and ids, and removals name the group") {
  TwoSizes m;
  REQUIRE(m.lg.block_size(0) == 8);
  REQUIRE(m.lg.block_size(1) == 4);
  HybridCache<> c({.groups = m.lg, .num_blocks = 12, .max_sequences = 2, .max_tokens = 32, .event_capacity = 64});
  CHECK(c.tokens_per_event() == 8);
  const auto p = tokens(17, 1);
  const SeqId s = prefill(c, p);  // full: 2 blocks of 8; window: 4 blocks of 4

  std::vector<BlockEvent> ev(64);
  std::vector<std::int32_t> ids(64 * 8, -1);
  const std::int32_t n = *c.drain_events(ev, ids);
  REQUIRE(n == 6);
  std::map<std::int32_t, std::int32_t> per_group;
  for (std::int32_t e = 0; e < n; ++e) {
    const BlockEvent& x = ev[std::size_t(e)];
    CHECK(x.kind == EventKind::stored);
    REQUIRE((x.group == 0 || x.group == 1));
    const std::int32_t B = x.group == 0 ? 8 : 4, j = per_group[x.group]++;
    CHECK(x.block_size == B);
    CHECK(x.num_tokens == B);
    CHECK(c.pool().has_hash(x.block));
    for (std::int32_t t = 0; t < B; ++t) CHECK(ids[std::size_t(e * 8 + t)] == p[std::size_t(j * B + t)]);  // the block's own ids
  }
  CHECK(per_group == std::map<std::int32_t, std::int32_t>{{0, 2}, {1, 4}});
  // Group by group, as vLLM publishes a request's new blocks per group: one wire event each.
  CHECK(ev[0].group == 0);
  CHECK(ev[1].group == 0);
  CHECK(ev[2].group == 1);
  CHECK(!ev[1].first);  // chained to the first
  CHECK(ev[3].first);   // a window block is published as a chain root
  std::vector<std::uint8_t> out;
  auto wire = encode_kv_events(std::span(ev).first(6), std::span(ids).first(6 * 8), 8, {}, out);
  REQUIRE(wire.ok());
  CHECK(*wire == 5);  // the full group's chain merges; the window's blocks are each a chain root
  MsgpackReader r(out);
  REQUIRE(*r.array("batch") == 3);
  REQUIRE(r.float64("ts").ok());
  REQUIRE(*r.array("events") == 5);
  for (std::int32_t e = 0; e < 5; ++e) {
    REQUIRE(*r.array("stored") == 10);
    CHECK(*r.str("tag") == "BlockStored");
    const auto hashes = *r.array("hashes");
    for (std::uint32_t k = 0; k < hashes; ++k) REQUIRE(r.uint("hash").ok());
    if (!r.nil()) REQUIRE(r.uint("parent").ok());
    const auto count = *r.array("token_ids");
    for (std::uint32_t k = 0; k < count; ++k) REQUIRE(r.sint("token").ok());
    const auto B = *r.sint("block_size");
    CHECK(count == hashes * std::uint32_t(B));
    CHECK(r.nil());
    CHECK(*r.str("medium") == "GPU");
    CHECK(r.nil());
    CHECK(r.nil());
    CHECK(*r.sint("group_idx") == (B == 8 ? 0 : 1));  // the event's own group, not the batch's
  }

  // Recycling the cached blocks removes them: each removal names the group that stored it.
  std::map<std::int32_t, std::int32_t> stored_group;  // block -> group
  for (std::int32_t e = 0; e < n; ++e) stored_group[ev[std::size_t(e)].block] = ev[std::size_t(e)].group;
  REQUIRE(c.free(s).ok());
  const SeqId t = prefill(c, tokens(24, 2));  // a miss that needs the cached blocks back
  const std::int32_t drained = c.drain_events(ev);
  std::int32_t removed = 0;
  for (std::int32_t e = 0; e < drained; ++e)
    if (const BlockEvent& x = ev[std::size_t(e)]; x.kind == EventKind::removed && stored_group.count(x.block)) {
      CHECK(x.group == stored_group[x.block]);
      ++removed;
    }
  CHECK(removed > 0);
  CHECK(c.free(t).ok());
}

TEST_CASE("hybrid events: an overflowing ring counts what it dropped, and a cache built without events keeps none") {
  TwoSizes m;
  HybridCache<> quiet({.groups = m.lg, .num_blocks = 12, .max_sequences = 2, .max_tokens = 32});
  (void)prefill(quiet, tokens(17, 1));
  std::vector<BlockEvent> ev(8);
  CHECK(quiet.drain_events(ev) == 0);

  HybridCache<> small({.groups = m.lg, .num_blocks = 12, .max_sequences = 2, .max_tokens = 32, .event_capacity = 4,
                       .medium = Medium::cpu});
  (void)prefill(small, tokens(17, 1));
  CHECK(small.pool().events().dropped() == 2);
  std::vector<std::int32_t> ids(8 * 7);
  CHECK(small.drain_events(ev, ids).status().what() == std::string("token_ids"));  // 8 events need 64 ids
  const std::int32_t n = *small.drain_events(std::span(ev).first(4), std::span(ids).first(32));
  CHECK(n == 4);
  for (std::int32_t e = 0; e < n; ++e) CHECK(ev[std::size_t(e)].medium == Medium::cpu);

  CHECK_THROWS_AS(HybridCache<>({.groups = m.lg, .num_blocks = 12, .max_sequences = 2, .max_tokens = 32, .event_capacity = -1}),
                  ConfigError);
}

TEST_CASE("hybrid events: groups of one rule side by side each publish their blocks with the block's ids, kept once per rule") {
  // Gemma-shaped: a full group between two windows of one shape. Their token
  // ids are kept in the first window's pages alone (HybridPrefix::keeper):
  // every group's event still carries the ids of the block it names.
  const std::vector<std::int32_t> l0{0}, l1{1}, l2{2};
  const LayerGroupSpec specs[] = {
      {.kind = AttentionKind::sliding_window, .layers = l0, .num_kv_heads = 1, .head_dim = 8, .window = 8},
      {.kind = AttentionKind::full, .layers = l1, .num_kv_heads = 1, .head_dim = 8},
      {.kind = AttentionKind::sliding_window, .layers = l2, .num_kv_heads = 1, .head_dim = 8, .window = 8}};
  const auto lg = *LayerGroups::make({.groups = specs, .block_size = 4});
  HybridCache<> c({.groups = lg, .num_blocks = 40, .max_sequences = 2, .max_tokens = 32, .event_capacity = 128});
  const auto p = tokens(26, 3);
  std::vector<std::int32_t> slots(3 * 26);
  auto a = c.admit(std::span(p).first(10), slots);  // prefill 10, then decode one token at a time to 26
  REQUIRE(a.ok());
  REQUIRE(c.computed(a->seq, 10).ok());
  for (std::int32_t t = 10; t < 26; ++t) REQUIRE(c.advance(a->seq, std::span(p).subspan(std::size_t(t), 1), slots).ok());
  REQUIRE(c.computed(a->seq, 26).ok());
  REQUIRE(c.check_invariants().ok());

  std::vector<BlockEvent> ev(128);
  std::vector<std::int32_t> ids(128 * 4, -1);
  const std::int32_t n = *c.drain_events(ev, ids);
  std::map<std::int32_t, std::int32_t> per_group;
  for (std::int32_t e = 0; e < n; ++e) {
    const BlockEvent& x = ev[std::size_t(e)];
    REQUIRE(x.kind == EventKind::stored);
    const std::int32_t j = per_group[x.group]++;  // each group publishes its blocks in order
    for (std::int32_t t = 0; t < 4; ++t) CHECK(ids[std::size_t(e * 4 + t)] == p[std::size_t(j * 4 + t)]);
  }
  CHECK(per_group == std::map<std::int32_t, std::int32_t>{{0, 6}, {1, 6}, {2, 6}});
  // The twins' names differ only by their group: a later request finds the prompt in every group.
  CHECK(c.match(p) == 24);
}
