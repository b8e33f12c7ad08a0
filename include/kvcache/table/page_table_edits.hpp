// What eviction does to a stream's row, as page-table edits: no K/V byte
// moves here. Each call validates first and changes nothing on error.
//   remove_blocks  drop whole logical blocks; later blocks move up (block policies)
//   drop_front     drop the oldest tokens; fully dead blocks leave (sliding window)
//   drop_tail      drop the last tokens after the engine compacted (token policies)
//   privatize      give a shared block's holder its own copy before an in-place write
//                  (admission's ring slots are rewritten, not appended to)
//   share_into     an empty live row takes every block of another (a fork into
//                  a row the caller owns: head-paged admission keeps its rows)
//   extend_tail    n more tokens in a tail block the caller alone writes
//                  (reserve() without the pool: admission's decode step)
//   append_fresh   n more tokens in new blocks after a whole-block row, with
//                  no slots (import(): a peer writes them)
//   seal / unseal  a row no call may read or edit (an import in flight), and back
// Eviction never lowers `appended` (tokens ever appended): bounds use it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>

#include "kvcache/pool/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/table/page_table.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// What eviction does to a row, as table edits (no data moves).
struct PageTableEdits {
  /// Blocks at or after `b` lose their published hashes: their content or
  /// their position (and after re-rotation their keys) changes.
  static void unpublish_from(PageTable& t, BlockPool& pool, std::uint32_t i, std::int32_t first) noexcept {
    for (std::int32_t b = first; b < t.st_[i].nblocks; ++b)
      if (pool.has_hash(t.row(i)[b])) (void)pool.unpublish(t.row(i)[b]);
    t.st_[i].nhashed = std::min(t.st_[i].nhashed, first);
  }

  /// Removes the listed logical blocks (ascending) from s; later blocks move up; their blocks go back to the pool.
  static Status remove_blocks(PageTable& t, BlockPool& pool, SeqId s, std::span<const std::int32_t> logical) noexcept {
    if (auto st = t.validate(s); !st) return st;
    const std::uint32_t i = s.index;
    PageTable::Stream& st = t.st_[i];
    const std::int32_t bs = t.block_size_, full = (st.front + st.tokens) / bs, lowest = st.front > 0 ? 1 : 0;
    for (std::size_t k = 0; k < logical.size(); ++k) {
      const std::int32_t b = logical[k];
      if (b < lowest || b >= full || (k > 0 && b <= logical[k - 1]))
        return Status{Errc::invalid_argument, "logical_block", b, full};
    }
    if (logical.empty()) return {};
    BlockId* r = t.row(i);
    // A shared block never moves (its keys would be re-rotated under the other holders).
    for (std::int32_t b = logical.front(); b < st.nblocks; ++b)
      if (pool.ref_count(r[b]) != 1) return Status{Errc::invalid_argument, "shared_block", b, pool.ref_count(r[b])};
    const std::int32_t first = logical.front();
    unpublish_from(t, pool, i, first);
    std::int32_t out = first;
    std::size_t k = 0;
    for (std::int32_t b = first; b < st.nblocks; ++b) {
      if (k < logical.size() && logical[k] == b) {
        (void)pool.release(r[b]);
        ++k;
        continue;
      }
      r[out++] = r[b];
    }
    for (std::int32_t b = out; b < st.nblocks; ++b) r[b] = BlockPool::null_block;
    const auto removed = static_cast<std::int32_t>(logical.size());
    st.nblocks -= removed;
    st.tokens -= removed * bs;
    return {};
  }

  /// The n oldest live tokens leave. Blocks that hold no live token go back
  /// to the pool (shared ones just lose this holder) and the row moves up;
  /// a partly dead first block stays with `front` dead slots.
  static Status drop_front(PageTable& t, BlockPool& pool, SeqId s, std::int32_t n) noexcept {
    if (auto st = t.validate(s); !st) return st;
    const std::uint32_t i = s.index;
    PageTable::Stream& st = t.st_[i];
    if (n < 0 || n > st.tokens) return Status{Errc::invalid_argument, "n_tokens", n, st.tokens};
    if (n == 0) return {};
    const std::int32_t bs = t.block_size_;
    const std::int32_t dead = n == st.tokens ? st.nblocks : (st.front + n) / bs;
    BlockId* r = t.row(i);
    // Tail first, as free() and truncate(): among equally old cached blocks
    // the chain's tail is recycled first and its root stays reachable.
    for (std::int32_t b = dead; b-- > 0;) (void)pool.release(r[b]);
    std::copy(r + dead, r + st.nblocks, r);
    std::fill(r + st.nblocks - dead, r + st.nblocks, BlockPool::null_block);
    st.nblocks -= dead;
    st.tokens -= n;
    st.front = st.tokens == 0 ? 0 : (st.front + n) % bs;
    // The row no longer starts at position 0: it never publishes again, and
    // its published blocks may lose their hashes once the dropped parents
    // are recycled (the index stays prefix-closed).
    st.nhashed = 0;
    return {};
  }

  /// The engine compacted the stream (slots from first_rewritten on changed):
  /// the last n tokens leave. Rewritten blocks lose their published hashes.
  static Status drop_tail(PageTable& t, BlockPool& pool, SeqId s, std::int32_t n, std::int32_t first_rewritten) noexcept {
    if (auto st = t.validate(s); !st) return st;
    const std::uint32_t i = s.index;
    PageTable::Stream& st = t.st_[i];
    if (n < 0 || n > st.tokens) return Status{Errc::invalid_argument, "n_tokens", n, st.tokens};
    if (first_rewritten < 0 || first_rewritten > st.tokens)
      return Status{Errc::invalid_argument, "first_rewritten", first_rewritten, st.tokens};
    unpublish_from(t, pool, i, (st.front + first_rewritten) / t.block_size_);
    t.cut_tail(pool, i, n);
    return {};
  }

  /// Logical block b of s, shared with another holder, is replaced by a fresh
  /// block: the returned copy (src -> dst) must run before anything writes
  /// into it. An unshared block stays and the copy is {-1, -1}. The block
  /// loses its place among the row's published blocks (it will be rewritten).
  static Result<BlockCopy> privatize(PageTable& t, BlockPool& pool, SeqId s, std::int32_t b) noexcept {
    if (auto st = t.validate(s); !st) return st;
    const std::uint32_t i = s.index;
    PageTable::Stream& st = t.st_[i];
    if (b < 0 || b >= st.nblocks) return Status{Errc::invalid_argument, "logical_block", b, st.nblocks};
    BlockId* r = t.row(i);
    if (pool.ref_count(r[b]) == 1) return BlockCopy{};
    BlockId fresh = BlockPool::null_block;
    if (auto got = pool.allocate(std::span<BlockId>(&fresh, 1)); !got) return got;
    const BlockCopy copy{r[b], fresh};
    (void)pool.release(r[b]);  // shared: another holder keeps it
    r[b] = fresh;
    st.nhashed = std::min(st.nhashed, b);
    return copy;
  }

  /// n more tokens of s in its partial tail block, which the caller knows no
  /// other row holds and nobody has published (a head-paged row that was
  /// never forked): reserve()'s common case without reading the pool. Their
  /// slots start at the returned one. invalid_argument when the tail has no room for n.
  static Result<std::int32_t> extend_tail(PageTable& t, SeqId s, std::int32_t n) noexcept {
    if (auto st = t.validate(s); !st) return st;
    PageTable::Stream& st = t.st_[s.index];
    const std::int32_t used = st.front + st.tokens, off = t.mod_b(used);
    if (n < 1 || off == 0 || n > t.block_size_ - off)
      return Status{Errc::invalid_argument, "n_tokens (past the tail block)", n, off == 0 ? 0 : t.block_size_ - off};
    st.tokens += n;
    st.appended += n;
    return t.row(s.index)[st.nblocks - 1] * t.block_size_ + off;
  }

  /// n more tokens of s in fresh blocks (their ids in out[0..k), k returned),
  /// all or nothing: s must end on a block boundary (a prefix hit or empty),
  /// with room for n more tokens (capacity_exceeded), out room for the
  /// blocks (buffer_too_small) and the pool that many free (out_of_blocks).
  static Result<std::int32_t> append_fresh(PageTable& t, BlockPool& pool, SeqId s, std::int32_t n, std::span<BlockId> out) noexcept {
    return append_fresh(t, pool, s, n, &out);
  }
  /// append_fresh() without copying the new blocks out (the row lists them).
  static Result<std::int32_t> append_fresh(PageTable& t, BlockPool& pool, SeqId s, std::int32_t n) noexcept {
    return append_fresh(t, pool, s, n, nullptr);
  }

 private:
  static Result<std::int32_t> append_fresh(PageTable& t, BlockPool& pool, SeqId s, std::int32_t n, std::span<BlockId>* copy) noexcept {
    if (auto st = t.validate(s); !st) return st;
    PageTable::Stream& st = t.st_[s.index];
    if (n < 0) return Status{Errc::invalid_argument, "n_tokens", n, 0};
    if (st.front != 0 || t.mod_b(st.tokens) != 0) return Status{Errc::invalid_argument, "tokens (not whole blocks)", st.tokens, 0};
    if (n > t.max_tokens_ - st.tokens) return Status{Errc::capacity_exceeded, "n_tokens", n, t.max_tokens_ - st.tokens};
    const std::int32_t k = t.blocks_for(std::int64_t{st.tokens} + n) - st.nblocks;
    if (copy && copy->size() < std::size_t(k)) return Status{Errc::buffer_too_small, "blocks", std::int64_t(copy->size()), k};
    if (k > pool.num_free()) return Status{Errc::out_of_blocks, "n_blocks", k, pool.num_free()};
    const std::span<BlockId> fresh{t.row(s.index) + st.nblocks, std::size_t(k)};
    (void)pool.allocate(fresh);  // checked: enough are free
    if (copy) std::copy(fresh.begin(), fresh.end(), copy->begin());
    st.nblocks += k;
    st.tokens += n;
    st.appended += n;
    return k;
  }

 public:

  /// Seals live row s: every call that names it fails (unknown_sequence), so
  /// nothing reads, writes, exports or evicts it until unseal(). It still
  /// holds its blocks and its handle.
  static void seal(PageTable& t, SeqId s) noexcept { t.st_[s.index].alive = 2; }
  /// Unseals sealed row s (its caller checked sealed(s)).
  static void unseal(PageTable& t, SeqId s) noexcept { t.st_[s.index].alive = 1; }

  /// The empty live row `into` takes every block of `from` (one more holder
  /// each), as fork() does for a row it adds. invalid_argument when `into`
  /// holds tokens or is `from`.
  static Status share_into(PageTable& t, BlockPool& pool, SeqId from, SeqId into) noexcept {
    if (auto st = t.validate(from); !st) return st;
    if (auto st = t.validate(into); !st) return st;
    if (from.index == into.index) return Status{Errc::invalid_argument, "into (is from)", into.index, from.index};
    if (const std::int32_t nb = t.st_[into.index].nblocks; nb != 0)
      return Status{Errc::invalid_argument, "into.blocks (not empty)", nb, 0};
    t.share_row(pool, from.index, into.index);
    return {};
  }
};

/// PageTableEdits::privatize as a free function.
inline Result<BlockCopy> privatize(PageTable& t, BlockPool& pool, SeqId s, std::int32_t logical) noexcept {
  return PageTableEdits::privatize(t, pool, s, logical);
}
/// PageTableEdits::extend_tail as a free function.
inline Result<std::int32_t> extend_tail(PageTable& t, SeqId s, std::int32_t n) noexcept {
  return PageTableEdits::extend_tail(t, s, n);
}
/// PageTableEdits::share_into as a free function.
inline Status share_into(PageTable& t, BlockPool& pool, SeqId from, SeqId into) noexcept {
  return PageTableEdits::share_into(t, pool, from, into);
}
/// PageTableEdits::remove_blocks as a free function.
inline Status remove_blocks(PageTable& t, BlockPool& pool, SeqId s, std::span<const std::int32_t> logical) noexcept {
  return PageTableEdits::remove_blocks(t, pool, s, logical);
}
/// PageTableEdits::drop_front as a free function.
inline Status drop_front(PageTable& t, BlockPool& pool, SeqId s, std::int32_t n) noexcept {
  return PageTableEdits::drop_front(t, pool, s, n);
}
/// PageTableEdits::drop_tail as a free function.
inline Status drop_tail(PageTable& t, BlockPool& pool, SeqId s, std::int32_t n, std::int32_t first_rewritten) noexcept {
  return PageTableEdits::drop_tail(t, pool, s, n, first_rewritten);
}

KVCACHE_END_NAMESPACE
