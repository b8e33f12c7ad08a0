// What one attention kind keeps, may free, may serve from the prefix cache,
// and holds at most: every per-kind decision of a hybrid cache, in one place.
//
// Everything follows from first_read(p): the first position a query at
// position p reads (all of 0 .. p-1 having been processed). A row may free
// the blocks wholly before it; a prefix hit of h tokens needs the blocks from
// first_read(h) up to h cached (full: all of them; a window: the last
// ceil((W-1)/B) or so, null blocks before them; a chunk: the current chunk's).
#pragma once

#include <algorithm>
#include <cstdint>

#include "kvcache/core/block_math.hpp"
#include "kvcache/config.hpp"
#include "kvcache/groups/layer_groups.hpp"

KVCACHE_BEGIN_NAMESPACE

/// The rule of one group, read from its LayerGroups entry.
struct GroupRule {
  AttentionKind kind = AttentionKind::full;  ///< The group's kind.
  std::int32_t block_size = 1;  ///< Tokens per page in this group.
  std::int32_t span = 0;  ///< The window W, the chunk C, or the encoder length (cross); 0 for full and MLA.
  std::int32_t shift = -1;  ///< log2(block_size) when a power of two (a shift, not a division, per token).

  /// Group g's rule.
  static GroupRule of(const LayerGroups& lg, std::int32_t g) noexcept {
    const auto& s = lg.spec(g);
    const std::int32_t span = s.kind == AttentionKind::sliding_window ? s.window
                              : s.kind == AttentionKind::chunked_local ? s.chunk
                              : s.kind == AttentionKind::cross         ? s.encoder_len
                                                                       : 0;
    return {s.kind, lg.block_size(g), span, BlockMath::of(lg.block_size(g)).shift};
  }

  /// Its blocks go into the prefix index (every kind but cross-attention, whose K/V is the request's own encoder output).
  constexpr bool caches() const noexcept { return kind != AttentionKind::cross; }
  /// Its published blocks chain to their parents, so the index keeps them
  /// prefix-closed (full, MLA). A window's or a chunk's blocks are published
  /// alone: an early block recycled must not take the later ones with it.
  constexpr bool chained() const noexcept { return global_kind(kind); }
  /// Its rows free blocks as the sequence advances (window, chunk).
  constexpr bool frees() const noexcept {
    return kind == AttentionKind::sliding_window || kind == AttentionKind::chunked_local;
  }

  /// Block index of position p (p >= 0).
  constexpr std::int64_t div(std::int64_t p) const noexcept { return shift >= 0 ? p >> shift : p / block_size; }
  /// Position p's offset in its block.
  constexpr std::int32_t mod(std::int64_t p) const noexcept {
    return static_cast<std::int32_t>(shift >= 0 ? p & (block_size - 1) : p % block_size);
  }
  /// Blocks holding `tokens` tokens.
  constexpr std::int64_t blocks_for(std::int64_t tokens) const noexcept { return div(tokens + block_size - 1); }
  /// Block indices a row reaches once its sequence has `tokens` tokens: theirs,
  /// or (cross-attention) the encoder's, whatever the decoder holds.
  constexpr std::int64_t row_blocks(std::int64_t tokens) const noexcept { return blocks_for(caches() ? tokens : span); }

  /// The first position a query at position p reads.
  constexpr std::int64_t first_read(std::int64_t p) const noexcept {
    switch (kind) {
      case AttentionKind::sliding_window: return std::max<std::int64_t>(0, p - span + 1);
      case AttentionKind::chunked_local: return p / span * span;
      default: return 0;
    }
  }
  /// Blocks wholly before what the next query reads, `processed` tokens in:
  /// a row may free its blocks below this index.
  constexpr std::int64_t skipped_blocks(std::int64_t processed) const noexcept {
    return frees() ? div(first_read(processed)) : 0;
  }
  /// The blocks [first, last) a prefix hit of h tokens (a multiple of block_size) needs cached.
  constexpr std::int64_t hit_first_block(std::int64_t h) const noexcept { return div(first_read(h)); }

  /// The most blocks a row holds over a request of `length` tokens, with at
  /// most `in_flight` tokens reserved beyond those processed (the prefill
  /// chunk; 1 when decoding). A window holds W - 1 + in_flight tokens plus one
  /// block for where they start in a block; a chunk C - 1 + in_flight, from
  /// the chunk's first position: a block boundary when C is a multiple of the
  /// block size (vLLM's bound then), else one block more for the offset.
  constexpr std::int64_t max_blocks(std::int64_t length, std::int64_t in_flight) const noexcept {
    switch (kind) {
      case AttentionKind::cross: return blocks_for(span);
      case AttentionKind::sliding_window:
      case AttentionKind::chunked_local: {
        const std::int64_t c = std::clamp<std::int64_t>(in_flight, 1, std::max<std::int64_t>(length, 1));
        const bool offset = kind == AttentionKind::sliding_window || mod(span) != 0;
        return std::min(blocks_for(length), blocks_for(std::min(length, span - 1 + c)) + (offset ? 1 : 0));
      }
      default: return blocks_for(length);
    }
  }
  friend constexpr bool operator==(const GroupRule&, const GroupRule&) = default;
};

KVCACHE_END_NAMESPACE
