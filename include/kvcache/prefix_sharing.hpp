// kvcache: forwarding header. kvcache/prefix_sharing.hpp moved to kvcache/prefix/prefix_sharing.hpp in
// 0.3.0 (CHANGELOG.md); this path forwards to it until 0.4.0.
#pragma once

#include "kvcache/prefix/prefix_sharing.hpp"
