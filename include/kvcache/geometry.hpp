// kvcache: forwarding header. kvcache/geometry.hpp moved to kvcache/core/geometry.hpp in
// 0.3.0 (CHANGELOG.md); this path forwards to it until 0.4.0.
#pragma once

#include "kvcache/core/geometry.hpp"
