// Score-based three-area block eviction: hand-computed cases, a brute-force
// reference on random score streams, RoPE re-rotation end to end, and the
// accounting agreement inside Cache.
#include <catch2/catch.hpp>

#include <kvcache/cache.hpp>
#include <kvcache/eviction/block_scores.hpp>
#include <kvcache/kernels/rope.hpp>

#include <algorithm>
#include <array>
#include <set>
#include <cmath>
#include <numeric>
#include <random>

#include "kernel_testing.hpp"

using namespace kvcache;

namespace {
constexpr std::int32_t B = 4;
using EvictCache = Cache<BlockPool, PageTable, AdmitAll, SelectAll, BlockScoreEviction>;

CacheConfig config(std::int32_t blocks = 64, std::int32_t seqs = 4, std::int32_t per_seq = 16) {
  return {.geometry = *Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = 8, .block_size = B}),
          .num_blocks = blocks, .max_sequences = seqs, .max_blocks_per_sequence = per_seq};
}
// start 4, recent 4, max 16: the evictable area keeps 2 blocks; runs from 20 tokens.
BlockScoreConfig small(Aggregation a = Aggregation::sum, std::int32_t pool = 1) {
  return {.start = 4, .recent = 4, .max = 16, .aggregation = a, .pool_window = pool};
}
std::vector<float> per_block(const std::vector<float>& block_scores) {  // spread evenly over each block's tokens
  std::vector<float> s;
  for (float v : block_scores)
    for (int t = 0; t < B; ++t) s.push_back(v / B);
  return s;
}
}  // namespace

TEST_CASE("configuration errors name the field") {
  CHECK_THROWS_WITH(BlockScoreEviction({.start = 0}), Catch::Contains("start=0"));
  CHECK_THROWS_WITH(BlockScoreEviction({.start = 4, .recent = 0}), Catch::Contains("recent=0"));
  CHECK_THROWS_WITH(BlockScoreEviction({.start = 4, .recent = 4, .max = 8}), Catch::Contains("max=8"));
  CHECK_THROWS_WITH(BlockScoreEviction({.start = 4, .recent = 4, .max = 16, .pool_window = 0}),
                    Catch::Contains("pool_window=0"));
  // Block multiples are the geometry's: the cache binds its block size, and a
  // size that is not a multiple of it names the field and the block size.
  CHECK_THROWS_WITH(EvictCache(config(), {}, {}, BlockScoreEviction({.start = 6, .recent = 4, .max = 16})),
                    Catch::Contains("start (a multiple of the block size)=6 (limit 4)"));
  CHECK_THROWS_WITH(EvictCache(config(), {}, {}, BlockScoreEviction({.start = 4, .recent = 6, .max = 16})),
                    Catch::Contains("recent (a multiple of the block size)=6"));
  CHECK_THROWS_WITH(EvictCache(config(), {}, {}, BlockScoreEviction({.start = 4, .recent = 4, .max = 18})),
                    Catch::Contains("max (a multiple of the block size)=18"));
  const EvictCache cache(config(), {}, {}, BlockScoreEviction(small()));
  CHECK(cache.eviction().block_size() == B);
  CHECK(cache.max_tokens_after_eviction() == 16 + B - 1);
}

TEST_CASE("lifetime counters grow by the length increase, max-pool looks forward") {
  BlockScoreEviction p(small(Aggregation::norm_sum, 3));
  p.bind({.streams = 1, .max_tokens = 64, .block_size = B});
  REQUIRE(p.observe(0, std::vector<float>{1, 5, 2}).ok());
  CHECK(std::vector<std::int32_t>(p.counters(0).begin(), p.counters(0).end()) == std::vector<std::int32_t>{3, 2, 1});
  CHECK(std::vector<float>(p.accumulators(0).begin(), p.accumulators(0).end()) == std::vector<float>{5, 5, 2});
  REQUIRE(p.observe(0, std::vector<float>{1, 5, 2, 0, 4}).ok());  // grew by 2
  CHECK(std::vector<std::int32_t>(p.counters(0).begin(), p.counters(0).end()) == std::vector<std::int32_t>{5, 4, 3, 2, 1});
  // pooled [5, 5, 4, 4, 4] added to [5, 5, 2]
  CHECK(std::vector<float>(p.accumulators(0).begin(), p.accumulators(0).end()) == std::vector<float>{10, 10, 6, 4, 4});
  REQUIRE(p.observe(0, std::vector<float>{0, 0, 0, 0, 1}).ok());  // no growth: counters unchanged
  CHECK(std::vector<std::int32_t>(p.counters(0).begin(), p.counters(0).end()) == std::vector<std::int32_t>{5, 4, 3, 2, 1});
}

TEST_CASE("hand-computed evictions: lowest blocks of the evictable area, ties to the lower block") {
  EvictCache cache(config(), {}, {}, BlockScoreEviction(small()));
  auto s = *cache.add_sequence();
  std::vector<std::int32_t> slots(24), evicted(8);
  std::vector<BlockRotation> rot(8);
  REQUIRE(cache.reserve(s, 19, slots).ok());
  REQUIRE(cache.observe(s, std::vector<float>(19, 1.0f)).ok());
  CHECK(cache.evict(s, evicted, rot)->evicted == 0);  // 19 < max + B
  REQUIRE(cache.reserve(s, 5, slots).ok());           // 24 tokens: blocks 0..5, block 5 recent
  const std::vector<BlockId> before(cache.table().blocks(s)->begin(), cache.table().blocks(s)->end());
  // Block scores (SUM): b0 100 (start), b1 10, b2 3, b3 3, b4 1, b5 100 (recent).
  REQUIRE(cache.observe(s, per_block({100, 10, 3, 3, 1, 100})).ok());
  auto r = cache.evict(s, evicted, rot);
  REQUIRE(r.ok());
  REQUIRE(r->evicted == 2);  // 4 evictable blocks, room for 2
  CHECK(evicted[0] == 2);    // b4 (1) and the lower of the tied b2/b3 (3)
  CHECK(evicted[1] == 4);
  REQUIRE(r->rotations == 2);
  CHECK(rot[0] == BlockRotation{before[3], 2, -4});
  CHECK(rot[1] == BlockRotation{before[5], 3, -8});
  CHECK(std::vector<BlockId>(cache.table().blocks(s)->begin(), cache.table().blocks(s)->end()) ==
        std::vector<BlockId>{before[0], before[1], before[3], before[5]});
  CHECK(*cache.tokens_held(s) == 16);
  // Scores moved with the blocks: the survivors' accumulators, in order.
  const auto acc = cache.eviction().accumulators(s.index);
  CHECK(std::vector<float>(acc.begin(), acc.end()) == per_block({104, 14, 7, 100}));  // + the first step's 1.0 each
  REQUIRE(cache.check_invariants().ok());

  // 22 tokens: the partial last block counts as recent, so only 3 blocks are evictable.
  REQUIRE(cache.reserve(s, 6, slots).ok());
  std::vector<float> sc = per_block({9, 9, 2, 9, 9});
  sc.resize(22, 0.5f);
  REQUIRE(cache.observe(s, sc).ok());
  r = cache.evict(s, evicted, rot);
  REQUIRE(r->evicted == 1);
  CHECK(evicted[0] == 2);
  CHECK(*cache.tokens_held(s) == 18);
  REQUIRE(cache.check_invariants().ok());
}

TEST_CASE("NORM_SUM prefers keeping young tokens over old ones with the same sum") {
  EvictCache cache(config(), {}, {}, BlockScoreEviction(small(Aggregation::norm_sum)));
  auto s = *cache.add_sequence();
  std::vector<std::int32_t> slots(24), evicted(8);
  std::vector<BlockRotation> rot(8);
  REQUIRE(cache.reserve(s, 12, slots).ok());
  REQUIRE(cache.observe(s, per_block({8, 8, 8})).ok());  // old tokens: lifetimes 12..1
  REQUIRE(cache.reserve(s, 12, slots).ok());
  std::vector<float> sc = per_block({0, 0, 0, 8, 8, 8});  // same new mass on blocks 3..5
  REQUIRE(cache.observe(s, sc).ok());
  // Sums: b1 = b2 = b3 = b4 = 8, but b1, b2 are older (larger counters): lower averages.
  auto r = cache.evict(s, evicted, rot);
  REQUIRE(r->evicted == 2);
  CHECK(evicted[0] == 1);
  CHECK(evicted[1] == 2);
}

TEST_CASE("rotation deltas re-rotate kept keys to their new positions") {
  // Keys of a 32-token stream stored with RoPE at their positions (f32, NeoX).
  const GeometrySpec g{.num_layers = 1, .num_kv_heads = 2, .head_dim = 8, .block_size = B, .dtype = DType::f32};
  EvictCache cache({.geometry = *Geometry::make(g), .num_blocks = 16, .max_sequences = 1, .max_blocks_per_sequence = 12},
                   {}, {}, BlockScoreEviction({.start = 4, .recent = 8, .max = 24}));
  kvtest::Pool pool(g, 16);
  const std::int32_t half = 4, max_delta = 32;
  std::vector<float> cs((max_delta + 1) * half), sn(cs.size());
  REQUIRE(make_rope_table(10000.0, 8, max_delta, cs, sn).ok());
  auto rope_at = [&](float x, float y, int pos, int i, bool first) {
    const double a = pos * std::pow(10000.0, -2.0 * i / 8);
    return float(first ? x * std::cos(a) - y * std::sin(a) : y * std::cos(a) + x * std::sin(a));
  };
  auto s = *cache.add_sequence();
  std::vector<std::int32_t> slots(32);
  REQUIRE(cache.reserve(s, 32, slots).ok());
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> raw(32 * 2 * 8);
  for (auto& x : raw) x = u(rng);
  for (int t = 0; t < 32; ++t)
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < half; ++i) {
        const float x = raw[(t * 2 + h) * 8 + i], y = raw[(t * 2 + h) * 8 + i + half];
        auto* row = reinterpret_cast<float*>(pool.view.row(slots[t] / B, 0, 0, slots[t] % B, h));
        row[i] = rope_at(x, y, t, i, true);
        row[i + half] = rope_at(x, y, t, i, false);
      }
  std::vector<float> sc(32, 1.0f);
  for (int t = 8; t < 16; ++t) sc[std::size_t(t)] = 0.0f;  // blocks 2 and 3 are the least attended
  REQUIRE(cache.observe(s, sc).ok());
  std::vector<std::int32_t> evicted(8);
  std::vector<BlockRotation> rot(8);
  auto r = cache.evict(s, evicted, rot);
  REQUIRE(r->evicted == 2);
  CHECK(evicted[0] == 2);
  CHECK(evicted[1] == 3);
  std::vector<std::int32_t> blocks, deltas;
  for (int k = 0; k < r->rotations; ++k) blocks.push_back(rot[k].block), deltas.push_back(rot[k].delta);
  CHECK(deltas == std::vector<std::int32_t>(4, -8));
  REQUIRE(rope_host({pool.view, 0, 1, blocks.data(), deltas.data(), r->rotations, cs.data(), sn.data(), max_delta}).ok());
  // Every kept token now carries RoPE at its new position.
  const auto row_blocks = *cache.table().blocks(s);
  for (int p = 0; p < 24; ++p) {
    const int orig = p < 8 ? p : p + 8;
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < half; ++i) {
        const float x = raw[(orig * 2 + h) * 8 + i], y = raw[(orig * 2 + h) * 8 + i + half];
        const auto* row = reinterpret_cast<const float*>(pool.view.row(row_blocks[p / B], 0, 0, p % B, h));
        REQUIRE(row[i] == Approx(rope_at(x, y, p, i, true)).margin(1e-5));
        REQUIRE(row[i + half] == Approx(rope_at(x, y, p, i, false)).margin(1e-5));
      }
  }
}

TEST_CASE("random score streams: the plan matches a brute-force reference, the bound and accounting hold") {
  std::mt19937_64 rng(Catch::rngSeed() ^ std::random_device{}());
  for (int trial = 0; trial < 40; ++trial) {
    const auto agg = trial % 2 ? Aggregation::sum : Aggregation::norm_sum;
    const BlockScoreConfig cfg{.start = 8, .recent = 8, .max = 32, .aggregation = agg,
                               .pool_window = 1 + int(rng() % 3)};
    EvictCache cache(config(256, 4, 40), {}, {}, BlockScoreEviction(cfg));
    std::vector<SeqId> seqs;
    std::vector<std::int64_t> peak_blocks, needed;
    for (int q = 0; q < 3; ++q) {
      seqs.push_back(*cache.add_sequence());
      const std::int64_t prompt = 1 + std::int64_t(rng() % 60);
      needed.push_back(*cache.blocks_needed(prompt, 200));
      std::vector<std::int32_t> slots(static_cast<std::size_t>(prompt));
      REQUIRE(cache.reserve(seqs.back(), std::int32_t(prompt), slots).ok());
      peak_blocks.push_back(*cache.blocks_held(seqs.back()));
    }
    std::vector<std::int32_t> evicted(64), slot(8);
    std::vector<BlockRotation> rot(64);
    for (const SeqId s : seqs) {  // the policy runs after prefill, as an engine's step does
      REQUIRE(cache.observe(s, std::vector<float>(std::size_t(*cache.tokens_held(s)), 0.5f)).ok());
      REQUIRE(cache.evict(s, evicted, rot).ok());
    }
    for (int step = 0; step < 200; ++step) {
      const std::size_t q = std::size_t(rng() % seqs.size());
      const SeqId s = seqs[q];
      REQUIRE(cache.reserve(s, 1, slot).ok());
      peak_blocks[q] = std::max<std::int64_t>(peak_blocks[q], *cache.blocks_held(s));
      const auto held = std::int32_t(*cache.tokens_held(s));
      std::vector<float> sc(static_cast<std::size_t>(held));
      for (auto& x : sc) x = float(rng() % 8) * 0.125f;  // coarse: ties happen
      REQUIRE(cache.observe(s, sc).ok());
      // Brute-force reference of the plan from the policy's own accumulators.
      const auto acc = cache.eviction().accumulators(s.index);
      const auto cnt = cache.eviction().counters(s.index);
      std::vector<std::pair<float, int>> cand;
      const int hi = held / B - cfg.recent / B;
      for (int b = cfg.start / B; b < hi; ++b) {
        float score = 0;
        for (int t = b * B; t < b * B + B; ++t) score += agg == Aggregation::sum ? acc[t] : acc[t] / float(cnt[t]);
        cand.push_back({score, b});
      }
      std::sort(cand.begin(), cand.end());
      const int want_n = held < cfg.max + B ? 0 : int(cand.size()) - (cfg.max - cfg.start - cfg.recent) / B;
      std::vector<int> want;
      for (int k = 0; k < want_n; ++k) want.push_back(cand[std::size_t(k)].second);
      std::sort(want.begin(), want.end());
      auto r = cache.evict(s, evicted, rot);
      REQUIRE(r.ok());
      REQUIRE(std::vector<int>(evicted.begin(), evicted.begin() + r->evicted) == want);
      // Accounting agrees with the table and the advertised bounds.
      REQUIRE(*cache.tokens_held(s) <= cache.max_tokens_after_eviction());
      INFO(cache.check_invariants().message());
  REQUIRE(cache.check_invariants().ok());
    }
    for (std::size_t q = 0; q < seqs.size(); ++q) REQUIRE(peak_blocks[q] <= needed[q]);  // never underestimated
  }
}

TEST_CASE("shared blocks never move, and bad scores or small buffers change nothing") {
  EvictCache cache(config(), {}, {}, BlockScoreEviction(small()));
  auto a = *cache.add_sequence();
  std::vector<std::int32_t> slots(32), evicted(8);
  std::vector<BlockRotation> rot(8);
  REQUIRE(cache.reserve(a, 12, slots).ok());
  auto b = *cache.fork(a);  // blocks 0..2 shared
  REQUIRE(cache.reserve(b, 12, slots).ok());
  REQUIRE(cache.observe(b, per_block({0, 0, 0, 5, 6, 7})).ok());  // shared blocks score lowest
  auto r = cache.evict(b, evicted, rot);
  REQUIRE(r.ok());
  REQUIRE(r->evicted == 2);  // candidates start after the last shared block (2): blocks 3, 4
  CHECK(evicted[0] == 3);
  CHECK(evicted[1] == 4);
  CHECK(cache.pool().ref_count((*cache.table().blocks(a))[2]) == 2);  // still shared, in place
  REQUIRE(cache.check_invariants().ok());

  const EvictCache before = cache;
  CHECK(cache.observe(a, std::vector<float>(5, 1.0f)).code() == Errc::invalid_argument);
  std::vector<float> nan(12, 1.0f);
  nan[7] = std::nanf("");
  auto st = cache.observe(a, nan);
  CHECK(std::string(st.what()) == "scores_at");
  CHECK(st.value() == 7);
  nan[7] = -1.0f;
  CHECK(std::string(cache.observe(a, nan).what()) == "scores_at");
  REQUIRE(cache.reserve(a, 12, slots).ok());
  REQUIRE(cache.observe(a, std::vector<float>(24, 1.0f)).ok());
  const EvictCache ready = cache;
  CHECK(cache.evict(a, std::span(evicted).first(1), rot).status().code() == Errc::buffer_too_small);
  CHECK(cache.evict(a, evicted, std::span(rot).first(0)).status().code() == Errc::buffer_too_small);
  CHECK(cache == ready);
  CHECK_FALSE(before == ready);
  REQUIRE(cache.free(b).ok());
  CHECK(cache.evict(b, evicted, rot).status().code() == Errc::unknown_sequence);
}

TEST_CASE("one stream per layer: each layer picks its own blocks, every layer evicts the same count") {
  constexpr int L = 3;
  EvictCache cache(config(128, 4, 16), {}, {}, BlockScoreEviction(small(Aggregation::norm_sum)));
  std::array<SeqId, L> layer{};
  for (auto& s : layer) s = *cache.add_sequence();
  std::vector<std::int32_t> slots(32), evicted(8);
  std::vector<BlockRotation> rot(8);
  std::mt19937 rng(7);
  std::set<std::vector<std::int32_t>> distinct;
  for (int step = 0; step < 40; ++step) {
    std::int32_t count = -1;
    for (int l = 0; l < L; ++l) {
      REQUIRE(cache.reserve(layer[std::size_t(l)], 1, slots).ok());
      const auto held = std::size_t(*cache.tokens_held(layer[std::size_t(l)]));
      std::vector<float> sc(held);
      for (auto& v : sc) v = float(rng() % 100);
      REQUIRE(cache.observe(layer[std::size_t(l)], sc).ok());
      auto r = cache.evict(layer[std::size_t(l)], evicted, rot);
      REQUIRE(r.ok());
      if (count >= 0) REQUIRE(r->evicted == count);
      count = r->evicted;
      if (r->evicted > 0) distinct.insert(std::vector<std::int32_t>(evicted.begin(), evicted.begin() + r->evicted));
    }
    for (int l = 1; l < L; ++l) REQUIRE(*cache.tokens_held(layer[std::size_t(l)]) == *cache.tokens_held(layer[0]));
  }
  CHECK(distinct.size() > 1);  // the layers did not all choose alike
  CHECK(cache.check_invariants().ok());
}
