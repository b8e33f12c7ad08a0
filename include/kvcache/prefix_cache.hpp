// kvcache: forwarding header. kvcache/prefix_cache.hpp moved to kvcache/prefix/prefix_cache.hpp in
// 0.3.0 (CHANGELOG.md); this path forwards to it until 0.4.0.
#pragma once

#include "kvcache/prefix/prefix_cache.hpp"
