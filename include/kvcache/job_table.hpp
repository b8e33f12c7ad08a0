// kvcache: forwarding header. kvcache/job_table.hpp moved to kvcache/core/job_table.hpp in
// 0.3.0 (CHANGELOG.md); this path forwards to it until 0.4.0.
#pragma once

#include "kvcache/core/job_table.hpp"
