// kvcache: forwarding header. kvcache/slot_move.hpp moved to kvcache/core/slot_move.hpp in
// 0.3.0 (CHANGELOG.md); this path forwards to it until 0.4.0.
#pragma once

#include "kvcache/core/slot_move.hpp"
