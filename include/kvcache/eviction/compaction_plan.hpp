// Compaction after token-granular eviction. The planner turns "keep these
// positions" into the fewest moves: kept tokens at or past the new length fill
// the holes below it, lowest hole first. Sources are all >= new length and
// destinations all < it, so the moves run in parallel in place. Token order
// changes (attention over cached keys is order-free once RoPE is applied);
// the planner reports the new order so positions and scores move with it.
#pragma once

#include <cstdint>
#include <span>

#include "kvcache/pool/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/core/slot_move.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// The fewest moves that compact `evicted` (strictly ascending token indices
/// of a stream that keeps `kept` tokens) out of it: each hole below `kept`
/// takes a kept token at or past it, lowest first, so no source is ever a
/// destination and the moves run in parallel in place. Calls move(src, dst)
/// in ascending dst order; returns the number of moves (the holes below kept).
template <class Move>
std::int32_t fill_holes(std::span<const std::int32_t> evicted, std::int32_t kept, Move&& move) noexcept {
  const auto count = std::int32_t(evicted.size());
  std::int32_t holes = 0;
  while (holes < count && evicted[std::size_t(holes)] < kept) ++holes;
  std::int32_t k = holes, m = 0;
  for (std::int32_t t = kept; m < holes; ++t) {
    if (k < count && evicted[std::size_t(k)] == t) {
      ++k;
      continue;
    }
    move(t, evicted[std::size_t(m++)]);
  }
  return holes;
}

/// keep: strictly ascending positions < length. blocks: the stream's page-table
/// row. Writes the moves (slot -> slot) and order[p] = the old position now at
/// p, for p < keep.size(). Returns the number of moves.
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

KVCACHE_END_NAMESPACE
