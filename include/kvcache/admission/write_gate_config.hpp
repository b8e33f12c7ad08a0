// Write-Gated KV's configuration: what a cache is given to build the policy
// (the ring, tau, the cap of each head's global region, and what a write does
// at the cap). gate_heads.hpp checks it against the table it binds to.
#pragma once

#include <cstdint>

#include "kvcache/config.hpp"

KVCACHE_BEGIN_NAMESPACE

/// What a write does when a head's global region is at its cap.
enum class GlobalCapAction : std::uint8_t {
  refuse,  ///< the call fails with capacity_exceeded naming the cap; nothing changes
  drop,    ///< the promotion is skipped: the token leaves like an unadmitted one (counted)
};

/// Write-Gated KV's configuration.
struct WriteGateConfig {
  std::int32_t num_layers = 1;       ///< Layers per sequence.
  std::int32_t num_kv_heads = 1;     ///< Kv-heads per layer.
  std::int32_t local_window = 256;   ///< W_local: ring tokens per head, a multiple of the block size.
  float tau = 0.1f;                  ///< A token is admitted when its gate is >= tau.
  std::int32_t global_cap = 0;       ///< Admitted tokens a head keeps at most; 0: as many as its row holds.
  GlobalCapAction at_cap = GlobalCapAction::refuse;  ///< What a promotion past the cap does.
};

KVCACHE_END_NAMESPACE
