// The example engine with sparse policies: Write-Gated KV through the cache
// against the gate rule on an unpaged buffer, Quest against the dense cache,
// and the three-way composition against the gated engine.
#include <catch2/catch.hpp>
#include <cmath>
#include <string>
#include <vector>

#include "engine.hpp"
#include "engine_testing.hpp"
#include "forward.hpp"
#include "gated.hpp"
#include "kv_store.hpp"
#include "model.hpp"
#include "policies.hpp"
#include "stats.hpp"

namespace kv = kvcache;
using namespace engine_testing;

namespace {
// Write-Gated KV's rule without a cache: every token kept in a contiguous
// buffer, gates from the same kernel, and a key farther than W behind the
// query masked unless admitted.
struct RuleKv {
  const engine::GateSet& g;
  engine::ContiguousKv all;
  std::int64_t first;
  std::int32_t cap;
  std::vector<std::uint8_t>& adm;  // [layer][head][position]
  std::vector<float> k_pre, gates;
  void pre_rope(std::int32_t, const float* k, std::int32_t n) { k_pre.assign(k, k + std::ptrdiff_t(n) * g.kv_heads * g.head_dim); }
  void write(std::int32_t l, const float* k, const float* v, std::int32_t n) {
    const std::int64_t row = std::int64_t(g.kv_heads) * g.head_dim;
    gates.resize(std::size_t(n * g.kv_heads));
    REQUIRE(kv::write_gate_host({g.weights(l), k_pre.data(), k, kv::DType::f32, row * 4, g.head_dim * 4, n, gates.data()}).ok());
    for (std::int32_t t = 0; t < n; ++t)
      for (std::int32_t h = 0; h < g.kv_heads; ++h)
        adm[std::size_t(l * g.kv_heads + h) * std::size_t(cap) + std::size_t(first + t)] = gates[std::size_t(t * g.kv_heads + h)] >= g.tau;
    all.write(l, k, v, n);
  }
  engine::HeldKv read(std::int32_t l, std::int32_t h) const {
    engine::HeldKv held = all.read(l, h);  // positions 0.. in order: the flag of token t is adm[..][t]
    held.admitted = adm.data() + std::size_t(l * g.kv_heads + h) * std::size_t(cap);
    held.window = g.window;
    return held;
  }
};
}  // namespace

TEST_CASE("Write-Gated KV through the cache attends exactly as the gate rule on an unpaged buffer and holds less") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  const auto& c = model.config();
  const engine::GateSet gates(kDir + "/gates-0.01.bin");
  REQUIRE(gates.window == 64);
  const auto text = heldout(400);
  engine::GatedEngine<> gated(model, gates);
  const auto score = gated.score(text);
  // The rule, chunk by chunk as the engine runs it.
  engine::Forward fwd(model);
  const std::int32_t cap = c.context + 256;
  std::vector<std::uint8_t> adm(std::size_t(c.layers * c.kv_heads * cap), 0);
  RuleKv rule{gates, engine::ContiguousKv(c, 400), 0, cap, adm, {}, {}};
  double nll = 0.0;
  std::vector<float> logits;
  for (std::int32_t at = 0; at + 1 < std::int32_t(text.size()); at += 64) {
    const std::int32_t n = std::min<std::int32_t>(64, std::int32_t(text.size()) - 1 - at);
    rule.first = at;
    fwd.run(rule, std::span(text).subspan(std::size_t(at), std::size_t(n)), at, logits, false);
    for (std::int32_t i = 0; i < n; ++i) {
      nll += engine::token_nll(&logits[std::size_t(i) * std::size_t(c.vocab)], c.vocab, text[std::size_t(at + i + 1)]);
    }
  }
  CHECK(score.predictions == 399);
  CHECK(score.nll == Approx(nll).epsilon(1e-5));  // the same keys, summed in another order
  // It dropped tokens, kept some, and held less than the 399 a dense cache holds.
  CHECK(gated.counts().admitted > 0);
  CHECK(gated.counts().dropped > 0);
  CHECK(score.peak_kv < 399);
  CHECK(score.peak_kv >= gates.window);
  // A mutation that read every ring key regardless of the rule would differ.
  const std::int64_t kept = std::count(adm.begin(), adm.end(), std::uint8_t{1});
  CHECK(kept < std::int64_t(c.layers * c.kv_heads) * 399);
}


TEST_CASE("Quest with a budget that covers the context serves exactly what the dense cache does") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  const auto reqs = requests(heldout(4096), 3, 700, 90, 10, 30);
  const engine::EngineConfig cfg0{.max_kv_tokens = 2048, .block_size = 16, .chunk = 32, .max_batch = 3};
  auto dense = reqs;
  engine::Engine<kv::KeepAll>(model, cfg0, {}).run(dense);
  auto cfg = cfg0;
  cfg.quest = {.token_budget = model.config().context, .dense_layers = 1,
               .query_group = model.config().q_heads / model.config().kv_heads};
  engine::Engine<kv::KeepAll, kv::QuestSelection> e(model, cfg, {});
  auto rs = reqs;
  e.run(rs);
  for (std::size_t i = 0; i < reqs.size(); ++i) CHECK(rs[i].output == dense[i].output);
  CHECK(e.stats().keys.reads > 0);
  CHECK(e.stats().keys.read == e.stats().keys.dense);  // every page chosen: every key read
}

TEST_CASE("Quest reads at most its budget per decode query in the sparse layers, under any eviction policy") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  const auto reqs = requests(heldout(4096), 3, 600, 90, 20, 20);
  const engine::EngineConfig cfg0{.max_kv_tokens = 2048, .block_size = 16, .chunk = 32, .max_batch = 3};
  const auto& c = model.config();
  const auto run = [&](auto policy, const engine::EngineConfig& base) {
    auto cfg = base;
    cfg.quest = {.token_budget = 64, .dense_layers = 1, .query_group = c.q_heads / c.kv_heads};
    engine::Engine<decltype(policy), kv::QuestSelection> e(model, cfg, policy);
    auto rs = reqs;
    while (std::any_of(rs.begin(), rs.end(), [](const auto& r) { return !r.done; })) {
      e.step(rs);
      REQUIRE(e.cache().check_invariants().ok());
    }
    const auto& k = e.stats().keys;
    REQUIRE(k.sparse_reads > 0);
    CHECK(k.sparse_read <= k.sparse_reads * 64);  // 4 pages of 16 at most
    CHECK(k.read < k.dense);
    for (const auto& r : rs) CHECK(std::int32_t(r.output.size()) == r.max_new);
  };
  run(kv::KeepAll{}, cfg0);
  run(kv::SlidingWindow(256), cfg0);
  engine::with_policy("h2o", 256, c, [&](auto policy, auto adjust) {  // compaction: stale pages recomputed
    auto cfg = cfg0;
    adjust(cfg);
    run(policy, cfg);
  });
  engine::with_policy("block_scores_summed", 256, c, [&](auto policy, auto adjust) {
    auto cfg = cfg0;
    adjust(cfg);
    run(policy, cfg);
  });
}

TEST_CASE("Write-Gated KV composed with Quest and H2O: no-op settings serve the gated engine exactly, tight ones read and hold less") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  const auto& c = model.config();
  const engine::GateSet gates(kDir + "/gates-0.01.bin");
  const auto text = heldout(700);
  const std::vector<std::int32_t> prompt(text.begin(), text.begin() + 600);
  const kv::QuestConfig all_pages{.token_budget = c.context, .dense_layers = 1, .query_group = c.q_heads / c.kv_heads};
  const kv::QuestConfig tight{.token_budget = 32, .dense_layers = 1, .query_group = c.q_heads / c.kv_heads};
  std::int64_t peak = 0, peak_h2o = 0, peak_all = 0;
  engine::GatedEngine<> plain(model, gates);
  const auto want = plain.generate(prompt, 24, peak);
  const auto plain_score = plain.score(text);
  {  // Quest reading every page, H2O keeping every admitted token: the gated engine's tokens and scores
    engine::GatedEngine<kv::QuestSelection, kv::H2OEviction> noop(model, gates, 64, 16, all_pages,
                                                                  kv::H2OEviction({.heavy = c.context, .recent = 0}));
    std::int64_t p = 0;
    CHECK(noop.generate(prompt, 24, p) == want);
    CHECK(noop.score(text).nll == plain_score.nll);
    CHECK(noop.counts().keys_read == plain.counts().keys_read);
  }
  engine::GatedEngine<kv::QuestSelection> quest(model, gates, 64, 16, tight);
  (void)quest.generate(prompt, 24, peak);
  CHECK(quest.counts().keys_read < plain.counts().keys_read);  // ring + 2 global pages per head row
  engine::GatedEngine<kv::SelectAll, kv::H2OEviction> h2o(model, gates, 64, 16, {}, kv::H2OEviction({.heavy = 64, .recent = 0}));
  (void)h2o.generate(prompt, 24, peak_h2o);
  CHECK(peak_h2o <= gates.window + 64 + 64);  // per head: the ring, 64 heavy hitters, a chunk's promotions
  CHECK(peak_h2o < peak);
  engine::GatedEngine<kv::QuestSelection, kv::H2OEviction> all(model, gates, 64, 16, tight, kv::H2OEviction({.heavy = 64, .recent = 0}));
  const auto out = all.generate(prompt, 24, peak_all);
  CHECK(out.size() == 24);
  CHECK(peak_all <= gates.window + 64 + 64);
  CHECK(all.counts().keys_read < h2o.counts().keys_read);
}

TEST_CASE("the one scheduler batches Write-Gated KV requests: each generates what it generates alone") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  const engine::GateSet gates(kDir + "/gates-0.01.bin");
  const auto& c = model.config();
  const auto reqs = requests(heldout(4096), 4, 500, 150, 40, 20);
  const kv::QuestConfig tight{.token_budget = 32, .dense_layers = 1, .query_group = c.q_heads / c.kv_heads};
  const auto batched_equals_alone = [&](auto selection, auto eviction, const kv::QuestConfig& quest) {
    using S = decltype(selection);
    using E = decltype(eviction);
    std::vector<std::vector<std::int32_t>> alone;
    engine::GatedEngine<S, E> one(model, gates, 32, 16, quest, eviction);
    for (const auto& r : reqs) {
      std::int64_t peak = 0;
      alone.push_back(one.generate(r.prompt, r.max_new, peak));
    }
    // Three at a time: the fourth waits for a handle, then runs beside the others' decode.
    engine::GatedEngine<S, E> e(model, gates, {.block_size = 16, .chunk = 32, .max_batch = 3, .quest = quest}, eviction);
    auto rs = reqs;
    while (std::any_of(rs.begin(), rs.end(), [](const auto& r) { return !r.done; })) {
      e.step(rs);
      REQUIRE(e.cache().check_invariants().ok());
      std::int64_t live = 0;
      for (const auto& r : rs) live += r.running;
      CHECK(live <= 3);
    }
    CHECK(e.stats().max_batch == 3);
    CHECK(e.stats().preemptions == 0);  // admitted by the lifetime bound: never short
    for (std::size_t i = 0; i < reqs.size(); ++i) CHECK(rs[i].output == alone[i]);
    CHECK(e.cache().free_sequences() == 3);  // every handle back
    CHECK(e.counts().admitted == one.counts().admitted);  // the same gates, whatever the batch
  };
  batched_equals_alone(kv::SelectAll{}, kv::KeepAll{}, {});
  batched_equals_alone(kv::QuestSelection{tight}, kv::H2OEviction({.heavy = 64, .recent = 0}), tight);
}

TEST_CASE("the scheduler refuses what it cannot serve, by name") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  const engine::GateSet gates(kDir + "/gates-0.01.bin");
  // Write-Gated KV takes its slots inside the forward pass: nothing can be preempted halfway.
  CHECK_THROWS_WITH((engine::GatedEngine<>(model, gates, engine::EngineConfig{.optimistic = true})),
                    Catch::Contains("optimistic"));
  // A request larger than the whole pool is never admitted: an error, not an endless loop.
  auto reqs = requests(heldout(4096), 1, 0, 600, 0, 10);
  engine::Engine<kv::KeepAll> e(model, {.max_kv_tokens = 256, .block_size = 16, .chunk = 32, .max_batch = 2}, {});
  CHECK_THROWS_WITH(e.run(reqs), Catch::Contains("request 0 does not fit the pool on its own"));
  // Nothing to generate: done without running.
  auto none = requests(heldout(4096), 1, 0, 50, 0, 0);
  e.run(none);
  CHECK(none[0].done);
  CHECK(none[0].output.empty());
}
