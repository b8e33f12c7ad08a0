// Prefix sharing: chained block hashes of full token blocks. A new sequence
// adopts the cached blocks of its longest published prefix (shared by ref
// count); a sequence publishes its full blocks once written. Cached blocks
// stay reusable after their last holder frees them, until the pool recycles
// them (block_pool.hpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>

#include "kvcache/block_hash.hpp"
#include "kvcache/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/page_table.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// What add_sequence(prompt, key) found.
struct PrefixHit {
  SeqId seq{};  ///< The new sequence.
  std::int32_t cached_tokens = 0;  ///< Tokens already in the cache (whole blocks, at most the prompt's length - 1).
};

/// Prefix matching, adoption and publishing over a pool and a page table.
struct PrefixSharing {
  /// Longest run of cached full blocks for `tokens` (at most (len-1)/B blocks:
  /// the last token is always recomputed for its logits). Writes them to out.
  template <BlockHasher H>
  static std::int32_t match(const PageTable& t, const BlockPool& pool, std::span<const std::int32_t> tokens,
                            const PrefixKey& key, const H& hasher, std::span<BlockId> out) noexcept {
    const std::int64_t limit = std::min<std::int64_t>(
        {tokens.empty() ? 0 : std::int64_t(tokens.size() - 1) / t.block_size_, std::int64_t(out.size()), t.max_blocks_});
    BlockHash parent = chain_root(key);
    std::int32_t m = 0;
    for (; m < limit; ++m) {
      parent = hasher(parent, tokens.subspan(std::size_t(m) * std::size_t(t.block_size_), std::size_t(t.block_size_)), key.extra);
      const BlockId b = pool.lookup(parent);
      if (b < 0) break;
      out[static_cast<std::size_t>(m)] = b;
    }
    return m;
  }

  /// add() seeded with the cached prefix of `tokens`: the hit blocks are shared
  /// (retained), the sequence starts with cached_tokens tokens.
  template <BlockHasher H>
  static Result<PrefixHit> add(PageTable& t, BlockPool& pool, std::span<const std::int32_t> tokens,
                               const PrefixKey& key, const H& hasher) noexcept {
    if (t.nfree_ == 0) return Status{Errc::capacity_exceeded, "max_sequences", t.max_streams_ + 1, t.max_streams_};
    const SeqId s = *t.add(key);
    std::span<BlockId> dst{t.row(s.index), static_cast<std::size_t>(t.max_blocks_)};
    const std::int32_t m = match(t, pool, tokens, key, hasher, dst);
    for (std::int32_t b = 0; b < m; ++b) (void)pool.retain(dst[static_cast<std::size_t>(b)]);
    t.st_[s.index].tokens = m * t.block_size_;
    t.st_[s.index].nblocks = t.st_[s.index].nhashed = m;
    t.st_[s.index].appended = t.st_[s.index].tokens;
    return PrefixHit{s, m * t.block_size_};
  }

  /// Publishes the full blocks of `tokens` (the sequence's tokens from position
  /// 0, already written to the cache) for prefix reuse. Returns how many blocks
  /// became shareable. The caller vouches that `tokens` is what was written.
  template <BlockHasher H>
  static Result<std::int32_t> publish(PageTable& t, BlockPool& pool, SeqId s, std::span<const std::int32_t> tokens,
                                      const H& hasher) noexcept {
    if (auto st = t.validate(s); !st) return st;
    const std::uint32_t i = s.index;
    // After eviction the held tokens are no longer the written prefix.
    if (t.st_[i].front != 0 || t.st_[i].tokens != t.st_[i].appended)
      return Status{Errc::invalid_argument, "evicted_tokens", t.st_[i].appended - t.st_[i].tokens, 0};
    if (std::int64_t(tokens.size()) > t.st_[i].tokens)
      return Status{Errc::prefix_too_long, "tokens.size", std::int64_t(tokens.size()), t.st_[i].tokens};
    const std::int32_t full = static_cast<std::int32_t>(tokens.size()) / t.block_size_;
    std::int32_t shared = 0;
    BlockHash parent = t.st_[i].nhashed == 0 ? chain_root(t.st_[i].key) : pool.hash(t.row(i)[t.st_[i].nhashed - 1]);
    for (std::int32_t b = t.st_[i].nhashed; b < full; ++b) {
      const BlockId blk = t.row(i)[b];
      const BlockHash h = hasher(parent, tokens.subspan(std::size_t(b) * std::size_t(t.block_size_), std::size_t(t.block_size_)), t.st_[i].key.extra);
      if (!pool.has_hash(blk)) {
        auto r = pool.publish(blk, h, parent);
        shared += (r.ok() && *r) ? 1 : 0;
      }
      parent = h;
    }
    t.st_[i].nhashed = std::max(t.st_[i].nhashed, full);
    return shared;
  }

};

/// Longest run of cached full blocks for `tokens`, at most (len-1)/B blocks
/// (the last token is always recomputed for its logits), written to out.
template <BlockHasher H>
std::int32_t match_prefix(const PageTable& t, const BlockPool& pool, std::span<const std::int32_t> tokens,
                          const PrefixKey& key, const H& hasher, std::span<BlockId> out) noexcept {
  return PrefixSharing::match(t, pool, tokens, key, hasher, out);
}
/// A new sequence starting with the cached prefix of `tokens` (blocks retained).
template <BlockHasher H>
Result<PrefixHit> add_with_prefix(PageTable& t, BlockPool& pool, std::span<const std::int32_t> tokens,
                                  const PrefixKey& key, const H& hasher) noexcept {
  return PrefixSharing::add(t, pool, tokens, key, hasher);
}
/// Publishes the full blocks of the sequence's first tokens.size() tokens.
template <BlockHasher H>
Result<std::int32_t> publish_prefix(PageTable& t, BlockPool& pool, SeqId s, std::span<const std::int32_t> tokens,
                                    const H& hasher) noexcept {
  return PrefixSharing::publish(t, pool, s, tokens, hasher);
}

KVCACHE_END_NAMESPACE
