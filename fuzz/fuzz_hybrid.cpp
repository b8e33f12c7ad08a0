// libFuzzer target: a hybrid cache whose groups the input chooses (one to
// four, of any kind, window, chunk and head size, so block sizes differ), its
// pool and lengths, then random admits with prefix hits, reserves, computed
// marks, rollbacks, frees and stale handles (tests/hybrid_harness.hpp: the
// shadow of every slot's content, the invariants, failed calls changing
// nothing, every hit and every live position reading back its own prefix).
#include <kvcache/cache/hybrid.hpp>

#include <vector>

#include "input.hpp"

#include "hybrid_harness.hpp"

namespace kv = kvcache;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz_input::Bytes in{data, size};
  const std::int32_t groups = 1 + in.pick(4);
  std::vector<std::vector<std::int32_t>> layers(static_cast<std::size_t>(groups));
  std::vector<kv::LayerGroupSpec> specs(static_cast<std::size_t>(groups));
  for (std::int32_t g = 0; g < groups; ++g) {
    layers[std::size_t(g)] = {g};
    auto& s = specs[std::size_t(g)];
    s.kind = kv::AttentionKind(in.pick(5));
    s.layers = layers[std::size_t(g)];
    s.head_dim = 4 << in.pick(3);  // 4, 8, 16: block sizes 1, 2 or 4 times the widest group's
    s.window = 1 + in.pick(12);
    s.chunk = 1 + in.pick(12);
    s.encoder_len = 1 + in.pick(9);
  }
  auto lg = kv::LayerGroups::make({.groups = specs, .block_size = 1 + in.pick(4), .max_padding_permille = 999});
  if (!lg) return 0;  // e.g. every group cross-attention is fine; a bad spec is LayerGroups' own test
  const std::int32_t max_tokens = 8 + in.pick(56);
  const kv::HybridConfig cfg{.groups = *lg, .num_blocks = 2 + in.pick(96), .max_sequences = 1 + in.pick(6),
                             .max_tokens = max_tokens, .prefill_chunk = in.pick(9), .prefix_caching = in.pick(8) != 0};
  const auto pick = [&in](std::int32_t n) { return in.pick(n); };
  const auto need = fuzz_input::need_for("fuzz_hybrid");
  kvtest::HybridHarness<decltype(pick), decltype(need)> h(pick, need, cfg);
  for (int ops = 0; ops < 400 && in.n > 0; ++ops) h.step();
  return 0;
}
