// The example engine's model: a llama-style decoder (RMSNorm, NeoX RoPE,
// grouped-query attention, SwiGLU): the byte-level tiny model whose weights
// train/train.py writes, which this file loads, or a pretrained Llama from a
// GGUF file (gguf.hpp). forward.hpp runs them.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace engine {

struct ModelConfig {
  std::int32_t vocab = 0, dim = 0, layers = 0, q_heads = 0, kv_heads = 0, hidden = 0, context = 0;
  float rope_theta = 0.0f, norm_eps = 0.0f;
  std::int32_t head_dim() const { return dim / q_heads; }
};

struct LayerWeights {
  const float *attn_norm, *wq, *wk, *wv, *wo, *mlp_norm, *w_gate, *w_up, *w_down;  // [out][in], row-major
};

class Model {
 public:
  // Throws std::runtime_error naming what is wrong with the file.
  explicit Model(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw std::runtime_error("cannot open weights " + path);
    std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    constexpr std::size_t kHeader = 4 + 8 * 4 + 2 * 4;
    if (bytes.size() < kHeader || std::memcmp(bytes.data(), "KVCM", 4) != 0)
      throw std::runtime_error(path + ": not a kvcache example model (magic)");
    std::uint32_t u[8];
    std::memcpy(u, bytes.data() + 4, sizeof u);
    if (u[0] != 1) throw std::runtime_error(path + ": format version " + std::to_string(u[0]) + ", expected 1");
    c_ = {std::int32_t(u[1]),
          std::int32_t(u[2]),
          std::int32_t(u[3]),
          std::int32_t(u[4]),
          std::int32_t(u[5]),
          std::int32_t(u[6]),
          std::int32_t(u[7]),
          0.0f,
          0.0f};
    std::memcpy(&c_.rope_theta, bytes.data() + 36, 4);
    std::memcpy(&c_.norm_eps, bytes.data() + 40, 4);
    if (c_.dim <= 0 || c_.q_heads <= 0 || c_.kv_heads <= 0 || c_.dim % c_.q_heads || c_.q_heads % c_.kv_heads)
      throw std::runtime_error(path + ": inconsistent shape");
    const std::size_t floats = (bytes.size() - kHeader) / 4;
    if (floats != expected_floats() || (bytes.size() - kHeader) % 4)
      throw std::runtime_error(path + ": " + std::to_string(floats) + " floats, the header implies " +
                               std::to_string(expected_floats()));
    data_.resize(floats);
    std::memcpy(data_.data(), bytes.data() + kHeader, floats * 4);
    bind();
  }

  // Weights already in this layout (gguf.hpp): embed [vocab][dim]; per layer attn_norm, wq, wk, wv, wo,
  // mlp_norm, w_gate, w_up, w_down ([out][in]); final norm; out [vocab][dim].
  Model(const ModelConfig& c, std::vector<float> data, const std::string& path) : c_(c), data_(std::move(data)) {
    if (data_.size() != expected_floats())
      throw std::runtime_error(path + ": " + std::to_string(data_.size()) + " floats, the shape implies " +
                               std::to_string(expected_floats()));
    bind();
  }

  // The weight pointers point into data_: a move keeps them (the buffer moves), a copy would not.
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;
  Model(Model&&) = default;
  Model& operator=(Model&&) = default;

  const ModelConfig& config() const { return c_; }
  const float* embedding(std::int32_t token) const { return embed_ + std::size_t(token) * std::size_t(c_.dim); }
  const LayerWeights& layer(std::int32_t l) const { return layers_[std::size_t(l)]; }
  const float* final_norm() const { return norm_; }
  const float* output() const { return out_; }

 private:
  void bind() {
    const float* p = data_.data();
    auto take = [&](std::size_t n) {
      const float* t = p;
      p += n;
      return t;
    };
    const std::size_t d = std::size_t(c_.dim), kv = std::size_t(c_.kv_heads * c_.head_dim()),
                      h = std::size_t(c_.hidden);
    embed_ = take(std::size_t(c_.vocab) * d);
    for (std::int32_t l = 0; l < c_.layers; ++l)
      layers_.push_back({take(d), take(d * d), take(kv * d), take(kv * d), take(d * d), take(d), take(h * d),
                         take(h * d), take(d * h)});
    norm_ = take(d);
    out_ = take(std::size_t(c_.vocab) * d);
  }
  std::size_t expected_floats() const {
    const std::size_t d = std::size_t(c_.dim), kv = std::size_t(c_.kv_heads) * std::size_t(c_.head_dim()),
                      h = std::size_t(c_.hidden);
    return 2 * std::size_t(c_.vocab) * d + d + std::size_t(c_.layers) * (2 * d + 2 * d * d + 2 * kv * d + 3 * h * d);
  }
  ModelConfig c_;
  std::vector<float> data_;
  const float *embed_ = nullptr, *norm_ = nullptr, *out_ = nullptr;
  std::vector<LayerWeights> layers_;
};

}  // namespace engine
