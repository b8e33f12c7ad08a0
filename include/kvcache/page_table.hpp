// Logical block -> physical block, per stream. A stream is a sequence, or a
// (sequence, layer, kv-head) when heads keep ragged lengths. Capacities are
// fixed at construction; no operation allocates afterwards.
//
// Every mutating call validates everything first and only then changes
// state, so a failed call leaves the table and the pool exactly as they were.
// The pool is passed to each call (not stored), so owners stay movable.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvcache/block_hash.hpp"
#include "kvcache/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

// copy.src < 0: nothing to copy. Otherwise the engine copies block src to dst
// before writing the new tokens (copy-on-write of a shared tail block).
struct ReserveInfo {
  std::int32_t new_blocks = 0;
  BlockCopy copy{};
};

struct BatchInfo {
  std::int32_t slots = 0;   // slots written (the rest of the buffer is -1)
  std::int32_t copies = 0;  // copy commands written
};

struct PrefixHit {
  SeqId seq{};
  std::int32_t cached_tokens = 0;
};

class PageTable {
 public:
  PageTable(const BlockPool& pool, std::int32_t max_streams, std::int32_t max_blocks_per_stream,
            std::int32_t block_size)
      : max_streams_(positive(max_streams, "max_streams")),
        max_blocks_(positive(max_blocks_per_stream, "max_blocks_per_stream")),
        block_size_(positive(block_size, "block_size")),
        blocks_(static_cast<std::size_t>(max_streams) * static_cast<std::size_t>(max_blocks_per_stream),
                BlockPool::null_block),
        tokens_(static_cast<std::size_t>(max_streams), 0),
        nblocks_(tokens_.size(), 0),
        nhashed_(tokens_.size(), 0),
        appended_(tokens_.size(), 0),
        key_(tokens_.size()),
        gen_(tokens_.size(), 0),
        alive_(tokens_.size(), 0),
        free_(tokens_.size()),
        stamp_(tokens_.size(), 0) {
    // Slots are int32 (slot = block * block_size + offset), as kernels take them.
    if (std::int64_t{pool.capacity()} * block_size > INT32_MAX)
      throw std::invalid_argument("kvcache::PageTable: pool capacity " + std::to_string(pool.capacity()) +
                                  " x block_size " + std::to_string(block_size) + " overflows int32 slots");
    if (std::int64_t{max_blocks_per_stream} * block_size > INT32_MAX)
      throw std::invalid_argument("kvcache::PageTable: max_blocks_per_stream x block_size overflows int32");
    for (std::int32_t i = 0; i < max_streams; ++i) free_[static_cast<std::size_t>(i)] = max_streams - 1 - i;
    nfree_ = max_streams;
  }

  std::int32_t block_size() const noexcept { return block_size_; }
  std::int32_t max_streams() const noexcept { return max_streams_; }
  std::int32_t max_blocks_per_stream() const noexcept { return max_blocks_; }
  std::int32_t num_streams() const noexcept { return max_streams_ - nfree_; }
  std::int32_t free_streams() const noexcept { return nfree_; }
  std::int32_t blocks_for(std::int64_t tokens) const noexcept {
    return static_cast<std::int32_t>((tokens + block_size_ - 1) / block_size_);
  }

  Status validate(SeqId s) const noexcept {
    if (s.index >= static_cast<std::uint32_t>(max_streams_))
      return Status{Errc::unknown_sequence, "seq.index", s.index, max_streams_};
    if (!alive_[s.index] || gen_[s.index] != s.generation)
      return Status{Errc::unknown_sequence, "seq.generation", s.generation, gen_[s.index]};
    return {};
  }

  // Unchecked accessors (call validate first): the hot paths of exporters.
  std::int32_t tokens_unchecked(SeqId s) const noexcept { return tokens_[s.index]; }
  std::span<const BlockId> blocks_unchecked(SeqId s) const noexcept {
    return {row(s.index), static_cast<std::size_t>(nblocks_[s.index])};
  }

  Result<std::int32_t> tokens(SeqId s) const noexcept {
    if (auto st = validate(s); !st) return st;
    return tokens_[s.index];
  }
  Result<std::span<const BlockId>> blocks(SeqId s) const noexcept {
    if (auto st = validate(s); !st) return st;
    return blocks_unchecked(s);
  }
  // Tokens ever appended (reserved minus truncated); eviction bounds use it.
  Result<std::int64_t> appended(SeqId s) const noexcept {
    if (auto st = validate(s); !st) return st;
    return appended_[s.index];
  }

  // Calls f(SeqId) for every live stream, in slot order.
  template <class F>
  void for_each_stream(F&& f) const {
    for (std::uint32_t i = 0; i < static_cast<std::uint32_t>(max_streams_); ++i)
      if (alive_[i]) f(SeqId{i, gen_[i]});
  }

  Result<SeqId> add(const PrefixKey& key = {}) noexcept {
    if (nfree_ == 0) return Status{Errc::capacity_exceeded, "max_sequences", max_streams_ + 1, max_streams_};
    const std::uint32_t i = static_cast<std::uint32_t>(free_[static_cast<std::size_t>(--nfree_)]);
    alive_[i] = 1;
    key_[i] = key;
    return SeqId{i, gen_[i]};
  }

  // Frees the stream; its blocks go back to the pool tail-first, so among
  // equally old cached blocks the chain tail is recycled first.
  Status release(BlockPool& pool, SeqId s) noexcept {
    if (auto st = validate(s); !st) return st;
    const std::uint32_t i = s.index;
    for (std::int32_t b = nblocks_[i]; b-- > 0;) (void)pool.release(row(i)[b]);
    clear_row(i, 0);
    tokens_[i] = nblocks_[i] = nhashed_[i] = 0;
    appended_[i] = 0;
    key_[i] = PrefixKey{};
    alive_[i] = 0;
    ++gen_[i];
    free_[static_cast<std::size_t>(nfree_++)] = static_cast<std::int32_t>(i);
    return {};
  }

  // Room for n more tokens; writes their slots to slots[0..n). All or nothing.
  Result<ReserveInfo> reserve(BlockPool& pool, SeqId s, std::int32_t n, std::span<std::int32_t> slots) noexcept {
    if (auto st = validate(s); !st) return st;
    Need need{};
    if (auto st = plan_reserve(pool, s.index, n, need); !st) return st;
    if (slots.size() < static_cast<std::size_t>(n)) return Status{Errc::buffer_too_small, "slots", std::int64_t(slots.size()), n};
    if (need.blocks > pool.num_free()) return Status{Errc::out_of_blocks, "n_blocks", need.blocks, pool.num_free()};
    ReserveInfo info{};
    apply_reserve(pool, s.index, n, slots.data(), info);
    return info;
  }

  // reserve() for a batch: counts[i] tokens for seqs[i], slots packed in order
  // into `slots`, the rest of `slots` padded with -1 (padded CUDA-graph
  // batches). Copy commands (one per shared tail) go to `copies`.
  Result<BatchInfo> reserve_batch(BlockPool& pool, std::span<const SeqId> seqs, std::span<const std::int32_t> counts,
                                  std::span<std::int32_t> slots, std::span<BlockCopy> copies) noexcept {
    if (counts.size() != seqs.size())
      return Status{Errc::invalid_argument, "counts.size", std::int64_t(counts.size()), std::int64_t(seqs.size())};
    ++epoch_;
    std::int64_t total_slots = 0, total_blocks = 0, total_copies = 0;
    for (std::size_t k = 0; k < seqs.size(); ++k) {
      if (auto st = validate(seqs[k]); !st) return st;
      if (stamp_[seqs[k].index] == epoch_)
        return Status{Errc::duplicate_sequence, "seq.index", seqs[k].index, std::int64_t(k)};
      stamp_[seqs[k].index] = epoch_;
      Need need{};
      if (auto st = plan_reserve(pool, seqs[k].index, counts[k], need); !st) return st;
      total_slots += counts[k];
      total_blocks += need.blocks;
      total_copies += need.copy;
    }
    if (std::int64_t(slots.size()) < total_slots)
      return Status{Errc::buffer_too_small, "slots", std::int64_t(slots.size()), total_slots};
    if (std::int64_t(copies.size()) < total_copies)
      return Status{Errc::buffer_too_small, "copies", std::int64_t(copies.size()), total_copies};
    if (total_blocks > pool.num_free()) return Status{Errc::out_of_blocks, "n_blocks", total_blocks, pool.num_free()};
    BatchInfo out{};
    std::int32_t* dst = slots.data();
    for (std::size_t k = 0; k < seqs.size(); ++k) {
      ReserveInfo info{};
      apply_reserve(pool, seqs[k].index, counts[k], dst, info);
      dst += counts[k];
      if (info.copy.src >= 0) copies[static_cast<std::size_t>(out.copies++)] = info.copy;
    }
    out.slots = static_cast<std::int32_t>(total_slots);
    for (std::int32_t* end = slots.data() + slots.size(); dst != end; ++dst) *dst = -1;
    return out;
  }

  // Drops the last n tokens (speculative-decoding rollback). Blocks left empty
  // return to the pool. A published block that becomes the partial tail keeps
  // its hash (its content is still valid) until a write: then a shared tail is
  // copied first and an unshared one loses its hash before it is overwritten.
  Status truncate(BlockPool& pool, SeqId s, std::int32_t n) noexcept {
    if (auto st = validate(s); !st) return st;
    const std::uint32_t i = s.index;
    if (n < 0) return Status{Errc::invalid_argument, "n_tokens", n, 0};
    if (n > tokens_[i]) return Status{Errc::truncate_too_many, "n_tokens", n, tokens_[i]};
    const std::int32_t t = tokens_[i] - n, keep = blocks_for(t);
    for (std::int32_t b = nblocks_[i]; b-- > keep;) (void)pool.release(row(i)[b]);
    clear_row(i, keep);
    tokens_[i] = t;
    nblocks_[i] = keep;
    nhashed_[i] = std::min(nhashed_[i], t / block_size_);
    appended_[i] -= n;
    return {};
  }

  // A new stream sharing every block of `s` (parallel sampling, beam search).
  Result<SeqId> fork(BlockPool& pool, SeqId s) noexcept {
    if (auto st = validate(s); !st) return st;
    auto child = add(key_[s.index]);
    if (!child) return child.status();
    const std::uint32_t p = s.index, c = child->index;
    for (std::int32_t b = 0; b < nblocks_[p]; ++b) {
      row(c)[b] = row(p)[b];
      (void)pool.retain(row(p)[b]);
    }
    tokens_[c] = tokens_[p];
    nblocks_[c] = nblocks_[p];
    nhashed_[c] = nhashed_[p];
    appended_[c] = appended_[p];
    return child;
  }

  // Longest run of cached full blocks for `tokens` (at most (len-1)/B blocks:
  // the last token is always recomputed for its logits). Writes them to out.
  template <BlockHasher H>
  std::int32_t match_prefix(const BlockPool& pool, std::span<const std::int32_t> tokens, const PrefixKey& key,
                            const H& hasher, std::span<BlockId> out) const noexcept {
    const std::int64_t limit = std::min<std::int64_t>(
        {tokens.empty() ? 0 : std::int64_t(tokens.size() - 1) / block_size_, std::int64_t(out.size()), max_blocks_});
    BlockHash parent = chain_root(key);
    std::int32_t m = 0;
    for (; m < limit; ++m) {
      parent = hasher(parent, tokens.subspan(std::size_t(m) * std::size_t(block_size_), std::size_t(block_size_)), key.extra);
      const BlockId b = pool.lookup(parent);
      if (b < 0) break;
      out[static_cast<std::size_t>(m)] = b;
    }
    return m;
  }

  // add() seeded with the cached prefix of `tokens`: the hit blocks are shared
  // (retained), the sequence starts with cached_tokens tokens.
  template <BlockHasher H>
  Result<PrefixHit> add_with_prefix(BlockPool& pool, std::span<const std::int32_t> tokens, const PrefixKey& key,
                                    const H& hasher) noexcept {
    if (nfree_ == 0) return Status{Errc::capacity_exceeded, "max_sequences", max_streams_ + 1, max_streams_};
    const SeqId s = *add(key);
    std::span<BlockId> dst{row(s.index), static_cast<std::size_t>(max_blocks_)};
    const std::int32_t m = match_prefix(pool, tokens, key, hasher, dst);
    for (std::int32_t b = 0; b < m; ++b) (void)pool.retain(dst[static_cast<std::size_t>(b)]);
    tokens_[s.index] = m * block_size_;
    nblocks_[s.index] = nhashed_[s.index] = m;
    appended_[s.index] = tokens_[s.index];
    return PrefixHit{s, m * block_size_};
  }

  // Publishes the full blocks of `tokens` (the sequence's tokens from position
  // 0, already written to the cache) for prefix reuse. Returns how many blocks
  // became shareable. The caller vouches that `tokens` is what was written.
  template <BlockHasher H>
  Result<std::int32_t> publish(BlockPool& pool, SeqId s, std::span<const std::int32_t> tokens,
                               const H& hasher) noexcept {
    if (auto st = validate(s); !st) return st;
    const std::uint32_t i = s.index;
    if (std::int64_t(tokens.size()) > tokens_[i])
      return Status{Errc::prefix_too_long, "tokens.size", std::int64_t(tokens.size()), tokens_[i]};
    const std::int32_t full = static_cast<std::int32_t>(tokens.size()) / block_size_;
    std::int32_t shared = 0;
    BlockHash parent = nhashed_[i] == 0 ? chain_root(key_[i]) : pool.hash(row(i)[nhashed_[i] - 1]);
    for (std::int32_t b = nhashed_[i]; b < full; ++b) {
      const BlockId blk = row(i)[b];
      const BlockHash h = hasher(parent, tokens.subspan(std::size_t(b) * std::size_t(block_size_), std::size_t(block_size_)), key_[i].extra);
      if (!pool.has_hash(blk)) {
        auto r = pool.publish(blk, h, parent);
        shared += (r.ok() && *r) ? 1 : 0;
      }
      parent = h;
    }
    nhashed_[i] = std::max(nhashed_[i], full);
    return shared;
  }

  // Every block held by exactly its holders, rows consistent with lengths,
  // handles conserved. Assumes the table is the pool's only client.
  Status check(const BlockPool& pool) const {
    std::vector<std::int32_t> refs(static_cast<std::size_t>(pool.capacity()), 0);
    std::int32_t alive = 0;
    for (std::uint32_t i = 0; i < std::uint32_t(max_streams_); ++i) {
      if (!alive_[i]) {
        if (tokens_[i] || nblocks_[i]) return Status{Errc::invariant_violated, "dead_stream", i, 0};
        continue;
      }
      ++alive;
      if (nblocks_[i] != blocks_for(tokens_[i]) || nblocks_[i] > max_blocks_)
        return Status{Errc::invariant_violated, "row_length", i, nblocks_[i]};
      if (nhashed_[i] > tokens_[i] / block_size_) return Status{Errc::invariant_violated, "num_hashed", i, nhashed_[i]};
      for (std::int32_t b = 0; b < max_blocks_; ++b) {
        const BlockId blk = row(i)[b];
        if (b >= nblocks_[i]) {
          if (blk != BlockPool::null_block) return Status{Errc::invariant_violated, "row_tail", i, b};
          continue;
        }
        if (!pool.valid(blk)) return Status{Errc::invariant_violated, "row_block", i, blk};
        if (b < nhashed_[i] && !pool.has_hash(blk)) return Status{Errc::invariant_violated, "unhashed", i, blk};
        ++refs[static_cast<std::size_t>(blk)];
      }
    }
    if (alive + nfree_ != max_streams_) return Status{Errc::invariant_violated, "handles", alive, nfree_};
    for (BlockId b = 1; b < pool.capacity(); ++b)
      if (refs[static_cast<std::size_t>(b)] != pool.ref_count(b))
        return Status{Errc::invariant_violated, "holders", b, pool.ref_count(b)};
    return {};
  }

  // Equality of observable state (batch scratch stamps excluded).
  friend bool operator==(const PageTable& a, const PageTable& b) {
    return a.max_streams_ == b.max_streams_ && a.max_blocks_ == b.max_blocks_ && a.block_size_ == b.block_size_ &&
           a.blocks_ == b.blocks_ && a.tokens_ == b.tokens_ && a.nblocks_ == b.nblocks_ && a.nhashed_ == b.nhashed_ &&
           a.appended_ == b.appended_ && a.key_ == b.key_ && a.gen_ == b.gen_ && a.alive_ == b.alive_ &&
           a.free_ == b.free_ && a.nfree_ == b.nfree_;
  }

 private:
  struct Need {
    std::int32_t blocks = 0;  // new blocks, copy-on-write target included
    std::int32_t copy = 0;    // 1 if the tail block is shared and gets written
  };

  static std::int32_t positive(std::int32_t v, const char* what) {
    if (v < 1) throw std::invalid_argument(std::string("kvcache::PageTable: ") + what + "=" + std::to_string(v) + " must be >= 1");
    return v;
  }

  BlockId* row(std::uint32_t i) noexcept { return blocks_.data() + std::size_t(i) * std::size_t(max_blocks_); }
  const BlockId* row(std::uint32_t i) const noexcept {
    return blocks_.data() + std::size_t(i) * std::size_t(max_blocks_);
  }
  void clear_row(std::uint32_t i, std::int32_t from) noexcept {
    for (std::int32_t b = from; b < nblocks_[i]; ++b) row(i)[b] = BlockPool::null_block;
  }

  Status plan_reserve(const BlockPool& pool, std::uint32_t i, std::int32_t n, Need& need) const noexcept {
    if (n < 0) return Status{Errc::invalid_argument, "n_tokens", n, 0};
    const std::int64_t room = std::int64_t{max_blocks_} * block_size_ - tokens_[i];
    if (n > room) return Status{Errc::capacity_exceeded, "n_tokens", n, room};
    need.blocks = blocks_for(std::int64_t{tokens_[i]} + n) - nblocks_[i];
    need.copy = 0;
    if (n > 0 && tokens_[i] % block_size_ != 0 && pool.ref_count(row(i)[nblocks_[i] - 1]) > 1) need.copy = 1;
    need.blocks += need.copy;
    return {};
  }
  void apply_reserve(BlockPool& pool, std::uint32_t i, std::int32_t n, std::int32_t* slots, ReserveInfo& info) noexcept {
    if (n == 0) return;
    BlockId* r = row(i);
    const std::int32_t t = tokens_[i], nb = nblocks_[i];
    if (t % block_size_ != 0) {  // the write lands in the partial tail block
      if (pool.ref_count(r[nb - 1]) > 1) {
        const BlockId dst = *pool.allocate_one();
        info.copy = BlockCopy{r[nb - 1], dst};
        (void)pool.release(r[nb - 1]);
        r[nb - 1] = dst;
      } else {
        (void)pool.unpublish(r[nb - 1]);  // its content changes: no prefix hit may see it
      }
    }
    const std::int32_t need = blocks_for(std::int64_t{t} + n);
    (void)pool.allocate(std::span<BlockId>(r + nb, static_cast<std::size_t>(need - nb)));
    info.new_blocks = need - nb;
    std::int32_t blk = t / block_size_, off = t % block_size_;
    for (std::int32_t k = 0; k < n; ++k) {
      slots[k] = r[blk] * block_size_ + off;
      if (++off == block_size_) {
        off = 0;
        ++blk;
      }
    }
    tokens_[i] = t + n;
    nblocks_[i] = need;
    appended_[i] += n;
  }

  std::int32_t max_streams_, max_blocks_, block_size_;
  std::vector<BlockId> blocks_;            // [max_streams][max_blocks], null-padded
  std::vector<std::int32_t> tokens_;       // tokens held
  std::vector<std::int32_t> nblocks_;      // == ceil(tokens / block_size)
  std::vector<std::int32_t> nhashed_;      // leading blocks already published
  std::vector<std::int64_t> appended_;     // tokens ever appended (eviction bounds)
  std::vector<PrefixKey> key_;
  std::vector<std::uint32_t> gen_;
  std::vector<std::uint8_t> alive_;
  std::vector<std::int32_t> free_;         // stack of free stream slots
  std::int32_t nfree_ = 0;
  std::vector<std::uint32_t> stamp_;       // duplicate detection scratch for reserve_batch
  std::uint32_t epoch_ = 0;
};

KVCACHE_END_NAMESPACE
