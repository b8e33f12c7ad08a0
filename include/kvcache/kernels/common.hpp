// kvcache: forwarding header. kvcache/kernels/common.hpp was split into
// kvcache/kernels/detail/common.hpp and kvcache/kernels/detail/rows.hpp in
// 0.3.0 (CHANGELOG.md); this path forwards to both until 0.4.0.
#pragma once

#include "kvcache/kernels/detail/common.hpp"
#include "kvcache/kernels/detail/rows.hpp"
