// Random write-gate weights and keys for the gate kernel's tests (host and
// CUDA), and a double-precision reference of the MLP written from the
// method's definition, with the C library's exp and erf.
#pragma once

#include <kvcache/kernels/write_gate.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace kvtest {
namespace kv = kvcache;

struct GateWeights {
  std::int32_t heads, hd, hidden;
  std::vector<float> norm_pre, norm_post, w1, b1, w2, b2;

  GateWeights(std::mt19937_64& rng, std::int32_t heads_, std::int32_t hd_, std::int32_t hidden_)
      : heads(heads_), hd(hd_), hidden(hidden_) {
    std::normal_distribution<float> n(0.0f, 1.0f);
    auto fill = [&](std::vector<float>& v, std::size_t size, float scale, float mean) {
      v.resize(size);
      for (auto& x : v) x = mean + scale * n(rng);
    };
    fill(norm_pre, std::size_t(hd), 0.1f, 1.0f);
    fill(norm_post, std::size_t(hd), 0.1f, 1.0f);
    fill(w1, std::size_t(heads) * 2 * std::size_t(hd) * std::size_t(hidden), 1.0f / std::sqrt(2.0f * float(hd)), 0.0f);
    fill(b1, std::size_t(heads) * std::size_t(hidden), 0.1f, 0.0f);
    fill(w2, std::size_t(heads) * std::size_t(hidden), 1.0f / std::sqrt(float(hidden)), 0.0f);
    fill(b2, std::size_t(heads), 0.5f, 0.0f);
  }
  kv::WriteGateWeights view(kv::GateActivation act = kv::GateActivation::gelu) const {
    kv::WriteGateWeights w;
    w.norm_pre = norm_pre.data();
    w.norm_post = norm_post.data();
    w.w1 = w1.data();
    w.b1 = b1.data();
    w.w2 = w2.data();
    w.b2 = b2.data();
    w.num_kv_heads = heads;
    w.head_dim = hd;
    w.hidden = hidden;
    w.activation = act;
    return w;
  }
};

// The gate of one (token, head) in double: RMSNorm both keys, MLP, sigmoid, clamp.
inline double reference_gate(const kv::WriteGateWeights& w, const float* pre, const float* post, std::int32_t h) {
  const std::int32_t hd = w.head_dim;
  std::vector<double> z(std::size_t(2 * hd));
  auto norm = [&](const float* x, const float* weight, double* out) {
    double ss = 0;
    for (std::int32_t i = 0; i < hd; ++i) ss += double(x[i]) * x[i];
    const double inv = 1.0 / std::sqrt(ss / hd + double(w.norm_eps));
    for (std::int32_t i = 0; i < hd; ++i) out[i] = x[i] * inv * weight[i];
  };
  norm(pre, w.norm_pre, z.data());
  norm(post, w.norm_post, z.data() + hd);
  double y = w.b2[h];
  for (std::int32_t j = 0; j < w.hidden; ++j) {
    double a = w.b1[std::size_t(h) * std::size_t(w.hidden) + std::size_t(j)];
    for (std::int32_t i = 0; i < 2 * hd; ++i)
      a += double(w.w1[(std::size_t(h) * 2 * std::size_t(hd) + std::size_t(i)) * std::size_t(w.hidden) + std::size_t(j)]) *
           z[std::size_t(i)];
    a = w.activation == kv::GateActivation::gelu ? 0.5 * a * (1.0 + std::erf(a / std::sqrt(2.0))) : a / (1.0 + std::exp(-a));
    y += double(w.w2[std::size_t(h) * std::size_t(w.hidden) + std::size_t(j)]) * a;
  }
  const double g = 1.0 / (1.0 + std::exp(-y));
  return g < w.min_gate ? double(w.min_gate) : g;
}

}  // namespace kvtest
