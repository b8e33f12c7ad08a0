// The token-paged caches with Quest page selection: one per eviction policy
// (Quest ranks the pages the policy left; its edits list their pages stale).
// A translation unit of its own, so a build's cores compile both families side by side.
#include "bind_cache.hpp"

namespace kvpy {

void register_quest_caches(nb::module_& m) { bind_token_paged_caches<kv::QuestSelection>(m, "Cache_Quest_"); }

}  // namespace kvpy
