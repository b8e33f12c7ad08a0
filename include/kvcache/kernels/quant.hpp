// kvcache: forwarding header. kvcache/kernels/quant.hpp moved to kvcache/kernels/detail/quant.hpp in
// 0.3.0 (CHANGELOG.md); this path forwards to it until 0.4.0.
#pragma once

#include "kvcache/kernels/detail/quant.hpp"
#include "kvcache/kernels/detail/quant_groups.hpp"
