// What the example engine's tests share: the model folder, its held-out
// text, and request builders.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "engine.hpp"
#include "kv_store.hpp"

#ifndef ENGINE_MODEL_DIR
#error "ENGINE_MODEL_DIR must name the folder with kjv-tiny.bin"
#endif

namespace engine_testing {

inline std::vector<char> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  REQUIRE(f.good());
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}
inline const std::string kDir = ENGINE_MODEL_DIR;
inline std::vector<std::int32_t> heldout(std::size_t n) {
  const auto bytes = read_file(kDir + "/heldout.bin");
  std::vector<std::int32_t> t;
  for (std::size_t i = 0; i < n; ++i) t.push_back(static_cast<unsigned char>(bytes[i]));
  return t;
}
// A plain buffer holding what a quantized pool gives back: each written row
// of K (side 0) or V of (layer, kv-head) goes through round_trip(side, layer,
// head, row) (quantized and dequantized as the test's pool does) first.
template <class F>
class RoundTripKv {
 public:
  RoundTripKv(const engine::ModelConfig& c, std::int32_t capacity, F round_trip)
      : plain_(c, capacity), heads_(c.kv_heads), hd_(c.head_dim()), round_trip_(std::move(round_trip)) {}
  void write(std::int32_t l, const float* k, const float* v, std::int32_t n) {
    std::vector<float> rows[2] = {{k, k + std::ptrdiff_t(n) * heads_ * hd_}, {v, v + std::ptrdiff_t(n) * heads_ * hd_}};
    for (std::int32_t side = 0; side < 2; ++side)
      for (std::int32_t t = 0; t < n; ++t)
        for (std::int32_t h = 0; h < heads_; ++h) round_trip_(side, l, h, rows[side].data() + std::ptrdiff_t(t * heads_ + h) * hd_);
    plain_.write(l, rows[0].data(), rows[1].data(), n);
  }
  engine::HeldKv read(std::int32_t l, std::int32_t g) const { return plain_.read(l, g); }

 private:
  engine::ContiguousKv plain_;
  std::int32_t heads_, hd_;
  F round_trip_;
};

inline std::int32_t argmax(const float* x, std::int32_t n) { return std::int32_t(std::max_element(x, x + n) - x); }
// `count` requests whose prompts start `stride` bytes apart in `text`, the
// i-th `len + i * grow` long; priorities alternate 0, 1.
inline std::vector<engine::Request> requests(const std::vector<std::int32_t>& text, int count, int stride, int len,
                                             int grow, std::int32_t max_new) {
  std::vector<engine::Request> reqs;
  for (int i = 0; i < count; ++i) {
    engine::Request r;
    r.id = i;
    r.priority = i % 2;
    r.prompt.assign(text.begin() + i * stride, text.begin() + i * stride + len + grow * i);
    r.max_new = max_new;
    reqs.push_back(r);
  }
  return reqs;
}

}  // namespace engine_testing
