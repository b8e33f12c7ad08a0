// What a new engine author and a fuzzer found (issue #11), one test per
// finding: each failed before its fix. Errors are typed, name the value and
// change nothing; legal states never read as invariant violations.
#include <catch2/catch.hpp>

#include <kvcache/cache.hpp>
#include <kvcache/eviction/average_attention.hpp>
#include <kvcache/eviction/block_scores.hpp>
#include <kvcache/eviction/h2o.hpp>
#include <kvcache/eviction/sink_window.hpp>
#include <kvcache/eviction/sliding_window.hpp>
#include <kvcache/eviction/snapkv.hpp>
#include <kvcache/eviction/tova.hpp>
#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/gather.hpp>
#include <kvcache/kernels/page_bounds.hpp>
#include <kvcache/kernels/ring_admit.hpp>
#include <kvcache/kernels/ring_write.hpp>
#include <kvcache/kernels/rope.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kernels/scores.hpp>

#include <cmath>
#include <limits>
#include <map>
#include <vector>

#include "kernel_testing.hpp"

using namespace kvcache;

namespace {
constexpr std::int32_t B = 4, G = 2;  // block size; groups = kv-heads
GeometrySpec spec() { return {.num_layers = 1, .num_kv_heads = G, .head_dim = 1, .block_size = B, .dtype = DType::f32}; }
CacheConfig config(std::int32_t blocks = 64, std::int32_t seqs = 4, std::int32_t per_seq = 16) {
  return {.geometry = *Geometry::make(spec()), .num_blocks = blocks, .max_sequences = seqs, .max_blocks_per_sequence = per_seq};
}

// An engine as the README writes it: K of (slot, head g) holds the position
// group g keeps there; every evict runs the compaction kernel on each
// group's range of moves, whatever the result says.
template <class Policy>
struct Engine {
  Cache<BlockPool, PageTable, AdmitAll, SelectAll, Policy> cache;
  kvtest::Pool pool{spec(), 64};
  std::map<std::uint32_t, std::int64_t> appended;  // by stream index
  std::vector<SlotMove> moves = std::vector<SlotMove>(std::size_t(G * 64 * B));
  std::vector<std::int32_t> group_moves = std::vector<std::int32_t>(G + 1);

  explicit Engine(Policy p) : cache(config(), {}, {}, std::move(p)) {}
  float* elem(std::int32_t slot, std::int32_t g) {
    return reinterpret_cast<float*>(pool.bytes.data() + kvtest::ref_offset(spec(), 64, slot / B, 0, 0, slot % B, g, 0));
  }
  std::int32_t slot_of(SeqId s, std::int32_t j) const { return (*cache.table().blocks(s))[std::size_t(j / B)] * B + j % B; }
  Status append(SeqId s, std::int32_t n) {
    std::vector<std::int32_t> slots(static_cast<std::size_t>(n));
    auto r = cache.reserve(s, n, slots);
    if (!r) return r.status();
    if (r->copy.src >= 0)  // copy-on-write: every head of the block
      for (std::int32_t j = 0; j < B; ++j)
        for (std::int32_t g = 0; g < G; ++g) *elem(r->copy.dst * B + j, g) = *elem(r->copy.src * B + j, g);
    for (std::int32_t i = 0; i < n; ++i)
      for (std::int32_t g = 0; g < G; ++g) *elem(slots[std::size_t(i)], g) = float(appended[s.index] + i);
    appended[s.index] += n;
    return {};
  }
  Status observe(SeqId s, float salt) {
    const auto held = std::int32_t(*cache.tokens_held(s));
    std::vector<float> v(std::size_t(G * held));
    for (std::int32_t g = 0; g < G; ++g)
      for (std::int32_t j = 0; j < held; ++j)
        v[std::size_t(g * held + j)] = std::fmod(*elem(slot_of(s, j), g) * 0.37f + salt, 1.0f);
    if constexpr (std::is_same_v<Policy, TovaEviction>) return cache.observe(s, Scores{ScoreKind::last_query_attention, v, G});
    else return cache.observe(s, Scores{ScoreKind::head_attention_sums, v, G});
  }
  Result<EvictionResult> evict(SeqId s) {
    auto r = cache.evict(s, EvictionSpans{.moves = moves, .group_moves = group_moves});
    if (!r) return r;
    const std::int32_t groups = cache.eviction().groups(), heads = G / groups;
    for (std::int32_t g = 0; g < groups; ++g) {  // literally the README's loop: no early return on an empty plan
      CompactionParams p{.cache = pool.view, .moves = moves.data() + group_moves[std::size_t(g)],
                         .num_moves = group_moves[std::size_t(g + 1)] - group_moves[std::size_t(g)],
                         .first_head = g * heads, .num_heads = heads};
      REQUIRE(compaction_host(p).ok());
    }
    return r;
  }
  // Memory read back through the row is what the policy tracks, slot by slot.
  void check(SeqId s) {
    const auto held = std::int32_t(*cache.tokens_held(s));
    const std::int32_t heads = G / cache.eviction().groups();
    for (std::int32_t h = 0; h < G; ++h) {
      const auto tracked = cache.eviction().positions(s.index, h / heads);
      for (std::int32_t j = 0; j < std::min<std::int32_t>(held, std::int32_t(tracked.size())); ++j)
        REQUIRE(std::int64_t(*elem(slot_of(s, j), h)) == tracked[std::size_t(j)]);
    }
  }
};
}  // namespace

TEST_CASE("an evict with nothing to evict writes empty ranges, never the last call's moves") {
  Engine<H2OEviction> e(H2OEviction({.heavy = 4, .recent = 4, .groups = G}));
  const SeqId a = *e.cache.add_sequence(), b = *e.cache.add_sequence();
  REQUIRE(e.append(a, 12).ok());
  REQUIRE(e.append(b, 3).ok());
  REQUIRE(e.observe(a, 0.1f).ok());
  REQUIRE(e.evict(a)->moves > 0);
  std::fill(e.group_moves.begin(), e.group_moves.end(), 7);  // poison: a stale plan would show
  auto r = e.evict(b);
  REQUIRE(r.ok());
  CHECK(r->moves == 0);
  CHECK(e.group_moves == std::vector<std::int32_t>(G + 1, 0));
  // A token policy always needs group_moves: without it the call fails and changes nothing.
  const auto before = e.cache;
  CHECK(e.cache.evict(b, EvictionSpans{}).status().message() == "buffer_too_small: group_moves=0 (limit 3)");
  CHECK(e.cache == before);
}

TEMPLATE_TEST_CASE("forks, rollbacks and evictions keep memory and policy state in step", "", H2OEviction,
                   TovaEviction, AverageAttentionEviction) {
  auto make = [] {
    if constexpr (std::is_same_v<TestType, H2OEviction>) return H2OEviction({.heavy = 5, .recent = 3, .groups = G});
    else if constexpr (std::is_same_v<TestType, TovaEviction>) return TovaEviction({.budget = 8});
    else return AverageAttentionEviction({.budget = 9, .step = 2, .groups = G});
  };
  Engine<TestType> e(make());
  std::vector<SeqId> live{*e.cache.add_sequence()};
  std::uint64_t x = 42;
  auto rnd = [&](std::uint64_t n) { return ((x = x * 6364136223846793005ull + 1442695040888963407ull) >> 33) % n; };
  for (int step = 0; step < 400; ++step) {
    const SeqId s = live[rnd(live.size())];
    const auto op = rnd(10);
    if (op == 0 && live.size() < 4) {
      auto c = e.cache.fork(s);
      REQUIRE(c.ok());
      e.appended[c->index] = e.appended[s.index];
      live.push_back(*c);
    } else if (op == 1 && live.size() > 1) {
      REQUIRE(e.cache.free(s).ok());
      e.appended.erase(s.index);
      std::erase(live, s);
    } else if (op == 2) {  // rollback within what the cache allows
      const auto n = std::int32_t(rnd(4));
      const auto st = e.cache.truncate(s, n);
      if (st) e.appended[s.index] -= n;
      else REQUIRE(st.code() == Errc::truncate_too_many);
    } else {
      if (!e.append(s, 1 + std::int32_t(rnd(3))).ok()) continue;  // pool full: skip, like a scheduler would
      REQUIRE(e.cache.check_invariants().ok());                  // reserved, not yet evicted: legal
      REQUIRE(e.observe(s, float(step % 7) * 0.1f).ok());
      REQUIRE(e.evict(s).ok());
    }
    INFO("step " << step << ": " << e.cache.check_invariants().message());
    REQUIRE(e.cache.check_invariants().ok());
    for (const SeqId t : live) e.check(t);
  }
}

TEST_CASE("a failed Result never reads as success") {
  auto g = Geometry::make({.num_layers = 0});
  REQUIRE_FALSE(g.ok());
  CHECK_THROWS_AS(g->pool_bytes(10), BadResultAccess);
  try {
    (void)*g;
    FAIL("no throw");
  } catch (const BadResultAccess& e) {
    CHECK(e.status().code() == Errc::invalid_argument);
    CHECK_THAT(e.what(), Catch::Contains("num_layers=0"));
  }
  CHECK_THROWS_AS(g.value(), BadResultAccess);
  CHECK(Result<int>(Status{Errc::out_of_blocks, "n"}).value_or(-1) == -1);
  CHECK(Result<int>(5).value_or(-1) == 5);
}

TEST_CASE("a range-for over the value of a temporary Result walks a value it owns") {
  // *call() on a temporary moves the value out, so the loop's range outlives the Result
  // (a reference into the temporary would dangle: ASan reports that as a use after free).
  const auto make = [](int n) { return Result<std::vector<int>>(std::vector<int>(std::size_t(n), 3)); };
  int sum = 0;
  for (const int x : *make(1000)) sum += x;
  CHECK(sum == 3000);
  static_assert(std::is_same_v<decltype(*make(1)), std::vector<int>>);
  const auto kept = make(2);
  static_assert(std::is_same_v<decltype(*kept), const std::vector<int>&>);
  CHECK_THROWS_AS(*Result<std::vector<int>>(Status{Errc::out_of_blocks, "n"}), BadResultAccess);
}

TEST_CASE("a fork under a token policy is legal: above the bound only by its shared excess, and back after") {
  Engine<H2OEviction> e(H2OEviction({.heavy = 4, .recent = 4, .groups = G}));
  const SeqId a = *e.cache.add_sequence();
  REQUIRE(e.append(a, 8).ok());
  REQUIRE(e.append(a, 1).ok());  // 9 held, bound 8: legal until the next evict
  REQUIRE(e.cache.check_invariants().ok());
  const SeqId b = *e.cache.fork(a);  // every block shared
  REQUIRE(e.cache.check_invariants().ok());
  REQUIRE(e.observe(a, 0.3f).ok());
  REQUIRE(e.evict(a).ok());
  CHECK(*e.cache.tokens_held(a) == 9);  // nothing unshared to evict
  CHECK(*e.cache.shared_excess(a) == 1);
  CHECK(e.cache.shared_excess() == 1);
  REQUIRE(e.cache.check_invariants().ok());
  REQUIRE(e.cache.free(a).ok());  // the sharing ends
  REQUIRE(e.observe(b, 0.2f).ok());
  REQUIRE(e.evict(b).ok());
  CHECK(*e.cache.tokens_held(b) == 8);
  CHECK(*e.cache.shared_excess(b) == 0);
  REQUIRE(e.cache.check_invariants().ok());
  CHECK(e.cache.shared_excess(a).status().code() == Errc::unknown_sequence);
}

TEST_CASE("a sliding window releases dead published blocks tail first: the chain's root stays reachable") {
  Cache<BlockPool, PageTable, AdmitAll, SelectAll, SlidingWindow> cache(config(16), {}, {}, SlidingWindow(4));
  std::vector<std::int32_t> tokens(16), slots(64);  // 12 written and published; a prompt reuses up to 15
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = std::int32_t(i + 7);
  const auto written = std::span(tokens).first(12);
  const SeqId a = *cache.add_sequence();
  REQUIRE(cache.reserve(a, 12, slots).ok());
  REQUIRE(*cache.publish(a, written) == 3);
  REQUIRE(cache.reserve(a, 8, slots).ok());
  REQUIRE(cache.evict(a, {}).ok());  // 4 dead blocks, 3 of them published
  std::vector<BlockId> hit(4);
  CHECK(cache.match_prefix(tokens, {}, hit) == 3);
  // Use every plain free block and one cached block: the chain's tail goes first.
  const SeqId b = *cache.add_sequence();
  REQUIRE(cache.reserve(b, (cache.free_blocks() - 3 + 1) * B, slots).ok());
  CHECK(cache.match_prefix(tokens, {}, hit) == 2);
}

TEMPLATE_TEST_CASE("a failed token-policy evict changes nothing, and a retry does the whole job", "", H2OEviction,
                   TovaEviction, AverageAttentionEviction, SnapKVEviction) {
  auto make = [] {
    if constexpr (std::is_same_v<TestType, H2OEviction>) return H2OEviction({.heavy = 4, .recent = 2, .groups = G});
    else if constexpr (std::is_same_v<TestType, TovaEviction>) return TovaEviction({.budget = 6});
    else if constexpr (std::is_same_v<TestType, SnapKVEviction>)
      return SnapKVEviction({.capacity = 4, .window = 2, .kernel = 1, .groups = G});
    else return AverageAttentionEviction({.budget = 6, .step = 2, .groups = G});
  };
  Engine<TestType> e(make());
  const SeqId s = *e.cache.add_sequence();
  REQUIRE(e.append(s, 10).ok());
  REQUIRE(e.observe(s, 0.5f).ok());
  REQUIRE(e.append(s, 2).ok());  // not observed yet: a sync would show in the snapshot
  const auto before = e.cache;
  std::vector<SlotMove> few(1);
  auto r = e.cache.evict(s, EvictionSpans{.moves = few, .group_moves = e.group_moves});
  CHECK(r.status().code() == Errc::buffer_too_small);
  CHECK(e.cache == before);
  auto twin = before;  // the same call on the untouched cache, as if the failure never happened
  const auto expect = twin.evict(s, EvictionSpans{.moves = e.moves, .group_moves = e.group_moves});
  r = e.evict(s);
  REQUIRE(r.ok());
  CHECK(r->tokens == expect->tokens);
  CHECK(r->tokens >= 4);  // 12 held, at most 8 kept
  CHECK(e.cache == twin);
  e.check(s);
}

TEST_CASE("rollback after compaction reaches back only to the compaction, and removes the newest tokens") {
  Engine<H2OEviction> e(H2OEviction({.heavy = 2, .recent = 1, .groups = G}));
  const SeqId s = *e.cache.add_sequence();
  REQUIRE(e.append(s, 5).ok());
  REQUIRE(e.observe(s, 0.0f).ok());
  REQUIRE(e.evict(s)->tokens == 2);
  const auto before = e.cache;
  const auto positions = std::vector<std::int32_t>(e.cache.eviction().positions(s.index, 0).begin(),
                                                   e.cache.eviction().positions(s.index, 0).end());
  CHECK(e.cache.truncate(s, 1).message() == "truncate_too_many: n_tokens=1 (limit 0)");
  CHECK(e.cache == before);
  REQUIRE(e.append(s, 2).ok());
  REQUIRE(e.observe(s, 0.5f).ok());  // the new tokens join the policy's state
  REQUIRE(e.cache.truncate(s, 2).ok());
  e.appended[s.index] -= 2;
  CHECK(std::vector<std::int32_t>(e.cache.eviction().positions(s.index, 0).begin(),
                                  e.cache.eviction().positions(s.index, 0).end()) == positions);
  REQUIRE(e.append(s, 1).ok());  // position 5 again, after the kept ones
  REQUIRE(e.observe(s, 0.5f).ok());
  CHECK(e.cache.eviction().positions(s.index, 0).back() == 5);
  REQUIRE(e.cache.check_invariants().ok());
  e.check(s);
}

TEST_CASE("block policies count in the geometry's block size, given once") {
  using BS = Cache<BlockPool, PageTable, AdmitAll, SelectAll, BlockScoreEviction>;
  using SW = Cache<BlockPool, PageTable, AdmitAll, SelectAll, SinkWindowEviction>;
  // The configs hold no block size: the cache binds the geometry's.
  CHECK_THROWS_WITH(BS(config(), {}, {}, BlockScoreEviction({.start = 6, .recent = 16, .max = 64})),
                    Catch::Contains("start (a multiple of the block size)=6 (limit 4)"));
  const BS bs(config(), {}, {}, BlockScoreEviction({.start = 16, .recent = 16, .max = 64}));
  CHECK(bs.eviction().block_size() == B);
  const SW sw(config(), {}, {}, SinkWindowEviction({.sinks = 3, .window = 32}));
  CHECK(sw.eviction().block_size() == B);
  CHECK(sw.eviction().pinned() == B);  // 3 sinks round up to one block of the geometry's size
  CHECK(sw.max_tokens_after_eviction() == B + 32 + B - 1);
}

TEST_CASE("extreme values are typed errors, not overflow") {
  Cache<> cache(config());
  CHECK(cache.blocks_needed(INT64_MAX, 0).status().code() == Errc::invalid_argument);
  CHECK_THAT(cache.blocks_needed(100, INT64_MAX).status().message(), Catch::Contains("max_new"));
  CHECK(*cache.blocks_needed(100, 0, INT64_MAX) == 25);
  Cache<BlockPool, PageTable, AdmitAll, SelectAll, SlidingWindow> window(config(), {}, {}, SlidingWindow(8));
  CHECK(*window.blocks_needed(100, 0, INT64_MAX) == 25);  // a chunk longer than the prompt is the prompt
  const std::int64_t big = INT64_MAX;
  CHECK(KeepAll{}.max_blocks_held(big, 16) == big / 16 + 1);
  CHECK(SnapKVEviction({}).max_blocks_held(big, 16) == big / 16 + 1);
  CHECK(H2OEviction({}).max_blocks_held(big, 16) == 17);
  CHECK(SlidingWindow(INT32_MAX).max_blocks_held(big, 1) == std::int64_t{INT32_MAX} + 1);
  CHECK_THROWS_WITH(BlockScoreEviction({.start = 1 << 30, .recent = 1 << 30, .max = 1 << 30}),
                    Catch::Contains("max=1073741824"));
  CHECK_THROWS_WITH(SinkWindowEviction({.sinks = INT32_MAX, .window = 16}), Catch::Contains("sinks+window"));
  auto cfg = config();
  cfg.event_capacity = -1;
  CHECK_THROWS_WITH(Cache<>(cfg), Catch::Contains("event_capacity=-1"));
  // Per-token policy state of 4096 groups x 256 sequences x 16k tokens: past the bookkeeping limit.
  using H = Cache<BlockPool, PageTable, AdmitAll, SelectAll, H2OEviction>;
  try {
    H h({.geometry = config().geometry, .num_blocks = 64, .max_sequences = 256, .max_blocks_per_sequence = 4096}, {}, {},
        H2OEviction({.groups = 4096}));
    FAIL("no error");
  } catch (const ConfigError& e) {
    CHECK(e.status().code() == Errc::capacity_exceeded);
    CHECK_THAT(e.what(), Catch::Contains("groups"));
  }
}

TEST_CASE("observe rejects a kind outside ScoreKind and infinite scores, and changes nothing") {
  Engine<H2OEviction> e(H2OEviction({.heavy = 4, .recent = 4, .groups = G}));
  const SeqId s = *e.cache.add_sequence();
  REQUIRE(e.append(s, 3).ok());
  const auto before = e.cache;
  std::vector<float> v(std::size_t(G * 3), 0.5f);
  CHECK_THAT(e.cache.observe(s, Scores{ScoreKind(3), v, G}).message(), Catch::Contains("scores.kind=3"));
  v[4] = std::numeric_limits<float>::infinity();
  CHECK(e.cache.observe(s, Scores{ScoreKind::head_attention_sums, v, G}).message() == "invalid_argument: scores_at=4 (limit 0)");
  v[4] = std::numeric_limits<float>::max();  // the largest finite score is fine
  CHECK(e.cache == before);
  CHECK(e.cache.observe(s, Scores{ScoreKind::head_attention_sums, v, G}).ok());
}

TEST_CASE("every enum field of every kernel's parameters is checked: a value outside its enum names the field and writes nothing") {
  const GeometrySpec spec{.num_layers = 1, .num_kv_heads = 1, .head_dim = 4, .block_size = B, .dtype = DType::f32};
  kvtest::Pool pool(spec, 4);
  kvtest::poison(pool.bytes);
  const auto before = pool.bytes;
  const auto bogus_dtype = static_cast<DType>(kLastDType + 1);
  std::vector<float> k(4, 1.0f), v(4, 2.0f), out(16), bounds(4 * 2 * 4), cs(4), sn(4), attn(4), sc(4);
  std::vector<std::int32_t> slots{1}, indptr{0, 1}, indices{1}, out_indptr{0, 1}, one{1}, zero{0}, len{1}, rows(8, 1);
  std::vector<std::uint8_t> bits(B);
  const std::vector<BlockCopy> pairs{{1, 2}};
  const std::vector<SlotMove> moves{{1, 2}};
  const float gate = 1.0f;
  const KvSource src{k.data(), v.data(), DType::f32, 0, 16, 16};
  auto bad = [&](PoolView view) { view.dtype = bogus_dtype; return view; };
  auto named = [&](Status st, const char* field) {
    INFO(st.message());
    CHECK(st.code() == Errc::invalid_argument);
    CHECK(std::string(st.what()) == field);
    CHECK(pool.bytes == before);
  };
  ScatterParams sp{pool.view, src, TokenAddress{slots.data()}, 1};
  REQUIRE(check_scatter_shape(sp).ok());
  named(scatter_host({bad(pool.view), src, TokenAddress{slots.data()}, 1}), "cache.dtype");
  sp.src.dtype = bogus_dtype;
  named(scatter_host(sp), "src.dtype");
  named(ring_write_host({.cache = pool.view, .src = sp.src, .num_tokens = 1, .ring_slots = slots.data()}), "src.dtype");
  GatherParams gp{.cache = pool.view, .indptr = indptr.data(), .indices = indices.data(), .out_indptr = out_indptr.data(),
                  .num_seqs = 1, .num_rows = 1, .k_out = out.data(), .v_out = out.data() + 8, .out_dtype = DType::f32,
                  .token_stride = 16, .head_stride = 16};
  REQUIRE(check_gather_shape(gp).ok());
  gp.out_dtype = bogus_dtype;
  named(gather_host(gp), "out_dtype");
  gp.out_dtype = DType::f32;
  gp.cache = bad(pool.view);
  named(gather_host(gp), "cache.dtype");
  named(block_copy_host({bad(pool.view), bad(pool.view), pairs.data(), 1}), "src.dtype");
  named(compaction_host({.cache = bad(pool.view), .moves = moves.data(), .num_moves = 1}), "cache.dtype");
  RopeParams rp{.cache = pool.view, .blocks = one.data(), .deltas = zero.data(), .num_entries = 1, .cos = cs.data(),
                .sin = sn.data(), .max_delta = 0};
  REQUIRE(check_rope_shape(rp).ok());
  rp.style = static_cast<RopeStyle>(5);
  named(rope_host(rp), "style");
  rp.style = RopeStyle::neox;
  rp.cache = bad(pool.view);
  named(rope_host(rp), "cache.dtype");
  ScoreParams scp{.attn = attn.data(), .lengths = len.data(), .scores = sc.data(), .num_streams = 1, .max_keys = 4};
  REQUIRE(check_score_shape(scp).ok());
  scp.reduce = static_cast<ScoreReduce>(9);
  named(scores_host(scp), "reduce");
  named(page_bounds_host({.cache = bad(pool.view), .pages = one.data(), .fill = one.data(), .num_pages = 1, .bounds = bounds.data()}),
        "cache.dtype");
  named(page_bounds_update_host({.cache = bad(pool.view), .slots = slots.data(), .num_tokens = 1, .bounds = bounds.data()}),
        "cache.dtype");
  RingAdmitParams ra{.cache = pool.view, .src = src, .gates = &gate, .num_tokens = 1, .num_heads = 1, .window = B,
                     .global_limit = 0, .tau = 0.5f, .ring_start = zero.data(), .ring_len = zero.data(),
                     .global_len = zero.data(), .bits = bits.data(), .rows = rows.data(), .row_stride = 1};
  REQUIRE(check_ring_admit_shape(ra).ok());
  ra.src.dtype = bogus_dtype;
  named(ring_admit_host(ra), "src.dtype");
  ra.src.dtype = DType::f32;
  ra.cache = bad(pool.view);
  named(ring_admit_host(ra), "cache.dtype");
}
