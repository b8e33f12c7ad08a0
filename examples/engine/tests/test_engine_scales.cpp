// Engine-held scales (EngineConfig::kv_scales): the calibration pass finds
// each (layer, kv-head)'s largest |K| and |V|, a per-head fp8 pool serves
// exactly what a buffer of the same per-head round trip serves, the gated
// engine reads its single-head pool back with each head's scale, and scales
// that do not fit the format are refused before anything is built; every
// named format serves.
#include <catch2/catch.hpp>
#include <array>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "calibrate.hpp"
#include "engine.hpp"
#include "engine_testing.hpp"
#include "forward.hpp"
#include "gated.hpp"
#include "kv_formats.hpp"
#include "kv_store.hpp"
#include "model.hpp"

namespace kv = kvcache;

using namespace engine_testing;

namespace {

const kv::KvFormat kHead{{.scales = kv::Scales::head}, {.scales = kv::Scales::head}};
const kv::KvFormat kTensor{{.scales = kv::Scales::tensor}, {.scales = kv::Scales::tensor}};

}  // namespace

TEST_CASE("calibration: each (layer, kv-head)'s largest |K| and |V| over the window, divided by the code's largest") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  const auto& c = model.config();
  const auto window = heldout(300);
  const auto head = engine::calibrate_kv_scales(model, window, kv::DType::fp8_e4m3, kHead);
  REQUIRE(head.k.size() == std::size_t(c.layers * c.kv_heads));
  REQUIRE(head.v.size() == head.k.size());
  // The window's rows read back from a plain buffer, head by head.
  engine::ContiguousKv plain(c, std::int32_t(window.size()));
  engine::Forward fwd(model);
  std::vector<float> logits;
  fwd.run(plain, window, 0, logits, true);
  std::vector<float> k_max, v_max;
  for (std::int32_t l = 0; l < c.layers; ++l)
    for (std::int32_t h = 0; h < c.kv_heads; ++h) {
      const engine::HeldKv held = plain.read(l, h);
      REQUIRE(held.count == std::int32_t(window.size()));
      float km = 0.0f, vm = 0.0f;
      for (std::int32_t t = 0; t < held.count; ++t)
        for (std::int32_t i = 0; i < c.head_dim(); ++i) {
          km = std::max(km, std::fabs(held.k[std::ptrdiff_t(t) * held.row_stride + i]));
          vm = std::max(vm, std::fabs(held.v[std::ptrdiff_t(t) * held.row_stride + i]));
        }
      CHECK(head.k[std::size_t(l * c.kv_heads + h)] == km / 448.0f);
      CHECK(head.v[std::size_t(l * c.kv_heads + h)] == vm / 448.0f);
      k_max.push_back(km), v_max.push_back(vm);
    }
  // The heads' ranges differ, so one scale would not do what these do.
  CHECK(*std::max_element(k_max.begin(), k_max.end()) > 2.0f * *std::min_element(k_max.begin(), k_max.end()));
  // Per tensor: each layer's largest over its heads; e5m2 and int8 divide by their own largest code.
  const auto tensor = engine::calibrate_kv_scales(model, window, kv::DType::fp8_e5m2, kTensor);
  REQUIRE(tensor.k.size() == std::size_t(c.layers));
  for (std::int32_t l = 0; l < c.layers; ++l)
    CHECK(tensor.v[std::size_t(l)] ==
          *std::max_element(v_max.begin() + l * c.kv_heads, v_max.begin() + (l + 1) * c.kv_heads) / 57344.0f);
  const auto int8 = engine::calibrate_kv_scales(model, window, kv::DType::int8, kHead);
  CHECK(int8.k[0] == k_max[0] / 127.0f);
  // Group sides hold no engine-held scales: none come back for them.
  const auto group = engine::calibrate_kv_scales(model, window, kv::DType::int8,
                                                 {{.scales = kv::Scales::group, .group = 32}, {.scales = kv::Scales::head}});
  CHECK(group.k.empty());
  CHECK(group.v.size() == head.v.size());
  CHECK_THROWS_AS(engine::calibrate_kv_scales(model, {}, kv::DType::fp8_e4m3, kHead), std::invalid_argument);
  const std::vector<std::int32_t> too_long(std::size_t(c.context) + 1, 1);
  CHECK_THROWS_AS(engine::calibrate_kv_scales(model, too_long, kv::DType::fp8_e4m3, kHead), std::invalid_argument);
}

TEST_CASE("a per-head fp8 pool serves exactly what a buffer of the per-head round trip serves") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  const auto& c = model.config();
  constexpr std::int32_t B = 16, kPrompt = 70, kNew = 24, kBlocks = 16;
  const auto scales = engine::calibrate_kv_scales(model, heldout(512), kv::DType::fp8_e4m3, kHead);
  auto serve = [&](const engine::KvScales& s, std::vector<std::vector<float>>& logits) {
    const auto g = *kv::Geometry::make({.num_layers = c.layers, .num_kv_heads = c.kv_heads, .head_dim = c.head_dim(),
                                        .block_size = B, .dtype = kv::DType::fp8_e4m3, .format = kHead});
    std::vector<std::byte> memory(std::size_t(*g.pool_bytes(kBlocks)));
    const auto pool = *kv::make_pool_view(g, memory.data(), kBlocks);
    kv::Cache<> cache({.geometry = g, .num_blocks = kBlocks, .max_sequences = 1, .max_blocks_per_sequence = 8});
    const auto seq = *cache.add_sequence();
    const std::array<kv::SeqId, 1> seqs{seq};
    const engine::HeldScales held(s, kHead, c);
    std::vector<std::int64_t> positions(std::size_t(kBlocks * B), -1);
    engine::Forward paged_fwd(model), plain_fwd(model);
    // Each (layer, head)'s rows: x times 1 / scale, rounded to e4m3, times
    // scale (the scatter and gather kernels' steps).
    RoundTripKv plain(c, kPrompt + kNew, [&](std::int32_t side, std::int32_t l, std::int32_t h, float* row) {
      const float sc = (side == 0 ? s.k : s.v)[std::size_t(l * c.kv_heads + h)], inv = 1.0f / sc;
      for (std::int32_t i = 0; i < c.head_dim(); ++i) row[i] = kv::cvt::e4m3_to_f32(kv::cvt::f32_to_e4m3(row[i] * inv)) * sc;
    });
    auto tokens = heldout(kPrompt);
    std::vector<std::int32_t> slots(kPrompt);
    std::vector<float> lp, lc;
    REQUIRE(cache.reserve(seq, kPrompt, slots).ok());
    engine::PagedKv<kv::Cache<>> prefill(cache, pool, seqs, slots, 0, positions, 1, {0, 1, 1}, nullptr, &held);
    paged_fwd.run(prefill, tokens, 0, lp, true);
    plain_fwd.run(plain, tokens, 0, lc, true);
    for (std::int32_t step = 0; step < kNew; ++step) {
      REQUIRE(lp == lc);  // bit for bit: every (layer, head) quantized and read back with its own scale
      logits.push_back(lp);
      tokens.push_back(argmax(lp.data(), c.vocab));
      const std::int64_t pos = kPrompt + step;
      REQUIRE(cache.reserve(seq, 1, slots).ok());
      engine::PagedKv<kv::Cache<>> store(cache, pool, seqs, std::span<const std::int32_t>(slots).first(1), pos, positions,
                                         1, {0, 1, 1}, nullptr, &held);
      paged_fwd.run(store, std::span(tokens).last(1), pos, lp, true);
      plain_fwd.run(plain, std::span(tokens).last(1), pos, lc, true);
    }
    REQUIRE(cache.check_invariants().ok());
  };
  std::vector<std::vector<float>> calibrated, ones;
  serve(scales, calibrated);
  serve({std::vector<float>(scales.k.size(), 1.0f), std::vector<float>(scales.v.size(), 1.0f)}, ones);
  CHECK(calibrated != ones);  // the scales reached the codes: the rounding falls elsewhere
}

TEST_CASE("Write-Gated KV's single-head pool applies each (layer, kv-head)'s scale on write and on read") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  const engine::GateSet gates(kDir + "/gates-0.01.bin");
  const auto text = heldout(400);
  const auto scales = engine::calibrate_kv_scales(model, heldout(512), kv::DType::fp8_e4m3, kHead);
  // A token a chunk, so every key but the query's own is read back from the pool.
  auto score = [&](kv::DType dtype, kv::KvFormat f, engine::KvScales s) {
    engine::GatedEngine<> e(model, gates,
                            engine::EngineConfig{.block_size = 16, .chunk = 1, .max_batch = 1, .kv_dtype = dtype,
                                                 .kv_format = f, .kv_scales = std::move(s)});
    const auto r = e.score(text);
    REQUIRE(e.cache().check_invariants().ok());
    return r.nll / double(r.predictions);
  };
  const double exact = score(kv::DType::f32, {}, {});
  const double per_head = score(kv::DType::fp8_e4m3, kHead, scales);
  // Within e4m3's rounding of f32: a read that missed a head's scale (x 1/448
  // here) would wreck attention, not move the loss in its third digit.
  CHECK(std::fabs(per_head - exact) < 0.01);
  // Scales 65,536 times too large leave e4m3 a few subnormal steps: the loss moves.
  engine::KvScales coarse = scales;
  for (auto* side : {&coarse.k, &coarse.v})
    for (float& s : *side) s *= 65536.0f;
  const double too_coarse = score(kv::DType::fp8_e4m3, kHead, coarse);
  CHECK(too_coarse > per_head + 0.05);
}

TEST_CASE("engine-held scales that do not fit the format are refused by name, before anything is built") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  const auto& c = model.config();
  const engine::GateSet gates(kDir + "/gates-0.01.bin");
  auto refusal = [&](kv::DType dtype, kv::KvFormat f, engine::KvScales s) -> std::string {
    std::string paged, gated;
    const engine::EngineConfig cfg{.max_kv_tokens = 256, .max_batch = 1, .kv_dtype = dtype, .kv_format = f, .kv_scales = s};
    try {
      engine::Engine<kv::KeepAll> e(model, cfg, {});
    } catch (const std::invalid_argument& err) {
      paged = err.what();
    }
    try {
      engine::GatedEngine<> e(model, gates, cfg);
    } catch (const std::invalid_argument& err) {
      gated = err.what();
    }
    CHECK(paged == gated);  // both backends check through HeldScales
    return paged;
  };
  const std::size_t cells = std::size_t(c.layers * c.kv_heads);
  CHECK(refusal(kv::DType::fp8_e4m3, kHead, {std::vector<float>(3, 1.0f), {}}) ==
        "kv_scales.k: 3 scales, the format needs " + std::to_string(cells) + " (layers x kv_heads)");
  CHECK(refusal(kv::DType::fp8_e4m3, kTensor, {{}, std::vector<float>(cells, 1.0f)}) ==
        "kv_scales.v: " + std::to_string(cells) + " scales, the format needs " + std::to_string(c.layers) +
            " (one per layer)");
  std::vector<float> bad(cells, 1.0f);
  bad[2] = -0.5f;
  CHECK(refusal(kv::DType::fp8_e4m3, kHead, {bad, {}}).rfind("kv_scales.k[2] = -0.5", 0) == 0);
  bad[2] = std::nanf("");
  CHECK(refusal(kv::DType::fp8_e4m3, kHead, {{}, bad}).rfind("kv_scales.v[2] = nan", 0) == 0);
  CHECK(refusal(kv::DType::int8, {{.scales = kv::Scales::group, .group = 32}, {.scales = kv::Scales::group, .group = 32}},
                {std::vector<float>(cells, 1.0f), {}})
            .rfind("kv_scales.k: " + std::to_string(cells) + " scales given, but the format's side holds no", 0) == 0);
  CHECK(refusal(kv::DType::fp8_e4m3, kHead, {std::vector<float>(cells, 0.5f), {}}).empty());  // fits: built
}

TEST_CASE("KV formats by name: each serves a request, a calibrated one gets its scales, an unknown name is refused") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  const auto text = heldout(600);
  std::vector<std::string> names;
  for (const engine::NamedKvFormat& f : engine::kv_formats()) {
    INFO(f.name);
    names.push_back(f.name);
    CHECK(&engine::kv_format_named(f.name) == &f);
    const auto cfg = engine::with_kv_format({.max_kv_tokens = 512, .max_batch = 1}, f, model,
                                            engine::calibration_window(text, model.config().context));
    CHECK(cfg.kv_dtype == f.dtype);
    CHECK(cfg.kv_format == f.format);
    CHECK(cfg.kv_scales.k.empty() == !f.calibrated);
    engine::Engine<kv::KeepAll> e(model, cfg, {});
    std::vector<engine::Request> reqs(1);
    reqs[0].prompt.assign(text.begin(), text.begin() + 100);
    reqs[0].max_new = 8;
    e.run(reqs);
    CHECK(reqs[0].output.size() == 8);
    REQUIRE(e.cache().check_invariants().ok());
  }
  std::sort(names.begin(), names.end());
  CHECK(std::adjacent_find(names.begin(), names.end()) == names.end());  // one format a name
  // The calibration window is the text's last context tokens (all of a shorter text).
  CHECK(engine::calibration_window(text, 256).data() == text.data() + 344);
  CHECK(engine::calibration_window(text, 4096).size() == text.size());
  try {
    (void)engine::kv_format_named("int3");
    FAIL("int3 was accepted");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()).rfind("unknown KV format 'int3' (one of: f32, f16, fp8_e4m3_tensor,", 0) == 0);
  }
}
