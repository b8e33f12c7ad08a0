// The head-paged caches: Write-Gated KV with keep-all or a token policy on
// each head row's global region, with or without Quest. Window and block
// policies do not compose with it (the C++ static_asserts say why; the
// Python factory names the combination).
#include "bind_gated_cache.hpp"

namespace kvpy {

template <class S, class E>
using Gated = kv::GatedCache<kv::WriteGate, S, E>;

template <class S>
void register_gated(nb::module_& m, const std::string& prefix) {
  bind_gated_cache<Gated<S, kv::KeepAll>>(m, (prefix + "KeepAll").c_str());
  bind_gated_cache<Gated<S, kv::H2OEviction>>(m, (prefix + "H2O").c_str());
  bind_gated_cache<Gated<S, kv::TovaEviction>>(m, (prefix + "Tova").c_str());
  bind_gated_cache<Gated<S, kv::SnapKVEviction>>(m, (prefix + "SnapKV").c_str());
  bind_gated_cache<Gated<S, kv::AverageAttentionEviction>>(m, (prefix + "AverageAttention").c_str());
}

void register_gated_caches(nb::module_& m) {
  register_gated<kv::SelectAll>(m, "Cache_WriteGate_");
  register_gated<kv::QuestSelection>(m, "Cache_WriteGate_Quest_");
}

}  // namespace kvpy
