// Compiled by expect.cmake, once per KVCACHE_MODE_*: only "good" may compile.
#include <kvcache/admission/write_gate.hpp>
#include <kvcache/cache.hpp>
#include <kvcache/cache/hybrid.hpp>
#include <kvcache/eviction/block_scores.hpp>
#include <kvcache/eviction/h2o.hpp>
#include <kvcache/eviction/sink_window.hpp>
#include <kvcache/eviction/sliding_window.hpp>
#include <kvcache/selection/quest.hpp>

namespace kv = kvcache;

struct EvictionMissingBound {  // no max_tokens_after_eviction()
  static constexpr kv::Signals required_signals = kv::no_signals;
  std::int64_t max_tokens_held(std::int64_t n) const { return n; }
  std::int64_t max_blocks_held(std::int64_t n, std::int32_t b) const { return (n + b - 1) / b; }
};
struct AdmissionWithoutKind {  // no AdmissionKind: the cache cannot tell how it writes
  static constexpr kv::Signals required_signals = kv::no_signals;
};
struct EvictionNeedingKeyNorms {  // a signal the cache cannot supply
  static constexpr kv::Signals required_signals{kv::Signals::key_norms};
  std::int64_t max_tokens_held(std::int64_t n) const { return n; }
  std::int64_t max_blocks_held(std::int64_t n, std::int32_t b) const { return (n + b - 1) / b; }
  std::int64_t max_tokens_after_eviction() const { return n_max; }
  static constexpr std::int64_t n_max = 1 << 20;
};
struct KeyNormBlocks : kv::SinkWindowEviction {  // a block policy that reads a signal no layer group gives
  static constexpr kv::Signals required_signals{kv::Signals::key_norms};
};
struct SelectionWithoutSignals {  // no required_signals
  static constexpr kv::SelectionKind kind = kv::SelectionKind::dense;
};

#if defined(KVCACHE_MODE_good)
using C = kv::Cache<>;
using G = kv::Cache<kv::BlockPool, kv::PageTable, kv::WriteGate>;
std::size_t size_of_gated() { return sizeof(G); }
// All three at once, and each pair: they compose.
using All = kv::Cache<kv::BlockPool, kv::PageTable, kv::WriteGate, kv::QuestSelection, kv::H2OEviction>;
std::size_t size_of_all() { return sizeof(All); }
std::size_t size_of_quest_h2o() { return sizeof(kv::Cache<kv::BlockPool, kv::PageTable, kv::AdmitAll, kv::QuestSelection, kv::H2OEviction>); }
// Block policies on a hybrid's global layers.
std::size_t size_of_hybrid_sinks() { return sizeof(kv::HybridCache<kv::FastBlockHasher, kv::SelectAll, kv::SinkWindowEviction>); }
std::size_t size_of_hybrid_scores() { return sizeof(kv::HybridCache<kv::FastBlockHasher, kv::SelectAll, kv::BlockScoreEviction>); }
std::size_t size_of_hybrid_quest_sinks() { return sizeof(kv::HybridCache<kv::FastBlockHasher, kv::QuestSelection, kv::SinkWindowEviction>); }
#elif defined(KVCACHE_MODE_bad_eviction)
using C = kv::Cache<kv::BlockPool, kv::PageTable, kv::AdmitAll, kv::SelectAll, EvictionMissingBound>;
#elif defined(KVCACHE_MODE_bad_signals)
using C = kv::Cache<kv::BlockPool, kv::PageTable, kv::AdmitAll, kv::SelectAll, EvictionNeedingKeyNorms>;
#elif defined(KVCACHE_MODE_bad_admission)
using C = kv::Cache<kv::BlockPool, kv::PageTable, AdmissionWithoutKind>;
#elif defined(KVCACHE_MODE_bad_composition)
using C = kv::Cache<kv::BlockPool, kv::PageTable, kv::WriteGate, kv::SelectAll, kv::SlidingWindow>;
#elif defined(KVCACHE_MODE_bad_composition_block)
using C = kv::Cache<kv::BlockPool, kv::PageTable, kv::WriteGate, kv::QuestSelection, kv::BlockScoreEviction>;
#elif defined(KVCACHE_MODE_bad_hybrid_token)
using C = kv::HybridCache<kv::FastBlockHasher, kv::SelectAll, kv::H2OEviction>;
#elif defined(KVCACHE_MODE_bad_hybrid_signals)
using C = kv::HybridCache<kv::FastBlockHasher, kv::SelectAll, KeyNormBlocks>;
#elif defined(KVCACHE_MODE_bad_selection)
using C = kv::Cache<kv::BlockPool, kv::PageTable, kv::AdmitAll, SelectionWithoutSignals>;
#endif

std::size_t size_of_cache() { return sizeof(C); }
