// kvcache: forwarding header. kvcache/kv_format.hpp moved to kvcache/core/kv_format.hpp in
// 0.3.0 (CHANGELOG.md); this path forwards to it until 0.4.0.
#pragma once

#include "kvcache/core/kv_format.hpp"
