// kvcache: forwarding header. kvcache/prefix_index.hpp moved to kvcache/pool/prefix_index.hpp in
// 0.3.0 (CHANGELOG.md); this path forwards to it until 0.4.0.
#pragma once

#include "kvcache/pool/prefix_index.hpp"
