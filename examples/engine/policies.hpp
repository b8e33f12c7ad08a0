// Every eviction policy of the library, by name, sized to a token budget.
#pragma once

#include <algorithm>
#include <kvcache/kvcache.hpp>
#include <string>
#include <vector>

#include "engine.hpp"
#include "model.hpp"

namespace engine {

inline const std::vector<std::string>& policy_names() {
  static const std::vector<std::string> names{"keep_all", "sliding_window", "sink_window", "block_scores",
                                              "h2o",      "tova",           "snapkv",      "average_attention"};
  return names;
}

// Calls f(policy, adjust) with the named policy holding about `budget` tokens
// per request; adjust(EngineConfig&) applies what the policy needs from the
// engine. Returns false for an unknown name.
template <class F>
bool with_policy(const std::string& name, std::int32_t budget, const ModelConfig& c, F&& f) {
  constexpr std::int32_t B = 16;
  auto plain = [](EngineConfig&) {};
  if (name == "keep_all") return f(kvcache::KeepAll{}, plain), true;
  if (name == "sliding_window") return f(kvcache::SlidingWindow(budget), plain), true;
  if (name == "sink_window")
    return f(kvcache::SinkWindowEviction({.sinks = 4, .window = budget - 2 * B, .block_size = B}), plain), true;
  if (name == "block_scores") {  // a 64-token recent area, smaller when the budget leaves no evictable block
    const std::int32_t recent = std::max(B, std::min(4 * B, (budget - 3 * B) / B * B));
    return f(kvcache::BlockScoreEviction({.start = B, .recent = recent, .max = budget - B, .block_size = B}), plain),
           true;
  }
  if (name == "h2o")  // half heavy hitters, half recent: the H2O paper's split
    return f(kvcache::H2OEviction({.heavy = budget / 2, .recent = budget - budget / 2, .groups = c.kv_heads}), plain),
           true;
  if (name == "tova") return f(kvcache::TovaEviction({.budget = budget}), plain), true;
  if (name == "snapkv")  // one-shot after the prompt: no eviction between prefill chunks
    return f(kvcache::SnapKVEviction({.capacity = budget - 32, .window = 32, .kernel = 7, .groups = c.kv_heads}),
             [](EngineConfig& e) { e.evict_in_prefill = false; }),
           true;
  if (name == "average_attention")
    return f(kvcache::AverageAttentionEviction({.budget = budget, .step = 32}), plain), true;
  return false;
}

}  // namespace engine
