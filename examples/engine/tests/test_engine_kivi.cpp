// KIVI in the example engine (channel_kv.hpp): a pool whose keys are
// quantized per channel over each block serves exactly what a plain buffer
// serves when it applies KIVI's rule (a block is quantized from the step
// after the one that filled it; until then its tokens are exact); a
// compaction seals again only the blocks a move wrote into, keeps every
// other block's bytes, and hands the new partial last block back to the
// residual; the engine runs KIVI under the full cache and under H2O,
// leaving no residual behind when its requests end; and under Write-Gated
// KV the rings read exact, every full global block as KIVI stores it.
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "channel_kv.hpp"
#include "engine.hpp"
#include "engine_testing.hpp"
#include "forward.hpp"
#include "gated.hpp"
#include "kv_formats.hpp"
#include "kv_store.hpp"
#include "model.hpp"
#include "serving.hpp"

namespace kv = kvcache;

using namespace engine_testing;

namespace {

const kv::KvFormat kKivi{{.scales = kv::Scales::channel, .minimum = true}, {.scales = kv::Scales::group, .group = 32, .minimum = true}};

// x in f16, rounded down (dir -1) or up (+1): the nearest, then one step the other way when it went past.
float f16(float x, int dir) {
  std::uint16_t b = kv::cvt::f32_to_f16(x);
  const float r = kv::cvt::f16_to_f32(b);
  if ((dir < 0 && r > x) || (dir > 0 && r < x)) b = std::uint16_t((b & 0x8000u) ? b - dir : b + dir);
  return kv::cvt::f16_to_f32(b);
}

// KIVI's 2-bit key channel, written out: the range over the block's tokens,
// the minimum as f16 holds it (rounded down), the scale the range above it
// over 3 (rounded up: no value past the codes), codes to nearest and clamped to [0, 3].
void round_trip_channel(float* x, std::int32_t n, std::int64_t stride) {
  float lo = x[0], hi = x[0];
  for (std::int32_t t = 1; t < n; ++t) lo = std::min(lo, x[t * stride]), hi = std::max(hi, x[t * stride]);
  const float m = f16(lo, -1), scale = f16((hi - m) / 3.0f, +1), inv = scale > 0.0f ? 1.0f / scale : 0.0f;
  for (std::int32_t t = 0; t < n; ++t)
    x[t * stride] = std::fma(std::clamp(std::nearbyint((x[t * stride] - m) * inv), 0.0f, 3.0f), scale, m);
}

// A plain buffer of exact rows that reads back, per layer, the blocks
// completed before the current forward call quantized as KIVI stores them
// (keys per channel, values in groups of 32 along the row), the rest exact.
class KiviReference {
 public:
  KiviReference(const engine::ModelConfig& c, std::int32_t block) : c_(c), B_(block), row_(c.kv_heads * c.head_dim()) {
    k_.resize(std::size_t(c.layers)), v_.resize(std::size_t(c.layers));
    rk_.resize(std::size_t(c.layers)), rv_.resize(std::size_t(c.layers));
  }
  void write(std::int32_t l, const float* k, const float* v, std::int32_t n) {
    if (l == 0) {  // a new forward call: the blocks full before it are the sealed ones
      sealed_ = std::int32_t(pos_.size()) / B_ * B_;
      for (std::int32_t i = 0; i < n; ++i) pos_.push_back(std::int64_t(pos_.size()));
    }
    auto& K = k_[std::size_t(l)];
    auto& V = v_[std::size_t(l)];
    K.insert(K.end(), k, k + std::ptrdiff_t(n) * row_);
    V.insert(V.end(), v, v + std::ptrdiff_t(n) * row_);
    rk_[std::size_t(l)] = K, rv_[std::size_t(l)] = V;
    const std::int32_t hd = c_.head_dim();
    for (std::int32_t b = 0; b < sealed_; b += B_)
      for (std::int32_t h = 0; h < c_.kv_heads; ++h)
        for (std::int32_t d = 0; d < hd; ++d) round_trip_channel(rk_[std::size_t(l)].data() + (b * row_ + h * hd + d), B_, row_);
    const kv::SideFormat g32{.scales = kv::Scales::group, .group = 32, .minimum = true};
    std::vector<std::uint8_t> codes(static_cast<std::size_t>(hd)), entries(static_cast<std::size_t>(hd));
    for (std::int32_t t = 0; t < sealed_; ++t)
      for (std::int32_t h = 0; h < c_.kv_heads; ++h) {
        float* x = rv_[std::size_t(l)].data() + (t * row_ + h * hd);
        kv::quant::quantize_row(x, hd, kv::DType::int2, g32, codes.data(), entries.data());
        kv::quant::dequantize_row(codes.data(), entries.data(), hd, kv::DType::int2, g32, x);
      }
  }
  engine::HeldKv read(std::int32_t l, std::int32_t g) const {
    const std::ptrdiff_t at = std::ptrdiff_t(g) * c_.head_dim();
    return {rk_[std::size_t(l)].data() + at, rv_[std::size_t(l)].data() + at, pos_.data(), std::int32_t(pos_.size()), row_};
  }

 private:
  engine::ModelConfig c_;
  std::int32_t B_, row_, sealed_ = 0;
  std::vector<std::vector<float>> k_, v_, rk_, rv_;
  std::vector<std::int64_t> pos_;
};

}  // namespace

TEST_CASE("a KIVI pool serves exactly what a buffer of KIVI's rule serves: full blocks quantized from the next step") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  const auto& c = model.config();
  constexpr std::int32_t B = 16, kPrompt = 70, kNew = 30, kBlocks = 16;
  const auto g = *kv::Geometry::make({.num_layers = c.layers, .num_kv_heads = c.kv_heads, .head_dim = c.head_dim(),
                                      .block_size = B, .dtype = kv::DType::int2, .format = kKivi});
  std::vector<std::byte> memory(std::size_t(*g.pool_bytes(kBlocks)));
  const auto pool = *kv::make_pool_view(g, memory.data(), kBlocks);
  kv::Cache<> cache({.geometry = g, .num_blocks = kBlocks, .max_sequences = 1, .max_blocks_per_sequence = 8});
  const auto seq = *cache.add_sequence();
  const std::array<kv::SeqId, 1> seqs{seq};
  std::vector<std::int64_t> positions(std::size_t(kBlocks * B), -1);
  engine::ChannelResidual residual(pool);
  KiviReference reference(c, B);
  engine::Forward paged_fwd(model), plain_fwd(model), exact_fwd(model);
  engine::ContiguousKv exact(c, kPrompt + kNew);
  auto tokens = heldout(kPrompt);
  std::vector<std::int32_t> slots(kPrompt);
  std::vector<float> lp, lr, le;
  REQUIRE(cache.reserve(seq, kPrompt, slots).ok());
  engine::PagedKv<kv::Cache<>> prefill(cache, pool, seqs, slots, 0, positions, 1, {0, 1, 1}, nullptr, nullptr, &residual);
  paged_fwd.run(prefill, tokens, 0, lp, true);
  plain_fwd.run(reference, tokens, 0, lr, true);
  exact_fwd.run(exact, tokens, 0, le, true);
  CHECK(lp == le);  // the prompt's own call reads every token exact
  bool differs = false;
  for (std::int32_t step = 0; step < kNew; ++step) {
    REQUIRE(lp == lr);  // bit for bit
    differs = differs || lp != le;
    tokens.push_back(argmax(lp.data(), c.vocab));
    const std::int64_t pos = kPrompt + step;
    REQUIRE(cache.reserve(seq, 1, slots).ok());
    engine::PagedKv<kv::Cache<>> store(cache, pool, seqs, std::span<const std::int32_t>(slots).first(1), pos, positions, 1,
                                       {0, 1, 1}, nullptr, nullptr, &residual);
    paged_fwd.run(store, std::span(tokens).last(1), pos, lp, true);
    plain_fwd.run(reference, std::span(tokens).last(1), pos, lr, true);
    exact_fwd.run(exact, std::span(tokens).last(1), pos, le, true);
  }
  CHECK(differs);  // the sealed blocks were read quantized
  CHECK(residual.open_blocks() == 1);  // 100 tokens: blocks 0-5 sealed, block 6 open
  REQUIRE(cache.check_invariants().ok());
}

TEST_CASE("a KIVI compaction seals again only the blocks a move wrote into, and the new last block goes back to the residual") {
  std::mt19937_64 rng(Catch::rngSeed() ^ 0x7b1);
  constexpr std::int32_t B = 8, L = 2, H = 2, D = 32, kBlocks = 8;
  const auto g = *kv::Geometry::make({.num_layers = L, .num_kv_heads = H, .head_dim = D, .block_size = B, .dtype = kv::DType::int2, .format = kKivi});
  std::vector<std::byte> memory(std::size_t(*g.pool_bytes(kBlocks)));
  const auto pool = *kv::make_pool_view(g, memory.data(), kBlocks);
  engine::ChannelResidual residual(pool);
  // 30 tokens over blocks 5, 2, 7, 1 (logical order): 3 full, 6 in the last.
  const std::array<std::int32_t, 4> before{5, 2, 7, 1};
  constexpr std::int32_t kRows = 30, kRow = H * D;
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> k(std::size_t(L * kRows * kRow)), v(k.size());
  for (auto& x : k) x = n(rng);
  for (auto& x : v) x = n(rng);
  std::vector<std::int32_t> slots;
  for (std::int32_t t = 0; t < kRows; ++t) slots.push_back(before[std::size_t(t / B)] * B + t % B);
  for (std::int32_t l = 0; l < L; ++l)
    residual.write(l, slots.data(), k.data() + l * kRows * kRow, v.data() + l * kRows * kRow, kRows);
  for (std::int32_t l = 0; l < L; ++l) residual.write(l, nullptr, nullptr, nullptr, 0);  // a later step: the full blocks sealed
  CHECK(residual.open_blocks() == 1);
  const auto read = [&](std::span<const std::int32_t> blocks, std::int32_t rows, std::int32_t l) {
    std::vector<float> kk(std::size_t(rows * kRow)), vv(kk.size());
    const std::array<std::int32_t, 2> indptr{0, std::int32_t(blocks.size())}, out{0, rows};
    REQUIRE(kv::gather_host({pool, l, indptr.data(), blocks.data(), out.data(), 1, rows, kk.data(), vv.data(), kv::DType::f32,
                             kRow * 4, D * 4})
                .ok());
    residual.overlay(l, blocks, rows, kk.data(), vv.data());
    return std::pair{kk, vv};
  };
  std::vector<std::pair<std::vector<float>, std::vector<float>>> was;
  for (std::int32_t l = 0; l < L; ++l) was.push_back(read(before, kRows, l));
  // Evict 9 tokens: rows 25-29 fill holes at rows 3 (block 5) and 20 (block 7); 21 rows stay, the last block is 7.
  const std::array<kv::SlotMove, 2> moves{kv::SlotMove{1 * B + 1, 5 * B + 3}, kv::SlotMove{1 * B + 3, 7 * B + 4}};
  const std::vector<std::byte> bytes = memory;
  const std::array<std::int32_t, 3> after{5, 2, 7};
  const engine::ChannelResidual::Moves m{moves, 0, L, 0, 0};
  residual.compact(before, kRows, after, 21, std::span(&m, 1));
  // Block 2 (no move into it) keeps its bytes; block 5 (a move into row 3) was sealed again.
  const auto block_bytes = [&](const std::vector<std::byte>& mem, std::int32_t b) {
    return std::vector<std::byte>(mem.begin() + b * g.block_bytes(), mem.begin() + (b + 1) * g.block_bytes());
  };
  CHECK(block_bytes(memory, 2) == block_bytes(bytes, 2));
  CHECK(block_bytes(memory, 5) != block_bytes(bytes, 5));
  CHECK(residual.open_blocks() == 1);  // block 7, 5 rows of 8
  for (std::int32_t l = 0; l < L; ++l) {
    const auto now = read(after, 21, l);
    const auto& [k0, v0] = was[std::size_t(l)];
    for (std::int32_t t = 0; t < 21; ++t) {
      const std::int32_t src = t == 3 ? 25 : t == 20 ? 27 : t;  // the moves' sources: rows 25 and 27 (block 1)
      for (std::int32_t i = 0; i < kRow; ++i) {
        const float want_k = k0[std::size_t(src * kRow + i)], want_v = v0[std::size_t(src * kRow + i)];
        if (t >= 16) {  // the new last block: exact, from the residual (row 20 came from the old residual too)
          REQUIRE(now.first[std::size_t(t * kRow + i)] == want_k);
          REQUIRE(now.second[std::size_t(t * kRow + i)] == want_v);
        } else if (t >= 8) {  // block 2: untouched
          REQUIRE(now.first[std::size_t(t * kRow + i)] == want_k);
          REQUIRE(now.second[std::size_t(t * kRow + i)] == want_v);
        } else {  // block 5, sealed again: within a code step of what it held (2 bits over the channel's range)
          float lo = 1e30f, hi = -1e30f;
          for (std::int32_t r = 0; r < 8; ++r) {
            const std::int32_t s = r == 3 ? 25 : r;
            lo = std::min(lo, k0[std::size_t(s * kRow + i)]), hi = std::max(hi, k0[std::size_t(s * kRow + i)]);
          }
          REQUIRE(std::fabs(now.first[std::size_t(t * kRow + i)] - want_k) <= (hi - lo) / 3.0f * 0.51f + 1e-3f);
        }
      }
    }
  }
}

TEST_CASE("the engine runs KIVI's keys under the full cache, H2O and block scores, and refuses them with page selection") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  const auto text = heldout(900);
  const engine::NamedKvFormat& kivi = engine::kv_format_named("int2_kivi");
  const auto cfg = engine::with_kv_format({.max_kv_tokens = 2048, .max_batch = 2}, kivi, model, {});
  CHECK(cfg.block_size == 32);
  const auto run = [&](auto policy, const engine::EngineConfig& adjusted) {
    engine::Engine<decltype(policy)> e(model, adjusted, policy);
    auto reqs = requests(text, 2, 100, 300, 40, 40);
    e.run(reqs);
    for (const auto& r : reqs) CHECK(r.output.size() == 40);
    REQUIRE(e.cache().check_invariants().ok());
    return reqs;
  };
  const auto full = run(kv::KeepAll{}, cfg);
  std::vector<engine::Request> h2o;
  engine::with("h2o", 128, model.config(), cfg, [&](auto policy, const engine::EngineConfig& adjusted) { h2o = run(policy, adjusted); });
  CHECK(full[1].output != h2o[1].output);  // H2O evicted (and compacted) tokens
  // Block policies take the format's block size as their unit (32 here, not
  // the engine's default 16), over one stream per layer.
  engine::with("block_scores", 160, model.config(), cfg, [&](auto policy, const engine::EngineConfig& adjusted) {
    CHECK(adjusted.layer_streams);
    (void)run(policy, adjusted);
  });
  // Page selection reads bounds of blocks whose codes are not written yet: refused.
  CHECK_THROWS_AS((engine::Engine<kv::KeepAll, kv::QuestSelection>(model, cfg, {})), std::invalid_argument);
}

namespace {

// Forwards the forward pass's calls to a gated store, recording the exact
// K/V each (layer, kv-head) was given; after each write it checks every row
// the store reads back from the cache against KIVI's rule: ring rows and the
// open global block exact, every full global block its tokens' keys round
// tripped per channel over the block and its values in groups of 32. Under
// a token policy (`evicting`) only the ring rows are checked exact: a
// compaction seals moved tokens again from their read-back values.
template <class C>
struct CheckedGatedKv {
  engine::GatedKv<C>& kv;
  std::int64_t first;
  std::int32_t H, D, W, B;
  std::vector<std::vector<float>>& exact_k;  // [layer * H + head][position * D + d]
  std::vector<std::vector<float>>& exact_v;
  bool evicting = false;
  std::int64_t ring = 0, sealed = 0, open = 0;  // rows checked of each kind

  void attend(std::int32_t l, std::int32_t g, std::int32_t t, float a) { kv.attend(l, g, t, a); }
  void attended(std::int32_t l) { kv.attended(l); }
  void pre_rope(std::int32_t l, const float* k, std::int32_t n) { kv.pre_rope(l, k, n); }
  void write(std::int32_t l, const float* k, const float* v, std::int32_t n) {
    for (std::int32_t h = 0; h < H; ++h)
      for (std::int32_t t = 0; t < n; ++t) {
        auto &ek = exact_k[std::size_t(l * H + h)], &ev = exact_v[std::size_t(l * H + h)];
        ek.resize(std::size_t((first + t + 1) * D)), ev.resize(ek.size());
        std::copy(k + (t * H + h) * D, k + (t * H + h + 1) * D, ek.begin() + (first + t) * D);
        std::copy(v + (t * H + h) * D, v + (t * H + h + 1) * D, ev.begin() + (first + t) * D);
      }
    kv.write(l, k, v, n);
    for (std::int32_t h = 0; h < H; ++h) check(l, h);
  }
  void select(std::int32_t l, const float* q, std::int32_t n) { kv.select(l, q, n); }
  engine::HeldKv read(std::int32_t l, std::int32_t g) const { return kv.read(l, g); }

  void check(std::int32_t l, std::int32_t h) {
    const engine::HeldKv held = kv.read(l, h);
    const auto& ek = exact_k[std::size_t(l * H + h)];
    const auto& ev = exact_v[std::size_t(l * H + h)];
    std::int32_t rows = 0;  // the cache's rows come first, then the chunk's own
    while (rows < held.count && held.pos[rows] < first) ++rows;
    const std::int32_t global = std::max(0, rows - W), full = global / B * B;
    std::vector<float> want_k(std::size_t(rows * D)), want_v(want_k.size());
    for (std::int32_t j = 0; j < rows; ++j) {
      std::copy_n(ek.begin() + held.pos[j] * D, D, want_k.begin() + j * D);
      std::copy_n(ev.begin() + held.pos[j] * D, D, want_v.begin() + j * D);
    }
    const kv::SideFormat g32{.scales = kv::Scales::group, .group = 32, .minimum = true};
    std::vector<std::uint8_t> codes(static_cast<std::size_t>(D)), entries(static_cast<std::size_t>(D));
    for (std::int32_t b = W; b < W + full; b += B)
      for (std::int32_t d = 0; d < D; ++d) round_trip_channel(want_k.data() + b * D + d, B, D);
    for (std::int32_t j = W; j < W + full; ++j) {
      kv::quant::quantize_row(want_v.data() + j * D, D, kv::DType::int2, g32, codes.data(), entries.data());
      kv::quant::dequantize_row(codes.data(), entries.data(), D, kv::DType::int2, g32, want_v.data() + j * D);
    }
    for (std::int32_t j = 0; j < rows; ++j) {
      if (evicting && j >= W) {
        for (std::int32_t d = 0; d < D; ++d) REQUIRE(std::isfinite(held.k[j * held.row_stride + d]));
        continue;
      }
      for (std::int32_t d = 0; d < D; ++d) {
        REQUIRE(held.k[j * held.row_stride + d] == want_k[std::size_t(j * D + d)]);
        REQUIRE(held.v[j * held.row_stride + d] == want_v[std::size_t(j * D + d)]);
      }
      (j < W ? ring : j < W + full ? sealed : open) += 1;
    }
  }
};

}  // namespace

namespace {
struct GatedKiviRun {
  std::int64_t ring = 0, sealed = 0, open = 0;  // rows checked
  std::int64_t held_open = 0, held_after = 0;  // the residual's blocks before and after close
  std::int64_t admitted = 0, peak = 0;
};
// One request over a GatedBackend on int2_kivi, driven chunk by chunk (a
// prompt longer than the ring, whose early tokens go straight to the global
// region, then chunks of 1 to 7 tokens: promotions one by one), every
// write checked; after each chunk the backend's after_forward (a token
// policy's eviction).
template <class Eviction>
GatedKiviRun run_gated_kivi(Eviction eviction) {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  const auto& c = model.config();
  const engine::GateSet gates(kDir + "/gates-0.01.bin");
  const auto cfg = engine::with_kv_format({.max_batch = 1}, engine::kv_format_named("int2_kivi"), model, {});
  REQUIRE(cfg.block_size == 32);
  engine::GatedBackend<kv::SelectAll, Eviction> backend(model, cfg, gates, eviction);
  using C = typename engine::GatedBackend<kv::SelectAll, Eviction>::Cache;
  engine::Request r;
  backend.open(r);
  const std::int32_t H = c.kv_heads, D = c.head_dim();
  std::vector<std::vector<float>> exact_k(std::size_t(c.layers * H)), exact_v(exact_k.size());
  const auto text = heldout(420);
  engine::Forward fwd(model);
  std::vector<float> logits;
  GatedKiviRun run;
  for (std::int32_t at = 0, n = 100; at < std::int32_t(text.size()); at += n, n = 1 + at % 7) {
    n = std::min<std::int32_t>(n, std::int32_t(text.size()) - at);
    auto store = backend.store(r, at, {}, nullptr);
    CheckedGatedKv<C> checked{store, at, H, D, gates.window, cfg.block_size, exact_k, exact_v, C::evicts_global};
    fwd.run(checked, std::span(text).subspan(std::size_t(at), std::size_t(n)), at, logits, false);
    run.ring += checked.ring, run.sealed += checked.sealed, run.open += checked.open;
    backend.after_forward(r, {});
    REQUIRE(backend.cache().check_invariants().ok());
    run.peak = std::max(run.peak, backend.held(r));
  }
  run.admitted = backend.counts().admitted;
  run.held_open = std::int64_t(backend.residual_blocks().open_blocks());
  backend.close(r);
  run.held_after = std::int64_t(backend.residual_blocks().open_blocks());
  return run;
}
}  // namespace

TEST_CASE("Write-Gated KV on KIVI's keys: rings and the open global block read exact, full global blocks as KIVI seals them") {
  const GatedKiviRun run = run_gated_kivi(kv::KeepAll{});
  CHECK(run.ring > 0);
  CHECK(run.sealed > 0);  // full global blocks were read quantized
  CHECK(run.open > 0);
  CHECK(run.admitted > 0);
  CHECK(run.held_open > 0);  // the rings, and the open global blocks
  CHECK(run.held_after == 0);  // a request's end drops its rows' blocks
  // Under H2O on the global regions, each eviction compacts the rows
  // through the residual: the rings stay exact (held, never sealed).
  const GatedKiviRun evicted = run_gated_kivi(kv::H2OEviction({.heavy = 32, .recent = 0}));
  CHECK(evicted.ring > 0);
  CHECK(evicted.peak < run.peak);  // it evicted
  CHECK(evicted.held_after == 0);
}

TEST_CASE("the gated engine runs KIVI's keys alone and under H2O, close to f32, and refuses them with page selection") {
  const engine::Model model(kDir + "/kjv-tiny.bin");
  const engine::GateSet gates(kDir + "/gates-0.01.bin");
  const auto text = heldout(600);
  const auto kivi = engine::with_kv_format({.max_batch = 1}, engine::kv_format_named("int2_kivi"), model, {});
  auto f32 = kivi;
  f32.kv_dtype = kv::DType::f32, f32.kv_format = {};
  const auto loss = [&](auto eviction, const engine::EngineConfig& cfg) {
    engine::GatedEngine<kv::SelectAll, decltype(eviction)> e(model, gates, cfg, eviction);
    const auto s = e.score(text);
    REQUIRE(e.cache().check_invariants().ok());
    CHECK(e.backend().residual_blocks().open_blocks() == 0);
    return s.nll / double(s.predictions);
  };
  const double exact = loss(kv::KeepAll{}, f32), quantized = loss(kv::KeepAll{}, kivi);
  CHECK(quantized != exact);
  CHECK(std::fabs(quantized - exact) < 0.02);  // 2-bit keys per channel: 0.003 nats a byte here
  const kv::H2OEviction h2o({.heavy = 96, .recent = 0});
  const double evicted = loss(h2o, kivi);
  CHECK(evicted != quantized);  // the global regions were compacted, and sealed again
  CHECK(std::fabs(evicted - loss(h2o, f32)) < 0.02);
  CHECK_THROWS_AS((engine::GatedEngine<kv::QuestSelection>(model, gates, kivi)), std::invalid_argument);
}
