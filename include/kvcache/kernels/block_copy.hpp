// Block copy: (src, dst) block pairs copied in one launch, all layers, K and V
// (copy-on-write, compaction moves). src and dst may be different pools of the
// same geometry: with one of them in pinned (mapped) host memory this is the
// batched swap between device and host, one launch for all blocks. A layer
// range copies only those layers: layer-by-layer onboarding launches one
// range per layer and records an event after each, so attention of layer i
// waits only for its own blocks.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvcache/kernels/detail/common.hpp"
#include "kvcache/kernels/detail/rows.hpp"
#include "kvcache/core/sequence_id.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Parameters of block_copy: (src, dst) block pairs copied across every layer, K and V.
struct BlockCopyParams {
  PoolView src{};  ///< Pool read from.
  PoolView dst{};  ///< Pool written to (same geometry; may be src).
  const BlockCopy* pairs = nullptr;  ///< The pairs.
  std::int32_t num_pairs = 0;  ///< Pairs in `pairs`.
  std::int32_t first_layer = 0;  ///< First layer copied.
  std::int32_t layers = 0;  ///< Layers copied from first_layer (0: through the last).
};

/// The layers a block_copy copies: [first_layer, block_copy_layer_end(p)).
KVCACHE_HOST_DEVICE inline std::int32_t block_copy_layer_end(const BlockCopyParams& p) noexcept {
  return p.layers == 0 ? p.src.num_layers : p.first_layer + p.layers;
}
static_assert(std::is_trivially_copyable_v<BlockCopyParams>);

/// Elements of one (block, layer, K|V) plane: it is contiguous in every layout.
KVCACHE_HOST_DEVICE inline std::int32_t plane_elems(const PoolView& v) noexcept {
  return v.block_size * v.num_kv_heads * v.head_dim;
}

/// Bytes of one plane: codes and, for group scales, their entries. Copied as
/// one run, so a block's scales move with its codes.
KVCACHE_HOST_DEVICE inline std::int32_t plane_run_bytes(const PoolView& v) noexcept {
  return static_cast<std::int32_t>(v.plane_bytes > 0 ? v.plane_bytes : row_bytes(v.dtype, plane_elems(v)));
}

/// Copies one (pair, layer, K|V) plane as raw bytes; lanes split them (shared by both backends).
KVCACHE_HOST_DEVICE inline void copy_plane(const BlockCopyParams& p, std::int32_t pair, std::int32_t layer,
                                           std::int32_t kv, std::int32_t lane, std::int32_t nlanes) noexcept {
  const BlockCopy c = p.pairs[pair];
  if (c.src < 0 || c.src >= p.src.num_blocks || c.dst < 0 || c.dst >= p.dst.num_blocks) return;
  move_row(p.dst.row(c.dst, layer, kv, 0, 0), DType::int8, p.src.row(c.src, layer, kv, 0, 0), DType::int8,
           plane_run_bytes(p.src), 1.0f, lane, nlanes);
}

/// Checks the parameters' shape (pool, pair count, pointers).
inline Status check_block_copy_shape(const BlockCopyParams& p) noexcept {
  if (!p.src.base || !p.dst.base) return Status{Errc::invalid_argument, "pool.base", 0, 1};
  if (p.num_pairs < 0) return Status{Errc::invalid_argument, "num_pairs", p.num_pairs, 0};
  if (p.num_pairs > 0 && !p.pairs) return Status{Errc::invalid_argument, "pairs", 0, 1};
  if (auto st = check_planes(p.src, "src.kv_planes"); !st) return st;
  if (p.src.dtype != p.dst.dtype || p.src.num_layers != p.dst.num_layers ||
      plane_elems(p.src) != plane_elems(p.dst) || p.src.head_dim != p.dst.head_dim || p.src.kv_planes != p.dst.kv_planes ||
      plane_run_bytes(p.src) != plane_run_bytes(p.dst) || !(p.src.format == p.dst.format))
    return Status{Errc::invalid_argument, "dst.geometry", 0, 0};
  if (p.first_layer < 0 || p.first_layer >= p.src.num_layers)
    return Status{Errc::invalid_argument, "first_layer", p.first_layer, p.src.num_layers - 1};
  if (p.layers < 0 || p.layers > p.src.num_layers - p.first_layer)
    return Status{Errc::invalid_argument, "layers", p.layers, p.src.num_layers - p.first_layer};
  if (dtype_bits(p.src.dtype) == 0)
    return Status{Errc::invalid_argument, "src.dtype", static_cast<std::int64_t>(p.src.dtype), kLastDType};
  return {};
}

/// Host backend: validates every pair, then copies; nothing is written on an error.
inline Status block_copy_host(const BlockCopyParams& p) noexcept {
  if (auto st = check_block_copy_shape(p); !st) return st;
  for (std::int32_t i = 0; i < p.num_pairs; ++i) {
    if (p.pairs[i].src < 0 || p.pairs[i].src >= p.src.num_blocks)
      return Status{Errc::invalid_argument, "pairs.src", i, p.src.num_blocks};
    if (p.pairs[i].dst < 0 || p.pairs[i].dst >= p.dst.num_blocks)
      return Status{Errc::invalid_argument, "pairs.dst", i, p.dst.num_blocks};
  }
#if defined(_OPENMP)
#pragma omp parallel for schedule(static)
#endif
  for (std::int32_t i = 0; i < p.num_pairs; ++i)
    for (std::int32_t l = p.first_layer; l < block_copy_layer_end(p); ++l)
      for (std::int32_t kv = 0; kv < p.src.kv_planes; ++kv) copy_plane(p, i, l, kv, 0, 1);
  return {};
}

KVCACHE_END_NAMESPACE
