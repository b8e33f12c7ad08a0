// EngineConfig::kv_scales, checked against the pool's format and the model
// once, when a backend is built, and then read by the stores: PagedKv hands
// a layer's row of scales to scatter and gather (the kernels index them by
// cache layer and kv-head); GatedKv, whose pool is single-head, passes each
// (layer, kv-head)'s scale as the call's k_scale / v_scale.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <kvcache/core/kv_format.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine_types.hpp"
#include "model.hpp"

namespace engine {

class HeldScales {
 public:
  HeldScales() = default;  // none: every scale is 1

  // Throws std::invalid_argument naming the side, the count or the value
  // when a side's scales do not fit its format ([layers] for tensor,
  // [layers][kv_heads] for head, none otherwise) or one is not positive
  // and finite.
  HeldScales(const KvScales& s, const kvcache::KvFormat& f, const ModelConfig& c) {
    const std::array<const std::vector<float>*, 2> given{&s.k, &s.v};
    const std::array<kvcache::Scales, 2> schemes{f.k.scales, f.v.scales};
    for (std::size_t kv = 0; kv < 2; ++kv) {
      const std::string side = kv == 0 ? "kv_scales.k" : "kv_scales.v";
      const std::vector<float>& v = *given[kv];
      if (v.empty()) continue;
      const bool tensor = schemes[kv] == kvcache::Scales::tensor, head = schemes[kv] == kvcache::Scales::head;
      if (!tensor && !head)
        throw std::invalid_argument(side + ": " + std::to_string(v.size()) +
                                    " scales given, but the format's side holds no engine-held scales (tensor or head)");
      const std::size_t want = std::size_t(c.layers) * std::size_t(tensor ? 1 : c.kv_heads);
      if (v.size() != want)
        throw std::invalid_argument(side + ": " + std::to_string(v.size()) + " scales, the format needs " +
                                    std::to_string(want) + (tensor ? " (one per layer)" : " (layers x kv_heads)"));
      for (std::size_t i = 0; i < v.size(); ++i)
        if (!(std::isfinite(v[i]) && v[i] > 0.0f))
          throw std::invalid_argument(side + "[" + std::to_string(i) + "] = " + std::to_string(v[i]) +
                                      ": not positive and finite");
      scales_[kv] = v;
      per_layer_[kv] = tensor ? 1 : c.kv_heads;
    }
  }

  bool empty() const { return scales_[0].empty() && scales_[1].empty(); }

  // The array a scatter or gather of model layer `layer` takes when the
  // layer is cache layer `pool_layer` (a single-layer pool of per-layer
  // streams: 0): the kernels index it by cache layer. Null: none.
  const float* array(std::int32_t kv, std::int32_t layer, std::int32_t pool_layer) const {
    const auto& s = scales_[std::size_t(kv)];
    return s.empty() ? nullptr : s.data() + std::ptrdiff_t(layer - pool_layer) * per_layer_[std::size_t(kv)];
  }

  // The scale of (layer, kv-head) of K (kv = 0) or V: 1 when none is held.
  float at(std::int32_t kv, std::int32_t layer, std::int32_t head) const {
    const auto& s = scales_[std::size_t(kv)];
    if (s.empty()) return 1.0f;
    const std::int32_t per = per_layer_[std::size_t(kv)];
    return s[std::size_t(layer * per + (per == 1 ? 0 : head))];
  }

 private:
  std::array<std::vector<float>, 2> scales_;
  std::array<std::int32_t, 2> per_layer_{};  // scales per layer: 1 (tensor) or kv_heads (head)
};

}  // namespace engine
