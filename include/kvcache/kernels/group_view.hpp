// kvcache: forwarding header. kvcache/kernels/group_view.hpp moved to kvcache/kernels/detail/group_view.hpp in
// 0.3.0 (CHANGELOG.md); this path forwards to it until 0.4.0.
#pragma once

#include "kvcache/kernels/detail/group_view.hpp"
