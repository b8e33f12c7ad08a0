// Token-granular policies (H2O, TOVA, SnapKV, average attention) against plain
// unpaged references of their rules, end to end: every slot of a real pool
// holds its token's position in each group's head, the cache's compaction
// moves run through the compaction kernel one head range at a time, and the
// positions left in memory must be exactly the reference's kept set. Scores
// are quantized so ties are frequent and the tie-break is exercised.
#include <catch2/catch.hpp>

#include <kvcache/cache.hpp>
#include <kvcache/eviction/average_attention.hpp>
#include <kvcache/eviction/h2o.hpp>
#include <kvcache/eviction/snapkv.hpp>
#include <kvcache/eviction/tova.hpp>
#include <kvcache/kernels/compaction.hpp>

#include <algorithm>
#include <map>
#include <random>
#include <vector>

#include "kernel_testing.hpp"

using namespace kvcache;

namespace {
constexpr std::int32_t B = 4;

float score_of(std::uint64_t seed, std::int32_t step, std::int32_t row, std::int64_t pos) {
  std::uint64_t h = seed ^ (std::uint64_t(step) * 0x9E3779B97F4A7C15ull) ^ (std::uint64_t(row) << 40) ^ std::uint64_t(pos);
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return float(h % 4) * 0.25f;
}

// One token of the reference: its position and its accumulated score.
struct RefToken {
  std::int64_t pos;
  float acc = 0.0f;
};
using Group = std::vector<RefToken>;  // kept tokens, ascending position

// Removes the `count` tokens with the lowest key among the eligible ones; ties to the older.
template <class Key, class Eligible>
void ref_evict_lowest(Group& g, std::int64_t count, Key key, Eligible eligible) {
  std::vector<std::pair<float, std::int64_t>> c;
  for (const auto& t : g)
    if (eligible(t)) c.push_back({key(t), t.pos});
  std::sort(c.begin(), c.end());
  c.resize(std::size_t(count));
  std::erase_if(g, [&](const RefToken& t) {
    return std::any_of(c.begin(), c.end(), [&](auto& e) { return e.second == t.pos; });
  });
}

struct H2ORule {
  static constexpr std::int32_t groups = 3, heavy = 6, recent = 5;
  static H2OEviction make() { return H2OEviction({.heavy = heavy, .recent = recent, .groups = groups}); }
  static constexpr ScoreKind kind = ScoreKind::head_attention_sums;
  static constexpr std::int32_t rows = groups;
  void observe(std::vector<Group>& gs, std::uint64_t seed, std::int32_t step) {
    for (std::int32_t g = 0; g < groups; ++g)
      for (auto& t : gs[std::size_t(g)]) t.acc += score_of(seed, step, g, t.pos);
  }
  void evict(std::vector<Group>& gs, std::int64_t appended) {
    for (auto& g : gs) {
      const auto n = std::int64_t(g.size());
      if (n <= heavy + recent) continue;
      ref_evict_lowest(g, n - heavy - recent, [](const RefToken& t) { return t.acc; },
                       [&](const RefToken& t) { return t.pos < appended - recent; });
    }
  }
};

struct TovaRule {
  static constexpr std::int32_t groups = 1, budget = 9, heads = 2;
  static TovaEviction make() { return TovaEviction({.budget = budget}); }
  static constexpr ScoreKind kind = ScoreKind::last_query_attention;
  static constexpr std::int32_t rows = heads;
  void observe(std::vector<Group>& gs, std::uint64_t seed, std::int32_t step) {
    for (auto& t : gs[0]) {
      float v = 0.0f;
      for (std::int32_t r = 0; r < heads; ++r) v += score_of(seed, step, r, t.pos);
      t.acc = v * (1.0f / float(heads));
    }
  }
  void evict(std::vector<Group>& gs, std::int64_t) {
    const auto n = std::int64_t(gs[0].size());
    if (n > budget) ref_evict_lowest(gs[0], n - budget, [](const RefToken& t) { return t.acc; }, [](auto&) { return true; });
  }
};

// TOVA as its paper runs it: one choice per layer (a group), from the
// average of that layer's heads' last-query rows.
struct TovaLayersRule {
  static constexpr std::int32_t groups = 3, budget = 9, heads = 2;
  static TovaEviction make() { return TovaEviction({.budget = budget, .groups = groups}); }
  static constexpr ScoreKind kind = ScoreKind::last_query_attention;
  static constexpr std::int32_t rows = groups * heads;
  void observe(std::vector<Group>& gs, std::uint64_t seed, std::int32_t step) {
    for (std::int32_t g = 0; g < groups; ++g)
      for (auto& t : gs[std::size_t(g)]) {
        float v = 0.0f;
        for (std::int32_t r = g * heads; r < (g + 1) * heads; ++r) v += score_of(seed, step, r, t.pos);
        t.acc = v * (1.0f / float(heads));
      }
  }
  void evict(std::vector<Group>& gs, std::int64_t) {
    for (auto& g : gs) {
      const auto n = std::int64_t(g.size());
      if (n > budget) ref_evict_lowest(g, n - budget, [](const RefToken& t) { return t.acc; }, [](auto&) { return true; });
    }
  }
};

struct AverageRule {
  static constexpr std::int32_t groups = 2, budget = 8, step = 3;
  static AverageAttentionEviction make() { return AverageAttentionEviction({.budget = budget, .step = step, .groups = groups}); }
  static constexpr ScoreKind kind = ScoreKind::head_attention_sums;
  static constexpr std::int32_t rows = groups;
  void observe(std::vector<Group>& gs, std::uint64_t seed, std::int32_t s) {
    for (std::int32_t g = 0; g < groups; ++g)
      for (auto& t : gs[std::size_t(g)]) t.acc += score_of(seed, s, g, t.pos);
  }
  void evict(std::vector<Group>& gs, std::int64_t appended) {
    for (auto& g : gs) {
      const auto n = std::int64_t(g.size());
      if (n < budget) continue;
      ref_evict_lowest(g, step * ((n - budget) / step + 1), [&](const RefToken& t) { return t.acc / float(appended - t.pos); },
                       [](auto&) { return true; });
    }
  }
};

struct SnapRule {
  static constexpr std::int32_t groups = 2, capacity = 7, window = 4, kernel = 3;
  static SnapKVEviction make() {
    return SnapKVEviction({.capacity = capacity, .window = window, .kernel = kernel, .groups = groups});
  }
  static constexpr ScoreKind kind = ScoreKind::head_attention_sums;
  static constexpr std::int32_t rows = groups;
  bool observed = false, done = false;
  void observe(std::vector<Group>& gs, std::uint64_t seed, std::int32_t s) {
    observed = true;
    for (std::int32_t g = 0; g < groups; ++g)
      for (auto& t : gs[std::size_t(g)]) t.acc += score_of(seed, s, g, t.pos);
  }
  void evict(std::vector<Group>& gs, std::int64_t appended) {
    if (!observed || done) return;
    done = true;
    for (auto& g : gs) {
      const auto n = std::int64_t(g.size()), nw = n - window;
      if (n <= capacity + window) continue;
      std::map<std::int64_t, float> pooled;  // by position, over the tokens outside the window
      for (std::int64_t j = 0; j < nw; ++j) {
        float m = 0.0f;
        for (std::int64_t k = std::max<std::int64_t>(0, j - kernel / 2); k <= std::min(nw - 1, j + kernel / 2); ++k)
          m = std::max(m, g[std::size_t(k)].acc);
        pooled[g[std::size_t(j)].pos] = m;
      }
      ref_evict_lowest(g, n - capacity - window, [&](const RefToken& t) { return pooled.at(t.pos); },
                       [&](const RefToken& t) { return t.pos < appended - window; });
    }
  }
};

// A cache over a real fp32 pool: one kv-head per group, head_dim 1, the K
// element of (slot, head g) holds the position of the token group g keeps there.
template <class Rule>
struct Harness {
  using Policy = decltype(Rule::make());
  static constexpr std::int32_t kBlocks = 64, kPerSeq = 24;
  GeometrySpec spec{.num_layers = 1, .num_kv_heads = Rule::groups, .head_dim = 1, .block_size = B, .dtype = DType::f32};
  Cache<BlockPool, PageTable, AdmitAll, SelectAll, Policy> cache{
      {.geometry = *Geometry::make(spec), .num_blocks = kBlocks, .max_sequences = 2, .max_blocks_per_sequence = kPerSeq},
      {}, {}, Rule::make()};
  kvtest::Pool pool{spec, kBlocks};
  SeqId s = *cache.add_sequence();
  std::int64_t appended = 0;

  std::int32_t held() const { return std::int32_t(*cache.tokens_held(s)); }
  float* elem(std::int32_t slot, std::int32_t g) {
    return reinterpret_cast<float*>(pool.bytes.data() + kvtest::ref_offset(spec, kBlocks, slot / B, 0, 0, slot % B, g, 0));
  }
  std::int32_t slot_of(std::int32_t j) const { return (*cache.table().blocks(s))[std::size_t(j / B)] * B + j % B; }
  std::int64_t pos_at(std::int32_t j, std::int32_t g) { return std::int64_t(*elem(slot_of(j), g)); }

  Status append(std::int32_t n) {
    std::vector<std::int32_t> slots(static_cast<std::size_t>(n));
    auto r = cache.reserve(s, n, slots);
    if (!r) return r.status();
    for (std::int32_t i = 0; i < n; ++i)
      for (std::int32_t g = 0; g < Rule::groups; ++g) *elem(slots[std::size_t(i)], g) = float(appended + i);
    appended += n;
    return {};
  }
  Status observe(std::uint64_t seed, std::int32_t step) {
    const std::int32_t h = held();
    std::vector<float> v(std::size_t(Rule::rows) * std::size_t(h));
    for (std::int32_t r = 0; r < Rule::rows; ++r)
      for (std::int32_t j = 0; j < h; ++j)
        v[std::size_t(r * h + j)] = score_of(seed, step, r, pos_at(j, r / (Rule::rows / Rule::groups)));  // row r: its group's head
    return cache.observe(s, Scores{Rule::kind, v, Rule::rows});
  }
  Result<EvictionResult> evict() {
    std::vector<SlotMove> moves(std::size_t(Rule::groups * held()));
    std::vector<std::int32_t> offsets(std::size_t(Rule::groups + 1));
    auto r = cache.evict(s, EvictionSpans{.moves = moves, .group_moves = offsets});
    if (!r || r->tokens == 0) return r;
    for (std::int32_t g = 0; g < Rule::groups; ++g) {  // the engine's part: compact each group's heads
      CompactionParams p{.cache = pool.view, .moves = moves.data() + offsets[std::size_t(g)],
                         .num_moves = offsets[std::size_t(g + 1)] - offsets[std::size_t(g)], .first_head = g,
                         .num_heads = 1};
      REQUIRE(compaction_host(p).ok());
    }
    return r;
  }
  // Memory, the policy's own bookkeeping and the reference agree, group by group.
  void check(const std::vector<Group>& ref) {
    REQUIRE(cache.check_invariants().ok());
    REQUIRE(*cache.tokens_held(s) <= cache.eviction().max_tokens_held(appended));
    for (std::int32_t g = 0; g < Rule::groups; ++g) {
      std::vector<std::int64_t> mem, want;
      const auto tracked = cache.eviction().positions(s.index, g);
      for (std::int32_t j = 0; j < held(); ++j) {
        mem.push_back(pos_at(j, g));
        if (j < std::int32_t(tracked.size())) REQUIRE(tracked[std::size_t(j)] == mem.back());  // state moved with the slot
      }
      for (const auto& t : ref[std::size_t(g)]) want.push_back(t.pos);
      std::sort(mem.begin(), mem.end());
      INFO("group " << g << " appended " << appended);
      REQUIRE(mem == want);
    }
  }
};

template <class Rule>
Harness<Rule> run_against_reference(std::uint64_t seed, std::int32_t steps, bool prefill_then_decode) {
  Harness<Rule> h;
  Rule rule;
  std::vector<Group> ref(static_cast<std::size_t>(Rule::groups));
  std::mt19937_64 rng(seed);
  const std::int32_t prompt = prefill_then_decode ? 30 : 0;
  std::int64_t peak_blocks = 0;
  for (std::int32_t step = 0; step < steps; ++step) {
    std::int32_t n = 1;
    if (h.appended < prompt) n = std::min<std::int32_t>(prompt - std::int32_t(h.appended), 1 + std::int32_t(rng() % 9));
    else if (!prefill_then_decode && rng() % 4 == 0) n = 1 + std::int32_t(rng() % 5);  // a prefill-sized chunk
    REQUIRE(h.append(n).ok());
    for (std::int32_t i = 0; i < n; ++i)
      for (auto& g : ref) g.push_back({h.appended - n + i});
    peak_blocks = std::max<std::int64_t>(peak_blocks, *h.cache.blocks_held(h.s));
    if (rng() % 8 == 0) {  // speculative rollback of part of this append
      const auto k = std::int32_t(rng() % std::uint64_t(n + 1));
      REQUIRE(h.cache.truncate(h.s, k).ok());
      h.appended -= k;
      for (auto& g : ref) g.resize(g.size() - std::size_t(k));
    }
    if (prefill_then_decode && h.appended < prompt) continue;  // SnapKV: observe once the prompt is in
    REQUIRE(h.observe(seed, step).ok());
    rule.observe(ref, seed, step);
    REQUIRE(h.evict().ok());
    rule.evict(ref, h.appended);
    h.check(ref);
  }
  // A whole life with chunks of at most 9 tokens never needs more blocks than blocks_needed says.
  CHECK(peak_blocks <= *h.cache.blocks_needed(h.appended, 0, 9));
  return h;
}
}  // namespace

TEMPLATE_TEST_CASE("token policies match their reference on random score streams", "", H2ORule, TovaRule,
                   TovaLayersRule, AverageRule, SnapRule) {
  const bool snap = std::is_same_v<TestType, SnapRule>;
  for (std::uint64_t seed : {1u, 2u, 3u, 4u}) (void)run_against_reference<TestType>(seed, snap ? 60 : 150, snap);
  // Deterministic: the same inputs give the same cache, policy state and memory.
  const auto a = run_against_reference<TestType>(9, 80, snap), b = run_against_reference<TestType>(9, 80, snap);
  CHECK(a.cache == b.cache);
  CHECK(a.pool.bytes == b.pool.bytes);
}

TEST_CASE("average attention evicts between prefill chunks: the peak stays below budget + step") {
  Harness<AverageRule> h;
  constexpr std::int32_t K = AverageRule::budget, P = AverageRule::step;
  std::int64_t peak = 0;
  for (std::int32_t step = 0; step < 40; ++step) {  // a long prompt in chunks of `step` tokens
    REQUIRE(h.append(P).ok());
    peak = std::max<std::int64_t>(peak, h.held());
    REQUIRE(h.observe(5, step).ok());
    const auto before = h.held();
    auto r = h.evict();
    REQUIRE(r.ok());
    CHECK(r->tokens % P == 0);  // p at a time
    CHECK(h.held() == (before < K ? before : before - P));
    CHECK(h.held() < K);
  }
  CHECK(peak == 9);  // 6 held before each chunk once it runs, plus 3
  CHECK(*h.cache.blocks_needed(120, 0, P) == (K - 1 + P + B - 1) / B);
  CHECK(*h.cache.blocks_needed(120, 0) == 120 / B);  // without chunked eviction the prompt sits whole
}

TEST_CASE("SnapKV compresses once, right after prefill, and then only appends") {
  Harness<SnapRule> h;
  REQUIRE(h.append(40).ok());
  CHECK(h.evict()->tokens == 0);  // never observed: nothing to go on
  REQUIRE(h.observe(9, 0).ok());
  auto r = h.evict();
  REQUIRE(r.ok());
  CHECK(r->tokens == 40 - SnapRule::capacity - SnapRule::window);
  CHECK(h.cache.eviction().compressed(h.s.index));
  for (std::int32_t g = 0; g < SnapRule::groups; ++g)  // the window survives in every group
    for (std::int64_t p = 40 - SnapRule::window; p < 40; ++p) {
      bool found = false;
      for (std::int32_t j = 0; j < h.held(); ++j) found |= h.pos_at(j, g) == p;
      CHECK(found);
    }
  REQUIRE(h.append(10).ok());
  REQUIRE(h.observe(9, 1).ok());
  CHECK(h.evict()->tokens == 0);
  CHECK(h.held() == SnapRule::capacity + SnapRule::window + 10);
}

TEST_CASE("bad scores and small buffers are typed errors that change nothing") {
  Harness<H2ORule> h;
  REQUIRE(h.append(20).ok());
  REQUIRE(h.observe(1, 0).ok());
  const auto before = h.cache;
  std::vector<float> v(std::size_t(H2ORule::groups * 20), 0.5f);
  auto err = [&](const Scores& sc, const char* what) {
    auto st = h.cache.observe(h.s, sc);
    CHECK(st.code() == Errc::invalid_argument);
    CHECK_THAT(st.message(), Catch::Contains(what));
    CHECK(h.cache == before);
  };
  err(Scores{ScoreKind::last_query_attention, v, H2ORule::groups}, "scores.kind");
  err(Scores{ScoreKind::head_attention_sums, std::span<const float>(v).first(59), H2ORule::groups}, "scores.size");
  err(Scores{ScoreKind::head_attention_sums, std::span<const float>(v).first(40), 2}, "scores.rows");
  err(Scores{ScoreKind::attention_sums, std::span<const float>(v).first(40), 2}, "scores.rows");  // a reduced form has one row
  v[37] = std::numeric_limits<float>::quiet_NaN();
  err(Scores{ScoreKind::head_attention_sums, v, H2ORule::groups}, "scores_at=37");
  v[37] = -1.0f;
  err(Scores{ScoreKind::head_attention_sums, v, H2ORule::groups}, "scores_at=37");

  {  // per-layer TOVA: the rows must split evenly into its groups
    Harness<TovaLayersRule> t;
    REQUIRE(t.append(12).ok());
    const auto t0 = t.cache;
    const std::vector<float> rows5(5 * 12, 0.25f);
    auto st = t.cache.observe(t.s, Scores{ScoreKind::last_query_attention, rows5, 5});
    CHECK(st.code() == Errc::invalid_argument);
    CHECK(st.message() == "invalid_argument: scores.rows=5 (limit 3)");
    CHECK(t.cache == t0);
  }

  std::vector<SlotMove> moves(8);
  std::vector<std::int32_t> offsets(4);
  auto st = h.cache.evict(h.s, EvictionSpans{.moves = std::span(moves).first(3), .group_moves = offsets});
  CHECK(st.status().code() == Errc::buffer_too_small);
  CHECK_THAT(st.status().message(), Catch::Contains("moves"));
  std::vector<SlotMove> plenty(60);
  st = h.cache.evict(h.s, EvictionSpans{.moves = plenty, .group_moves = std::span(offsets).first(3)});
  CHECK(st.status().code() == Errc::buffer_too_small);
  CHECK_THAT(st.status().message(), Catch::Contains("group_moves"));
  CHECK(h.cache == before);
}

TEST_CASE("tokens in shared blocks never leave, and an evicted stream cannot be published") {
  Harness<TovaRule> h;
  REQUIRE(h.append(12).ok());
  const auto child = *h.cache.fork(h.s);  // blocks 0..2 now shared
  REQUIRE(h.append(4).ok());              // block 3 is the parent's own
  REQUIRE(h.observe(3, 0).ok());
  auto r = h.evict();
  REQUIRE(r.ok());
  CHECK(r->tokens == 4);  // 16 held, budget 9, but only block 3 holds candidates
  for (std::int32_t j = 0; j < 12; ++j) CHECK(h.pos_at(j, 0) == j);  // the shared prefix is untouched
  std::vector<std::int32_t> tokens(std::size_t(h.held()), 1);
  CHECK(h.cache.publish(h.s, tokens).status().code() == Errc::invalid_argument);
  CHECK(h.cache.table().check(h.cache.pool()).ok());  // (the bound waits until the prefix is unshared)
  (void)child;
}

TEST_CASE("compaction head ranges are checked") {
  kvtest::Pool pool({.num_layers = 1, .num_kv_heads = 2, .head_dim = 1, .block_size = B, .dtype = DType::f32}, 4);
  CompactionParams p{.cache = pool.view, .first_head = 1, .num_heads = 2};
  CHECK_THAT(compaction_host(p).message(), Catch::Contains("first_head+num_heads=3"));
  p = {.cache = pool.view, .first_head = 3};
  CHECK(compaction_host(p).code() == Errc::invalid_argument);
  p = {.cache = pool.view, .first_head = 1, .num_heads = INT32_MAX};  // the sum would overflow int32
  CHECK(compaction_host(p).message() == "invalid_argument: first_head+num_heads=2147483648 (limit 2)");
  p = {.cache = pool.view, .first_head = INT32_MIN};  // found by fuzz_kernels: the report itself overflowed
  CHECK(compaction_host(p).code() == Errc::invalid_argument);
  p = {.cache = pool.view, .first_layer = INT32_MAX};
  CHECK(compaction_host(p).message() == "invalid_argument: first_layer+num_layers=2147483648 (limit 1)");
  p = {.cache = pool.view, .first_head = 1};
  CHECK(compaction_host(p).ok());
}
