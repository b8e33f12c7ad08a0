// kvcache: forwarding header. kvcache/kernels/quant.hpp was split into
// kvcache/kernels/detail/quant.hpp and kvcache/kernels/detail/quant_groups.hpp
// in 0.3.0 (CHANGELOG.md); this path forwards to both until 0.4.0.
#pragma once

#include "kvcache/kernels/detail/quant.hpp"
#include "kvcache/kernels/detail/quant_groups.hpp"
