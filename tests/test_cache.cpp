#include <catch2/catch.hpp>

#include <kvcache/cache.hpp>

#include <algorithm>
#include <vector>

using namespace kvcache;

namespace {
Geometry geometry(std::int32_t bs = 16) {
  return *Geometry::make({.num_layers = 2, .num_kv_heads = 2, .head_dim = 64, .block_size = bs});
}
CacheConfig config(std::int32_t blocks = 33, std::int32_t seqs = 4, std::int32_t per_seq = 8) {
  return {.geometry = geometry(), .num_blocks = blocks, .max_sequences = seqs, .max_blocks_per_sequence = per_seq};
}

// Holds at most `cap` tokens: used to prove check_invariants() can fail.
struct TinyBound {
  static constexpr Signals required_signals = no_signals;
  std::int64_t cap = 4;
  std::int64_t max_tokens_held(std::int64_t n) const { return n < cap ? n : cap; }
  std::int64_t max_blocks_held(std::int64_t n, std::int32_t b) const { return (max_tokens_held(n) + b - 1) / b; }
  std::int64_t max_tokens_after_eviction() const { return cap; }
};
struct NeedsScores {
  static constexpr Signals required_signals{Signals::gate_scores};
  std::int64_t max_tokens_held(std::int64_t n) const { return n; }
  std::int64_t max_blocks_held(std::int64_t n, std::int32_t b) const { return (n + b - 1) / b; }
  std::int64_t max_tokens_after_eviction() const { return INT64_MAX; }
};
struct NotAPolicy {};
}  // namespace

static_assert(EvictionPolicy<KeepAll> && EvictionPolicy<TinyBound> && !EvictionPolicy<NotAPolicy>);
static_assert(AdmissionPolicy<AdmitAll> && !AdmissionPolicy<NotAPolicy> && !AdmissionPolicy<KeepAll>);
static_assert(SelectionPolicy<SelectAll> && !SelectionPolicy<NotAPolicy>);
static_assert(!Cache<>::provided_signals.covers(NeedsScores::required_signals));

// Empty policies and the default hasher take no space in the cache: it is
// the pool, the table, the transfers' holds and the prefix cache's state.
struct BareLayout {
  Geometry g;
  BlockPool p;
  PageTable t;
  BlockHolds holds;
  PrefixState prefix;
  PendingImports imports;
};
static_assert(sizeof(Cache<>) == sizeof(BareLayout));

TEST_CASE("cache construction rejects an empty geometry and bad capacities") {
  CHECK_THROWS_WITH(Cache<>(CacheConfig{}), Catch::Contains("geometry (empty"));
  auto cfg = config();
  // The configuration's own names (not the page table's max_streams), with every cache's words (check_pool_config).
  cfg.max_sequences = 0;
  CHECK_THROWS_WITH(Cache<>(cfg), "kvcache::Cache: invalid_argument: max_sequences=0 (limit 1)");
  cfg = config();
  cfg.num_blocks = 1;
  CHECK_THROWS_WITH(Cache<>(cfg), "kvcache::Cache: invalid_argument: num_blocks=1 (limit 2)");
  cfg = config();
  cfg.event_capacity = -1;
  CHECK_THROWS_WITH(Cache<>(cfg), "kvcache::Cache: invalid_argument: event_capacity=-1 (limit 0)");
  cfg = config();
  cfg.max_blocks_per_sequence = 0;
  CHECK_THROWS_WITH(Cache<>(cfg), "kvcache::Cache: invalid_argument: max_blocks_per_sequence=0 (limit 1)");
  try {  // typed: the status names the field
    cfg = config();
    cfg.max_sequences = -3;
    Cache<> c(cfg);
    FAIL("constructed");
  } catch (const ConfigError& e) {
    CHECK(e.status() == Status{Errc::invalid_argument, "max_sequences", -3, 1});
  }
}

TEST_CASE("accounting agrees with what the page table holds") {
  Cache<> cache(config());
  CHECK(cache.free_blocks() == 32);
  CHECK(cache.max_tokens_after_eviction() == INT64_MAX);
  CHECK(*cache.blocks_needed(100, 28) == 8);
  CHECK(*cache.blocks_needed(0, 0) == 0);
  CHECK(cache.blocks_needed(-1, 0).status().code() == Errc::invalid_argument);
  CHECK(cache.blocks_needed(5, -3).status().what() == std::string("max_new"));
  CHECK(cache.can_admit(100, 28));
  CHECK_FALSE(cache.can_admit(100, 500));

  auto s = *cache.add_sequence();
  std::vector<std::int32_t> slots(128);
  REQUIRE(cache.reserve(s, 100, slots).ok());
  CHECK(*cache.tokens_held(s) == 100);
  CHECK(*cache.blocks_held(s) == 7);
  CHECK(cache.free_blocks() == 25);
  REQUIRE(cache.reserve(s, 28, slots).ok());
  CHECK(*cache.blocks_held(s) <= *cache.blocks_needed(100, 28));
  REQUIRE(cache.check_invariants().ok());
  REQUIRE(cache.free(s).ok());
  CHECK(cache.tokens_held(s).status().code() == Errc::unknown_sequence);
  CHECK(cache.blocks_held(s).status().code() == Errc::unknown_sequence);
  CHECK(cache.free_blocks() == 32);
}

TEST_CASE("can_admit also needs a free sequence handle") {
  Cache<> cache(config(33, 2));
  REQUIRE(cache.add_sequence().ok());
  REQUIRE(cache.add_sequence().ok());
  CHECK_FALSE(cache.can_admit(1, 1));
  CHECK(cache.free_sequences() == 0);
}

TEST_CASE("check_invariants enforces the eviction policy's advertised bound") {
  Cache<BlockPool, PageTable, AdmitAll, SelectAll, TinyBound> cache(config());
  CHECK(cache.max_tokens_after_eviction() == 4);
  CHECK(*cache.blocks_needed(100, 100) == 7);  // the prompt is held whole until the policy runs
  CHECK(*cache.blocks_needed(2, 100) == 1);
  auto s = *cache.add_sequence();
  std::vector<std::int32_t> slots(8);
  REQUIRE(cache.reserve(s, 4, slots).ok());
  REQUIRE(cache.check_invariants().ok());
  REQUIRE(cache.reserve(s, 1, slots).ok());  // no eviction runs yet: the bound is broken
  auto st = cache.check_invariants();
  CHECK(st.code() == Errc::invariant_violated);
  CHECK(std::string(st.what()) == "tokens_held");
}

TEST_CASE("the composed cache forwards sharing, rollback and exports") {
  Cache<BlockPool, PageTable, AdmitAll, SelectAll, KeepAll, SipHasher128> cache(config(), {}, {}, {},
                                                                                 SipHasher128(0x1234, 0x5678));
  std::vector<std::int32_t> prompt(40);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = std::int32_t(i * 3);
  auto a = *cache.add_sequence();
  std::vector<std::int32_t> slots(64);
  REQUIRE(cache.reserve(a, 40, slots).ok());
  CHECK(*cache.publish(a, prompt) == 2);
  auto b = cache.add_sequence(prompt);
  REQUIRE(b.ok());
  CHECK(b->cached_tokens == 32);
  std::vector<BlockId> hits(4);
  CHECK(cache.match_prefix(prompt, {}, hits) == 2);
  auto c = *cache.fork(a);
  REQUIRE(cache.truncate(c, 10).ok());
  const std::array<SeqId, 3> seqs{a, b->seq, c};
  std::vector<std::int32_t> indptr(4), indices(16), last(3), lens(3), dense(3 * 8);
  REQUIRE(cache.export_csr(seqs, indptr, indices, last).ok());
  REQUIRE(cache.export_lengths(seqs, lens).ok());
  REQUIRE(cache.export_block_table(seqs, dense, 8).ok());
  CHECK(lens == std::vector<std::int32_t>{40, 32, 30});
  CHECK(indptr == std::vector<std::int32_t>{0, 3, 5, 7});
  CHECK(last == std::vector<std::int32_t>{8, 16, 14});
  CHECK(dense[8] == dense[0]);  // b shares a's first block
  REQUIRE(cache.check_invariants().ok());
  std::vector<BlockEvent> ev(8);
  CHECK(cache.drain_events(ev) == 0);  // events are off unless asked for
  CHECK(cache.reset_prefix_cache().code() == Errc::blocks_in_use);
}

TEST_CASE("reserve_batch without copies: fine while no entry shares a partial block, buffer_too_small naming copies after a fork") {
  Cache<> cache(config());
  std::vector<std::int32_t> slots(64);
  const SeqId a = *cache.add_sequence();
  REQUIRE(cache.reserve(a, 10, slots).ok());  // a partial tail block
  const SeqId one[] = {a};
  const std::int32_t count[] = {1};
  CHECK(cache.reserve_batch(one, count, slots).ok());  // no copy needed: copies may be left out
  const SeqId child = *cache.fork(a);  // now both share a's partial tail
  const auto before = cache;
  const SeqId both[] = {a, child};
  const std::int32_t counts[] = {1, 1};
  CHECK(cache.reserve_batch(both, counts, slots).status() == Status{Errc::buffer_too_small, "copies", 0, 2});  // each sharer counted, as planned
  CHECK(std::all_of(slots.begin(), slots.end(), [](std::int32_t s) { return s == -1; }));
  CHECK(cache == before);  // refused: nothing changed
  std::vector<BlockCopy> copies(2);
  const auto r = cache.advance_batch(both, counts, slots, copies);
  REQUIRE(r.ok());
  CHECK(r->copies == 1);  // the first writer copies; the other keeps the block
  REQUIRE(cache.check_invariants().ok());
}
