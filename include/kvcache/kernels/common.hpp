// kvcache: forwarding header. kvcache/kernels/common.hpp moved to kvcache/kernels/detail/common.hpp in
// 0.3.0 (CHANGELOG.md); this path forwards to it until 0.4.0.
#pragma once

#include "kvcache/kernels/detail/common.hpp"
#include "kvcache/kernels/detail/rows.hpp"
