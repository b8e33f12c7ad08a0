// Every eviction policy of the library, by name, sized to a token budget.
#pragma once

#include <algorithm>
#include <kvcache/kvcache.hpp>
#include <string>
#include <vector>

#include "engine.hpp"
#include "model.hpp"

namespace engine {

// Policies run as published: H2O, SnapKV and average attention choose per
// (layer, kv-head), TOVA per layer, and block_scores (OpenVINO's) per layer,
// with one stream per (request, layer). The `_summed` variants are the
// engine's first, aggregated ones (scores summed over layers: one choice per
// kv-head, or one for the request), kept so both appear in the tables.
inline const std::vector<std::string>& policy_names() {
  static const std::vector<std::string> names{
      "keep_all",          "sliding_window",          "sink_window", "block_scores", "block_scores_summed",
      "h2o",               "h2o_summed",              "tova",        "tova_summed",  "snapkv",
      "snapkv_summed",     "average_attention",       "average_attention_summed"};
  return names;
}

// Calls f(policy, adjust) with the named policy holding about `budget` tokens
// per request; adjust(EngineConfig&) applies what the policy needs from the
// engine. B is the engine's block size (the block policies' unit). Returns
// false for an unknown name.
template <class F>
bool with_policy(const std::string& name, std::int32_t budget, const ModelConfig& c, F&& f, std::int32_t B = 16) {
  auto plain = [](EngineConfig&) {};
  auto grouped = [](Grouping g) { return [g](EngineConfig& e) { e.grouping = g; }; };
  const std::int32_t layer_heads = c.layers * c.kv_heads;
  if (name == "keep_all") return f(kvcache::KeepAll{}, plain), true;
  if (name == "sliding_window") return f(kvcache::SlidingWindow(budget), plain), true;
  if (name == "sink_window")
    return f(kvcache::SinkWindowEviction({.sinks = 4, .window = budget - 2 * B}), plain), true;
  if (name == "block_scores" || name == "block_scores_summed") {
    // A 64-token recent area, smaller when the budget leaves no evictable block.
    const std::int32_t recent = std::max(B, std::min(4 * B, (budget - 3 * B) / B * B));
    const bool per_layer = name == "block_scores";
    return f(kvcache::BlockScoreEviction({.start = B, .recent = recent, .max = budget - B}),
             [per_layer](EngineConfig& e) { e.layer_streams = per_layer; }),
           true;
  }
  if (name == "h2o" || name == "h2o_summed") {  // half heavy hitters, half recent: the H2O paper's split
    const bool summed = name == "h2o_summed";
    return f(kvcache::H2OEviction({.heavy = budget / 2,
                                   .recent = budget - budget / 2,
                                   .groups = summed ? c.kv_heads : layer_heads}),
             grouped(summed ? Grouping::heads : Grouping::layer_heads)),
           true;
  }
  if (name == "tova" || name == "tova_summed") {
    const bool summed = name == "tova_summed";
    return f(kvcache::TovaEviction({.budget = budget, .groups = summed ? 1 : c.layers}),
             grouped(summed ? Grouping::all : Grouping::layers)),
           true;
  }
  if (name == "snapkv" || name == "snapkv_summed") {  // one-shot after the prompt: no eviction between prefill chunks
    const Grouping g = name == "snapkv" ? Grouping::layer_heads : Grouping::heads;
    return f(kvcache::SnapKVEviction({.capacity = budget - 32,
                                      .window = 32,
                                      .kernel = 7,
                                      .groups = g == Grouping::heads ? c.kv_heads : layer_heads}),
             [g](EngineConfig& e) {
               e.evict_in_prefill = false;
               e.grouping = g;
               e.observe_window = g == Grouping::layer_heads ? 32 : 0;  // the paper's window: the prompt's last queries
             }),
           true;
  }
  if (name == "average_attention" || name == "average_attention_summed") {
    const bool summed = name == "average_attention_summed";
    return f(kvcache::AverageAttentionEviction({.budget = budget, .step = 32, .groups = summed ? 1 : layer_heads}),
             grouped(summed ? Grouping::all : Grouping::layer_heads)),
           true;
  }
  return false;
}

}  // namespace engine
