// Compaction after token-granular eviction. The planner turns "keep these
// positions" into the fewest moves: kept tokens at or past the new length fill
// the holes below it, lowest hole first. Sources are all >= new length and
// destinations all < it, so the moves run in parallel in place. Token order
// changes (attention over cached keys is order-free once RoPE is applied);
// the planner reports the new order so positions and scores move with it.
#pragma once

#include <cstdint>
#include <span>
#include <type_traits>

#include "common.hpp"
#include "kvcache/block_pool.hpp"

KVCACHE_BEGIN_NAMESPACE

struct SlotMove {
  std::int32_t src = -1;
  std::int32_t dst = -1;
  friend constexpr bool operator==(const SlotMove&, const SlotMove&) = default;
};

// keep: strictly ascending positions < length. blocks: the stream's page-table
// row. Writes the moves (slot -> slot) and order[p] = the old position now at
// p, for p < keep.size(). Returns the number of moves.
inline Result<std::int32_t> plan_compaction(std::span<const std::int32_t> keep, std::int32_t length,
                                            std::span<const BlockId> blocks, std::int32_t block_size,
                                            std::span<SlotMove> moves, std::span<std::int32_t> order) noexcept {
  if (block_size < 1) return Status{Errc::invalid_argument, "block_size", block_size, 1};
  if (length < 0 || std::int64_t{length} > std::int64_t(blocks.size()) * block_size)
    return Status{Errc::invalid_argument, "length", length, std::int64_t(blocks.size()) * block_size};
  const auto n = static_cast<std::int32_t>(keep.size());
  for (std::int32_t i = 0; i < n; ++i)
    if (keep[std::size_t(i)] < 0 || keep[std::size_t(i)] >= length || (i > 0 && keep[std::size_t(i)] <= keep[std::size_t(i - 1)]))
      return Status{Errc::invalid_argument, "keep", i, length};
  if (std::int64_t(order.size()) < n) return Status{Errc::buffer_too_small, "order", std::int64_t(order.size()), n};
  // Kept tokens below n stay; the rest (keep[first_mover..]) fill the holes.
  std::int32_t first_mover = 0;
  while (first_mover < n && keep[std::size_t(first_mover)] < n) ++first_mover;
  const std::int32_t num_moves = n - first_mover;
  if (std::int64_t(moves.size()) < num_moves) return Status{Errc::buffer_too_small, "moves", std::int64_t(moves.size()), num_moves};
  auto slot = [&](std::int32_t pos) { return blocks[std::size_t(pos / block_size)] * block_size + pos % block_size; };
  std::int32_t k = 0, m = first_mover, mv = 0;
  for (std::int32_t p = 0; p < n; ++p) {
    if (k < first_mover && keep[std::size_t(k)] == p) {
      order[std::size_t(p)] = p;
      ++k;
      continue;
    }
    const std::int32_t from = keep[std::size_t(m++)];
    order[std::size_t(p)] = from;
    moves[std::size_t(mv++)] = SlotMove{slot(from), slot(p)};
  }
  return num_moves;
}

struct CompactionParams {
  PoolView cache{};
  const SlotMove* moves = nullptr;
  std::int32_t num_moves = 0;
  std::int32_t first_layer = 0, num_layers = 1;
};
static_assert(std::is_trivially_copyable_v<CompactionParams>);

KVCACHE_HOST_DEVICE inline void compaction_row(const CompactionParams& p, std::int32_t move, std::int32_t layer,
                                               std::int32_t kv, std::int32_t head, std::int32_t lane,
                                               std::int32_t nlanes) noexcept {
  const SlotMove m = p.moves[move];
  const std::int64_t b = p.cache.block_size, pool_slots = p.cache.num_blocks * b;
  if (m.src < 0 || m.src >= pool_slots || m.dst < 0 || m.dst >= pool_slots) return;
  const std::int32_t l = p.first_layer + layer;
  move_row(p.cache.row(m.dst / b, l, kv, static_cast<std::int32_t>(m.dst % b), head), p.cache.dtype,
           p.cache.row(m.src / b, l, kv, static_cast<std::int32_t>(m.src % b), head), p.cache.dtype,
           p.cache.head_dim, 1.0f, lane, nlanes);
}

// What the host can see; shared by both launchers.
inline Status check_compaction_shape(const CompactionParams& p) noexcept {
  if (!p.cache.base) return Status{Errc::invalid_argument, "cache.base", 0, 1};
  if (p.num_layers < 1 || p.first_layer < 0 || p.first_layer + p.num_layers > p.cache.num_layers)
    return Status{Errc::invalid_argument, "first_layer+num_layers", std::int64_t{p.first_layer} + p.num_layers, p.cache.num_layers};
  if (p.num_moves < 0 || (p.num_moves > 0 && !p.moves)) return Status{Errc::invalid_argument, "moves", p.num_moves, 0};
  return {};
}

inline Status compaction_host(const CompactionParams& p) noexcept {
  if (auto st = check_compaction_shape(p); !st) return st;
  const std::int64_t pool_slots = p.cache.num_blocks * p.cache.block_size;
  for (std::int32_t i = 0; i < p.num_moves; ++i)
    if (p.moves[i].src < 0 || p.moves[i].src >= pool_slots || p.moves[i].dst < 0 || p.moves[i].dst >= pool_slots)
      return Status{Errc::invalid_argument, "moves", i, pool_slots};
  for (std::int32_t i = 0; i < p.num_moves; ++i)
    for (std::int32_t l = 0; l < p.num_layers; ++l)
      for (std::int32_t kv = 0; kv < 2; ++kv)
        for (std::int32_t h = 0; h < p.cache.num_kv_heads; ++h) compaction_row(p, i, l, kv, h, 0, 1);
  return {};
}

KVCACHE_END_NAMESPACE
