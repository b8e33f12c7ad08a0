// The forward pass of one sequence chunk on the CPU. K/V go through a store
// the engine picks (kv_store.hpp): kvcache's paged pool, or a plain
// contiguous buffer as the reference. Attention masks by token position, not
// by slot order, so it stays right after token policies reorder the cache.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "model.hpp"

namespace engine {

// What the forward pass needs from a K/V store, per layer:
//   write(layer, k, v)           the chunk's rows [n][kv_heads][head_dim]
//   read(layer, head)            -> HeldKv of every held token of that kv-head
struct HeldKv {
  const float* k = nullptr;  // [count][row_stride], the head's row at offset 0
  const float* v = nullptr;
  const std::int64_t* pos = nullptr;  // [count] token positions
  std::int32_t count = 0, row_stride = 0;
};

// Per-step attention the engine hands to eviction policies: for each kv-head,
// the attention of the chunk's queries (summed over them and over the q-heads
// reading that kv-head) to each held token, and the last query's softmax.
struct AttentionTrace {
  std::vector<float> head_sums;   // [kv_heads][held], summed over layers, queries and q-heads
  std::vector<float> last_query;  // [q_heads][held], the last query's softmax averaged over layers
};

class Forward {
 public:
  explicit Forward(const Model& m) : m_(m), c_(m.config()) {
    const std::int32_t hd = c_.head_dim();
    inv_freq_.resize(std::size_t(hd / 2));
    for (std::int32_t i = 0; i < hd / 2; ++i)
      inv_freq_[std::size_t(i)] = 1.0 / std::pow(double(c_.rope_theta), double(2 * i) / double(hd));
  }

  // Runs tokens at positions first_pos.. and writes logits [n][vocab] (only
  // the last row when last_only). The store already has room for the chunk.
  template <class Store>
  void run(Store& kv, std::span<const std::int32_t> tokens, std::int64_t first_pos, std::vector<float>& logits,
           bool last_only, AttentionTrace* trace = nullptr) {
    const auto n = std::int32_t(tokens.size());
    const std::int32_t d = c_.dim, hd = c_.head_dim(), kvd = c_.kv_heads * hd, h = c_.hidden;
    if (trace) {
      trace->head_sums.clear();
      trace->last_query.clear();
    }
    x_.assign(std::size_t(n * d), 0.0f);
    for (std::int32_t i = 0; i < n; ++i)
      std::copy_n(m_.embedding(tokens[std::size_t(i)]), d, x_.begin() + std::ptrdiff_t(i) * d);
    for (std::int32_t l = 0; l < c_.layers; ++l) {
      const LayerWeights& w = m_.layer(l);
      rmsnorm(x_, w.attn_norm, n, hn_);
      matmul(hn_, n, d, w.wq, d, q_);
      matmul(hn_, n, d, w.wk, kvd, k_);
      matmul(hn_, n, d, w.wv, kvd, v_);
      for (std::int32_t i = 0; i < n; ++i) {
        for (std::int32_t j = 0; j < c_.q_heads; ++j) rope(&q_[std::size_t(i * d + j * hd)], first_pos + i);
        for (std::int32_t j = 0; j < c_.kv_heads; ++j) rope(&k_[std::size_t(i * kvd + j * hd)], first_pos + i);
      }
      kv.write(l, k_.data(), v_.data(), n);
      attention(kv, l, n, first_pos, trace);
      matmul(att_, n, d, w.wo, d, tmp_);
      for (std::size_t i = 0; i < x_.size(); ++i) x_[i] += tmp_[i];
      rmsnorm(x_, w.mlp_norm, n, hn_);
      matmul(hn_, n, d, w.w_gate, h, gate_);
      matmul(hn_, n, d, w.w_up, h, up_);
      for (std::size_t i = 0; i < gate_.size(); ++i) gate_[i] = gate_[i] / (1.0f + std::exp(-gate_[i])) * up_[i];
      matmul(gate_, n, h, w.w_down, d, tmp_);
      for (std::size_t i = 0; i < x_.size(); ++i) x_[i] += tmp_[i];
    }
    const std::int32_t from = last_only ? n - 1 : 0;
    std::vector<float> last(x_.begin() + std::ptrdiff_t(from) * d, x_.end());
    rmsnorm(last, m_.final_norm(), n - from, hn_);
    matmul(hn_, n - from, d, m_.output(), c_.vocab, logits);
  }

 private:
  template <class Store>
  void attention(Store& kv, std::int32_t l, std::int32_t n, std::int64_t first_pos, AttentionTrace* trace) {
    const std::int32_t d = c_.dim, hd = c_.head_dim(), rep = c_.q_heads / c_.kv_heads;
    const float scale = 1.0f / std::sqrt(float(hd));
    att_.assign(std::size_t(n * d), 0.0f);
    for (std::int32_t g = 0; g < c_.kv_heads; ++g) {
      const HeldKv held = kv.read(l, g);
      if (trace) {  // zero-filled on the first layer; the held count is the same in every layer
        trace->head_sums.resize(std::size_t(c_.kv_heads * held.count), 0.0f);
        trace->last_query.resize(std::size_t(c_.q_heads * held.count), 0.0f);
      }
      p_.resize(std::size_t(held.count));
      for (std::int32_t j = g * rep; j < (g + 1) * rep; ++j)
        for (std::int32_t i = 0; i < n; ++i) {
          const float* q = &q_[std::size_t(i * d + j * hd)];
          const std::int64_t qpos = first_pos + i;
          float mx = -INFINITY;
          for (std::int32_t t = 0; t < held.count; ++t) {
            if (held.pos[t] > qpos) {  // causal, by position
              p_[std::size_t(t)] = -INFINITY;
              continue;
            }
            const float* k = held.k + std::size_t(t) * std::size_t(held.row_stride);
            float s = 0.0f;
            for (std::int32_t e = 0; e < hd; ++e) s += q[e] * k[e];
            p_[std::size_t(t)] = s * scale;
            mx = std::max(mx, p_[std::size_t(t)]);
          }
          float sum = 0.0f;
          for (auto& e : p_) sum += (e = std::exp(e - mx));
          float* out = &att_[std::size_t(i * d + j * hd)];
          for (std::int32_t t = 0; t < held.count; ++t) {
            const float a = p_[std::size_t(t)] / sum;
            if (a == 0.0f) continue;
            const float* v = held.v + std::size_t(t) * std::size_t(held.row_stride);
            for (std::int32_t e = 0; e < hd; ++e) out[e] += a * v[e];
            if (trace) {
              trace->head_sums[std::size_t(g * held.count + t)] += a;
              if (i == n - 1) trace->last_query[std::size_t(j * held.count + t)] += a / float(c_.layers);
            }
          }
        }
    }
  }

  void rope(float* x, std::int64_t pos) const {  // NeoX pairing: i with i + hd/2
    const std::int32_t half = c_.head_dim() / 2;
    for (std::int32_t i = 0; i < half; ++i) {
      const double ang = double(pos) * inv_freq_[std::size_t(i)];
      const float cs = float(std::cos(ang)), sn = float(std::sin(ang));
      const float a = x[i], b = x[i + half];
      x[i] = a * cs - b * sn;
      x[i + half] = a * sn + b * cs;
    }
  }
  void rmsnorm(const std::vector<float>& in, const float* w, std::int32_t n, std::vector<float>& out) const {
    const std::int32_t d = c_.dim;
    out.resize(std::size_t(n * d));
    for (std::int32_t i = 0; i < n; ++i) {
      float ss = 0.0f;
      for (std::int32_t e = 0; e < d; ++e) ss += in[std::size_t(i * d + e)] * in[std::size_t(i * d + e)];
      const float r = 1.0f / std::sqrt(ss / float(d) + c_.norm_eps);
      for (std::int32_t e = 0; e < d; ++e) out[std::size_t(i * d + e)] = in[std::size_t(i * d + e)] * r * w[e];
    }
  }
  // y[n][out] = x[n][in] . W[out][in]^T
  static void matmul(const std::vector<float>& x, std::int32_t n, std::int32_t in, const float* w, std::int32_t out,
                     std::vector<float>& y) {
    y.resize(std::size_t(n) * std::size_t(out));
    for (std::int32_t i = 0; i < n; ++i)
      for (std::int32_t o = 0; o < out; ++o) {
        const float* a = &x[std::size_t(i) * std::size_t(in)];
        const float* b = w + std::size_t(o) * std::size_t(in);
        float s = 0.0f;
        for (std::int32_t e = 0; e < in; ++e) s += a[e] * b[e];
        y[std::size_t(i) * std::size_t(out) + std::size_t(o)] = s;
      }
  }

  const Model& m_;
  ModelConfig c_;
  std::vector<double> inv_freq_;
  std::vector<float> x_, hn_, q_, k_, v_, att_, tmp_, gate_, up_, p_;
};

}  // namespace engine
