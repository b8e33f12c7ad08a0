// kvcache: forwarding header. kvcache/block_pool.hpp moved to kvcache/pool/block_pool.hpp in
// 0.3.0 (CHANGELOG.md); this path forwards to it until 0.4.0.
#pragma once

#include "kvcache/pool/block_pool.hpp"
