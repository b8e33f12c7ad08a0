// kvcache: forwarding header. kvcache/head_rows.hpp moved to kvcache/table/head_rows.hpp in
// 0.3.0 (CHANGELOG.md); this path forwards to it until 0.4.0.
#pragma once

#include "kvcache/table/head_rows.hpp"
