// The example engine with memory tiers (tiered.hpp): multi-turn
// conversations over a device pool too small for them, with a host tier.
// Prefilled one token at a time, every token's K/V is computed the same way
// wherever the prefill starts, so each write policy must generate exactly
// the tokens recompute does: onboarded blocks hold exactly what recompute
// would write. Host hits replace computed tokens one for one, the bytes
// moved are whole blocks, and a host tier too small to take a store still
// serves the right tokens.
#include <catch2/catch.hpp>

#include <vector>

#include "engine_testing.hpp"
#include "tiered.hpp"

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
