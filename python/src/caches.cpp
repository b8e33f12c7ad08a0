// The token-paged caches: one per eviction policy (AdmitAll, SelectAll).
#include "bind_cache.hpp"

namespace kvpy {

template <class E>
using Plain = kv::Cache<kv::BlockPool, kv::PageTable, kv::AdmitAll, kv::SelectAll, E>;

void register_caches(nb::module_& m) {
  bind_cache<Plain<kv::KeepAll>>(m, "Cache_KeepAll");
  bind_cache<Plain<kv::SlidingWindow>>(m, "Cache_SlidingWindow");
  bind_cache<Plain<kv::SinkWindowEviction>>(m, "Cache_SinkWindow");
  bind_cache<Plain<kv::BlockScoreEviction>>(m, "Cache_BlockScores");
  bind_cache<Plain<kv::H2OEviction>>(m, "Cache_H2O");
  bind_cache<Plain<kv::TovaEviction>>(m, "Cache_Tova");
  bind_cache<Plain<kv::SnapKVEviction>>(m, "Cache_SnapKV");
  bind_cache<Plain<kv::AverageAttentionEviction>>(m, "Cache_AverageAttention");
}

}  // namespace kvpy
