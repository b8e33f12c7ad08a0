// Compaction kernel: runs the moves of plan_compaction (eviction/
// compaction_plan.hpp) on the K/V rows of a layer range and a kv-head range
// (token policies that choose per head compact one head range at a time).
#pragma once

#include <cstdint>
#include <span>
#include <type_traits>

#include "kvcache/kernels/detail/common.hpp"
#include "kvcache/kernels/detail/quant_rows.hpp"
#include "kvcache/kernels/detail/rows.hpp"
#include "kvcache/core/slot_move.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Parameters of compaction: slot moves over a layer range and a kv-head range.
struct CompactionParams {
  PoolView cache{};  ///< The pool.
  const SlotMove* moves = nullptr;  ///< Moves (src slot, dst slot); independent of each other.
  std::int32_t num_moves = 0;  ///< Moves in `moves`.
  std::int32_t first_layer = 0;  ///< First layer moved.
  std::int32_t num_layers = 1;  ///< Layers moved.
  std::int32_t first_head = 0;  ///< First kv-head moved.
  std::int32_t num_heads = 0;  ///< kv-head range; num_heads 0 = every head
};
static_assert(std::is_trivially_copyable_v<CompactionParams>);

/// Runs one move for one (layer, K|V, head) row; lanes split the row (shared by both backends).
KVCACHE_HOST_DEVICE inline void compaction_row(const CompactionParams& p, std::int32_t move, std::int32_t layer,
                                               std::int32_t kv, std::int32_t head, std::int32_t lane,
                                               std::int32_t nlanes) noexcept {
  const SlotMove m = p.moves[move];
  const std::int64_t b = p.cache.block_size, pool_slots = p.cache.num_blocks * b;
  if (m.src < 0 || m.src >= pool_slots || m.dst < 0 || m.dst >= pool_slots) return;
  const std::int32_t l = p.first_layer + layer;
  head += p.first_head;
  if (quantized_side(p.cache, kv)) {  // codes and group entries; a row is whole groups: never requantized
    move_pool_row(p.cache, kv, m.dst / b, static_cast<std::int32_t>(m.dst % b), m.src / b,
                  static_cast<std::int32_t>(m.src % b), l, head, lane, nlanes);
    return;
  }
  move_row(p.cache.row(m.dst / b, l, kv, static_cast<std::int32_t>(m.dst % b), head), p.cache.dtype,
           p.cache.row(m.src / b, l, kv, static_cast<std::int32_t>(m.src % b), head), p.cache.dtype,
           p.cache.head_dim, 1.0f, lane, nlanes);
}

/// Heads the launch covers: the range, or every head from first_head on.
/// In 64 bits: the range is checked (and reported) even when first_head is far out of it.
inline std::int64_t heads_of(const CompactionParams& p) noexcept {
  return p.num_heads > 0 ? p.num_heads : std::int64_t{p.cache.num_kv_heads} - p.first_head;
}

/// What the host can see; shared by both launchers.
inline Status check_compaction_shape(const CompactionParams& p) noexcept {
  if (!p.cache.base) return Status{Errc::invalid_argument, "cache.base", 0, 1};
  if (p.num_layers < 1 || p.first_layer < 0 || std::int64_t{p.first_layer} + p.num_layers > p.cache.num_layers)
    return Status{Errc::invalid_argument, "first_layer+num_layers", std::int64_t{p.first_layer} + p.num_layers, p.cache.num_layers};
  const std::int64_t heads = heads_of(p);
  if (p.num_heads < 0 || p.first_head < 0 || heads < 1 || p.first_head + heads > p.cache.num_kv_heads)
    return Status{Errc::invalid_argument, "first_head+num_heads", p.first_head + heads, p.cache.num_kv_heads};
  if (p.num_moves < 0 || (p.num_moves > 0 && !p.moves)) return Status{Errc::invalid_argument, "moves", p.num_moves, 0};
  if (auto st = check_planes(p.cache, "cache.kv_planes"); !st) return st;
  if (auto st = check_pool_rows(p.cache, "cache.dtype"); !st) return st;
  if (auto st = check_row_writes(p.cache, "cache.format (channel scales: moving a row changes its block's channels)"); !st)
    return st;
  return {};
}

/// Host backend: validates every move and the ranges, then moves; nothing is written on an error.
inline Status compaction_host(const CompactionParams& p) noexcept {
  if (auto st = check_compaction_shape(p); !st) return st;
  const std::int64_t pool_slots = p.cache.num_blocks * p.cache.block_size;
  for (std::int32_t i = 0; i < p.num_moves; ++i)
    if (p.moves[i].src < 0 || p.moves[i].src >= pool_slots || p.moves[i].dst < 0 || p.moves[i].dst >= pool_slots)
      return Status{Errc::invalid_argument, "moves", i, pool_slots};
  for (std::int32_t i = 0; i < p.num_moves; ++i)
    for (std::int32_t l = 0; l < p.num_layers; ++l)
      for (std::int32_t kv = 0; kv < p.cache.kv_planes; ++kv)
        for (std::int32_t h = 0; h < heads_of(p); ++h) compaction_row(p, i, l, kv, h, 0, 1);
  return {};
}

KVCACHE_END_NAMESPACE
