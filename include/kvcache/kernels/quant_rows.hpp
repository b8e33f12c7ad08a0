// kvcache: forwarding header. kvcache/kernels/quant_rows.hpp moved to kvcache/kernels/detail/quant_rows.hpp in
// 0.3.0 (CHANGELOG.md); this path forwards to it until 0.4.0.
#pragma once

#include "kvcache/kernels/detail/quant_rows.hpp"
