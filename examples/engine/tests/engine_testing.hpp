// What the example engine's tests share: the model folder, its held-out
// text, and request builders.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "engine.hpp"

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
