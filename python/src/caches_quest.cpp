// The token-paged caches with Quest page selection: one per eviction policy
// (Quest ranks the pages the policy left; its edits list their pages stale).
#include "bind_cache.hpp"

namespace kvpy {

template <class E>
using Quest = kv::Cache<kv::BlockPool, kv::PageTable, kv::AdmitAll, kv::QuestSelection, E>;

void register_quest_caches(nb::module_& m) {
  bind_cache<Quest<kv::KeepAll>>(m, "Cache_Quest_KeepAll");
  bind_cache<Quest<kv::SlidingWindow>>(m, "Cache_Quest_SlidingWindow");
  bind_cache<Quest<kv::SinkWindowEviction>>(m, "Cache_Quest_SinkWindow");
  bind_cache<Quest<kv::BlockScoreEviction>>(m, "Cache_Quest_BlockScores");
  bind_cache<Quest<kv::H2OEviction>>(m, "Cache_Quest_H2O");
  bind_cache<Quest<kv::TovaEviction>>(m, "Cache_Quest_Tova");
  bind_cache<Quest<kv::SnapKVEviction>>(m, "Cache_Quest_SnapKV");
  bind_cache<Quest<kv::AverageAttentionEviction>>(m, "Cache_Quest_AverageAttention");
}

}  // namespace kvpy
