// The KV formats the example engines take by name (kvcache_serve and
// kvcache_engine --kv-format NAME, the Python engine's EngineConfig.kv_format,
// the rows of kvcache_eval --quant): a pool dtype, a KvFormat, and whether
// its engine-held scales come from a calibration pass (else they are 1).
// KIVI's format groups keys per channel over a block, so it names the block
// size too (32, KIVI's group), and the engine keeps each open block in full
// precision (channel_kv.hpp).
#pragma once

#include <algorithm>
#include <kvcache/core/kv_format.hpp>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "calibrate.hpp"
#include "engine_types.hpp"
#include "model.hpp"

namespace engine {

struct NamedKvFormat {
  const char* name;   // what a command line passes
  const char* label;  // what a table prints
  kvcache::DType dtype;
  kvcache::KvFormat format;
  bool calibrated = false;  // per-(layer, kv-head) scales from calibrate_kv_scales
  std::int32_t block_size = 0;  // the pool's block size, for a format whose groups are blocks; 0: the engine's
};

inline const std::vector<NamedKvFormat>& kv_formats() {
  using kvcache::DType, kvcache::Scales;
  static const kvcache::SideFormat tensor{.scales = Scales::tensor}, head{.scales = Scales::head},
      g16{.scales = Scales::group, .group = 16}, g32{.scales = Scales::group, .group = 32},
      g32m{.scales = Scales::group, .group = 32, .minimum = true}, g16m{.scales = Scales::group, .group = 16, .minimum = true},
      channel_m{.scales = Scales::channel, .minimum = true};
  static const std::vector<NamedKvFormat> all{
      {"f32", "f32", DType::f32, {}},
      {"f16", "f16", DType::f16, {}},
      {"fp8_e4m3_tensor", "fp8 e4m3, tensor scale 1", DType::fp8_e4m3, {tensor, tensor}},
      {"fp8_e4m3_head", "fp8 e4m3, per-head scales", DType::fp8_e4m3, {head, head}, true},
      {"int8_g32", "int8, group 32", DType::int8, {g32, g32}},
      {"int4_g32_min", "int4, group 32 + minimum", DType::int4, {g32m, g32m}},
      {"fp4_g16", "fp4 e2m1, group 16", DType::fp4_e2m1, {g16, g16}},
      {"int2_g32_min", "int2, group 32 + minimum", DType::int2, {g32m, g32m}},
      {"int2_g16_min", "int2, group 16 + minimum", DType::int2, {g16m, g16m}},
      {"int2_kivi", "int2 KIVI: K per channel, V group 32 (+ minimum, block 32)", DType::int2, {channel_m, g32m}, false, 32}};
  return all;
}

// The format called `name`; std::invalid_argument naming it and the choices otherwise.
inline const NamedKvFormat& kv_format_named(const std::string& name) {
  std::string names;
  for (const NamedKvFormat& f : kv_formats()) {
    if (name == f.name) return f;
    names += (names.empty() ? "" : ", ") + std::string(f.name);
  }
  throw std::invalid_argument("unknown KV format '" + name + "' (one of: " + names + ")");
}

// The calibration window the drivers use: the text's last `context` tokens
// (the held-out text's, standing in for an engine's first batch).
inline std::span<const std::int32_t> calibration_window(const std::vector<std::int32_t>& text, std::int32_t context) {
  const std::size_t n = std::min(text.size(), std::size_t(context));
  return {text.data() + text.size() - n, n};
}

// cfg with the pool stored in format f: dtype, KvFormat, the format's block
// size if it names one, and, for a calibrated format, scales from
// `calibration` (a window of text).
inline EngineConfig with_kv_format(EngineConfig cfg, const NamedKvFormat& f, const Model& m,
                                   std::span<const std::int32_t> calibration) {
  cfg.kv_dtype = f.dtype, cfg.kv_format = f.format;
  if (f.block_size > 0) cfg.block_size = f.block_size;
  cfg.kv_scales = f.calibrated ? calibrate_kv_scales(m, calibration, f.dtype, f.format) : KvScales{};
  return cfg;
}

}  // namespace engine
