// kvcache: forwarding header. kvcache/kernels/convert.hpp moved to kvcache/kernels/detail/convert.hpp in
// 0.3.0 (CHANGELOG.md); this path forwards to it until 0.4.0.
#pragma once

#include "kvcache/kernels/detail/convert.hpp"
