// RingAdmitParams alone: what the deferred write gate fills for a ring_admit
// launch (admission/gate_deferred.hpp), without the kernel's bodies.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvcache/config.hpp"
#include "kvcache/kernels/params/kv_source.hpp"
#include "kvcache/kernels/params/pool_view.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Parameters of ring_admit: one layer's write of num_tokens tokens x num_heads kv-heads.
/// The policy's four (num_heads, window, global_limit, tau) must be the ones
/// the host replays in reconcile(): take them from WriteGate::ring_admit_params()
/// and fill in the rest, never type them again.
struct RingAdmitParams {
  PoolView cache{};                      ///< Pool of single-head blocks (one layer, one kv-head per block).
  KvSource src{};                        ///< New K/V: entry t * num_heads + h is token t of head h (head 0, layer 0).
  const float* gates = nullptr;          ///< [num_tokens][num_heads], in [0, 1].
  std::int32_t num_tokens = 0;           ///< Tokens written.
  std::int32_t num_heads = 0;            ///< Kv-heads (rows).
  std::int32_t window = 0;               ///< W: ring slots per head, a multiple of the block size.
  /// Admitted tokens a head keeps at most, a number (0 admits none): the
  /// policy's effective cap, WriteGate::global_cap(), not its config's
  /// global_cap (where 0 means "as many as the row holds").
  std::int32_t global_limit = 0;
  float tau = 0.0f;                      ///< Admitted when gate >= tau (the policy's WriteGateConfig::tau).
  const std::int32_t* ring_start = nullptr;  ///< [num_heads]: the ring's oldest slot before the call (allot).
  const std::int32_t* ring_len = nullptr;    ///< [num_heads]: ring tokens before the call (allot).
  std::int32_t* global_len = nullptr;    ///< [num_heads]: device state, read and advanced.
  std::uint8_t* bits = nullptr;          ///< [num_heads][window]: device state, admission bit per ring slot.
  const std::int32_t* rows = nullptr;    ///< [num_heads][row_stride]: each head's blocks (the allotted rows).
  std::int32_t row_stride = 0;           ///< Entries per row in `rows`.
};
static_assert(std::is_trivially_copyable_v<RingAdmitParams>);

KVCACHE_END_NAMESPACE
