// The rows of a page table: logical block -> physical block, per stream. A
// stream is a sequence, or a (sequence, layer, kv-head) when heads keep
// ragged lengths. Capacities are fixed at construction; no operation
// allocates afterwards. PageTable (table/page_table.hpp) adds the decode step's
// batched reserve on top of these one-stream edits.
//
// Every mutating call validates everything first and only then changes
// state, so a failed call leaves the table and the pool exactly as they were.
// The pool is passed to each call (not stored), so owners stay movable.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/core/block_hash.hpp"
#include "kvcache/pool/block_holds.hpp"
#include "kvcache/core/block_math.hpp"
#include "kvcache/pool/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Logical to physical blocks per stream, with dense generation-checked handles
/// (the base of PageTable, which adds reserve_batch).
class PageTableRows {
  friend struct PrefixSharing;   // prefix/prefix_sharing.hpp: match / adopt / publish
  friend struct PageTableEdits;  // table/page_table_edits.hpp: what eviction does to a row
  friend class PageTable;        // table/page_table.hpp: reserve_batch, the decode step's pass over these rows

 public:
  /// A table of `max_streams` rows of up to `max_blocks_per_stream` blocks over `pool`; throws ConfigError for bad
  /// sizes.
  PageTableRows(const BlockPool& pool, std::int32_t max_streams, std::int32_t max_blocks_per_stream,
            std::int32_t block_size)
      : max_streams_(positive(max_streams, "max_streams")),
        max_blocks_(positive(max_blocks_per_stream, "max_blocks_per_stream")),
        block_size_(positive(block_size, "block_size")),
        blocks_(checked_sizes(pool, max_streams, max_blocks_per_stream, block_size), BlockPool::null_block),
        st_(static_cast<std::size_t>(max_streams)),
        free_(max_streams),
        max_tokens_(max_blocks_per_stream * block_size),  // checked_sizes: fits int32
        shift_(BlockMath::of(block_size).shift) {
  }

  /// Tokens per block.
  std::int32_t block_size() const noexcept { return block_size_; }
  /// Division by the block size (a shift when it is a power of two): what per-sequence loops use.
  BlockMath block_math() const noexcept { return math(); }
  /// Rows (handles) the table has.
  std::int32_t max_streams() const noexcept { return max_streams_; }
  /// Most tokens one row holds (max blocks x block size).
  std::int32_t max_tokens() const noexcept { return max_tokens_; }
  /// Longest row, in blocks.
  std::int32_t max_blocks_per_stream() const noexcept { return max_blocks_; }
  /// Rows in use.
  std::int32_t num_streams() const noexcept { return max_streams_ - free_.size(); }
  /// Rows free.
  std::int32_t free_streams() const noexcept { return free_.size(); }
  /// Blocks that `tokens` tokens fill.
  std::int32_t blocks_for(std::int64_t tokens) const noexcept { return math().blocks_for(tokens); }

  /// True when s names a live row of this generation (not sealed).
  bool live(SeqId s) const noexcept {
    return s.index < static_cast<std::uint32_t>(max_streams_) && st_[s.index].alive == 1 && st_[s.index].gen == s.generation;
  }
  /// True when s names a sealed row: an import in flight, whose handle is not handed out yet.
  bool sealed(SeqId s) const noexcept {
    return s.index < static_cast<std::uint32_t>(max_streams_) && st_[s.index].alive == 2 && st_[s.index].gen == s.generation;
  }

  /// ok, or unknown_sequence naming the stale index or generation, or a
  /// sealed row (an import in flight: no call reads or edits it).
  Status validate(SeqId s) const noexcept {
    return check_handle(s, static_cast<std::uint32_t>(max_streams_), [&](std::uint32_t i) {
      return HandleSlot{.in_use = st_[i].alive != 0, .sealed = st_[i].alive == 2, .generation = st_[i].gen};
    });
  }

  /// Unchecked accessors (call validate first): the hot paths of exporters.
  std::int32_t tokens_unchecked(SeqId s) const noexcept { return st_[s.index].tokens; }
  /// s's blocks, s assumed valid.
  std::span<const BlockId> blocks_unchecked(SeqId s) const noexcept {
    return {row(s.index), static_cast<std::size_t>(st_[s.index].nblocks)};
  }
  /// Dead slots at the head of the first block (a sliding window dropped them;
  /// 0 otherwise). The row holds front + tokens slots; kernels that read the
  /// row mask the front with their window.
  std::int32_t front_unchecked(SeqId s) const noexcept { return st_[s.index].front; }

  /// Live tokens s holds.
  Result<std::int32_t> tokens(SeqId s) const noexcept {
    if (auto st = validate(s); !st) return st;
    return st_[s.index].tokens;
  }
  /// s's physical blocks, in logical order.
  Result<std::span<const BlockId>> blocks(SeqId s) const noexcept {
    if (auto st = validate(s); !st) return st;
    return blocks_unchecked(s);
  }
  /// Dead slots before s's first live token (sliding window only, < block size).
  Result<std::int32_t> front(SeqId s) const noexcept {
    if (auto st = validate(s); !st) return st;
    return st_[s.index].front;
  }
  /// Tokens ever appended to s (the next token's position), s assumed valid.
  std::int64_t appended_unchecked(SeqId s) const noexcept { return st_[s.index].appended; }
  /// s's prefix key (salt and extra), s assumed valid.
  const PrefixKey& key_unchecked(SeqId s) const noexcept { return st_[s.index].key; }
  /// Tokens ever appended (reserved minus truncated); eviction bounds use it.
  Result<std::int64_t> appended(SeqId s) const noexcept {
    if (auto st = validate(s); !st) return st;
    return st_[s.index].appended;
  }

  /// Calls f(SeqId) for every live stream, in slot order.
  template <class F>
  void for_each_stream(F&& f) const {
    for (std::uint32_t i = 0; i < static_cast<std::uint32_t>(max_streams_); ++i)
      if (st_[i].alive) f(SeqId{i, st_[i].gen});
  }

  /// A new empty row; capacity_exceeded when every handle is in use.
  Result<SeqId> add(const PrefixKey& key = {}) noexcept {
    auto slot = free_.take();
    if (!slot) return slot.status();
    const std::uint32_t i = *slot;
    st_[i].alive = 1;
    st_[i].key = key;
    return SeqId{i, st_[i].gen};
  }

  /// Frees the stream; its blocks go back to the pool tail-first, so among
  /// equally old cached blocks the chain tail is recycled first.
  Status release(BlockPool& pool, SeqId s) noexcept {
    if (auto st = validate(s); !st) return st;
    const std::uint32_t i = s.index;
    for (std::int32_t b = st_[i].nblocks; b-- > 0;) (void)pool.release(row(i)[b]);
    clear_row(i, 0);
    st_[i].tokens = st_[i].nblocks = st_[i].nhashed = st_[i].front = 0;
    st_[i].appended = 0;
    st_[i].key = PrefixKey{};
    st_[i].alive = 0;
    ++st_[i].gen;
    free_.give(i);
    return {};
  }

  /// Room for n more tokens; writes their slots to slots[0..n). All or nothing.
  Result<ReserveInfo> reserve(BlockPool& pool, SeqId s, std::int32_t n, std::span<std::int32_t> slots) noexcept {
    if (auto st = validate(s); !st) return st;
    Stream& stream = st_[s.index];
    if (const std::int32_t off = mod_b(stream.front + stream.tokens);
        n > 0 && off != 0 && slots.size() >= static_cast<std::size_t>(n) &&
        append_in_tail(pool, stream, row(s.index)[stream.nblocks - 1], block_size_, off, n, slots.data()))
      return ReserveInfo{};  // fits the tail: nothing to allocate, nothing can fail
    Need need{};
    if (auto st = plan_reserve(pool, s.index, n, need); !st) return st;
    if (slots.size() < static_cast<std::size_t>(n)) return Status{Errc::buffer_too_small, "slots", std::int64_t(slots.size()), n};
    if (need.blocks > pool.num_free()) return Status{Errc::out_of_blocks, "n_blocks", need.blocks, pool.num_free()};
    ReserveInfo info{};
    apply_reserve(pool, s.index, n, slots.data(), info);
    return info;
  }

  /// n tokens of s were appended without a slot (a per-token admission did not
  /// admit them): its positions advance, nothing is held.
  Status skip(SeqId s, std::int32_t n) noexcept {
    if (auto st = validate(s); !st) return st;
    if (n < 0) return Status{Errc::invalid_argument, "n_tokens", n, 0};
    st_[s.index].appended += n;
    return {};
  }

  /// Drops the last n tokens (speculative-decoding rollback). Blocks left empty
  /// return to the pool. A published block that becomes the partial tail keeps
  /// its hash (its content is still valid) until a write: then a shared tail is
  /// copied first and an unshared one loses its hash before it is overwritten.
  Status truncate(BlockPool& pool, SeqId s, std::int32_t n) noexcept {
    if (auto st = validate(s); !st) return st;
    const std::uint32_t i = s.index;
    if (n < 0) return Status{Errc::invalid_argument, "n_tokens", n, 0};
    if (n > st_[i].tokens) return Status{Errc::truncate_too_many, "n_tokens", n, st_[i].tokens};
    cut_tail(pool, i, n);
    st_[i].appended -= n;
    return {};
  }

  /// A new stream sharing every block of `s` (parallel sampling, beam search).
  Result<SeqId> fork(BlockPool& pool, SeqId s) noexcept {
    if (auto st = validate(s); !st) return st;
    auto child = add(st_[s.index].key);
    if (!child) return child.status();
    share_row(pool, s.index, child->index);
    return child;
  }

  /// Every block held by exactly its holders (the rows and `holds`), rows
  /// consistent with lengths, handles conserved. Assumes the table and the
  /// holds are the pool's only clients.
  Status check(const BlockPool& pool, const BlockHolds& holds = {}) const {
    std::vector<std::int32_t> refs(static_cast<std::size_t>(pool.capacity()), 0);
    holds.add_refs(refs);  // the pool's holders are the rows' and the transfers' holds
    std::int32_t alive = 0;
    for (std::uint32_t i = 0; i < std::uint32_t(max_streams_); ++i) {
      if (!st_[i].alive) {
        if (st_[i].tokens || st_[i].nblocks || st_[i].front) return Status{Errc::invariant_violated, "dead_stream", i, 0};
        continue;
      }
      ++alive;
      const std::int32_t used = st_[i].front + st_[i].tokens;
      if (st_[i].front < 0 || st_[i].front >= block_size_ || (st_[i].tokens == 0 && st_[i].front != 0))
        return Status{Errc::invariant_violated, "front", i, st_[i].front};
      if (st_[i].nblocks != blocks_for(used) || st_[i].nblocks > max_blocks_)
        return Status{Errc::invariant_violated, "row_length", i, st_[i].nblocks};
      if (st_[i].nhashed > used / block_size_) return Status{Errc::invariant_violated, "num_hashed", i, st_[i].nhashed};
      for (std::int32_t b = 0; b < max_blocks_; ++b) {
        const BlockId blk = row(i)[b];
        if (b >= st_[i].nblocks) {
          if (blk != BlockPool::null_block) return Status{Errc::invariant_violated, "row_tail", i, b};
          continue;
        }
        if (!pool.valid(blk)) return Status{Errc::invariant_violated, "row_block", i, blk};
        if (b < st_[i].nhashed && !pool.has_hash(blk)) return Status{Errc::invariant_violated, "unhashed", i, blk};
        ++refs[static_cast<std::size_t>(blk)];
      }
    }
    if (alive + free_.size() != max_streams_) return Status{Errc::invariant_violated, "handles", alive, free_.size()};
    for (BlockId b = 1; b < pool.capacity(); ++b)
      if (refs[static_cast<std::size_t>(b)] != pool.ref_count(b))
        return Status{Errc::invariant_violated, "holders", b, pool.ref_count(b)};
    return {};
  }

  /// Equality of observable state (batch scratch stamps excluded).
  friend bool operator==(const PageTableRows& a, const PageTableRows& b) {
    return a.max_streams_ == b.max_streams_ && a.max_blocks_ == b.max_blocks_ && a.block_size_ == b.block_size_ &&
           a.blocks_ == b.blocks_ && a.st_ == b.st_ && a.free_ == b.free_;
  }

 private:
  struct Need {
    std::int32_t blocks = 0;  // new blocks, copy-on-write target included
    std::int32_t copy = 0;    // 1 if the tail block is shared and gets written
  };

  static std::int32_t positive(std::int32_t v, const char* what) {
    if (v < 1) throw ConfigError("kvcache::PageTable", Status{Errc::invalid_argument, what, v, 1});
    return v;
  }
  // Slots are int32 (slot = block * block_size + offset), as kernels take
  // them; so are a stream's token indices. Returns the row storage's size.
  static std::size_t checked_sizes(const BlockPool& pool, std::int32_t streams, std::int32_t max_blocks, std::int32_t bs) {
    if (std::int64_t{pool.capacity()} * bs > INT32_MAX)
      throw ConfigError("kvcache::PageTable", Status{Errc::capacity_exceeded, "num_blocks*block_size",
                                                     std::int64_t{pool.capacity()} * bs, INT32_MAX});
    if (std::int64_t{max_blocks} * bs > INT32_MAX)
      throw ConfigError("kvcache::PageTable", Status{Errc::capacity_exceeded, "max_blocks_per_stream*block_size",
                                                     std::int64_t{max_blocks} * bs, INT32_MAX});
    const std::int64_t per_stream = std::int64_t{max_blocks} * static_cast<std::int64_t>(sizeof(BlockId) + sizeof(Stream)) + 4;
    (void)checked_elements("kvcache::PageTable", "max_sequences", streams, streams, per_stream);
    return static_cast<std::size_t>(streams) * static_cast<std::size_t>(max_blocks);
  }

  BlockId* row(std::uint32_t i) noexcept { return blocks_.data() + std::size_t(i) * std::size_t(max_blocks_); }
  const BlockId* row(std::uint32_t i) const noexcept {
    return blocks_.data() + std::size_t(i) * std::size_t(max_blocks_);
  }
  void clear_row(std::uint32_t i, std::int32_t from) noexcept {
    for (std::int32_t b = from; b < st_[i].nblocks; ++b) row(i)[b] = BlockPool::null_block;
  }

  BlockMath math() const noexcept { return {block_size_, shift_}; }
  std::int32_t div_b(std::int64_t x) const noexcept { return math().div(x); }
  std::int32_t mod_b(std::int32_t x) const noexcept { return math().mod(x); }

  Status plan_reserve(const BlockPool& pool, std::uint32_t i, std::int32_t n, Need& need) const noexcept {
    const Stream& st = st_[i];
    const std::int32_t used = st.front + st.tokens;
    if (n < 0) return Status{Errc::invalid_argument, "n_tokens", n, 0};
    const std::int64_t room = max_tokens_ - used;
    if (n > room) return Status{Errc::capacity_exceeded, "n_tokens", n, room};
    need.blocks = blocks_for(std::int64_t{used} + n) - st.nblocks;
    need.copy = (n > 0 && mod_b(used) != 0 && pool.ref_count(row(i)[st.nblocks - 1]) > 1) ? 1 : 0;
    need.blocks += need.copy;
    return {};
  }

  // The general append; callers have tried append_in_tail first.
  void apply_reserve(BlockPool& pool, std::uint32_t i, std::int32_t n, std::int32_t* slots, ReserveInfo& info) noexcept {
    if (n == 0) return;
    Stream& st = st_[i];
    BlockId* r = row(i);
    const std::int32_t t = st.front + st.tokens, nb = st.nblocks;
    std::int32_t off = mod_b(t);
    if (off != 0) {  // the write lands in the partial tail block
      BlockId& tail = r[nb - 1];
      if (pool.ref_count(tail) > 1) {
        const BlockId dst = *pool.allocate_one();
        info.copy = BlockCopy{tail, dst};
        (void)pool.release(tail);
        tail = dst;
      } else if (pool.has_hash(tail)) {
        (void)pool.unpublish(tail);  // its content changes: no prefix hit may see it
      }
    }
    const std::int32_t need = blocks_for(std::int64_t{t} + n);
    if (need > nb) (void)pool.allocate(std::span<BlockId>(r + nb, static_cast<std::size_t>(need - nb)));
    info.new_blocks = need - nb;
    // Slots run consecutively inside a block: fill block by block.
    for (std::int32_t k = 0, blk = div_b(t); k < n; off = 0, ++blk) {
      const std::int32_t base = r[blk] * block_size_ + off, m = std::min(block_size_ - off, n - k);
      for (std::int32_t j = 0; j < m; ++j) slots[k + j] = base + j;
      k += m;
    }
    st.tokens += n;
    st.nblocks = need;
    st.appended += n;
  }

  // Row c (empty) takes every block of row p, one more holder each (fork, share_into).
  void share_row(BlockPool& pool, std::uint32_t p, std::uint32_t c) noexcept {
    for (std::int32_t b = 0; b < st_[p].nblocks; ++b) {
      row(c)[b] = row(p)[b];
      (void)pool.retain(row(p)[b]);
    }
    st_[c].tokens = st_[p].tokens;
    st_[c].nblocks = st_[p].nblocks;
    st_[c].nhashed = st_[p].nhashed;
    st_[c].front = st_[p].front;
    st_[c].appended = st_[p].appended;
  }

  // Drops the last n held tokens; blocks left empty return to the pool.
  // Callers update `appended` (rollback) or not (eviction).
  void cut_tail(BlockPool& pool, std::uint32_t i, std::int32_t n) noexcept {
    Stream& st = st_[i];
    const std::int32_t t = st.tokens - n, used = t == 0 ? 0 : st.front + t, keep = blocks_for(used);
    for (std::int32_t b = st.nblocks; b-- > keep;) (void)pool.release(row(i)[b]);
    clear_row(i, keep);
    st.tokens = t;
    st.front = t == 0 ? 0 : st.front;
    st.nblocks = keep;
    st.nhashed = std::min(st.nhashed, used / block_size_);
  }

  std::int32_t max_streams_, max_blocks_, block_size_;
  std::vector<BlockId> blocks_;            // [max_streams][max_blocks], null-padded
  // Everything about one stream in one cache line: a decode step touches it once.
  struct Stream {
    std::int32_t tokens = 0;    // tokens held (live)
    std::int32_t nblocks = 0;   // == ceil((front + tokens) / block_size)
    std::int32_t nhashed = 0;   // leading blocks already published
    std::uint32_t gen = 0;      // handle generation
    std::int64_t appended = 0;  // tokens ever appended (eviction bounds)
    PrefixKey key{};
    std::uint8_t alive = 0;     // 0 free, 1 live, 2 sealed (an import in flight)
    std::int32_t front = 0;     // dead slots before the first live token (< block_size)
    std::uint32_t stamp = 0;    // reserve_batch duplicate detection (scratch, not state)
    friend bool operator==(const Stream& a, const Stream& b) {
      return a.tokens == b.tokens && a.nblocks == b.nblocks && a.nhashed == b.nhashed && a.gen == b.gen &&
             a.appended == b.appended && a.key == b.key && a.alive == b.alive && a.front == b.front;
    }
  };
  std::vector<Stream> st_;

  // Decode's common case, no allocation: the n tokens fit the partial tail
  // block (at `off`), which only this stream holds and nobody can hit.
  static bool append_in_tail(const BlockPool& pool, Stream& st, BlockId tail, std::int32_t block_size, std::int32_t off,
                             std::int32_t n, std::int32_t* slots) noexcept {
    if (n > block_size - off || pool.ref_count(tail) != 1 || pool.has_hash(tail)) return false;
    const std::int32_t base = tail * block_size + off;
    for (std::int32_t j = 0; j < n; ++j) slots[j] = base + j;
    st.tokens += n;
    st.appended += n;
    return true;
  }

  FreeHandles free_;                       // free stream slots (core/sequence_id.hpp)
  std::int32_t max_tokens_;                // max_blocks_per_stream * block_size
  std::int32_t shift_;                     // log2(block_size), or -1 if not a power of two
};

KVCACHE_END_NAMESPACE
