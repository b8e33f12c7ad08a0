// kvcache: forwarding header. kvcache/strided_span.hpp moved to kvcache/core/strided_span.hpp in
// 0.3.0 (CHANGELOG.md); this path forwards to it until 0.4.0.
#pragma once

#include "kvcache/core/strided_span.hpp"
