// kvcache: forwarding header. kvcache/events.hpp moved to kvcache/core/events.hpp in
// 0.3.0 (CHANGELOG.md); this path forwards to it until 0.4.0.
#pragma once

#include "kvcache/core/events.hpp"
