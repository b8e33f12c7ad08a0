// Quantized KV: the format's validation and byte accounting (Geometry), the
// group codecs' round trip against fp32 with per-format error bounds, and
// the kernels' handling of quantized pools (block copy moves codes and
// scales; int8 and e5m2 with an engine-held scale through scatter and gather).
#include <catch2/catch.hpp>

#include <kvcache/core/geometry.hpp>
#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kernels/gather.hpp>
#include <kvcache/kernels/detail/quant.hpp>
#include <kvcache/kernels/scatter.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernel_testing.hpp"

using namespace kvcache;

namespace {

// Keys as real models have them: most channels small, a few channels large
// (the outliers KIVI and KVQuant report), so group ranges differ widely.
std::vector<float> realistic_row(std::mt19937_64& rng, int n) {
  std::normal_distribution<float> z(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) x[std::size_t(i)] = z(rng) * (i % 37 == 5 ? 20.0f : 1.0f);
  return x;
}

struct Case {
  DType code;
  bool minimum;
};
const Case kCases[] = {{DType::int8, false}, {DType::int8, true},          {DType::int4, false}, {DType::int4, true},
                       {DType::fp8_e4m3, false}, {DType::fp8_e5m2, false}, {DType::fp4_e2m1, false},
                       {DType::int2, false},     {DType::int2, true}};

// The most a value may move through its group's codes: half a step of the
// code at the value's magnitude (a relative step for the float codes), plus
// how far the value lies outside what the stored scale and minimum reach.
double error_bound(const Case& c, double x, const quant::GroupScale& g) {
  const double s = g.scale;
  const double top = double(quant::code_max(c.code, c.minimum)) * s;
  const double lo = c.minimum ? double(g.minimum) : -top, hi = c.minimum ? double(g.minimum) + top : top;
  const double outside = x < lo ? lo - x : (x > hi ? x - hi : 0.0);
  double step = s / 2;  // integers
  if (c.code == DType::fp8_e4m3) step = std::max(std::fabs(x) * 0x1p-4, s * 0x1p-10);
  if (c.code == DType::fp8_e5m2) step = std::max(std::fabs(x) * 0x1p-3, s * 0x1p-17);
  if (c.code == DType::fp4_e2m1) step = std::max(std::fabs(x) * 0.25, s * 0.25);
  return step * (1 + 1e-6) + outside + 1e-7 * std::fabs(x);
}

}  // namespace

TEST_CASE("group codecs: every format and group size round-trips within its bound") {
  std::mt19937_64 rng(Catch::rngSeed() ^ 0x9e3779b9u);
  for (const Case& c : kCases)
    for (int group : {16, 32, 64, 128}) {
      if (c.code == DType::fp4_e2m1 && group != 16) continue;
      INFO("code " << int(c.code) << " minimum " << c.minimum << " group " << group);
      double worst = 0, sq = 0;
      std::int64_t n = 0;
      for (int trial = 0; trial < 200; ++trial) {
        std::vector<float> x = realistic_row(rng, group);
        if (trial % 10 == 0) std::fill(x.begin(), x.end(), 0.0f);  // an all-zero group: scale 0, exact
        if (trial % 10 == 1) std::fill(x.begin(), x.end(), -3.5f);  // a constant group
        std::vector<std::uint8_t> codes(std::size_t(row_bytes(c.code, group)), 0xA5), entry(8, 0xA5);
        const auto g = quant::quantize_group(x.data(), group, c.code, c.minimum, codes.data(), entry.data());
        const auto back = quant::load_entry(c.code, c.minimum, entry.data());
        REQUIRE(back.scale == g.scale);  // what the writer used is what the reader gets
        REQUIRE(back.minimum == g.minimum);
        std::vector<float> y(std::size_t(group), std::nanf(""));
        quant::dequantize_group(codes.data(), entry.data(), group, c.code, c.minimum, y.data());
        const auto [lo, hi] = std::minmax_element(x.begin(), x.end());
        const double range = std::max(double(*hi - *lo), double(std::max(std::fabs(*lo), std::fabs(*hi))));
        for (int i = 0; i < group; ++i) {
          const double err = std::fabs(double(y[std::size_t(i)]) - x[std::size_t(i)]);
          INFO("trial " << trial << " i " << i << " x " << x[std::size_t(i)] << " y " << y[std::size_t(i)]);
          REQUIRE(err <= error_bound(c, x[std::size_t(i)], g));
          if (range > 0) worst = std::max(worst, err / range), sq += (err / range) * (err / range), ++n;
          else REQUIRE(err == 0.0);
        }
        // The stored scale and minimum reach the whole group but for the
        // scale's own rounding (2^-11 of f16, 2^-4 of e4m3).
        const double s = g.scale, top = double(quant::code_max(c.code, c.minimum)) * s;
        const double slack = (c.code == DType::fp4_e2m1 ? 0x1p-3 : 0x1p-10) * range + 1e-6;
        if (c.minimum) REQUIRE((*lo >= g.minimum - slack && *hi <= g.minimum + top + slack));
        else REQUIRE(std::max(std::fabs(*lo), std::fabs(*hi)) <= top + slack);
      }
      // Relative to each group's range: half a step of the code at most.
      const double step = c.code == DType::int8 ? 1.0 / (c.minimum ? 255 : 127)
                          : c.code == DType::int4 ? 1.0 / (c.minimum ? 15 : 7)
                          : c.code == DType::int2 ? 1.0 / (c.minimum ? 3 : 1)
                          : c.code == DType::fp8_e4m3 ? 0x1p-3
                          : c.code == DType::fp8_e5m2 ? 0x1p-2
                                                      : 1.0 / 3;  // fp4: 4 -> 6 near the top
      CHECK(worst <= step / 2 * 1.01 + 0x1p-10);
      CHECK(std::sqrt(sq / double(n)) < worst);
    }
}

TEST_CASE("group codecs: codes are packed low nibble first, signed or offset by the minimum") {
  // int4 symmetric, scale 1: the values are their codes.
  float x[16] = {7, -7, 1, -1, 0, 2, 3, 4, 5, 6, -2, -3, -4, -5, -6, 0};
  std::uint8_t codes[8], entry[2];
  const auto g = quant::quantize_group(x, 16, DType::int4, false, codes, entry);
  CHECK(g.scale == 1.0f);
  CHECK(codes[0] == 0x97);  // 7 low, -7 (0x9) high
  CHECK(codes[1] == 0xF1);  // 1, -1
  float y[16];
  quant::dequantize_group(codes, entry, 16, DType::int4, false, y);
  for (int i = 0; i < 16; ++i) CHECK(y[i] == x[i]);
  // With a minimum: codes count up from it.
  float u[16];
  for (int i = 0; i < 16; ++i) u[i] = 10.0f + float(i);
  std::uint8_t e2[4];
  const auto m = quant::quantize_group(u, 16, DType::int4, true, codes, e2);
  CHECK(m.minimum == 10.0f);
  CHECK(m.scale == 1.0f);
  CHECK(codes[0] == 0x10);
  CHECK(codes[7] == 0xFE);
  // fp4: the e4m3 scale of a group whose largest magnitude is 6 is 1.
  float f[16] = {6, -6, 0.5f, 1, 1.5f, 2, 3, 4, 0, -0.5f, -1, -1.5f, -2, -3, -4, 0};
  std::uint8_t e3[1];
  const auto s = quant::quantize_group(f, 16, DType::fp4_e2m1, false, codes, e3);
  CHECK(s.scale == 1.0f);
  CHECK(e3[0] == 0x38);  // 1.0 in e4m3
  CHECK(codes[0] == 0xF7);
  quant::dequantize_group(codes, e3, 16, DType::fp4_e2m1, false, y);
  for (int i = 0; i < 16; ++i) CHECK(y[i] == f[i]);
  // -0 keeps its sign, as a negative that rounds to zero does (issue 62: f32_to_e2m1(-0.0f) gave +0).
  CHECK(quant::f32_to_e2m1(-0.0f) == 8u);
  CHECK(quant::f32_to_e2m1(-0.1f) == 8u);
  CHECK(quant::f32_to_e2m1(0.0f) == 0u);
  CHECK(quant::f32_to_e2m1(-std::numeric_limits<float>::quiet_NaN()) == 0u);
  CHECK(std::signbit(quant::e2m1_to_f32(quant::f32_to_e2m1(-0.0f))));
  // int2: four a byte, element 4i + j in bits 2j; symmetric codes -1, 0, 1 (scale 2 here), or 0..3 above the minimum.
  float t[16] = {2, -2, 0, 2, -2, -2, 0, 0, 2, 2, 2, 2, 0, -2, 0, 2};
  const auto s2 = quant::quantize_group(t, 16, DType::int2, false, codes, entry);
  CHECK(s2.scale == 2.0f);
  CHECK(codes[0] == 0x4D);  // 1, -1, 0, 1 from the low bits: 01 00 11 01
  CHECK(codes[1] == 0x0F);  // -1, -1, 0, 0
  quant::dequantize_group(codes, entry, 16, DType::int2, false, y);
  for (int i = 0; i < 16; ++i) CHECK(y[i] == t[i]);
  float w[16];
  for (int i = 0; i < 16; ++i) w[i] = 5.0f + float(i % 4);
  const auto m2 = quant::quantize_group(w, 16, DType::int2, true, codes, e2);
  CHECK((m2.minimum == 5.0f && m2.scale == 1.0f));
  CHECK(codes[0] == 0xE4);  // 0, 1, 2, 3 from the low bits: 11 10 01 00
  quant::dequantize_group(codes, e2, 16, DType::int2, true, y);
  for (int i = 0; i < 16; ++i) CHECK(y[i] == w[i]);
}

TEST_CASE("geometry: a quantized block holds its codes and its group entries") {
  const GeometrySpec base{.num_layers = 1, .num_kv_heads = 8, .head_dim = 128, .block_size = 16};
  auto with = [&](DType d, KvFormat f) {
    GeometrySpec s = base;
    s.dtype = d;
    s.format = f;
    return Geometry::make(s);
  };
  const SideFormat g32{.scales = Scales::group, .group = 32};
  const SideFormat g32m{.scales = Scales::group, .group = 32, .minimum = true};
  const SideFormat g16{.scales = Scales::group, .group = 16};
  const SideFormat tensor{.scales = Scales::tensor};
  // int8, a scale per 32 values: 16 x 8 rows of 128 codes, then 4 f16 scales a row.
  auto i8 = with(DType::int8, {g32, g32});
  REQUIRE(i8.ok());
  CHECK(i8->row_bytes() == 128);
  CHECK(i8->scales_offset() == 16 * 8 * 128);
  CHECK(i8->plane_bytes() == 16 * 8 * 128 + 16 * 8 * 4 * 2);
  CHECK(i8->block_bytes() == 2 * i8->plane_bytes());
  // int4 with a minimum: half the codes, twice the entries.
  auto i4 = with(DType::int4, {g32m, g32m});
  CHECK(i4->row_bytes() == 64);
  CHECK(i4->plane_bytes() == 16 * 8 * 64 + 16 * 8 * 4 * 4);
  // fp4 (NVFP4's element): an e4m3 scale per 16 values.
  auto f4 = with(DType::fp4_e2m1, {g16, g16});
  CHECK(f4->plane_bytes() == 16 * 8 * 64 + 16 * 8 * 8 * 1);
  // fp8 with engine-held scales: the pool holds codes only.
  auto f8 = with(DType::fp8_e5m2, {tensor, {.scales = Scales::head}});
  CHECK(f8->plane_bytes() == 16 * 8 * 128);
  CHECK(f8->group_bytes_per_row(0) == 0);
  // K by groups with a minimum (KIVI-like), V by tensor: planes take the larger side.
  auto mixed = with(DType::int8, {g32m, tensor});
  CHECK(mixed->group_bytes_per_row(0) == 16);
  CHECK(mixed->group_bytes_per_row(1) == 0);
  CHECK(mixed->plane_bytes() == 16 * 8 * 128 + 16 * 8 * 16);
  // Entries follow the codes' row order, from a 16-byte boundary.
  auto tiny = Geometry::make({.num_kv_heads = 1, .head_dim = 16, .block_size = 1, .dtype = DType::int4,
                              .v_head_dim = 0, .format = {.k = g16}});
  REQUIRE(tiny.ok());
  CHECK(tiny->scales_offset() == 16);  // 8 bytes of codes, rounded up
  CHECK(tiny->plane_bytes() == 18);
  GeometrySpec hnd = base;
  hnd.dtype = DType::int8;
  hnd.format = {g32, g32m};
  hnd.layout = Layout::HND;
  auto h = Geometry::make(hnd);
  CHECK(h->group_entries_offset(1, 3, 2) == h->scales_offset() + (2 * 16 + 3) * 16);
  CHECK(i8->group_entries_offset(0, 3, 2) == i8->scales_offset() + (3 * 8 + 2) * 8);
  CHECK(*i8 == *with(DType::int8, {g32, g32}));
  CHECK_FALSE(*i8 == *with(DType::int8, {g32, g16}));
}

TEST_CASE("geometry: each bad format is a typed error naming its field") {
  struct Bad {
    DType dtype;
    KvFormat format;
    std::int32_t head_dim;
    const char* what;
    std::int64_t value;
  };
  const SideFormat g32{.scales = Scales::group, .group = 32};
  const Bad cases[] = {
      {DType::f16, {.k = {.scales = Scales::tensor}}, 128, "format.k.scales (a float dtype is stored unscaled)", 1},
      {DType::int8, {.k = g32}, 128, "format.v.scales (an integer code needs scales)", 0},
      {DType::int8, {g32, {.scales = Scales::group, .group = 24}}, 96, "format.v.group (16, 32, 64 or 128)", 24},
      {DType::int8, {g32, g32}, 80, "format.k.group (must divide head_dim)", 32},
      {DType::fp4_e2m1, {g32, g32}, 128, "format.k.group (fp4 takes groups of 16)", 32},
      {DType::fp8_e4m3, {{.scales = Scales::group, .group = 32, .minimum = true}, {}}, 128,
       "format.k.minimum (integer codes only)", 1},
      {DType::int8, {{.scales = Scales::tensor, .group = 32}, g32}, 128, "format.k.group (only with group scales)", 32},
      {DType::int8, {{.scales = Scales::head, .minimum = true}, g32}, 128, "format.k.minimum (only with group scales)", 1},
      {DType::int8, {{.scales = static_cast<Scales>(9)}, g32}, 128, "format.k.scales", 9},
      {DType::int4, {{.scales = Scales::tensor}, {.scales = Scales::tensor}}, 7,
       "head_dim (odd: a 4-bit dtype packs two values a byte)", 7},
      {DType::int2, {{.scales = Scales::tensor}, g32}, 128, "format.k.scales (2-bit codes take group or channel scales)", 1},
      {static_cast<DType>(9), {}, 128, "dtype", 9},
  };
  for (const Bad& b : cases) {
    INFO(b.what);
    auto g = Geometry::make({.head_dim = b.head_dim, .dtype = b.dtype, .format = b.format});
    REQUIRE_FALSE(g.ok());
    CHECK(g.status().code() == Errc::invalid_argument);
    CHECK(std::string(g.status().what()) == b.what);
    CHECK(g.status().value() == b.value);
  }
  // A pool without V takes no V format.
  auto mla = Geometry::make({.dtype = DType::int8, .v_head_dim = 0, .format = {g32, g32}});
  CHECK(std::string(mla.status().what()) == "format.v.scales (the pool has no V plane)");
}

TEST_CASE("block copy moves a quantized block's codes and scales together") {
  std::mt19937_64 rng(Catch::rngSeed() ^ 0x51ed27u);
  for (DType d : {DType::int8, DType::int4, DType::fp4_e2m1})
    for (auto planes : {KvPlanes::interleaved, KvPlanes::separate}) {
      const std::int32_t group = d == DType::fp4_e2m1 ? 16 : 32;
      const GeometrySpec s{.num_layers = 2, .num_kv_heads = 2, .head_dim = 64, .block_size = 16, .dtype = d,
                           .planes = planes,
                           .format = {{.scales = Scales::group, .group = group, .minimum = d == DType::int4},
                                      {.scales = Scales::group, .group = group}}};
      auto g = Geometry::make(s);
      REQUIRE(g.ok());
      const std::int64_t blocks = 5;
      std::vector<std::byte> a(std::size_t(*g->pool_bytes(blocks))), b(a.size());
      for (auto& x : a) x = std::byte(rng());
      for (auto& x : b) x = std::byte(rng());
      const auto before = b;
      auto va = *make_pool_view(*g, a.data(), blocks), vb = *make_pool_view(*g, b.data(), blocks);
      const BlockCopy pairs[] = {{1, 3}, {4, 0}};
      REQUIRE(block_copy_host({va, vb, pairs, 2}).ok());
      // Every plane of each destination block equals its source's, scales included; nothing else moved.
      auto st = *g->strides(blocks);
      std::vector<char> moved(b.size(), 0);
      for (auto [src, dst] : pairs)
        for (int l = 0; l < 2; ++l)
          for (int kv = 0; kv < 2; ++kv) {
            const std::int64_t so = st.offset(src, l, kv, 0, 0), dof = st.offset(dst, l, kv, 0, 0);
            REQUIRE(std::memcmp(&a[std::size_t(so)], &b[std::size_t(dof)], std::size_t(g->plane_bytes())) == 0);
            std::fill_n(moved.begin() + dof, g->plane_bytes(), 1);
          }
      for (std::size_t i = 0; i < b.size(); ++i)
        if (!moved[i]) REQUIRE(b[i] == before[i]);
      // A pool of another format is not this one's.
      GeometrySpec other = s;
      other.format.v.minimum = !s.format.v.minimum && d != DType::fp4_e2m1;
      if (d != DType::fp4_e2m1) {
        auto go = Geometry::make(other);
        std::vector<std::byte> c(std::size_t(*go->pool_bytes(blocks)));
        auto st2 = block_copy_host({va, *make_pool_view(*go, c.data(), blocks), pairs, 2});
        CHECK(std::string(st2.what()) == "dst.geometry");
      }
    }
}

TEST_CASE("int8 and fp8 e5m2 with a per-tensor scale go through scatter and gather") {
  std::mt19937_64 rng(Catch::rngSeed() ^ 0x7e57u);
  for (DType d : {DType::int8, DType::fp8_e5m2}) {
    const SideFormat t{.scales = Scales::tensor};
    auto g = Geometry::make({.num_kv_heads = 2, .head_dim = 32, .block_size = 4, .dtype = d, .format = {t, t}});
    REQUIRE(g.ok());
    const std::int64_t blocks = 3, tokens = 5;
    std::vector<std::byte> pool(std::size_t(*g->pool_bytes(blocks)));
    std::vector<float> k, v;
    for (int i = 0; i < tokens * 2 * 32; ++i) k.push_back(realistic_row(rng, 1)[0]), v.push_back(realistic_row(rng, 1)[0]);
    const float k_amax = std::fabs(*std::max_element(k.begin(), k.end(), [](float a, float b) { return std::fabs(a) < std::fabs(b); }));
    const float v_amax = std::fabs(*std::max_element(v.begin(), v.end(), [](float a, float b) { return std::fabs(a) < std::fabs(b); }));
    const float qmax = quant::code_max(d, false), ks = k_amax / qmax, vs = v_amax / qmax;
    const std::int32_t slots[] = {0, 1, 2, 3, 4};  // one sequence's first 5 positions
    ScatterParams p{};
    p.cache = *make_pool_view(*g, pool.data(), blocks);
    p.src = KvSource{k.data(), v.data(), DType::f32, 0, 2 * 32 * 4, 32 * 4};
    p.addr.slots = slots;
    p.num_tokens = tokens;
    p.k_scale = ks;
    p.v_scale = vs;
    REQUIRE(scatter_host(p).ok());
    std::vector<float> ko(k.size(), -1), vo(v.size(), -1);
    const std::int32_t indptr[] = {0, 2}, indices[] = {0, 1}, out_indptr[] = {0, 5};
    GatherParams gp{};
    gp.cache = p.cache;
    gp.indptr = indptr;
    gp.indices = indices;
    gp.out_indptr = out_indptr;
    gp.num_seqs = 1;
    gp.num_rows = tokens;
    gp.k_out = ko.data();
    gp.v_out = vo.data();
    gp.out_dtype = DType::f32;
    gp.token_stride = 2 * 32 * 4;
    gp.head_stride = 32 * 4;
    gp.k_scale = ks;
    gp.v_scale = vs;
    REQUIRE(gather_host(gp).ok());
    for (std::size_t i = 0; i < k.size(); ++i) {
      INFO("dtype " << int(d) << " i " << i);
      const double kb = d == DType::int8 ? ks / 2 * 1.0001 : std::max(std::fabs(k[i]) * 0x1p-3, ks * 0x1p-17);
      const double vb = d == DType::int8 ? vs / 2 * 1.0001 : std::max(std::fabs(v[i]) * 0x1p-3, vs * 0x1p-17);
      REQUIRE(std::fabs(ko[i] - k[i]) <= kb + 1e-6);
      REQUIRE(std::fabs(vo[i] - v[i]) <= vb + 1e-6);
    }
  }
}

TEST_CASE("engine-held scales per layer and per (layer, head) scale each row they name") {
  // K: one scale per (layer, kv-head), as vLLM's and TensorRT-LLM's per-head
  // fp8 scales; V: one per layer. Both times the call's k_scale / v_scale.
  const int L = 2, H = 3, D = 16, B = 4;
  for (DType d : {DType::int8, DType::fp8_e4m3}) {
    auto g = Geometry::make({.num_layers = L, .num_kv_heads = H, .head_dim = D, .block_size = B, .dtype = d,
                             .format = {{.scales = Scales::head}, {.scales = Scales::tensor}}});
    REQUIRE(g.ok());
    std::vector<std::byte> pool(std::size_t(*g->pool_bytes(2)));
    const PoolView view = *make_pool_view(*g, pool.data(), 2);
    std::vector<float> k(std::size_t(L * 2 * H * D)), v(k.size());  // [layer][token][head][dim]
    std::mt19937_64 rng(Catch::rngSeed() ^ 0x4eadu);
    for (std::size_t i = 0; i < k.size(); ++i) k[i] = realistic_row(rng, 1)[0] * float(1 + i / std::size_t(D) % H), v[i] = realistic_row(rng, 1)[0];
    const float k_heads[L * H] = {0.05f, 0.1f, 0.2f, 0.07f, 0.15f, 0.3f}, v_layers[L] = {0.04f, 0.08f};
    const std::int32_t slots[] = {5, 2};
    ScatterParams p{view, KvSource{k.data(), v.data(), DType::f32, 2 * H * D * 4, H * D * 4, D * 4}, TokenAddress{slots}, 2, 0, L,
                    2.0f, 0.5f, k_heads, v_layers};
    REQUIRE(scatter_host(p).ok());
    const Strides st = *g->strides(2);
    for (int l = 0; l < L; ++l)
      for (int t = 0; t < 2; ++t)
        for (int h = 0; h < H; ++h)
          for (int kv = 0; kv < 2; ++kv) {
            const float scale = kv == 0 ? 2.0f * k_heads[l * H + h] : 0.5f * v_layers[l];
            const float* x = (kv ? v : k).data() + ((l * 2 + t) * H + h) * D;
            const std::byte* row = &pool[std::size_t(st.offset(slots[t] / B, l, kv, slots[t] % B, h))];
            for (int i = 0; i < D; ++i) {
              std::uint8_t want[4] = {};  // store_elem's widest element, though d takes one byte
              store_elem(d, want, 0, x[i] / scale);
              REQUIRE(std::to_integer<std::uint8_t>(row[i]) == want[0]);
            }
          }
    // Gather with the same arrays reads each row back at its own scale.
    std::vector<float> ko(std::size_t(2 * B * H * D)), vo(ko.size());
    const std::int32_t indptr[] = {0, 2}, pages[] = {0, 1}, rows[] = {0, 2 * B};
    GatherParams gp{view, 1, indptr, pages, rows, 1, 2 * B, ko.data(), vo.data(), DType::f32, H * D * 4, D * 4, 2.0f, 0.5f,
                    k_heads, v_layers};
    REQUIRE(gather_host(gp).ok());
    for (int t = 0; t < 2; ++t)
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < D; ++i) {
          const float x = k[std::size_t(((2 + t) * H + h) * D + i)], got = ko[std::size_t((slots[t] * H + h) * D + i)];
          const float scale = 2.0f * k_heads[H + h];
          const double bound = d == DType::int8 ? scale / 2 * 1.001 : std::max(std::fabs(x) * 0x1p-4, scale * 0x1p-10);
          REQUIRE(std::fabs(got - x) <= bound + 1e-6);
        }
    // Bad arrays are typed errors, and nothing is written.
    const auto before = pool;
    const float bad[L * H] = {0.05f, 0.1f, 0.0f, 0.07f, 0.15f, 0.3f};
    p.k_scales = bad;
    CHECK(scatter_host(p).message() == "invalid_argument: k_scales_at=2 (limit 6)");
    gp.k_scales = bad;
    CHECK(gather_host(gp).message() == "invalid_argument: k_scales_at=2 (limit 6)");
    // Not finite (inf, NaN) is refused too; FLT_MAX is finite and taken as a scale.
    const float inf[L * H] = {0.05f, 0.1f, 0.2f, 0.07f, std::numeric_limits<float>::infinity(), 0.3f};
    p.k_scales = inf;
    CHECK(scatter_host(p).message() == "invalid_argument: k_scales_at=4 (limit 6)");
    const float nan[L * H] = {std::numeric_limits<float>::quiet_NaN(), 0.1f, 0.2f, 0.07f, 0.15f, 0.3f};
    gp.k_scales = nan;
    CHECK(gather_host(gp).message() == "invalid_argument: k_scales_at=0 (limit 6)");
    CHECK(pool == before);
    const float huge[L * H] = {std::numeric_limits<float>::max(), 0.1f, 0.2f, 0.07f, 0.15f, 0.3f};
    gp.k_scales = huge;
    CHECK(gather_host(gp).ok());
  }
  // An array for a side without engine-held scales names that side.
  const SideFormat g32{.scales = Scales::group, .group = 32};
  auto g = Geometry::make({.head_dim = 32, .block_size = 4, .dtype = DType::int8, .format = {g32, {.scales = Scales::tensor}}});
  std::vector<std::byte> pool(std::size_t(*g->pool_bytes(1)));
  std::vector<float> x(64, 1.0f);
  const float one = 1.0f;
  const std::int32_t slot = 0;
  ScatterParams p{*make_pool_view(*g, pool.data(), 1), KvSource{x.data(), x.data() + 32, DType::f32, 0, 64 * 4, 32 * 4},
                  TokenAddress{&slot}, 1};
  p.k_scales = &one;
  CHECK(scatter_host(p).message() == "invalid_argument: k_scales (format.k holds no engine-held scales)=3 (limit 2)");
  p.k_scales = nullptr, p.v_scales = &one;
  CHECK(scatter_host(p).ok());
}
