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
