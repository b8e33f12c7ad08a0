// kvcache: forwarding header. kvcache/block_tokens.hpp moved to kvcache/prefix/block_tokens.hpp in
// 0.3.0 (CHANGELOG.md); this path forwards to it until 0.4.0.
#pragma once

#include "kvcache/prefix/block_tokens.hpp"
