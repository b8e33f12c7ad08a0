// kv.HybridCache with a block eviction policy on the global layers (the full
// and MLA groups'): HybridCache<FastBlockHasher, SelectAll, SinkWindowEviction>
// and <..., BlockScoreEviction>, each also with Quest, a translation unit of
// their own so that a build's cores compile them beside the others.
#include "bind_hybrid.hpp"

namespace kvpy {

void register_hybrid_eviction(nb::module_& m) {
  bind_hybrid_cache<kv::HybridCache<kv::FastBlockHasher, kv::SelectAll, kv::SinkWindowEviction>>(m, "HybridCache_SinkWindow");
  bind_hybrid_cache<kv::HybridCache<kv::FastBlockHasher, kv::SelectAll, kv::BlockScoreEviction>>(m, "HybridCache_BlockScores");
  bind_hybrid_cache<kv::HybridCache<kv::FastBlockHasher, kv::QuestSelection, kv::SinkWindowEviction>>(m, "HybridCache_Quest_SinkWindow");
  bind_hybrid_cache<kv::HybridCache<kv::FastBlockHasher, kv::QuestSelection, kv::BlockScoreEviction>>(m, "HybridCache_Quest_BlockScores");
}

}  // namespace kvpy
