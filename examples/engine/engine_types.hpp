// What a driver hands the engine and reads back: requests, the engine's
// configuration (pool, chunking, admission, how policies see the model) and
// its running statistics.
#pragma once

#include <concepts>
#include <cstdint>
#include <kvcache/kvcache.hpp>
#include <span>
#include <vector>

namespace engine {

struct Request {
  std::int32_t id = 0, priority = 0;  // a larger priority is preempted last
  std::vector<std::int32_t> prompt;
  std::int32_t max_new = 0;
  // Progress.
  std::vector<std::int32_t> output;
  std::int32_t fed = 0;  // tokens of prompt + output already in the cache
  bool running = false, done = false;
  std::vector<kvcache::SeqId> seqs;  // its streams: one, or one per layer (EngineConfig::layer_streams)
  std::int64_t peak_kv = 0, need_blocks = 0;
  std::vector<float> last_logits;
  std::vector<float> logits;  // EngineConfig::keep_logits: each output token's logits, [output][vocab]
};

// How a token policy's groups map onto the model: one choice for the whole
// sequence (scores reduced over layers and heads), one per kv-head (scores
// summed over layers: this engine's first, aggregated variants), one per
// layer (TOVA's paper), or one per (layer, kv-head) (H2O's and SnapKV's).
enum class Grouping { all, heads, layers, layer_heads };

// Engine-held scales of a quantized pool whose format takes them
// (kvcache::Scales::tensor: one per model layer; Scales::head: one per
// (layer, kv-head), [layers][kv_heads]), for K and V; cache = x / scale.
// Empty: every scale is 1. They come from the checkpoint or from a
// calibration pass (calibrate.hpp); kv_scales.hpp checks them.
struct KvScales {
  std::vector<float> k, v;
};

struct EngineConfig {
  std::int32_t max_kv_tokens = 4096;  // the pool: max_kv_tokens / block_size blocks
  std::int32_t block_size = 16;
  std::int32_t chunk = 64;       // prefill chunk
  std::int32_t max_batch = 8;    // running requests at most
  bool evict_in_prefill = true;  // run eviction after every prefill chunk (not for SnapKV)
  // Admission by the cache's accounting: `lifetime` admits a request only if
  // the pool covers blocks_needed for its whole life (no preemption can
  // happen); `optimistic` admits when its prefill peak fits now, as vLLM
  // does, and preempts the lowest-priority request when decoding runs out.
  bool optimistic = false;
  Grouping grouping = Grouping::heads;  // token policies: what their groups are (policies.hpp sets it)
  // SnapKV's observation window: the scores after the prompt sum the
  // attention of its last `observe_window` queries only, and the prompt's
  // last chunk is cut to hold them all (0: every query of the chunk).
  std::int32_t observe_window = 0;
  // One stream per (request, layer) in a single-layer pool of the same bytes,
  // so a block policy chooses per layer, as OpenVINO's does; scores come from
  // each layer's own attention. Not for token policies (they compact a
  // request's layers together; their groups choose per layer instead).
  bool layer_streams = false;
  // Page selection, when the engine's Selection is QuestSelection: its config
  // (the engine supplies the bounds store). score() then feeds the tokens after
  // the prompt one at a time, so teacher-forced queries are decode queries.
  kvcache::QuestConfig quest{};
  // Keep the logits every output token was chosen from (Request::logits), for
  // a driver that compares engines (kvcache_serve).
  bool keep_logits = false;
  // How the pool stores K and V (kvcache/core/kv_format.hpp): f32 by default, so
  // the paged engine matches the contiguous reference token for token; a
  // quantized dtype and format make scatter quantize and gather dequantize,
  // and attention reads what the pool gives back.
  kvcache::DType kv_dtype = kvcache::DType::f32;
  kvcache::KvFormat kv_format{};
  KvScales kv_scales{};  // the format's engine-held scales (empty: 1)
};

// Keys the decode queries read, per (query, layer, kv-head), against the dense read.
struct KeyCounts {
  std::int64_t read = 0, dense = 0, reads = 0;  // reads: (decode query, layer, kv-head) triples
  std::int64_t sparse_read = 0, sparse_reads = 0;  // the same in the layers page selection serves
};

struct EngineStats {
  std::int64_t steps = 0, tokens_generated = 0, preemptions = 0, reprefilled = 0, kv_high_water = 0, max_batch = 0;
  std::vector<std::int64_t> kv_over_time;  // tokens held by all requests after each step
  KeyCounts keys;  // what decode queries read (page selection reads fewer than all)
};

// What a cache's constructor takes for its selection (Arg): for a page-bounds
// cache, the engine's QuestConfig over the backend's store `bounds`; else the dense policy.
template <class Arg>
Arg selection_arg(kvcache::QuestConfig q, std::span<float> bounds) {
  if constexpr (std::same_as<Arg, kvcache::QuestConfig>) {
    q.bounds = bounds;
    return q;
  } else {
    (void)q, (void)bounds;
    return {};
  }
}

}  // namespace engine
