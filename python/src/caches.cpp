// The token-paged caches: one per eviction policy (AdmitAll, SelectAll).
#include "bind_cache.hpp"

namespace kvpy {

void register_caches(nb::module_& m) { bind_token_paged_caches<kv::SelectAll>(m, "Cache_"); }

}  // namespace kvpy
