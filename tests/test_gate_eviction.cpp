// Write-Gated KV admission with a token eviction policy on each head row's
// global region (H2O, SnapKV, TOVA, average attention). The reference of
// the combined rule: the same policy on a plain cache with one sequence per
// head row, fed the row's global region as a token stream (a promotion is
// an append, in order) and the same scores. After every operation each
// row's global tokens, in order, are the reference's, the K/V the engine's
// compaction moved read back as those tokens', and the ring is untouched.
#include <catch2/catch.hpp>

#include <kvcache/admission/write_gate.hpp>
#include <kvcache/eviction/average_attention.hpp>
#include <kvcache/eviction/h2o.hpp>
#include <kvcache/eviction/snapkv.hpp>
#include <kvcache/eviction/tova.hpp>
#include <kvcache/kvcache.hpp>

#include <map>
#include <random>
#include <string>
#include <vector>

#include "write_gate_testing.hpp"

using namespace kvcache;
using gate_testing::key_of;
using gate_testing::KvMemory;

namespace {
std::mt19937_64 fresh_rng() { return std::mt19937_64(Catch::rngSeed() ^ std::random_device{}()); }

constexpr std::int32_t B = 4, W = 8, L = 2, H = 2, kBlocks = 600, kRow = 40, kSeqs = 3, kRows = kSeqs * L * H;

template <class P>
struct Run {
  using Gated = GatedCache<WriteGate, SelectAll, P>;
  using Plain = Cache<BlockPool, PageTable, AdmitAll, SelectAll, P>;
  std::mt19937_64& rng;
  KvMemory mem{B, kBlocks, H};
  Gated cache;
  Plain ref;  // one sequence per head row: its global region as a token stream
  std::vector<SeqId> live;
  std::map<std::uint32_t, SeqId> ref_of;                      // head row stream -> reference sequence
  std::map<std::uint32_t, std::vector<std::int32_t>> arrivals;  // head row stream -> position of each arrival
  std::vector<std::int32_t> tag = std::vector<std::int32_t>(kSeqs, 0);

  Run(std::mt19937_64& r, P policy)
      : rng(r),
        cache({.geometry = mem.geo, .num_blocks = kBlocks, .max_sequences = kSeqs, .max_blocks_per_sequence = kRow},
              WriteGateConfig{.num_layers = L, .num_kv_heads = H, .local_window = W, .tau = 0.5f}, {}, policy),
        ref({.geometry = mem.geo, .num_blocks = kBlocks, .max_sequences = kRows, .max_blocks_per_sequence = kRow}, {}, {},
            policy) {}

  SeqId row(SeqId s, std::int32_t l, std::int32_t h) const { return *cache.admission().head(s, l, h); }
  std::vector<std::int32_t> global(SeqId s, std::int32_t l, std::int32_t h) const {
    const auto p = *cache.admission().positions(s, l, h);
    return std::vector<std::int32_t>(p.begin() + std::min<std::ptrdiff_t>(W, std::ptrdiff_t(p.size())), p.end());
  }
  // New global tokens of every row of s (promotions append): the reference appends them too.
  void follow(SeqId s) {
    for (std::int32_t l = 0; l < L; ++l)
      for (std::int32_t h = 0; h < H; ++h) {
        const auto g = global(s, l, h);
        const SeqId rs = ref_of.at(row(s, l, h).index);
        const auto held = std::int32_t(*ref.tokens_held(rs));
        REQUIRE(std::int32_t(g.size()) >= held);
        if (std::int32_t(g.size()) == held) continue;
        std::vector<std::int32_t> slots(g.size() - std::size_t(held));
        REQUIRE(ref.reserve(rs, std::int32_t(slots.size()), slots).ok());
        auto& arr = arrivals[row(s, l, h).index];
        for (std::size_t i = std::size_t(held); i < g.size(); ++i) arr.push_back(g[i]);
      }
  }
  void add() {
    const SeqId s = *cache.add_sequence();
    live.push_back(s);
    for (std::int32_t l = 0; l < L; ++l)
      for (std::int32_t h = 0; h < H; ++h) {
        ref_of[row(s, l, h).index] = *ref.add_sequence();
        arrivals[row(s, l, h).index].clear();
      }
  }
  bool write(SeqId s, std::int32_t n) {
    gate_testing::RandomWrite w;
    for (std::int32_t l = 0; l < L; ++l) {
      auto r = gate_testing::random_write(cache, rng, s, l, n, 8, w);
      if (!r) return false;
      mem.copy_blocks(std::span(w.copies).first(std::size_t(r->copies)));
      mem.run(std::span(w.moves).first(std::size_t(r->moves)), w.slots, {}, tag[s.index], l, w.pos0, n);
    }
    follow(s);
    return true;
  }
  // One layer's scores, each head row in turn: a function of the token's position and the step.
  std::vector<float> scores(SeqId s, std::int32_t l, std::int32_t step) const {
    std::vector<float> v;
    for (std::int32_t h = 0; h < H; ++h) {
      const auto held = *cache.admission().positions(s, l, h);
      for (const std::int32_t p : held)
        v.push_back(float((p * 7919 + step * 31 + h * 13 + l * 5) % 97) / 16.0f);
    }
    return v;
  }
  static constexpr ScoreKind kind = P::required_signals.covers(Signals{Signals::head_attention_sums})
                                        ? ScoreKind::head_attention_sums
                                        : ScoreKind::last_query_attention;
  void observe(SeqId s, std::int32_t step) {
    for (std::int32_t l = 0; l < L; ++l) {
      const auto v = scores(s, l, step);
      REQUIRE(cache.observe(s, l, kind, v).ok());
      std::size_t at = 0;  // the reference gets each row's global part
      for (std::int32_t h = 0; h < H; ++h) {
        const auto n = std::size_t(cache.admission().positions(s, l, h)->size());
        const auto g = global(s, l, h).size();
        const std::span<const float> part(v.data() + at + (n - g), g);
        at += n;
        REQUIRE(ref.observe(ref_of.at(row(s, l, h).index), Scores{kind, part, 1}).ok());
      }
    }
  }
  void evict(SeqId s) {
    std::vector<SlotMove> moves(std::size_t(L * H * kRow * B));
    auto r = cache.evict(s, moves);
    REQUIRE(r.ok());
    mem.move(std::span(moves).first(std::size_t(r->moves)));
    for (std::int32_t l = 0; l < L; ++l)
      for (std::int32_t h = 0; h < H; ++h) {
        std::vector<SlotMove> rm(std::size_t(kRow * B));
        std::vector<std::int32_t> group_moves(2);
        REQUIRE(ref.evict(ref_of.at(row(s, l, h).index), EvictionSpans{{}, {}, rm, group_moves}).ok());
      }
  }
  // Every row's global tokens are the reference's, in order, and memory holds them.
  void check() {
    REQUIRE(cache.check_invariants().ok());
    REQUIRE(ref.check_invariants().ok());
    for (const SeqId s : live)
      for (std::int32_t l = 0; l < L; ++l)
        for (std::int32_t h = 0; h < H; ++h) {
          const SeqId hr = row(s, l, h);
          const auto& arr = arrivals.at(hr.index);
          std::vector<std::int32_t> want;
          const std::int64_t appended = *ref.table().appended(ref_of.at(hr.index));
          for (const std::int32_t a : ref.eviction().positions(ref_of.at(hr.index).index, 0)) {
            REQUIRE(a < appended);
            want.push_back(arr[std::size_t(a)]);
          }
          // Tokens the reference has not synced yet are the region's newest, in arrival order.
          const auto got = global(s, l, h);
          for (std::size_t i = want.size(); i < got.size(); ++i) want.push_back(arr[arr.size() - (got.size() - i)]);
          INFO("seq " << s.index << " layer " << l << " head " << h);
          REQUIRE(got == want);
          const auto blocks = *cache.table().blocks(hr);
          const auto all = *cache.admission().positions(s, l, h);
          for (std::size_t j = 0; j < all.size(); ++j)
            REQUIRE(mem.k_at(blocks[j / B] * B + std::int32_t(j % B)) == key_of(tag[s.index], l, h, all[j]));
        }
  }
};

template <class P>
void random_run(std::mt19937_64& rng, P policy, std::int32_t ops) {
  Run<P> run(rng, policy);
  std::int32_t next_tag = 0;
  for (std::int32_t op = 0; op < ops; ++op) {
    const auto pick = [&] { return run.live[std::size_t(rng() % run.live.size())]; };
    const std::uint64_t what = run.live.empty() ? 0 : rng() % 8;
    if (what == 0 && run.live.size() < std::size_t(kSeqs)) {
      run.add();
      run.tag[run.live.back().index] = next_tag++;
      (void)run.write(run.live.back(), 1 + std::int32_t(rng() % 40));
    } else if (what <= 3) {
      (void)run.write(pick(), 1 + std::int32_t(rng() % 6));
    } else if (what <= 5) {
      run.observe(pick(), op);
    } else if (what == 6) {
      run.evict(pick());
    } else if (run.live.size() > 1) {
      const auto k = std::size_t(rng() % run.live.size());
      const SeqId s = run.live[k];
      for (std::int32_t l = 0; l < L; ++l)
        for (std::int32_t h = 0; h < H; ++h) REQUIRE(run.ref.free(run.ref_of.at(run.row(s, l, h).index)).ok());
      REQUIRE(run.cache.free(s).ok());
      run.live.erase(run.live.begin() + std::ptrdiff_t(k));
    }
    run.check();
  }
}
}  // namespace

TEST_CASE("Write-Gated KV + H2O: each head row's global region is what H2O keeps of the admitted tokens") {
  auto rng = fresh_rng();
  for (int trial = 0; trial < 6; ++trial) random_run(rng, H2OEviction({.heavy = 4 + std::int32_t(rng() % 6), .recent = std::int32_t(rng() % 4)}), 120);
}

TEST_CASE("Write-Gated KV + SnapKV: one compression of each head row's global region") {
  auto rng = fresh_rng();
  for (int trial = 0; trial < 6; ++trial) random_run(rng, SnapKVEviction({.capacity = 3 + std::int32_t(rng() % 4), .window = 2, .kernel = 3}), 80);
}

TEST_CASE("Write-Gated KV + TOVA and average attention on the global region") {
  auto rng = fresh_rng();
  for (int trial = 0; trial < 3; ++trial) {
    random_run(rng, TovaEviction({.budget = 5 + std::int32_t(rng() % 6)}), 80);
    random_run(rng, AverageAttentionEviction({.budget = 6 + std::int32_t(rng() % 6), .step = 2}), 80);
  }
}

TEST_CASE("Write-Gated KV + H2O: errors name the value and change nothing and a fork keeps its shared tokens") {
  auto rng = fresh_rng();
  Run<H2OEviction> run(rng, H2OEviction({.heavy = 3, .recent = 1}));
  run.add();
  const SeqId s = run.live[0];
  REQUIRE(run.write(s, 60));
  const auto snapshot = run.cache;
  auto v = run.scores(s, 0, 1);
  v.pop_back();
  REQUIRE(run.cache.observe(s, 0, ScoreKind::head_attention_sums, v).message().find("scores.size") != std::string::npos);
  v = run.scores(s, 0, 1);
  v[3] = -1.0f;
  REQUIRE(run.cache.observe(s, 0, ScoreKind::head_attention_sums, v).message().find("scores_at") != std::string::npos);
  v[3] = 0.0f;
  REQUIRE(run.cache.observe(s, 0, ScoreKind::last_query_attention, v).message().find("scores.kind") != std::string::npos);
  REQUIRE(run.cache.observe(s, L, ScoreKind::head_attention_sums, v).message().find("layer") != std::string::npos);
  std::vector<SlotMove> few(1);
  auto r = run.cache.evict(s, few);
  REQUIRE(r.status().code() == Errc::buffer_too_small);
  REQUIRE(run.cache == snapshot);
  // A fork shares every block: nothing in them may leave until the fork is gone.
  const SeqId child = *run.cache.fork(s);
  std::vector<SlotMove> moves(std::size_t(L * H * kRow * B));
  auto shared = run.cache.evict(s, moves);
  REQUIRE(shared.ok());
  REQUIRE(shared->tokens == 0);
  REQUIRE(run.cache.free(child).ok());
  auto alone = run.cache.evict(s, moves);
  REQUIRE(alone.ok());
  REQUIRE(alone->tokens > 0);
  for (std::int32_t l = 0; l < L; ++l)
    for (std::int32_t h = 0; h < H; ++h) REQUIRE(run.global(s, l, h).size() <= 4);  // heavy + recent
  REQUIRE(run.cache.check_invariants().ok());
}
