// The token ids each block holds, for publishing on reserve
// (CacheConfig::publish_on_reserve): reserve() is given the new tokens' ids,
// and a block is hashed and published as soon as it is full. Ids live per
// block, where the K/V lives, so the store is bounded by the pool (not by
// sequences x context) and follows a block through sharing, copy-on-write and
// rollback the way its K/V does.
//
// Per stream, `known` counts the leading positions whose ids the store has.
// A reserve without ids (draft tokens the engine has not committed) stops it:
// those tokens are never published until publish(seq, tokens) supplies them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/core/block_hash.hpp"
#include "kvcache/core/block_math.hpp"
#include "kvcache/config.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Token ids and folded extra keys per block, and how many leading ids each stream has given.
class BlockTokens {
 public:
  BlockTokens() = default;
  /// A store for num_blocks blocks of block_size tokens and `streams` streams.
  BlockTokens(std::int32_t num_blocks, std::int32_t block_size, std::int32_t streams)
      : ids_(checked(num_blocks, block_size), -1),
        extra_(static_cast<std::size_t>(num_blocks), 0),
        mixed_at_(static_cast<std::size_t>(num_blocks), -1),
        known_(static_cast<std::size_t>(streams), 0),
        block_size_(block_size),
        math_(BlockMath::of(block_size)) {}

  /// True when the cache publishes on reserve.
  bool on() const noexcept { return block_size_ > 0; }
  /// Block b's token ids (full once the block is).
  std::span<const std::int32_t> ids(std::int32_t b) const noexcept {
    return {ids_.data() + std::size_t(b) * std::size_t(block_size_), static_cast<std::size_t>(block_size_)};
  }
  /// The extra key block b hashes (the stream's extra with its multimodal keys folded in).
  std::uint64_t extra(std::int32_t b) const noexcept { return extra_[static_cast<std::size_t>(b)]; }
  /// Leading positions of stream s whose ids the store has.
  std::int64_t known(std::uint32_t s) const noexcept { return known_[s]; }

  /// Stream s wrote ids[k] at slot_of(k), for positions first, first + 1, ...
  /// (`base`: the stream's own extra). The ids count when they continue what
  /// the store knows; each range of `extras` is folded into a block when its
  /// first position inside that block is among the written ones.
  template <class SlotOf>
  void write(std::uint32_t s, std::int64_t first, SlotOf&& slot_of, std::span<const std::int32_t> ids,
             std::uint64_t base, std::span<const ExtraKey> extras) noexcept {
    const std::int64_t n = static_cast<std::int64_t>(ids.size());
    for (std::size_t k = 0; k < ids.size(); ++k) {
      const std::int32_t slot = slot_of(k);
      ids_[static_cast<std::size_t>(slot)] = ids[k];
      if (math_.mod(slot) == 0) {  // a block's first token: its extra starts from the stream's
        extra_[block(slot)] = base;
        mixed_at_[block(slot)] = -1;
      }
    }
    for (const ExtraKey& e : extras) {
      const std::int64_t lo = std::max(e.begin, first), hi = std::min(e.end, first + n);
      for (std::int64_t p = lo; p < hi; ++p) {
        const std::int32_t slot = slot_of(static_cast<std::size_t>(p - first)), off = math_.mod(slot);
        if (off != 0 && p != e.begin) continue;  // not the range's first position in this block
        extra_[block(slot)] = fold_extra(extra_[block(slot)], e.key);
        mixed_at_[block(slot)] = off;
      }
    }
    if (known_[s] == first) known_[s] = first + n;
  }
  /// Block dst is a copy of src (copy-on-write): so are its ids.
  void copy_block(std::int32_t src, std::int32_t dst) noexcept {
    std::copy_n(ids_.begin() + std::ptrdiff_t(src) * block_size_, block_size_, ids_.begin() + std::ptrdiff_t(dst) * block_size_);
    extra_[static_cast<std::size_t>(dst)] = extra_[static_cast<std::size_t>(src)];
    mixed_at_[static_cast<std::size_t>(dst)] = mixed_at_[static_cast<std::size_t>(src)];
  }
  /// Stream s starts a row whose first `known` positions the store has (a prefix hit, a fork).
  void start(std::uint32_t s, std::int64_t known) noexcept { known_[s] = known; }
  /// Stream s rolled back to `tokens` positions, its tail in block `tail`
  /// (-1: none). A multimodal key folded in at or after the cut cannot be
  /// taken out again: the tail block's ids stop counting.
  void truncate(std::uint32_t s, std::int64_t tokens, std::int32_t tail) noexcept {
    known_[s] = std::min(known_[s], tokens);
    const std::int32_t off = static_cast<std::int32_t>(tokens - std::int64_t{math_.div(tokens)} * block_size_);
    if (tail >= 0 && off != 0 && mixed_at_[static_cast<std::size_t>(tail)] >= off)
      known_[s] = std::min(known_[s], tokens - off);
  }

  friend bool operator==(const BlockTokens& a, const BlockTokens& b) {
    return a.ids_ == b.ids_ && a.extra_ == b.extra_ && a.mixed_at_ == b.mixed_at_ && a.known_ == b.known_ &&
           a.block_size_ == b.block_size_;
  }

 private:
  static std::size_t checked(std::int32_t num_blocks, std::int32_t block_size) {
    return checked_elements("kvcache::BlockTokens", "num_blocks*block_size", std::int64_t{num_blocks} * block_size,
                            std::int64_t{num_blocks} * block_size, 4 + 12 / std::max(block_size, 1));
  }
  std::size_t block(std::int32_t slot) const noexcept { return static_cast<std::size_t>(math_.div(slot)); }

  std::vector<std::int32_t> ids_;        // [num_blocks][block_size]
  std::vector<std::uint64_t> extra_;     // per block
  std::vector<std::int32_t> mixed_at_;   // per block: offset of the last folded key's first position (-1: none)
  std::vector<std::int64_t> known_;      // per stream
  std::int32_t block_size_ = 0;
  BlockMath math_{};
};

KVCACHE_END_NAMESPACE
