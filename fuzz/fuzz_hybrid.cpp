// libFuzzer target: a hybrid cache whose groups the input chooses (one to
// four, of any kind, window, chunk and head size, so block sizes differ), its
// pool and lengths, a KV format per group (f16; int8 or fp8 with engine-held
// scales; int8, int4, fp4 or int2 in groups with their entries in the page,
// which changes each group's tokens a page), then random admits with prefix hits, reserves, computed
// marks, rollbacks, frees and stale handles (tests/hybrid_harness.hpp: the
// shadow of every slot's content, the invariants, failed calls changing
// nothing, every hit and every live position reading back its own prefix);
// or, where a group is full or MLA, the same with a block eviction policy on
// those groups (tests/hybrid_eviction_harness.hpp: K/V written after an
// eviction differs from the prompt's, and every row reads back what it holds).
#include <kvcache/cache/hybrid.hpp>
#include <kvcache/eviction/block_scores.hpp>
#include <kvcache/eviction/sink_window.hpp>

#include <numeric>

#include <vector>

#include "input.hpp"

#include "hybrid_eviction_harness.hpp"
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
    // Group formats take groups of 16 values: their heads are 4 times wider.
    const kv::SideFormat tensor{.scales = kv::Scales::tensor}, head{.scales = kv::Scales::head},
        g16{.scales = kv::Scales::group, .group = 16}, g16_min{.scales = kv::Scales::group, .group = 16, .minimum = true};
    switch (in.pick(8)) {
      case 2: s.dtype = kv::DType::int8, s.format = {tensor, tensor}; break;
      case 3: s.dtype = kv::DType::fp8_e4m3, s.format = {head, head}; break;
      case 4: s.dtype = kv::DType::int8, s.format = {g16, g16_min}, s.head_dim *= 4; break;
      case 5: s.dtype = kv::DType::int4, s.format = {g16_min, g16}, s.head_dim *= 4; break;
      case 6: s.dtype = kv::DType::fp4_e2m1, s.format = {g16, g16}, s.head_dim *= 4; break;
      case 7: s.dtype = kv::DType::int2, s.format = {g16_min, g16_min}, s.head_dim *= 4; break;
      default: break;  // f16, unscaled
    }
    if (s.kind == kv::AttentionKind::mla) s.format.v = {};  // MLA stores no V
  }
  auto lg = kv::LayerGroups::make({.groups = specs, .block_size = 1 + in.pick(4), .max_padding_permille = 999});
  if (!lg) return 0;  // e.g. every group cross-attention is fine; a bad spec is LayerGroups' own test
  const std::int32_t max_tokens = 8 + in.pick(56);
  const kv::HybridConfig cfg{.groups = *lg, .num_blocks = 2 + in.pick(96), .max_sequences = 1 + in.pick(6),
                             .max_tokens = max_tokens, .prefill_chunk = in.pick(9), .prefix_caching = in.pick(8) != 0};
  const auto pick = [&in](std::int32_t n) { return in.pick(n); };
  const auto need = fuzz_input::need_for("fuzz_hybrid");
  // A block eviction policy on the global groups, when there is one: sinks and a window, or block scores
  // in multiples of every global group's block size.
  std::int32_t step = 0;
  for (std::int32_t g = 0; g < lg->num_groups(); ++g)
    if (kv::global_kind(lg->spec(g).kind))
      step = step == 0 ? lg->block_size(g) : std::lcm(step, lg->block_size(g));
  switch (step > 0 ? in.pick(3) : 0) {
    case 1: {
      kv::HybridCache<kv::FastBlockHasher, kv::SelectAll, kv::SinkWindowEviction> cache(
          cfg, {}, kv::SinkWindowEviction({.sinks = in.pick(9), .window = 1 + in.pick(16)}));
      kvtest::HybridEvictionHarness h(cache, pick, need);
      for (int ops = 0; ops < 400 && in.n > 0; ++ops) h.step();
      return 0;
    }
    case 2: {
      const std::int32_t start = step * (1 + in.pick(2)), recent = step * (1 + in.pick(2));
      kv::HybridCache<kv::FastBlockHasher, kv::SelectAll, kv::BlockScoreEviction> cache(
          cfg, {}, kv::BlockScoreEviction({.start = start, .recent = recent, .max = start + recent + step * (1 + in.pick(3))}));
      kvtest::HybridEvictionHarness h(cache, pick, need);
      for (int ops = 0; ops < 400 && in.n > 0; ++ops) h.step();
      return 0;
    }
    default: {
      kvtest::HybridHarness<decltype(pick), decltype(need)> h(pick, need, cfg);
      for (int ops = 0; ops < 400 && in.n > 0; ++ops) h.step();
      return 0;
    }
  }
}
