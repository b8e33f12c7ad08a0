// kv.HybridCache with Quest on the global layers (the full and MLA groups'):
// HybridCache<FastBlockHasher, QuestSelection>, a translation unit of its
// own so that a build's cores compile it beside the dense one.
#include "bind_hybrid.hpp"

namespace kvpy {

void register_hybrid_quest(nb::module_& m) {
  bind_hybrid_cache<kv::HybridCache<kv::FastBlockHasher, kv::QuestSelection>>(m, "HybridCache_Quest");
}

}  // namespace kvpy
