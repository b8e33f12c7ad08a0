// RoPE re-rotation, score reduction + top-k selection, and page key bounds on
// the host backend, against double-precision and brute-force references.
#include <catch2/catch.hpp>

#include <kvcache/kernels/page_bounds.hpp>
#include <kvcache/kernels/rope.hpp>
#include <kvcache/kernels/scores.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "kernel_testing.hpp"

using namespace kvcache;
using namespace kvtest;

namespace {
std::mt19937_64 fresh_rng() { return std::mt19937_64(Catch::rngSeed() ^ std::random_device{}()); }
// Max and min of keys as the bounds take them: -0 counts as +0 (fp8 keys round small values to either zero).
float total_max(float a, float b) { return std::max(a, b + 0.0f); }
float total_min(float a, float b) { return std::min(a, b + 0.0f); }
}  // namespace

TEST_CASE("rope table holds cos/sin of delta * theta^(-2i/d)") {
  std::vector<float> c(5 * 4), s(5 * 4);
  REQUIRE(make_rope_table(10000.0, 8, 4, c, s).ok());
  CHECK(c[3 * 4 + 1] == Approx(std::cos(3.0 * std::pow(10000.0, -2.0 / 8))).epsilon(1e-6));
  CHECK(s[2 * 4 + 3] == Approx(std::sin(2.0 * std::pow(10000.0, -6.0 / 8))).epsilon(1e-6));
  CHECK(c[0] == 1.0f);
  CHECK(s[0] == 0.0f);
  CHECK(std::string(make_rope_table(0.0, 8, 4, c, s).what()) == "theta");
  CHECK(std::string(make_rope_table(-5.0, 8, 4, c, s).what()) == "theta");
  // NaN and infinities are reported without converting them to an integer (UBSan would flag it).
  CHECK(make_rope_table(std::nan(""), 8, 4, c, s).message() == "invalid_argument: theta=0 (limit 0)");
  CHECK(make_rope_table(-HUGE_VAL, 8, 4, c, s).message() == "invalid_argument: theta=0 (limit 0)");
  CHECK(make_rope_table(-1e300, 8, 4, c, s).message() == "invalid_argument: theta=0 (limit 0)");
  CHECK(std::string(make_rope_table(10000.0, 7, 4, c, s).what()) == "rotary_dim");
  CHECK(make_rope_table(10000.0, 8, 5, c, s).code() == Errc::buffer_too_small);
}

TEST_CASE("rope rotates exactly the listed blocks' keys, NeoX and GPT-J pairing") {
  auto rng = fresh_rng();
  for (auto style : {RopeStyle::neox, RopeStyle::gptj})
    for (int trial = 0; trial < 10; ++trial) {
      GeometrySpec g = random_spec(rng);
      g.dtype = DType::f32;  // exact comparison against a double reference
      g.format = {};
      const std::int32_t max_delta = 64, half = g.head_dim / 2;
      std::vector<float> cs((max_delta + 1) * half), sn(cs.size());
      REQUIRE(make_rope_table(10000.0, g.head_dim, max_delta, cs, sn).ok());
      Pool pool(g, 6);
      pool.bytes = random_elems(rng, DType::f32, std::int64_t(pool.bytes.size()) / 4);
      pool.view.base = pool.bytes.data();
      const Pool before = pool;
      std::vector<std::int32_t> blocks{1, 4}, deltas{int(rng() % 65), -int(rng() % 65)};
      RopeParams p{pool.view, 0, g.num_layers, blocks.data(), deltas.data(), 2, cs.data(), sn.data(), max_delta, 0, style};
      REQUIRE(rope_host(p).ok());
      for (int b = 0; b < 6; ++b)
        for (int l = 0; l < g.num_layers; ++l)
          for (int t = 0; t < g.block_size; ++t)
            for (int h = 0; h < g.num_kv_heads; ++h)
              for (int i = 0; i < half; ++i) {
                const int ix = style == RopeStyle::neox ? i : 2 * i, iy = style == RopeStyle::neox ? i + half : 2 * i + 1;
                const double x = before.get(b, l, 0, t, h, ix), y = before.get(b, l, 0, t, h, iy);
                const int e = b == 1 ? 0 : (b == 4 ? 1 : -1);
                double wx = x, wy = y;
                if (e >= 0) {
                  const double a = deltas[std::size_t(e)] * std::pow(10000.0, -2.0 * i / g.head_dim);
                  wx = x * std::cos(a) - y * std::sin(a);
                  wy = y * std::cos(a) + x * std::sin(a);
                }
                REQUIRE(pool.get(b, l, 0, t, h, ix) == Approx(wx).margin(1e-5));
                REQUIRE(pool.get(b, l, 0, t, h, iy) == Approx(wy).margin(1e-5));
                REQUIRE(pool.get(b, l, 1, t, h, ix) == before.get(b, l, 1, t, h, ix));  // values untouched
              }
    }
}

TEST_CASE("rope rejects a block outside the pool or a delta beyond the table, rotating nothing") {
  GeometrySpec g{.num_layers = 1, .num_kv_heads = 1, .head_dim = 8, .block_size = 4, .dtype = DType::f32};
  Pool pool(g, 3);
  poison(pool.bytes, 0x3f);
  const auto before = pool.bytes;
  std::vector<float> cs(3 * 4, 1.0f), sn(3 * 4, 0.5f);
  std::vector<std::int32_t> blocks{1, 2}, deltas{1, 3};
  RopeParams p{pool.view, 0, 1, blocks.data(), deltas.data(), 2, cs.data(), sn.data(), 2};
  auto st = rope_host(p);
  CHECK(std::string(st.what()) == "deltas");
  CHECK(st.value() == 1);
  deltas[1] = -2;
  blocks[0] = 3;
  CHECK(std::string(rope_host(p).what()) == "blocks");
  blocks[0] = 1;
  p.first_layer = INT32_MAX;
  CHECK(rope_host(p).message() == "invalid_argument: first_layer+num_layers=2147483648 (limit 1)");
  CHECK(pool.bytes == before);
}

TEST_CASE("scores sum attention over heads and queries, mean divides by heads") {
  auto rng = fresh_rng();
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  const int S = 3, H = 4, Q = 3, K = 50;
  std::vector<float> attn(std::size_t(S * H * Q * K)), scores(std::size_t(S * K), -7.0f);
  for (auto& a : attn) a = u(rng);
  std::vector<std::int32_t> lens{50, 0, 17};
  for (auto reduce : {ScoreReduce::sum, ScoreReduce::mean_over_heads}) {
    REQUIRE(scores_host({attn.data(), lens.data(), scores.data(), S, H, Q, K, reduce}).ok());
    for (int s = 0; s < S; ++s)
      for (int k = 0; k < K; ++k) {
        if (k >= lens[std::size_t(s)]) {
          REQUIRE(scores[std::size_t(s * K + k)] == -7.0f);
          continue;
        }
        double want = 0;
        for (int h = 0; h < H; ++h)
          for (int q = 0; q < Q; ++q) want += attn[std::size_t(((s * H + h) * Q + q) * K + k)];
        if (reduce == ScoreReduce::mean_over_heads) want /= H;
        REQUIRE(scores[std::size_t(s * K + k)] == Approx(want).epsilon(1e-5));
      }
  }
  lens[0] = 51;
  CHECK(std::string(scores_host({attn.data(), lens.data(), scores.data(), S, H, Q, K}).what()) == "lengths");
}

TEST_CASE("select returns the k lowest / highest per stream, ties to the lower position") {
  auto rng = fresh_rng();
  for (int trial = 0; trial < 50; ++trial) {
    const int S = 1 + int(rng() % 4), K = 1 + int(rng() % 60), k = int(rng() % (K + 1));
    std::vector<float> sc(std::size_t(S * K));
    for (auto& x : sc) x = float(int(rng() % 7)) * 0.5f - 1.0f;  // many ties, both zeros
    for (auto& x : sc)
      if (x == 0.0f && rng() % 2) x = -0.0f;
    std::vector<std::int32_t> lens(static_cast<std::size_t>(S)), out(static_cast<std::size_t>(S * k), 99);
    for (auto& l : lens) l = int(rng() % (K + 1));
    const bool lowest = trial % 2;
    REQUIRE(select_host(sc.data(), lens.data(), S, K, k, lowest, out.data()).ok());
    for (int s = 0; s < S; ++s) {
      std::vector<int> idx(static_cast<std::size_t>(lens[std::size_t(s)]));
      std::iota(idx.begin(), idx.end(), 0);
      auto val = [&](int i) { return sc[std::size_t(s * K + i)] + 0.0f; };  // -0 == +0
      std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return lowest ? val(a) < val(b) : val(a) > val(b); });
      for (int j = 0; j < k; ++j)
        REQUIRE(out[std::size_t(s * k + j)] == (j < int(idx.size()) ? idx[std::size_t(j)] : -1));
    }
  }
  std::vector<float> nan_scores{1.0f, std::nanf("")};
  std::vector<std::int32_t> lens{2}, out(1);
  CHECK(std::string(select_host(nan_scores.data(), lens.data(), 1, 2, 1, true, out.data()).what()) == "scores_nan_at");
  CHECK(std::string(select_host(nan_scores.data(), lens.data(), 1, 2, 3, true, out.data()).what()) == "k");
}

TEST_CASE("page bounds hold the element-wise key max and min of the filled tokens") {
  auto rng = fresh_rng();
  for (int trial = 0; trial < 20; ++trial) {
    const GeometrySpec g = random_spec(rng);
    Pool pool(g, 5);
    pool.bytes = random_elems(rng, g.dtype, std::int64_t(pool.bytes.size()) / dtype_bytes(g.dtype));
    pool.view.base = pool.bytes.data();
    std::vector<float> bounds(std::size_t(5 * g.num_kv_heads * 2 * g.head_dim), 123.0f);
    std::vector<std::int32_t> pages{3, 1}, fill{g.block_size, int(rng() % (g.block_size + 1))};
    const int layer = int(rng() % g.num_layers);
    REQUIRE(page_bounds_host({pool.view, layer, pages.data(), fill.data(), 2, bounds.data()}).ok());
    for (int e = 0; e < 2; ++e)
      for (int h = 0; h < g.num_kv_heads; ++h)
        for (int d = 0; d < g.head_dim; ++d) {
          float mx = -FLT_MAX, mn = FLT_MAX;
          for (int t = 0; t < fill[std::size_t(e)]; ++t) {
            mx = total_max(mx, pool.get(pages[std::size_t(e)], layer, 0, t, h, d));
            mn = total_min(mn, pool.get(pages[std::size_t(e)], layer, 0, t, h, d));
          }
          const float* b = bounds.data() + (std::size_t(pages[std::size_t(e)]) * std::size_t(g.num_kv_heads) + std::size_t(h)) * 2 * std::size_t(g.head_dim);
          REQUIRE(b[d] == mx);
          REQUIRE(b[g.head_dim + d] == mn);
        }
    REQUIRE(bounds[0] == 123.0f);  // page 0 untouched
  }
}

TEST_CASE("page bounds update: appends folded in decode steps and prefill chunks equal a recompute, bit for bit") {
  auto rng = fresh_rng();
  for (int trial = 0; trial < 20; ++trial) {
    const GeometrySpec g = random_spec(rng);
    const std::int32_t blocks = 6, B = g.block_size;
    Pool pool(g, blocks);
    pool.bytes = random_elems(rng, g.dtype, std::int64_t(pool.bytes.size()) / dtype_bytes(g.dtype));
    pool.view.base = pool.bytes.data();
    const int layer = int(rng() % g.num_layers);
    CAPTURE(trial, int(g.dtype), B, g.num_kv_heads, g.head_dim);
    // One stream over blocks 5, 2, 4 (the keys are already in the pool): its
    // slots written in chunks of 1..2B tokens, as reserve would hand them out.
    const std::int32_t order[] = {5, 2, 4};
    std::vector<std::int32_t> all;
    for (const std::int32_t b : order)
      for (std::int32_t t = 0; t < B; ++t) all.push_back(b * B + t);
    std::vector<float> bounds(std::size_t(blocks * g.num_kv_heads * 2 * g.head_dim), 77.0f), want = bounds;
    std::size_t done = 0;
    while (done < all.size()) {
      const std::size_t n = std::min(all.size() - done, std::size_t(1 + rng() % std::uint64_t(2 * B)));
      REQUIRE(page_bounds_update_host({pool.view, layer, all.data() + done, std::int64_t(n), bounds.data()}).ok());
      done += n;
      // The recompute of every page written so far, with its fill.
      std::vector<std::int32_t> pages, fill;
      for (std::size_t k = 0; k < 3 && k * std::size_t(B) < done; ++k) {
        pages.push_back(order[k]);
        fill.push_back(std::int32_t(std::min<std::size_t>(std::size_t(B), done - k * std::size_t(B))));
      }
      REQUIRE(page_bounds_host({pool.view, layer, pages.data(), fill.data(), std::int32_t(pages.size()), want.data()}).ok());
      REQUIRE(bounds == want);  // pages not written yet keep their old entries (77) in both
    }
    // A rewrite of a live slot without the reset: the bound still holds every key the page holds now.
    const std::int32_t slot = 2 * B + std::int32_t(rng() % std::uint64_t(B));
    for (std::int32_t h = 0; h < g.num_kv_heads; ++h)
      for (std::int32_t d = 0; d < g.head_dim; ++d)
        store_elem(g.dtype, pool.bytes.data() + ref_offset(g, blocks, 2, layer, 0, slot - 2 * B, h, d), 0, float(d % 3) - 1.0f);
    PageBoundsUpdateParams rewrite{pool.view, layer, &slot, 1, bounds.data()};
    rewrite.first_slot_starts_page = false;
    REQUIRE(page_bounds_update_host(rewrite).ok());
    for (std::int32_t h = 0; h < g.num_kv_heads; ++h)
      for (std::int32_t d = 0; d < g.head_dim; ++d)
        for (std::int32_t t = 0; t < B; ++t) {
          const float* b = bounds.data() + (std::size_t(2) * std::size_t(g.num_kv_heads) + std::size_t(h)) * 2 * std::size_t(g.head_dim);
          REQUIRE(pool.get(2, layer, 0, t, h, d) <= b[d]);
          REQUIRE(pool.get(2, layer, 0, t, h, d) >= b[g.head_dim + d]);
        }
  }
}

TEST_CASE("page bounds update: a slot outside the pool, a bad layer or pointers are errors, and nothing is written") {
  const GeometrySpec g{.num_layers = 1, .num_kv_heads = 2, .head_dim = 4, .block_size = 4, .dtype = DType::f32};
  Pool pool(g, 3);
  std::vector<float> bounds(std::size_t(3 * 2 * 2 * 4), 5.0f);
  const auto before = bounds;
  const std::vector<std::int32_t> slots{0, 12};  // 12: past 3 blocks of 4
  Status st = page_bounds_update_host({pool.view, 0, slots.data(), 2, bounds.data()});
  CHECK(st.code() == Errc::invalid_argument);
  CHECK(std::string(st.what()) == "slots_at");
  CHECK(st.value() == 1);
  CHECK(page_bounds_update_host({pool.view, 1, slots.data(), 1, bounds.data()}).code() == Errc::invalid_argument);
  CHECK(page_bounds_update_host({pool.view, 0, nullptr, 1, bounds.data()}).code() == Errc::invalid_argument);
  CHECK(page_bounds_update_host({pool.view, 0, slots.data(), -1, bounds.data()}).code() == Errc::invalid_argument);
  CHECK(bounds == before);
  const std::int32_t skipped = -1;  // a negative slot is skipped, as scatter skips it
  REQUIRE(page_bounds_update_host({pool.view, 0, &skipped, 1, bounds.data()}).ok());
  CHECK(bounds == before);
}
