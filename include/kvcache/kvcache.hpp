// Everything host-side in one include.
#pragma once

#include "kvcache/admission/admit_all.hpp"
#include "kvcache/block_hash.hpp"
#include "kvcache/block_pool.hpp"
#include "kvcache/cache.hpp"
#include "kvcache/config.hpp"
#include "kvcache/events.hpp"
#include "kvcache/eviction/keep_all.hpp"
#include "kvcache/geometry.hpp"
#include "kvcache/hash_index.hpp"
#include "kvcache/page_table.hpp"
#include "kvcache/page_table_export.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/selection/select_all.hpp"
#include "kvcache/sequence_id.hpp"
#include "kvcache/status.hpp"
