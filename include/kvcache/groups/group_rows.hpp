// The rows of one layer group: per sequence, the block id of every block
// index, with the null block where the group's rule freed a block (or a
// prefix hit never needed it), and where an eviction policy on a global
// group removed one (a hole: the blocks after it keep their index, so their
// keys keep their positions). Ids are drawn from, and go back to, the one
// BlockPool every group shares.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/pool/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/groups/group_rule.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// One group's block rows: [max_sequences][max_blocks] ids, each row's length, its first live block and its holes.
class GroupRows {
 public:
  GroupRows() = default;
  /// Empty rows for max_sequences sequences of up to max_blocks blocks; ConfigError past the bookkeeping limit.
  GroupRows(const GroupRule& rule, std::int32_t max_sequences, std::int32_t max_blocks)
      : rule_(rule),
        max_blocks_(max_blocks),
        ids_(checked_elements("kvcache::GroupRows", "max_blocks", max_blocks, std::int64_t{max_sequences} * max_blocks, 4),
             BlockPool::null_block),
        len_(std::size_t(max_sequences), 0),
        first_(std::size_t(max_sequences), 0),
        holes_(std::size_t(max_sequences), 0) {}

  const GroupRule& rule() const noexcept { return rule_; }  ///< The group's rule.
  std::int32_t max_blocks() const noexcept { return max_blocks_; }  ///< Block indices a row may reach.
  /// Row i's ids, null entries included: its block indices 0 .. length-1.
  std::span<const BlockId> row(std::uint32_t i) const noexcept { return {at(i), std::size_t(len_[i])}; }
  /// Row i's first live block: every entry below it is the null block.
  std::int32_t first_live(std::uint32_t i) const noexcept { return first_[i]; }
  /// Row i's live blocks (the ones it holds a reference to).
  std::int32_t live(std::uint32_t i) const noexcept { return len_[i] - first_[i] - holes_[i]; }
  /// Null entries of row i past its first live block: the blocks an eviction removed.
  std::int32_t holes(std::uint32_t i) const noexcept { return holes_[i]; }
  /// Positions row i holds no block for: before its first live block and in its holes.
  std::int64_t not_held(std::uint32_t i) const noexcept { return std::int64_t(first_[i] + holes_[i]) * rule_.block_size; }
  /// Row i's live blocks, in order, to `out` (compacted past holes); returns the end.
  template <class Out>
  Out copy_live(std::uint32_t i, Out out) const noexcept {
    const BlockId* b = at(i);
    if (holes_[i] == 0) return std::copy(b + first_[i], b + len_[i], out);
    return std::copy_if(b + first_[i], b + len_[i], out, [](BlockId x) { return x != BlockPool::null_block; });
  }
  /// Blocks of row i below index `upto` that would go back to the free pool if released (held by nobody else).
  std::int32_t freeable_below(const BlockPool& pool, std::uint32_t i, std::int32_t upto) const noexcept {
    std::int32_t n = 0;
    for (std::int32_t j = first_[i]; j < std::min(upto, len_[i]); ++j)
      n += at(i)[j] != BlockPool::null_block && pool.ref_count(at(i)[j]) == 1;
    return n;
  }

  /// Row i holds nothing below `upto`: those blocks go back to the pool last
  /// index first (so the later ones, whose content a window hit needs, are
  /// recycled first as vLLM does), their entries become the null block.
  void free_below(BlockPool& pool, std::uint32_t i, std::int32_t upto) noexcept {
    upto = std::min(upto, len_[i]);
    for (std::int32_t j = upto - 1; j >= first_[i]; --j) release(pool, i, j);
    first_[i] = std::max(first_[i], upto);
  }
  /// Row i lets block index j go (an eviction): a hole, the later blocks keep their indices.
  void punch(BlockPool& pool, std::uint32_t i, std::int32_t j) noexcept {
    if (at(i)[j] == BlockPool::null_block) return;
    release(pool, i, j);
    ++holes_[i];
  }
  /// Row i's blocks from index `keep` on go back to the pool, last first; the row ends at `keep`.
  void cut(BlockPool& pool, std::uint32_t i, std::int32_t keep) noexcept {
    for (std::int32_t j = len_[i] - 1; j >= keep; --j)
      if (j >= first_[i]) release(pool, i, j);
    len_[i] = keep;
    first_[i] = std::min(first_[i], keep);
  }
  /// Row i starts over (after cut(pool, i, 0)).
  void clear(std::uint32_t i) noexcept { len_[i] = first_[i] = holes_[i] = 0; }
  /// Row i, empty, takes a prefix hit: null entries below `first`, then `hits` (already retained).
  void adopt(std::uint32_t i, std::int32_t first, std::span<const BlockId> hits) noexcept {
    std::fill(at(i), at(i) + first, BlockPool::null_block);
    std::copy(hits.begin(), hits.end(), at(i) + first);
    first_[i] = first;
    len_[i] = first + std::int32_t(hits.size());
    holes_[i] = 0;
  }
  /// Row i grows by `fresh` (newly allocated blocks).
  void append(std::uint32_t i, std::span<const BlockId> fresh) noexcept {
    std::copy(fresh.begin(), fresh.end(), at(i) + len_[i]);
    len_[i] += std::int32_t(fresh.size());
  }

  friend bool operator==(const GroupRows&, const GroupRows&) = default;

 private:
  BlockId* at(std::uint32_t i) noexcept { return ids_.data() + std::size_t(i) * std::size_t(max_blocks_); }
  const BlockId* at(std::uint32_t i) const noexcept { return ids_.data() + std::size_t(i) * std::size_t(max_blocks_); }
  // Block j of row i goes back to the pool; a hole there is one hole fewer.
  void release(BlockPool& pool, std::uint32_t i, std::int32_t j) noexcept {
    BlockId& b = at(i)[j];
    if (b != BlockPool::null_block) (void)pool.release(b);
    else if (j >= first_[i]) --holes_[i];
    b = BlockPool::null_block;
  }

  GroupRule rule_{};
  std::int32_t max_blocks_ = 0;
  std::vector<BlockId> ids_;
  std::vector<std::int32_t> len_, first_, holes_;
};

KVCACHE_END_NAMESPACE
