// Engine-held scales computed from a first batch, for a checkpoint that
// ships none: the model runs a calibration window through a plain buffer,
// and each (layer, kv-head)'s largest |K| (after RoPE, as the pool stores
// it) and |V| over the window set scale = amax / code_max, so the window's
// largest value meets the code's largest (448 for e4m3). A later value past
// the window's maximum saturates there (the kernels clamp, never overflow).
#pragma once

#include <cmath>
#include <cstdint>
#include <kvcache/kernels/detail/quant.hpp>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine_types.hpp"
#include "forward.hpp"
#include "kv_store.hpp"
#include "model.hpp"

namespace engine {

// A plain buffer that also keeps each (layer, kv-head)'s largest |K| and |V|.
class AmaxKv {
 public:
  AmaxKv(const ModelConfig& c, std::int32_t capacity)
      : plain_(c, capacity), heads_(c.kv_heads), hd_(c.head_dim()),
        amax_{std::vector<float>(std::size_t(c.layers * c.kv_heads)), std::vector<float>(std::size_t(c.layers * c.kv_heads))} {}
  void write(std::int32_t l, const float* k, const float* v, std::int32_t n) {
    for (std::int32_t t = 0; t < n; ++t)
      for (std::int32_t h = 0; h < heads_; ++h)
        for (std::int32_t i = 0; i < hd_; ++i) {
          const std::size_t at = std::size_t((t * heads_ + h) * hd_ + i), cell = std::size_t(l * heads_ + h);
          keep(amax_[0][cell], std::fabs(k[at]));
          keep(amax_[1][cell], std::fabs(v[at]));
        }
    plain_.write(l, k, v, n);
  }
  HeldKv read(std::int32_t l, std::int32_t g) const { return plain_.read(l, g); }
  // [layers][kv_heads] of K (kv = 0) or V; a NaN met stays (the caller refuses it).
  const std::vector<float>& amax(std::int32_t kv) const { return amax_[std::size_t(kv)]; }

 private:
  static void keep(float& m, float a) { m = std::isnan(a) || a > m ? a : m; }  // a NaN sticks
  ContiguousKv plain_;
  std::int32_t heads_, hd_;
  std::vector<float> amax_[2];
};

// The scales `format` holds engine-side for codes of `dtype`, from `window`
// (at most the model's context): [layers][kv_heads] for Scales::head, the
// layer's largest over its heads for Scales::tensor, none for other sides.
// A (layer, head) whose values are all zero gets 1. Throws
// std::invalid_argument for an empty or over-long window, and
// std::runtime_error when the model produced a value that is not finite.
inline KvScales calibrate_kv_scales(const Model& m, std::span<const std::int32_t> window, kvcache::DType dtype,
                                    const kvcache::KvFormat& format) {
  const ModelConfig& c = m.config();
  if (window.empty() || std::int64_t(window.size()) > c.context)
    throw std::invalid_argument("calibration window: " + std::to_string(window.size()) + " tokens, needs 1.." +
                                std::to_string(c.context));
  AmaxKv store(c, std::int32_t(window.size()));
  Forward fwd(m);
  std::vector<float> logits;
  fwd.run(store, window, 0, logits, true);
  const float code_max = kvcache::quant::code_max(dtype, false);
  KvScales out;
  for (std::int32_t kv = 0; kv < 2; ++kv) {
    const kvcache::Scales scheme = kv == 0 ? format.k.scales : format.v.scales;
    if (scheme != kvcache::Scales::tensor && scheme != kvcache::Scales::head) continue;
    const std::vector<float>& amax = store.amax(kv);
    std::vector<float>& s = kv == 0 ? out.k : out.v;
    for (std::int32_t l = 0; l < c.layers; ++l) {
      float layer_max = 0.0f;
      for (std::int32_t h = 0; h < c.kv_heads; ++h) {
        const float a = amax[std::size_t(l * c.kv_heads + h)];
        if (!std::isfinite(a))
          throw std::runtime_error("calibration: layer " + std::to_string(l) + " head " + std::to_string(h) +
                                   (kv == 0 ? " K" : " V") + " is not finite");
        if (scheme == kvcache::Scales::head) s.push_back(a > 0.0f ? a / code_max : 1.0f);
        layer_max = std::fmax(layer_max, a);
      }
      if (scheme == kvcache::Scales::tensor) s.push_back(layer_max > 0.0f ? layer_max / code_max : 1.0f);
    }
  }
  return out;
}

}  // namespace engine
