// The example engine over a hybrid cache (hybrid_backend.hpp): layers 1 and
// 3 a sliding window, 0 and 2 full attention, one pool. Where the window
// covers the context it serves exactly the full engine's tokens; with a
// short window it equals a plain buffer with the same mask, token for token,
// and holds less, so a fixed pool admits more at once.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

#include "engine.hpp"
#include "engine_testing.hpp"
#include "forward.hpp"
#include "hybrid_backend.hpp"
#include "kv_store.hpp"
#include "model.hpp"

namespace kv = kvcache;
using namespace engine_testing;

namespace {
// A plain buffer read with the hybrid's mask: odd layers see the last W keys.
struct WindowRuleKv {
  engine::ContiguousKv all;
  std::int32_t window;
  std::vector<std::uint8_t> none = std::vector<std::uint8_t>(4096, 0);
  void write(std::int32_t l, const float* k, const float* v, std::int32_t n) { all.write(l, k, v, n); }
  engine::HeldKv read(std::int32_t l, std::int32_t h) const {
    engine::HeldKv held = all.read(l, h);
    if (l % 2 == 1) held.admitted = none.data(), held.window = window;
    return held;
  }
};
}  // namespace

TEST_CASE("hybrid layers: a window covering the context serves the full engine's tokens exactly") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  const auto reqs = requests(heldout(4096), 3, 700, 300, 40, 40);
  const engine::EngineConfig cfg{.max_kv_tokens = 4096, .block_size = 16, .chunk = 64, .max_batch = 3};
  auto full = reqs, hybrid = reqs;
  engine::Engine<kv::KeepAll>(model, cfg, {}).run(full);
  engine::HybridEngine e(model, cfg, model.config().context);
  while (std::any_of(hybrid.begin(), hybrid.end(), [](const auto& r) { return !r.done; })) {
    e.step(hybrid);
    REQUIRE(e.cache().check_invariants().ok());
  }
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    CHECK(hybrid[i].output == full[i].output);
    CHECK(hybrid[i].peak_kv == full[i].peak_kv);  // nothing left a window this long
  }
  CHECK(e.cache().free_blocks() == e.cache().pool().capacity() - 1);  // every page back
}

TEST_CASE("hybrid layers: a 64-token window equals a plain buffer with the same mask, and holds less") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  const auto& c = model.config();
  constexpr std::int32_t W = 64, kPrompt = 300, kNew = 40;
  const auto prompt = heldout(kPrompt);
  std::vector<engine::Request> one(1);
  one[0].prompt = prompt;
  one[0].max_new = kNew;
  const engine::EngineConfig cfg{.max_kv_tokens = 2048, .block_size = 16, .chunk = 64, .max_batch = 1, .keep_logits = true};
  engine::HybridEngine e(model, cfg, W);
  e.run(one);
  // The reference: the whole prompt at once into a plain buffer, then greedy decoding, the odd layers masked to W.
  engine::Forward fwd(model);
  WindowRuleKv rule{engine::ContiguousKv(c, kPrompt + kNew), W};
  std::vector<float> logits, all_logits;
  std::vector<std::int32_t> out;
  fwd.run(rule, prompt, 0, logits, true);
  for (std::int32_t t = 0; t < kNew; ++t) {
    out.push_back(argmax(logits.data(), c.vocab));
    all_logits.insert(all_logits.end(), logits.begin(), logits.end());
    if (t + 1 == kNew) break;
    fwd.run(rule, std::span(out).last(1), kPrompt + t, logits, true);
  }
  CHECK(one[0].output == out);
  REQUIRE(one[0].logits.size() == all_logits.size());
  float worst = 0.0f;  // the same keys in the same order: the prompt went in chunks here, at once there
  for (std::size_t i = 0; i < all_logits.size(); ++i) worst = std::max(worst, std::fabs(one[0].logits[i] - all_logits[i]));
  CHECK(worst < 1e-4f);
  // Without the mask the same model reads more: its logits move (the check above can fail).
  engine::Forward wide_fwd(model);
  WindowRuleKv wide{engine::ContiguousKv(c, kPrompt + kNew), 1 << 20};
  std::vector<float> wide_logits;
  wide_fwd.run(wide, prompt, 0, wide_logits, true);
  float moved = 0.0f;
  for (std::int32_t i = 0; i < c.vocab; ++i) moved = std::max(moved, std::fabs(wide_logits[std::size_t(i)] - all_logits[std::size_t(i)]));
  CHECK(moved > 1e-2f);
  // Held per layer: the full layers all of it, the window ones W - 1 + a chunk at most, in blocks of 16.
  CHECK(one[0].peak_kv < kPrompt + kNew);
  CHECK(one[0].peak_kv <= (kPrompt + kNew + (W - 1 + 64 + 2 * 16)) / 2 + 1);
  // A fixed pool admits more requests at once than with every layer full.
  const auto many = requests(heldout(8192), 8, 900, 600, 0, 16);
  engine::EngineConfig fixed{.max_kv_tokens = 2048, .block_size = 16, .chunk = 64, .max_batch = 8};
  auto a = many, b = many;
  engine::Engine<kv::KeepAll> dense(model, fixed, {});
  dense.run(a);
  engine::HybridEngine windowed(model, fixed, W);
  windowed.run(b);
  CHECK(windowed.stats().max_batch > dense.stats().max_batch);
}

TEST_CASE("the hybrid backend refuses settings it cannot honour") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  CHECK_THROWS_WITH(engine::HybridEngine(model, {.optimistic = true}, 64), Catch::Contains("optimistic"));
  CHECK_THROWS_WITH(engine::HybridEngine(model, {.evict_in_prefill = false}, 64), Catch::Contains("evict_in_prefill"));
  CHECK_THROWS_WITH(engine::HybridEngine(model, {}, 0), Catch::Contains("window"));
}

TEST_CASE("Quest on the hybrid's full layers: a budget covering the context serves the dense hybrid's tokens, a tight one reads its budget") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  const auto& c = model.config();
  constexpr std::int32_t W = 64, kBudget = 64;
  const auto reqs = requests(heldout(4096), 3, 700, 300, 40, 40);
  const engine::EngineConfig dense_cfg{.max_kv_tokens = 4096, .block_size = 16, .chunk = 64, .max_batch = 3, .keep_logits = true};
  auto dense = reqs;
  engine::HybridEngine(model, dense_cfg, W).run(dense);
  auto quest = [&](std::int32_t budget) {
    engine::EngineConfig cfg = dense_cfg;
    cfg.quest = {.token_budget = budget, .dense_layers = 0, .query_group = c.q_heads / c.kv_heads};
    engine::HybridEngine<kv::QuestSelection> e(model, cfg, W);
    auto rs = reqs;
    while (std::any_of(rs.begin(), rs.end(), [](const auto& r) { return !r.done; })) {
      e.step(rs);
      REQUIRE(e.cache().check_invariants().ok());
    }
    CHECK(e.cache().free_blocks() == e.cache().pool().capacity() - 1);  // every page back
    return std::pair{rs, e.stats().keys};
  };
  // Every page within the budget: Quest reads them all, without an estimate.
  const auto [wide, wide_keys] = quest(4096);
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    CHECK(wide[i].output == dense[i].output);
    CHECK(wide[i].logits == dense[i].logits);
  }
  CHECK(wide_keys.sparse_reads > 0);
  CHECK(wide_keys.sparse_read == wide_keys.dense);
  // 64 tokens (4 pages of 16) a query: the sink, the best-bounded two, the last. Only the full layers select.
  const auto [tight, tight_keys] = quest(kBudget);
  CHECK(tight_keys.sparse_reads == wide_keys.sparse_reads);  // one per (decode query, full layer, kv-head)
  CHECK(tight_keys.sparse_read <= std::int64_t{kBudget} * tight_keys.sparse_reads);
  CHECK(tight_keys.sparse_read * 4 < tight_keys.dense);  // prompts of 300 tokens and more: a fraction is read
  float moved = 0.0f;
  for (std::size_t i = 0; i < reqs.size(); ++i)
    for (std::size_t j = 0; j < std::min(tight[i].logits.size(), dense[i].logits.size()); ++j)
      moved = std::max(moved, std::fabs(tight[i].logits[j] - dense[i].logits[j]));
  CHECK(moved > 1e-3f);  // what was left out moved the logits: the mask was applied
}

TEST_CASE("a block policy on the hybrid's full layers: past the request it changes nothing, within it the full rows hold its budget") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  constexpr std::int32_t W = 64, B = 16, kChunk = 64;
  const auto reqs = requests(heldout(4096), 3, 700, 300, 40, 40);
  const engine::EngineConfig cfg{.max_kv_tokens = 4096, .block_size = B, .chunk = kChunk, .max_batch = 3, .keep_logits = true};
  auto plain = reqs;
  engine::HybridEngine(model, cfg, W).run(plain);
  // Runs the workload with the policy, checking the full rows after every step; returns the requests.
  auto with = [&](auto policy, std::int64_t bound) {
    engine::HybridEngine<kv::SelectAll, decltype(policy)> e(model, cfg, W, policy);
    auto rs = reqs;
    bool let_go = false;
    while (std::any_of(rs.begin(), rs.end(), [](const auto& r) { return !r.done; })) {
      e.step(rs);
      REQUIRE(e.cache().check_invariants().ok());
      for (const auto& r : rs) {
        if (!r.running) continue;
        const std::int64_t held = *e.cache().tokens_held(r.seqs[0], 0);
        CHECK(held <= bound + kChunk + B);
        let_go = let_go || *e.cache().evicted(r.seqs[0]);
      }
    }
    CHECK(let_go == (bound < 4096));
    CHECK(e.cache().free_blocks() == e.cache().pool().capacity() - 1);  // every page back
    return rs;
  };
  // Sinks and a window past every request: nothing leaves, the same tokens and logits bit for bit.
  const auto wide = with(kv::SinkWindowEviction({.sinks = 4, .window = 4096}), 4096);
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    CHECK(wide[i].output == plain[i].output);
    CHECK(wide[i].logits == plain[i].logits);
  }
  // 128 tokens: sinks and a window, and block scores fed the full layers' attention, keep other blocks.
  const auto sinks = with(kv::SinkWindowEviction({.sinks = 4, .window = 128 - 2 * B}), 128);
  const auto scored = with(kv::BlockScoreEviction({.start = B, .recent = 4 * B, .max = 128 - B}), 128);
  bool differ = false;
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    CHECK(sinks[i].peak_kv < plain[i].peak_kv);
    differ = differ || scored[i].logits != sinks[i].logits;
  }
  CHECK(differ);
}
