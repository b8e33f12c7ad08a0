// The write-gate kernel's host backend against a double-precision reference
// of the MLP, its exp/erf against the C library, the CUDA kernel's operation
// order emulated on the host (bit for bit), and its errors.
#include <catch2/catch.hpp>

#include <kvcache/kernels/write_gate.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "gate_testing.hpp"
#include "kernel_testing.hpp"

using namespace kvcache;
using namespace kvtest;

namespace {
std::mt19937_64 fresh_rng() { return std::mt19937_64(Catch::rngSeed() ^ std::random_device{}()); }

// Keys stored as `t`, laid out [token][layer][head][d] with `layers` layers,
// so the head stride is head_dim and the token stride spans all layers.
struct Keys {
  DType t;
  std::int32_t tokens, layers, heads, hd;
  std::vector<std::byte> pre, post;
  Keys(std::mt19937_64& rng, DType t_, std::int32_t tokens_, std::int32_t layers_, std::int32_t heads_, std::int32_t hd_)
      : t(t_), tokens(tokens_), layers(layers_), heads(heads_), hd(hd_) {
    const std::int64_t n = std::int64_t{tokens} * layers * heads * hd;
    pre = random_elems(rng, t, n);
    post = random_elems(rng, t, n);
  }
  WriteGateParams params(const WriteGateWeights& w, std::int32_t layer, float* gates) const {
    const std::int64_t e = dtype_bytes(t), off = std::int64_t{layer} * heads * hd * e;
    return WriteGateParams{w, pre.data() + off, post.data() + off, t, std::int64_t{layers} * heads * hd * e, hd * e, tokens, gates};
  }
  std::vector<float> row(const std::vector<std::byte>& v, std::int32_t token, std::int32_t layer, std::int32_t head) const {
    std::vector<float> out(static_cast<std::size_t>(hd));
    const std::int64_t base = ((std::int64_t{token} * layers + layer) * heads + head) * hd;
    for (std::int32_t d = 0; d < hd; ++d) out[std::size_t(d)] = load_elem(t, v.data(), base + d);
    return out;
  }
};

// The CUDA kernel's order on the host: per hidden unit, per partial, finish.
float emulated_gate(const WriteGateParams& p, std::int64_t t, std::int32_t h) {
  const auto& w = p.w;
  std::vector<float> z(std::size_t(2 * w.head_dim)), a(std::size_t(w.hidden)), parts(gate_math::kPartials);
  gate_norm(gate_key(p, p.k_pre, t, h), p.dtype, w.norm_pre, w.head_dim, w.norm_eps, z.data());
  gate_norm(gate_key(p, p.k_post, t, h), p.dtype, w.norm_post, w.head_dim, w.norm_eps, z.data() + w.head_dim);
  for (std::int32_t j = 0; j < w.hidden; ++j) a[std::size_t(j)] = gate_math::activate(gate_hidden(w, h, j, z.data()), w.activation);
  for (std::int32_t l = 0; l < gate_math::kPartials; ++l) parts[std::size_t(l)] = gate_partial(w, h, l, a.data());
  return gate_finish(w, h, parts.data());
}
}  // namespace

TEST_CASE("write gate: exp and erf written from rounded operations track the C library") {
  double worst_exp = 0, worst_erf = 0;
  for (float x = -86.0f; x <= 88.0f; x += 0.0137f) {
    const double ref = std::exp(double(x));
    worst_exp = std::max(worst_exp, std::fabs(double(gate_math::exp(x)) - ref) / ref);
  }
  for (float x = -6.0f; x <= 6.0f; x += 0.00071f)
    worst_erf = std::max(worst_erf, std::fabs(double(gate_math::erf(x)) - std::erf(double(x))));
  CHECK(worst_exp < 1e-6);
  CHECK(worst_erf < 6e-7);  // the formula's 1.5e-7 plus float rounding near 1
  CHECK(gate_math::exp(-200.0f) == 0.0f);
  CHECK(std::isinf(gate_math::exp(100.0f)));
  CHECK(std::isnan(gate_math::exp(std::numeric_limits<float>::quiet_NaN())));
  CHECK(gate_math::erf(0.0f) == 0.0f);
  CHECK(gate_math::erf(-1.0f) == -gate_math::erf(1.0f));
}

TEST_CASE("write gate: host gates match the double reference for f32, f16 and bf16 keys, and the CUDA order bit for bit") {
  auto rng = fresh_rng();
  const DType types[] = {DType::f32, DType::f16, DType::bf16, DType::fp8_e4m3};
  const std::int32_t dims[] = {8, 32, 64, 128};
  for (int trial = 0; trial < 12; ++trial) {
    const DType t = types[trial % 4];
    const std::int32_t hd = dims[rng() % 4], heads = 1 + std::int32_t(rng() % 3), layers = 1 + std::int32_t(rng() % 2);
    const std::int32_t hidden = trial % 3 == 0 ? 4 * hd : 1 + std::int32_t(rng() % 70);  // not a multiple of 32 too
    const auto act = trial % 5 == 4 ? GateActivation::silu : GateActivation::gelu;
    CAPTURE(trial, t, hd, heads, layers, hidden, int(act));
    GateWeights gw(rng, heads, hd, hidden);
    Keys keys(rng, t, 1 + std::int32_t(rng() % 9), layers, heads, hd);
    const std::int32_t layer = layers - 1;
    std::vector<float> gates(std::size_t(keys.tokens * heads), -1.0f);
    const auto p = keys.params(gw.view(act), layer, gates.data());
    REQUIRE(write_gate_host(p).ok());
    for (std::int32_t tok = 0; tok < keys.tokens; ++tok)
      for (std::int32_t h = 0; h < heads; ++h) {
        const float g = gates[std::size_t(tok * heads + h)];
        const auto pre = keys.row(keys.pre, tok, layer, h), post = keys.row(keys.post, tok, layer, h);
        CHECK(std::fabs(double(g) - reference_gate(p.w, pre.data(), post.data(), h)) < 2e-5);
        CHECK(g >= p.w.min_gate);
        CHECK(g <= 1.0f);
        const float e = emulated_gate(p, tok, h);
        CHECK(std::memcmp(&g, &e, sizeof g) == 0);
      }
  }
}

TEST_CASE("write gate: the clamp holds gates at min_gate, and the gate follows its output bias") {
  auto rng = fresh_rng();
  GateWeights gw(rng, 2, 16, 64);
  Keys keys(rng, DType::f32, 5, 1, 2, 16);
  std::vector<float> gates(10);
  std::fill(gw.b2.begin(), gw.b2.end(), -60.0f);
  REQUIRE(write_gate_host(keys.params(gw.view(), 0, gates.data())).ok());
  for (float g : gates) CHECK(g == 1e-3f);
  auto w = gw.view();
  w.min_gate = 0.0f;
  REQUIRE(write_gate_host(keys.params(w, 0, gates.data())).ok());
  for (float g : gates) CHECK(g < 1e-20f);
  std::fill(gw.b2.begin(), gw.b2.end(), 60.0f);
  REQUIRE(write_gate_host(keys.params(gw.view(), 0, gates.data())).ok());
  for (float g : gates) CHECK(g == 1.0f);
}

TEST_CASE("write gate: bad parameters are errors naming the field, and no gate is written") {
  auto rng = fresh_rng();
  GateWeights gw(rng, 2, 16, 64);
  Keys keys(rng, DType::f16, 3, 1, 2, 16);
  std::vector<float> gates(6, -7.0f);
  auto expect = [&](WriteGateParams p, const char* what) {
    const Status st = write_gate_host(p);
    CHECK(st.code() == Errc::invalid_argument);
    CHECK(std::string(st.what()) == what);
    for (float g : gates) CHECK(g == -7.0f);
  };
  const auto good = keys.params(gw.view(), 0, gates.data());
  auto p = good;
  p.w.num_kv_heads = 0;
  expect(p, "num_kv_heads");
  p = good;
  p.w.head_dim = 0;
  expect(p, "head_dim");
  p = good;
  p.w.hidden = -3;
  expect(p, "hidden");
  p = good;
  p.w.min_gate = 1.5f;
  expect(p, "min_gate");
  p = good;
  p.w.min_gate = std::numeric_limits<float>::quiet_NaN();
  expect(p, "min_gate");
  p = good;
  p.w.norm_eps = 0.0f;
  expect(p, "norm_eps");
  p = good;
  p.w.activation = static_cast<GateActivation>(7);
  expect(p, "activation");
  p = good;
  p.dtype = static_cast<DType>(9);
  expect(p, "dtype");
  p = good;
  p.num_tokens = -1;
  expect(p, "num_tokens");
  p = good;
  p.w.w1 = nullptr;
  expect(p, "pointers");
  p = good;
  p.gates = nullptr;
  expect(p, "pointers");
  p = good;  // no tokens: nothing to read, null pointers are fine
  p.num_tokens = 0;
  p.k_pre = nullptr;
  CHECK(write_gate_host(p).ok());
}
