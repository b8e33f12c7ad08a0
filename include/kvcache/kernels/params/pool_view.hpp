// The pool as every kernel takes it: caller memory and its geometry, by
// value. A parameter struct alone, with the two helpers that read it, so a
// policy or binding that fills kernel parameters includes this and nothing
// of the kernels' bodies or backends.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvcache/config.hpp"
#include "kvcache/core/geometry.hpp"
#include "kvcache/core/kv_format.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// A concrete pool: caller memory + its geometry. Trivially copyable, by value.
struct PoolView {
  void* base = nullptr;  ///< Base address of the pool.
  Strides strides{};  ///< Byte strides of the geometry.
  std::int64_t num_blocks = 0;  ///< Blocks in the pool.
  std::int32_t num_layers = 0;  ///< Layers per block.
  std::int32_t num_kv_heads = 0;  ///< Kv-heads per token.
  std::int32_t head_dim = 0;  ///< Elements per head.
  std::int32_t block_size = 0;  ///< Tokens per block.
  DType dtype = DType::f16;  ///< Element type.
  /// Planes per (block, layer): 2 (K and V), or 1 (one plane: MLA's latent, or
  /// one side of K and V with different head dims). A 1-plane view reads and
  /// writes only the K side of a kernel's source or output.
  std::int32_t kv_planes = 2;
  /// K's and V's scaling (core/kv_format.hpp); group entries sit scales_offset bytes into each plane.
  KvFormat format{};
  std::int64_t scales_offset = 0;  ///< Bytes from a plane's start to its group entries.
  std::int64_t plane_bytes = 0;  ///< Bytes of one (block, layer, K|V) plane: codes, then group entries.

  /// Address of one (block, layer, K|V, token, head) row of head_dim elements.
  KVCACHE_HOST_DEVICE std::byte* row(std::int64_t block, std::int32_t layer, std::int32_t kv, std::int32_t token,
                                     std::int32_t head) const noexcept {
    return static_cast<std::byte*>(base) + strides.offset(block, layer, kv, token, head);
  }
};
static_assert(std::is_trivially_copyable_v<PoolView>);

/// Side kv's format (0 = K, 1 = V).
KVCACHE_HOST_DEVICE inline const SideFormat& side_format(const PoolView& v, std::int32_t kv) noexcept {
  return kv == 0 ? v.format.k : v.format.v;
}

/// A view of `num_blocks` blocks of geometry g at base; invalid_argument for a null base, geometry_overflow past int64.
inline Result<PoolView> make_pool_view(const Geometry& g, void* base, std::int64_t num_blocks) noexcept {
  if (base == nullptr) return Status{Errc::invalid_argument, "base", 0, 1};
  auto s = g.strides(num_blocks);
  if (!s) return s.status();
  const auto& sp = g.spec();
  return PoolView{base, *s, num_blocks, sp.num_layers, sp.num_kv_heads, sp.head_dim, sp.block_size, sp.dtype, g.kv_planes(),
                  sp.format, g.scales_offset(), g.plane_bytes()};
}

KVCACHE_END_NAMESPACE
