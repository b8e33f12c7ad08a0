// The example engine's forward pass: matches the training framework's logits
// on a fixed prompt (stored, so no PyTorch here), and gives the same logits
// and greedy tokens whether K/V live in kvcache's paged pool or in a plain
// contiguous buffer; preemption changes nothing; every policy runs inside
// the engine within its bound.
#include <catch2/catch.hpp>
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "engine.hpp"
#include "forward.hpp"
#include "kv_store.hpp"
#include "model.hpp"
#include "policies.hpp"

#ifndef ENGINE_MODEL_DIR
#error "ENGINE_MODEL_DIR must name the folder with kjv-tiny.bin"
#endif

namespace kv = kvcache;

namespace {
std::vector<char> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  REQUIRE(f.good());
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}
const std::string kDir = ENGINE_MODEL_DIR;
std::vector<std::int32_t> heldout(std::size_t n) {
  const auto bytes = read_file(kDir + "/heldout.bin");
  std::vector<std::int32_t> t;
  for (std::size_t i = 0; i < n; ++i) t.push_back(static_cast<unsigned char>(bytes[i]));
  return t;
}
std::int32_t argmax(const float* x, std::int32_t n) { return std::int32_t(std::max_element(x, x + n) - x); }
// `count` requests whose prompts start `stride` bytes apart in `text`, the
// i-th `len + i * grow` long; priorities alternate 0, 1.
std::vector<engine::Request> requests(const std::vector<std::int32_t>& text, int count, int stride, int len, int grow,
                                      std::int32_t max_new) {
  std::vector<engine::Request> reqs;
  for (int i = 0; i < count; ++i) {
    engine::Request r;
    r.id = i;
    r.priority = i % 2;
    r.prompt.assign(text.begin() + i * stride, text.begin() + i * stride + len + grow * i);
    r.max_new = max_new;
    reqs.push_back(r);
  }
  return reqs;
}
}  // namespace

TEST_CASE("the C++ forward pass matches the stored PyTorch logits") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  const auto& c = model.config();
  const auto ref = read_file(kDir + "/reference.bin");
  std::uint32_t shape[2];
  std::memcpy(shape, ref.data(), 8);
  REQUIRE(shape[1] == std::uint32_t(c.vocab));
  const auto prompt = heldout(shape[0]);
  engine::Forward fwd(model);
  engine::ContiguousKv store(c, c.context);
  std::vector<float> logits;
  fwd.run(store, prompt, 0, logits, false);
  REQUIRE(logits.size() == std::size_t(shape[0]) * shape[1]);
  double worst = 0.0;
  const float* want = reinterpret_cast<const float*>(ref.data() + 8);
  for (std::size_t i = 0; i < logits.size(); ++i) worst = std::max(worst, double(std::fabs(logits[i] - want[i])));
  INFO("largest |logit - reference| = " << worst);
  CHECK(worst < 2e-3);
  for (std::uint32_t t = 0; t < shape[0]; ++t)  // and the same predictions
    CHECK(argmax(&logits[t * shape[1]], c.vocab) == argmax(want + t * shape[1], c.vocab));
}

TEST_CASE("keep-all through the paged cache gives exactly the contiguous buffer's tokens") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  const auto& c = model.config();
  constexpr std::int32_t B = 16, kPrompt = 100, kNew = 60;
  const auto g = *kv::Geometry::make({.num_layers = c.layers,
                                      .num_kv_heads = c.kv_heads,
                                      .head_dim = c.head_dim(),
                                      .block_size = B,
                                      .dtype = kv::DType::f32});
  constexpr std::int32_t kBlocks = 64;
  std::vector<std::byte> memory(std::size_t(*g.pool_bytes(kBlocks)));
  const auto pool = *kv::make_pool_view(g, memory.data(), kBlocks);
  kv::Cache<> cache({.geometry = g, .num_blocks = kBlocks, .max_sequences = 2, .max_blocks_per_sequence = 32});
  const auto seq = *cache.add_sequence();
  std::vector<std::int64_t> positions(std::size_t(kBlocks * B), -1);

  engine::Forward paged_fwd(model), plain_fwd(model);
  engine::ContiguousKv plain(c, kPrompt + kNew);
  auto prompt = heldout(kPrompt);
  std::vector<std::int32_t> slots(kPrompt), tokens_paged, tokens_plain;
  std::vector<float> lp, lc;
  // Prefill in chunks of 32 through the pool; at once into the plain buffer.
  for (std::int32_t at = 0; at < kPrompt; at += 32) {
    const std::int32_t n = std::min(32, kPrompt - at);
    REQUIRE(cache.reserve(seq, n, slots).ok());
    engine::PagedKv<kv::Cache<>> store(cache, pool, seq, std::span<const std::int32_t>(slots).first(std::size_t(n)), at,
                                       positions);
    paged_fwd.run(store, std::span(prompt).subspan(std::size_t(at), std::size_t(n)), at, lp, true);
  }
  plain_fwd.run(plain, prompt, 0, lc, true);
  for (std::int32_t step = 0; step < kNew; ++step) {
    REQUIRE(lp == lc);  // bit for bit: the same floats, read back through the page table
    tokens_paged.push_back(argmax(lp.data(), c.vocab));
    tokens_plain.push_back(argmax(lc.data(), c.vocab));
    const std::int64_t pos = kPrompt + step;
    REQUIRE(cache.reserve(seq, 1, slots).ok());
    engine::PagedKv<kv::Cache<>> store(cache, pool, seq, std::span<const std::int32_t>(slots).first(1), pos, positions);
    paged_fwd.run(store, std::span(tokens_paged).last(1), pos, lp, true);
    plain_fwd.run(plain, std::span(tokens_plain).last(1), pos, lc, true);
  }
  CHECK(tokens_paged == tokens_plain);
  CHECK(cache.check_invariants().ok());
}

TEST_CASE("preemption and re-prefill do not change what the scheduler generates") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  const auto text = heldout(4096);
  const auto reqs = requests(text, 4, 700, 90, 10, 40);
  auto run = [&](const engine::EngineConfig& cfg) {
    engine::Engine<kv::KeepAll> e(model, cfg, {});
    auto rs = reqs;
    e.run(rs);
    REQUIRE(e.cache().check_invariants().ok());
    CHECK(e.cache().free_sequences() == cfg.max_batch);  // everything freed
    return std::pair{rs, e.stats()};
  };
  const auto [roomy, roomy_stats] = run({.max_kv_tokens = 4096, .block_size = 16, .chunk = 32, .max_batch = 4});
  const auto [tight, tight_stats] =
      run({.max_kv_tokens = 256, .block_size = 16, .chunk = 32, .max_batch = 4, .optimistic = true});
  CHECK(roomy_stats.preemptions == 0);
  CHECK(tight_stats.preemptions > 0);  // the tight pool really preempted
  CHECK(tight_stats.kv_high_water <= 256);
  for (std::size_t i = 0; i < reqs.size(); ++i) CHECK(tight[i].output == roomy[i].output);
}

TEST_CASE("every policy serves requests through the engine within its bound") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  const auto text = heldout(4096);
  const auto reqs = requests(text, 3, 900, 200, 24, 24);
  const engine::EngineConfig cfg0{.max_kv_tokens = 4096, .block_size = 16, .chunk = 32, .max_batch = 3};
  auto full = reqs;
  engine::Engine<kv::KeepAll>(model, cfg0, {}).run(full);

  for (const auto& name : engine::policy_names())
    for (std::int32_t budget : {96, 512}) {
      DYNAMIC_SECTION(name << " at " << budget) {
        const bool known = engine::with_policy(name, budget, model.config(), [&](auto policy, auto adjust) {
          auto cfg = cfg0;
          adjust(cfg);
          engine::Engine<decltype(policy)> e(model, cfg, policy);
          auto rs = reqs;
          const std::int64_t bound = e.cache().max_tokens_after_eviction();
          while (std::any_of(rs.begin(), rs.end(), [](const auto& r) { return !r.done; })) {
            e.step(rs);
            REQUIRE(e.cache().check_invariants().ok());
            for (const auto& r : rs)  // after each step's evict: the policy's advertised bound
              if (r.running && r.fed >= std::int64_t(r.prompt.size()) && name != "snapkv")
                REQUIRE(*e.cache().tokens_held(r.seq) <= bound);
          }
          for (std::size_t i = 0; i < rs.size(); ++i) {
            REQUIRE(rs[i].output.size() == std::size_t(rs[i].max_new));
            // A chunk is held whole during its attention, then evicted down.
            if (name != "keep_all" && name != "snapkv") CHECK(rs[i].peak_kv <= budget + cfg.chunk);
            // The requests hold at most 272 tokens: a budget of 512 evicts nothing.
            if (budget == 512) CHECK(rs[i].output == full[i].output);
          }
          if (budget == 96 && name != "keep_all") CHECK(e.stats().kv_high_water < 3 * 272);  // it really evicted
        });
        REQUIRE(known);
      }
    }
}
