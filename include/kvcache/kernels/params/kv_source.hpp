// The new tokens' K and V as the write kernels (scatter, ring_write,
// ring_admit) read them: a parameter struct alone.
#pragma once

#include <cstdint>

#include "kvcache/config.hpp"
#include "kvcache/core/kv_format.hpp"

KVCACHE_BEGIN_NAMESPACE

/// The new tokens' K and V: element (layer, token, head, d) at
/// k + layer*layer_stride + token*token_stride + head*head_stride (bytes), d
/// contiguous. K and V share strides, so both may be slices of a fused QKV tensor.
struct KvSource {
  const void* k = nullptr;  ///< K of token 0, head 0, layer 0.
  const void* v = nullptr;  ///< V of token 0, head 0, layer 0.
  DType dtype = DType::f16;  ///< Input element type.
  std::int64_t layer_stride = 0;  ///< Bytes between layers (multi-layer writes).
  std::int64_t token_stride = 0;  ///< Bytes between tokens.
  std::int64_t head_stride = 0;  ///< Bytes between heads.

  /// Address of one input row (K or V, layer, token, head).
  KVCACHE_HOST_DEVICE const std::byte* row(std::int32_t kv, std::int32_t layer, std::int64_t token,
                                           std::int32_t head) const noexcept {
    return static_cast<const std::byte*>(kv == 0 ? k : v) + layer * layer_stride + token * token_stride +
           head * head_stride;
  }
};

KVCACHE_END_NAMESPACE
