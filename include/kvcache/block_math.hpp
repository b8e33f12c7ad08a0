// kvcache: forwarding header. kvcache/block_math.hpp moved to kvcache/core/block_math.hpp in
// 0.3.0 (CHANGELOG.md); this path forwards to it until 0.4.0.
#pragma once

#include "kvcache/core/block_math.hpp"
