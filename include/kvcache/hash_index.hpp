// kvcache: forwarding header. kvcache/hash_index.hpp moved to kvcache/pool/hash_index.hpp in
// 0.3.0 (CHANGELOG.md); this path forwards to it until 0.4.0.
#pragma once

#include "kvcache/pool/hash_index.hpp"
