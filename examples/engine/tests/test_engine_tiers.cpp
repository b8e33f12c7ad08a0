// The example engine with memory tiers (tiered.hpp): multi-turn
// conversations over a device pool too small for them, with a host tier.
// Prefilled one token at a time, every token's K/V is computed the same way
// wherever the prefill starts, so each write policy must generate exactly
// the tokens recompute does: onboarded blocks hold exactly what recompute
// would write. Host hits replace computed tokens one for one, the bytes
// moved are whole blocks, and a host tier too small to take a store still
// serves the right tokens. The same on a hybrid model (tiered_hybrid.hpp):
// every group's blocks come back, the window group's last window only.
#include <catch2/catch.hpp>

#include <vector>

#include "engine_testing.hpp"
#include "tiered.hpp"
#include "tiered_hybrid.hpp"

namespace kv = kvcache;
using namespace engine_testing;

namespace {
const engine::MultiTurn kTurns{.conversations = 4, .turns = 3, .first = 64, .user = 16, .max_new = 8};
engine::MultiTurnRun run(const engine::Model& m, std::int32_t host, kv::WriteMode write) {
  return engine::serve_multiturn(m, {.device_blocks = 14, .host_blocks = host, .block_size = 16, .chunk = 1, .write = write},
                                 heldout(65536), kTurns);
}
}  // namespace

TEST_CASE("tiered engine: every write policy serves recompute's tokens, from host memory where the device forgot") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  const auto base = run(model, 0, kv::WriteMode::write_back);
  CHECK(base.stats.host_hit_tokens == 0);
  CHECK(base.stats.bytes_offloaded == 0);
  const std::int64_t block_bytes = std::int64_t(model.config().layers) * 2 * model.config().kv_heads * model.config().head_dim() * 16 * 4;
  for (const auto write : {kv::WriteMode::write_back, kv::WriteMode::write_through, kv::WriteMode::write_through_reused}) {
    INFO("write mode " << int(write));
    const auto r = run(model, 256, write);
    CHECK(r.outputs == base.outputs);
    const auto& s = r.stats;
    CHECK(s.host_hit_tokens > 0);
    CHECK(s.prompt_tokens == base.stats.prompt_tokens);
    CHECK(s.device_hit_tokens + s.host_hit_tokens + s.computed_tokens == s.prompt_tokens);
    CHECK(s.computed_tokens == base.stats.computed_tokens + base.stats.device_hit_tokens - s.device_hit_tokens - s.host_hit_tokens);
    CHECK(s.bytes_onboarded == s.blocks_onboarded * block_bytes);
    CHECK(s.host_hit_tokens == s.blocks_onboarded * 16);
    CHECK(s.bytes_offloaded == s.blocks_offloaded * block_bytes);
    for (std::size_t t = 0; t < r.turns.size(); ++t)
      if (t < std::size_t(kTurns.conversations)) CHECK(r.turns[t].host_hit == 0);  // nothing to find on a first turn
  }
  // A host tier of 3 blocks cannot take a turn's store: it serves what fits, and the same tokens.
  const auto small = run(model, 3, kv::WriteMode::write_back);
  CHECK(small.outputs == base.outputs);
  CHECK(small.stats.host_hit_tokens <= 3 * 16 * std::int64_t(small.turns.size()));
}

TEST_CASE("tiered hybrid engine: host memory serves recompute's tokens, the window group moving only its last window") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  constexpr std::int32_t W = 32;
  const auto run_hybrid = [&](std::int32_t host) {
    engine::HybridTieredEngine e(model, {.device_blocks = 14, .host_blocks = host, .block_size = 16, .chunk = 1}, W);
    return engine::serve_multiturn_on(e, heldout(65536), kTurns);  // the engine checks every invariant after each turn
  };
  const auto base = run_hybrid(0);
  const auto tiered = run_hybrid(256);
  CHECK(tiered.outputs == base.outputs);
  const auto& s = tiered.stats;
  CHECK(base.stats.host_hit_tokens == 0);
  CHECK(s.host_hit_tokens > 0);
  CHECK(s.device_hit_tokens + s.host_hit_tokens + s.computed_tokens == s.prompt_tokens);
  CHECK(s.computed_tokens < base.stats.computed_tokens);
  for (std::size_t t = 0; t < std::size_t(kTurns.conversations); ++t) CHECK(tiered.turns[t].host_hit == 0);
  // Each onboarded hit moves the full group's blocks past the device hit and the window's last ceil((W - 1) / 16) = 2:
  // fewer pages than two per block of the hit, which a full-attention model would move.
  const std::int64_t pages = s.blocks_onboarded, hit_blocks = s.host_hit_tokens / 16;
  CHECK(pages < 2 * hit_blocks);
  CHECK(pages >= hit_blocks);
  const auto& c = model.config();
  CHECK(s.bytes_onboarded == pages * (c.layers / 2) * 2 * c.kv_heads * c.head_dim() * 16 * 4);
}
