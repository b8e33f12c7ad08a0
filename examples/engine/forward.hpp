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
//   pre_rope(layer, k, n)        optional: the chunk's keys before RoPE (a write gate reads them)
//   select(layer, q, n)          optional: the chunk's queries [n][q_heads][head_dim], post-RoPE, before
//                                the layer's reads (page selection picks what read() returns)
//   attend(layer, head, t, a)    optional: query weight a > 0 on held token t of a kv-head (any query, q-head)
//   attended(layer)              optional: the layer's attention is done (a store feeds its scores on)
struct HeldKv {
  const float* k = nullptr;  // [count][row_stride], the head's row at offset 0
  const float* v = nullptr;
  const std::int64_t* pos = nullptr;  // [count] token positions
  std::int32_t count = 0, row_stride = 0;
  // Write-Gated KV: a key farther than `window` behind the query is read
  // only if admitted (the gate's rule; null: every key is).
  const std::uint8_t* admitted = nullptr;
  std::int64_t window = 0;
  // Page selection (Quest): only keys with selected[t] != 0 are read (null: every key is).
  const std::uint8_t* selected = nullptr;
};

// Per-step attention the engine hands to eviction policies: for each kv-head,
// the attention of the chunk's queries (summed over them and over the q-heads
// reading that kv-head) to each held token, and the last query's softmax.
struct AttentionTrace {
  std::vector<float> head_sums;   // [kv_heads][held], summed over layers, queries and q-heads
  std::vector<float> last_query;  // [q_heads][held], the last query's softmax averaged over layers
  // The same per layer, as the papers choose: H2O, SnapKV and average
  // attention per (layer, kv-head), TOVA per layer.
  std::vector<float> layer_head_sums;   // [layers][kv_heads][held], summed over queries and q-heads
  std::vector<float> layer_last_query;  // [layers][q_heads][held], the last query's softmax
  // Per layer, summed over kv-heads, q-heads and queries: a block policy's
  // scores when every layer is its own stream. Layers may then hold
  // different tokens, and only these are filled (`ragged`).
  std::vector<std::vector<float>> layer_sums;  // [layers][held in that layer]
  bool ragged = false;
};

// -log softmax(logits)[target] over `vocab` logits, in double.
inline double token_nll(const float* logits, std::int32_t vocab, std::int32_t target) {
  const float mx = *std::max_element(logits, logits + vocab);
  double z = 0.0;
  for (std::int32_t v = 0; v < vocab; ++v) z += std::exp(double(logits[v] - mx));
  return std::log(z) + mx - logits[target];
}

class Forward {
 public:
  explicit Forward(const Model& m) : m_(m), c_(m.config()) {
    const std::int32_t d = c_.dim, kvd = c_.kv_heads * c_.head_dim(), h = c_.hidden;
    for (std::int32_t l = 0; l < c_.layers; ++l) {
      const LayerWeights& w = m_.layer(l);
      layers_.push_back({transpose(w.wq, d, d), transpose(w.wk, kvd, d), transpose(w.wv, kvd, d),
                         transpose(w.wo, d, d), transpose(w.w_gate, h, d), transpose(w.w_up, h, d),
                         transpose(w.w_down, d, h)});
    }
    out_t_ = transpose(m_.output(), c_.vocab, d);
    const std::int32_t hd = c_.head_dim();
    inv_freq_.resize(std::size_t(hd / 2));
    for (std::int32_t i = 0; i < hd / 2; ++i)
      inv_freq_[std::size_t(i)] = 1.0 / std::pow(double(c_.rope_theta), double(2 * i) / double(hd));
  }

  // Runs tokens at positions first_pos.. and writes logits [n][vocab] (only
  // the last row when last_only). The store already has room for the chunk.
  // The trace's attention sums cover the last `observe_last` queries (0: all).
  template <class Store>
  void run(Store& kv, std::span<const std::int32_t> tokens, std::int64_t first_pos, std::vector<float>& logits,
           bool last_only, AttentionTrace* trace = nullptr, std::int32_t observe_last = 0) {
    const auto n = std::int32_t(tokens.size());
    const std::int32_t d = c_.dim, hd = c_.head_dim(), kvd = c_.kv_heads * hd, h = c_.hidden;
    if (trace) {
      trace->head_sums.clear();
      trace->last_query.clear();
      trace->layer_head_sums.clear();
      trace->layer_last_query.clear();
      trace->layer_sums.assign(std::size_t(c_.layers), {});
    }
    x_.assign(std::size_t(n * d), 0.0f);
    for (std::int32_t i = 0; i < n; ++i)
      std::copy_n(m_.embedding(tokens[std::size_t(i)]), d, x_.begin() + std::ptrdiff_t(i) * d);
    for (std::int32_t l = 0; l < c_.layers; ++l) {
      const LayerWeights& w = m_.layer(l);
      const Transposed& t = layers_[std::size_t(l)];
      rmsnorm(x_, w.attn_norm, n, hn_);
      matmul(hn_, n, d, t.wq, d, q_);
      matmul(hn_, n, d, t.wk, kvd, k_);
      matmul(hn_, n, d, t.wv, kvd, v_);
      if constexpr (requires { kv.pre_rope(l, k_.data(), n); }) kv.pre_rope(l, k_.data(), n);
      for (std::int32_t i = 0; i < n; ++i) {
        for (std::int32_t j = 0; j < c_.q_heads; ++j) rope(&q_[std::size_t(i * d + j * hd)], first_pos + i);
        for (std::int32_t j = 0; j < c_.kv_heads; ++j) rope(&k_[std::size_t(i * kvd + j * hd)], first_pos + i);
      }
      kv.write(l, k_.data(), v_.data(), n);
      if constexpr (requires { kv.select(l, q_.data(), n); }) kv.select(l, q_.data(), n);
      attention(kv, l, n, first_pos, trace, observe_last > 0 ? std::max(0, n - observe_last) : 0);
      if constexpr (requires { kv.attended(l); }) kv.attended(l);
      matmul(att_, n, d, t.wo, d, tmp_);
      for (std::size_t i = 0; i < x_.size(); ++i) x_[i] += tmp_[i];
      rmsnorm(x_, w.mlp_norm, n, hn_);
      matmul(hn_, n, d, t.w_gate, h, gate_);
      matmul(hn_, n, d, t.w_up, h, up_);
      for (std::size_t i = 0; i < gate_.size(); ++i) gate_[i] = gate_[i] / (1.0f + std::exp(-gate_[i])) * up_[i];
      matmul(gate_, n, h, t.w_down, d, tmp_);
      for (std::size_t i = 0; i < x_.size(); ++i) x_[i] += tmp_[i];
    }
    const std::int32_t from = last_only ? n - 1 : 0;
    std::vector<float> last(x_.begin() + std::ptrdiff_t(from) * d, x_.end());
    rmsnorm(last, m_.final_norm(), n - from, hn_);
    matmul(hn_, n - from, d, out_t_, c_.vocab, logits);
  }

  // Layer 0's key of kv-head h for `token` at `pos`: it depends on nothing
  // else (no attention comes before it), so a test can check where a
  // compaction left every layer-0 key.
  std::vector<float> layer0_key(std::int32_t token, std::int64_t pos, std::int32_t h) {
    const std::int32_t d = c_.dim, hd = c_.head_dim(), kvd = c_.kv_heads * hd;
    x_.assign(m_.embedding(token), m_.embedding(token) + d);
    rmsnorm(x_, m_.layer(0).attn_norm, 1, hn_);
    matmul(hn_, 1, d, layers_[0].wk, kvd, k_);
    rope(&k_[std::size_t(h * hd)], pos);
    return {k_.begin() + std::ptrdiff_t(h) * hd, k_.begin() + std::ptrdiff_t(h + 1) * hd};
  }

 private:
  template <class Store>
  // The trace's sums take the queries from `observed` on (SnapKV's window).
  void attention(Store& kv, std::int32_t l, std::int32_t n, std::int64_t first_pos, AttentionTrace* trace,
                 std::int32_t observed) {
    const std::int32_t d = c_.dim, hd = c_.head_dim(), rep = c_.q_heads / c_.kv_heads;
    const float scale = 1.0f / std::sqrt(float(hd));
    att_.assign(std::size_t(n * d), 0.0f);
    for (std::int32_t g = 0; g < c_.kv_heads; ++g) {
      const HeldKv held = kv.read(l, g);
      if (trace) trace->layer_sums[std::size_t(l)].resize(std::size_t(held.count), 0.0f);
      if (trace && !trace->ragged) {  // zero-filled on the first layer; the held count is the same in every layer
        trace->head_sums.resize(std::size_t(c_.kv_heads * held.count), 0.0f);
        trace->last_query.resize(std::size_t(c_.q_heads * held.count), 0.0f);
        trace->layer_head_sums.resize(std::size_t(c_.layers * c_.kv_heads * held.count), 0.0f);
        trace->layer_last_query.resize(std::size_t(c_.layers * c_.q_heads * held.count), 0.0f);
      }
      p_.resize(std::size_t(held.count));
      for (std::int32_t j = g * rep; j < (g + 1) * rep; ++j)
        for (std::int32_t i = 0; i < n; ++i) {
          const float* q = &q_[std::size_t(i * d + j * hd)];
          const std::int64_t qpos = first_pos + i;
          float mx = -INFINITY;
          for (std::int32_t t = 0; t < held.count; ++t) {
            if (held.pos[t] > qpos || (held.admitted && !held.admitted[t] && qpos - held.pos[t] >= held.window) ||
                (held.selected && !held.selected[t])) {
              // causal, by position; a gated key outside the local window; a page the selection left out
              p_[std::size_t(t)] = -INFINITY;
              continue;
            }
            p_[std::size_t(t)] = dot(q, held.k + std::size_t(t) * std::size_t(held.row_stride), hd) * scale;
            mx = std::max(mx, p_[std::size_t(t)]);
          }
          float sum = 0.0f;
          for (auto& e : p_) sum += (e = std::exp(e - mx));
          float* out = &att_[std::size_t(i * d + j * hd)];
          for (std::int32_t t = 0; t < held.count; ++t) {
            const float a = p_[std::size_t(t)] / sum;
            if (a == 0.0f) continue;
            if constexpr (requires { kv.attend(l, g, t, a); }) kv.attend(l, g, t, a);
            const float* v = held.v + std::size_t(t) * std::size_t(held.row_stride);
            for (std::int32_t e = 0; e < hd; ++e) out[e] += a * v[e];
            if (trace && i >= observed) trace->layer_sums[std::size_t(l)][std::size_t(t)] += a;
            if (trace && i >= observed && !trace->ragged) {
              trace->head_sums[std::size_t(g * held.count + t)] += a;
              trace->layer_head_sums[std::size_t((l * c_.kv_heads + g) * held.count + t)] += a;
              if (i == n - 1) {
                trace->last_query[std::size_t(j * held.count + t)] += a / float(c_.layers);
                trace->layer_last_query[std::size_t((l * c_.q_heads + j) * held.count + t)] = a;
              }
            }
          }
        }
    }
  }

  // Eight running sums, so the compiler can vectorize the dot product
  // without reordering a sum it was asked to keep in order.
  static float dot(const float* a, const float* b, std::int32_t n) {
    float acc[8] = {};
    std::int32_t e = 0;
    for (; e + 8 <= n; e += 8)
      for (std::int32_t j = 0; j < 8; ++j) acc[j] += a[e + j] * b[e + j];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; e < n; ++e) s += a[e] * b[e];
    return s;
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
  // y[n][out] = x[n][in] . W[out][in]^T, from W stored transposed
  // ([in][out]): the inner loop runs over outputs, contiguous and without a
  // reduction, so the compiler vectorizes it without reordering any sum.
  static void matmul(const std::vector<float>& x, std::int32_t n, std::int32_t in, const std::vector<float>& wt,
                     std::int32_t out, std::vector<float>& y) {
    y.assign(std::size_t(n) * std::size_t(out), 0.0f);
    for (std::int32_t i = 0; i < n; ++i) {
      float* yi = &y[std::size_t(i) * std::size_t(out)];
      for (std::int32_t e = 0; e < in; ++e) {
        const float a = x[std::size_t(i) * std::size_t(in) + std::size_t(e)];
        const float* w = &wt[std::size_t(e) * std::size_t(out)];
        for (std::int32_t o = 0; o < out; ++o) yi[o] += a * w[o];
      }
    }
  }
  static std::vector<float> transpose(const float* w, std::int32_t out, std::int32_t in) {
    std::vector<float> t(std::size_t(out) * std::size_t(in));
    for (std::int32_t o = 0; o < out; ++o)
      for (std::int32_t e = 0; e < in; ++e) t[std::size_t(e) * std::size_t(out) + std::size_t(o)] = w[std::size_t(o) * std::size_t(in) + std::size_t(e)];
    return t;
  }
  struct Transposed {
    std::vector<float> wq, wk, wv, wo, w_gate, w_up, w_down;  // [in][out]
  };

  const Model& m_;
  ModelConfig c_;
  std::vector<Transposed> layers_;
  std::vector<float> out_t_;  // the output projection, [dim][vocab]
  std::vector<double> inv_freq_;
  std::vector<float> x_, hn_, q_, k_, v_, att_, tmp_, gate_, up_, p_;
};

}  // namespace engine
