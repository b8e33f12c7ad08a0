// kvcache: forwarding header. kvcache/sequence_id.hpp moved to kvcache/core/sequence_id.hpp in
// 0.3.0 (CHANGELOG.md); this path forwards to it until 0.4.0.
#pragma once

#include "kvcache/core/sequence_id.hpp"
