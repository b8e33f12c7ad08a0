// kvcache: forwarding header. kvcache/block_holds.hpp moved to kvcache/pool/block_holds.hpp in
// 0.3.0 (CHANGELOG.md); this path forwards to it until 0.4.0.
#pragma once

#include "kvcache/pool/block_holds.hpp"
