// kvcache: forwarding header. kvcache/page_table_rows.hpp moved to kvcache/table/page_table_rows.hpp in
// 0.3.0 (CHANGELOG.md); this path forwards to it until 0.4.0.
#pragma once

#include "kvcache/table/page_table_rows.hpp"
