// The example engine's forward pass: matches the training framework's logits
// on a fixed prompt (stored, so no PyTorch here), and gives the same logits
// and greedy tokens whether K/V live in kvcache's paged pool or in a plain
// contiguous buffer (and, from a quantized pool, the same logits as a buffer
// of the dequantized values); preemption changes nothing; every policy runs inside
// the engine within its bound. The sparse compositions (Write-Gated KV,
// Quest) are in test_engine_sparse.cpp.
#include <catch2/catch.hpp>
#include <cmath>
#include <fstream>
#include <kvcache/kernels/detail/quant_groups.hpp>
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
#include "tasks.hpp"

namespace kv = kvcache;

using namespace engine_testing;

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

TEST_CASE("a quantized pool serves exactly what a buffer of the dequantized values serves") {
  // EngineConfig::kv_dtype / kv_format's path: scatter quantizes, gather
  // dequantizes. The logits match, bit for bit, those of a plain buffer fed
  // the same rows through the group codecs, and differ from f32's.
  const engine::Model model(kDir + "/kjv-tiny.bin");
  const auto& c = model.config();
  constexpr std::int32_t B = 16, kPrompt = 70, kNew = 24, kBlocks = 16;
  for (const auto& [code, f] : {std::pair{kv::DType::int4, kv::SideFormat{kv::Scales::group, 32, true}},
                                std::pair{kv::DType::int2, kv::SideFormat{kv::Scales::group, 16, true}}}) {
    const auto g = *kv::Geometry::make({.num_layers = c.layers, .num_kv_heads = c.kv_heads, .head_dim = c.head_dim(),
                                        .block_size = B, .dtype = code, .format = {f, f}});
    std::vector<std::byte> memory(std::size_t(*g.pool_bytes(kBlocks)));
    const auto pool = *kv::make_pool_view(g, memory.data(), kBlocks);
    kv::Cache<> cache({.geometry = g, .num_blocks = kBlocks, .max_sequences = 1, .max_blocks_per_sequence = 8});
    const auto seq = *cache.add_sequence();
    std::vector<std::int64_t> positions(std::size_t(kBlocks * B), -1);
    engine::Forward paged_fwd(model), plain_fwd(model), exact_fwd(model);
    // The same rows through the group codecs.
    std::vector<std::uint8_t> codes(std::size_t(c.head_dim())), entries(std::size_t(c.head_dim()) * 4);
    RoundTripKv plain(c, kPrompt + kNew, [&, code = code, f = f](std::int32_t, std::int32_t, std::int32_t, float* row) {
      kv::quant::quantize_row(row, c.head_dim(), code, f, codes.data(), entries.data());
      kv::quant::dequantize_row(codes.data(), entries.data(), c.head_dim(), code, f, row);
    });
    engine::ContiguousKv exact(c, kPrompt + kNew);
    auto tokens = heldout(kPrompt);
    std::vector<std::int32_t> slots(kPrompt);
    std::vector<float> lp, lc, le;
    REQUIRE(cache.reserve(seq, kPrompt, slots).ok());
    engine::PagedKv<kv::Cache<>> prefill(cache, pool, seq, slots, 0, positions);
    paged_fwd.run(prefill, tokens, 0, lp, true);
    plain_fwd.run(plain, tokens, 0, lc, true);
    exact_fwd.run(exact, tokens, 0, le, true);
    bool differs = false;
    for (std::int32_t step = 0; step < kNew; ++step) {
      REQUIRE(lp == lc);
      differs = differs || lp != le;
      tokens.push_back(argmax(lp.data(), c.vocab));
      const std::int64_t pos = kPrompt + step;
      REQUIRE(cache.reserve(seq, 1, slots).ok());
      engine::PagedKv<kv::Cache<>> store(cache, pool, seq, std::span<const std::int32_t>(slots).first(1), pos, positions);
      paged_fwd.run(store, std::span(tokens).last(1), pos, lp, true);
      plain_fwd.run(plain, std::span(tokens).last(1), pos, lc, true);
      exact_fwd.run(exact, std::span(tokens).last(1), pos, le, true);
    }
    CHECK(differs);  // the codes are not the f32 values: quantization reached the attention
  }
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

TEST_CASE("one stream per layer serves exactly what one stream does when nothing is evicted") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  const auto reqs = requests(heldout(4096), 3, 700, 90, 10, 30);
  auto run = [&](bool layer_streams) {
    engine::Engine<kv::KeepAll> e(
        model, {.max_kv_tokens = 1024, .block_size = 16, .chunk = 32, .max_batch = 3, .layer_streams = layer_streams},
        {});
    auto rs = reqs;
    e.run(rs);
    REQUIRE(e.cache().check_invariants().ok());
    CHECK(e.cache().free_sequences() == 3 * (layer_streams ? model.config().layers : 1));  // every stream freed
    return std::pair{rs, e.stats()};
  };
  const auto [one, one_stats] = run(false);
  const auto [per_layer, per_layer_stats] = run(true);
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    CHECK(per_layer[i].output == one[i].output);
    CHECK(per_layer[i].peak_kv == one[i].peak_kv);
  }
  CHECK(per_layer_stats.kv_high_water == one_stats.kv_high_water);
  // Token policies choose per layer through their groups instead.
  CHECK_THROWS_AS((engine::Engine<kv::H2OEviction>(model, {.layer_streams = true}, kv::H2OEviction({.heavy = 8, .recent = 8}))),
                  std::invalid_argument);
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
          engine::Forward key_fwd(model);
          auto rs = reqs;
          const std::int64_t bound = e.cache().max_tokens_after_eviction();
          bool layers_differ = false;
          while (std::any_of(rs.begin(), rs.end(), [](const auto& r) { return !r.done; })) {
            e.step(rs);
            REQUIRE(e.cache().check_invariants().ok());
            for (const auto& r : rs)  // after each step's evict: the policy's advertised bound, in every stream
              if (r.running && r.fed >= std::int64_t(r.prompt.size()) && !name.starts_with("snapkv"))
                for (const auto s : r.seqs) REQUIRE(*e.cache().tokens_held(s) <= bound);
            // Token policies: every group's compaction moved the engine's
            // positions and K/V exactly as the policy's bookkeeping says,
            // whatever the grouping (per kv-head, per layer, per both): each
            // (layer, kv-head) reads the positions its group tracks, and
            // every (sampled) layer-0 key read back through the row is the
            // key of the token at that position (layer-0 keys depend on
            // token and position only; a compaction on the wrong layer or
            // head breaks this).
            const std::int32_t hd = model.config().head_dim(), kvh = model.config().kv_heads;
            for (const auto& r : rs) {
              if (!r.running || r.fed == 0) continue;
              auto kv = e.view(r);
              std::vector<std::int64_t> layer0;
              for (std::int32_t l = 0; l < model.config().layers; ++l)
                for (std::int32_t h = 0; h < kvh; ++h) {
                  const engine::HeldKv held = kv.read(l, h);
                  if (r.seqs.size() > 1) {
                    // One stream per layer: each keeps its own blocks, in
                    // order, with the start area and the newest token.
                    REQUIRE(held.count == *e.cache().tokens_held(r.seqs[std::size_t(l)]));
                    REQUIRE(std::is_sorted(held.pos, held.pos + held.count));
                    REQUIRE(std::adjacent_find(held.pos, held.pos + held.count) == held.pos + held.count);
                    for (std::int32_t j = 0; j < std::min(16, held.count); ++j) REQUIRE(held.pos[j] == j);
                    REQUIRE(held.pos[held.count - 1] == r.fed - 1);
                    const std::vector<std::int64_t> mine(held.pos, held.pos + held.count);
                    if (l == 0) layer0 = mine;
                    layers_differ = layers_differ || mine != layer0;
                  }
                  if constexpr (kv::TokenEviction<decltype(policy)>) {
                    const auto tracked = e.cache().eviction().positions(r.seqs[0].index, e.group_of(l, h));
                    // Tokens appended since the policy's last observation join at the end.
                    REQUIRE(tracked.size() <= std::size_t(held.count));
                    if (!name.starts_with("snapkv")) REQUIRE(tracked.size() == std::size_t(held.count));
                    for (std::size_t j = 0; j < tracked.size(); ++j) REQUIRE(held.pos[j] == tracked[j]);
                  }
                  if (l > 0) continue;
                  for (std::int32_t j = 0; j < held.count; j += 7) {  // a sample of rows keeps it quick
                    const auto p = std::size_t(held.pos[j]);
                    const std::int32_t tok = p < r.prompt.size() ? r.prompt[p] : r.output[p - r.prompt.size()];
                    const auto want = key_fwd.layer0_key(tok, held.pos[j], h);
                    for (std::int32_t x = 0; x < hd; ++x)
                      REQUIRE(held.k[std::size_t(j) * std::size_t(held.row_stride) + std::size_t(x)] ==
                              Approx(want[std::size_t(x)]).margin(1e-4));
                  }
                }
            }
          }
          for (std::size_t i = 0; i < rs.size(); ++i) {
            REQUIRE(rs[i].output.size() == std::size_t(rs[i].max_new));
            // A chunk is held whole during its attention, then evicted down.
            if (name != "keep_all" && !name.starts_with("snapkv")) CHECK(rs[i].peak_kv <= budget + cfg.chunk);
            // The requests hold at most 272 tokens: a budget of 512 evicts nothing.
            if (budget == 512) CHECK(rs[i].output == full[i].output);
          }
          if (budget == 96 && name != "keep_all") CHECK(e.stats().kv_high_water < 3 * 272);  // it really evicted
          // Per-layer block eviction really chose differently in some layers.
          if (name == "block_scores" && budget == 96) CHECK(layers_differ);
        });
        REQUIRE(known);
      }
    }
}

namespace {
std::string str(const std::vector<std::int32_t>& v) { return {v.begin(), v.end()}; }
}  // namespace

TEST_CASE("the evaluation's tasks put the answer far back, in the trained formats") {
  const engine::Tasks tasks(heldout(65536));
  std::mt19937_64 rng(5);
  for (const double depth : {0.1, 0.5, 0.9}) {
    const auto s = tasks.passkey(rng, 1024, depth);
    const std::string prompt = str(s.prompt), answer = str(s.answer);
    REQUIRE(s.prompt.size() + s.answer.size() == 1024);
    REQUIRE(answer.size() >= 7);  // 5-8 digits, then ".\n"
    const std::string key = answer.substr(0, answer.size() - 2);
    CHECK(answer.substr(answer.size() - 2) == ".\n");
    const auto at = prompt.find("The pass key is " + key + ". Remember it. " + key + " is the pass key.\n");
    REQUIRE(at != std::string::npos);
    CHECK(std::abs(double(at) / 1024.0 - depth * 0.9) < 0.1);  // at its depth in the filler
    CHECK(prompt.substr(prompt.size() - 38) == "What is the pass key? The pass key is ");
  }
  const auto r = tasks.recall(rng, 1024);
  REQUIRE(r.prompt.size() + r.answer.size() == 1024);
  const std::string rp = str(r.prompt), value = str(r.answer).substr(0, 4);
  const auto q = rp.rfind("What is ");
  REQUIRE(q != std::string::npos);
  const std::string name = rp.substr(q + 8, rp.find("'s number?", q) - q - 8);
  const auto fact = rp.find(name + "'s number is " + value + ".\n");
  REQUIRE(fact != std::string::npos);
  CHECK(fact < 1024 * 3 / 4 + 200);  // stated in the first three quarters
  const auto p = tasks.repeat(rng, 1024);
  REQUIRE(p.prompt.size() + p.answer.size() == 1024);
  REQUIRE(p.answer.size() == 96);
  const std::string pp = str(p.prompt), whole = pp.substr(pp.size() - 32) + str(p.answer);
  const auto first = pp.find(whole);
  REQUIRE(first != std::string::npos);  // the passage was seen whole before
  const auto distance = pp.size() - 32 - first;
  CHECK(distance >= 300 + 128);
  CHECK(distance <= 900 + 128);
}

TEST_CASE("intervals: Wilson for accuracies, normal for means") {
  const auto w = engine::wilson(8, 10);  // textbook values
  CHECK(w.value == Approx(0.8));
  CHECK(w.lo == Approx(0.490).margin(0.001));
  CHECK(w.hi == Approx(0.943).margin(0.001));
  const auto none = engine::wilson(0, 40);
  CHECK(none.lo == 0.0);
  CHECK(none.hi == Approx(0.0876).margin(0.001));  // never-correct still leaves room
  const auto all = engine::wilson(40, 40);
  CHECK(all.hi == 1.0);
  CHECK(all.lo == Approx(0.912).margin(0.001));
  const auto m = engine::mean_ci({1.0, 2.0, 3.0, 4.0});
  CHECK(m.value == Approx(2.5));
  CHECK(m.hi - m.value == Approx(1.96 * std::sqrt(5.0 / 3.0 / 4.0)));
  CHECK(engine::wilson(0, 0).n == 0);
}

