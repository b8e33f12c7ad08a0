// Prefix sharing: chained block hashes of full token blocks. A new sequence
// adopts the cached blocks of its longest published prefix (shared by ref
// count); a sequence publishes its full blocks once written, explicitly or
// as reserve() is given their ids (prefix/block_tokens.hpp). Cached blocks stay
// reusable after their last holder frees them, until the pool recycles them
// (pool/block_pool.hpp); the index keeps copies and stays prefix-closed
// (pool/prefix_index.hpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>

#include "kvcache/core/block_hash.hpp"
#include "kvcache/pool/block_pool.hpp"
#include "kvcache/prefix/block_tokens.hpp"
#include "kvcache/config.hpp"
#include "kvcache/table/page_table.hpp"
#include "kvcache/status.hpp"
#include "kvcache/core/sequence_id.hpp"

KVCACHE_BEGIN_NAMESPACE

/// What add_sequence(prompt, key) found.
struct PrefixHit {
  SeqId seq{};  ///< The new sequence.
  std::int32_t cached_tokens = 0;  ///< Tokens already in the cache (whole blocks, at most the prompt's length - 1).
};

/// The prefix hit a prompt would get, found without changing anything.
struct PrefixMatch {
  std::int32_t blocks = 0;  ///< Hit blocks (written to the caller's buffer).
  std::int32_t free_blocks = 0;  ///< Of those, free-but-cached: adopting them takes them from the free pool.
};

/// Prefix matching, adoption and publishing over a pool and a page table.
struct PrefixSharing {
  /// Extra keys must be non-empty ranges at non-negative positions, sorted and
  /// not overlapping (an input's placeholders are consecutive tokens).
  static Status check_extras(std::span<const ExtraKey> extras) noexcept {
    for (std::size_t i = 0; i < extras.size(); ++i) {
      if (extras[i].begin < 0) return Status{Errc::invalid_argument, "extras.begin", extras[i].begin, 0};
      if (extras[i].end <= extras[i].begin) return Status{Errc::invalid_argument, "extras.end", extras[i].end, extras[i].begin + 1};
      if (i > 0 && extras[i].begin < extras[i - 1].end)
        return Status{Errc::invalid_argument, "extras.begin (sorted, not overlapping)", extras[i].begin, extras[i - 1].end};
    }
    return {};
  }

  /// Longest run of cached full blocks for `tokens` (at most (len-1)/B blocks:
  /// the last token is always recomputed for its logits), written to out.
  template <BlockHasher H>
  static PrefixMatch match(const PageTable& t, const BlockPool& pool, std::span<const std::int32_t> tokens,
                           const PrefixKey& key, std::span<const ExtraKey> extras, const H& hasher,
                           std::span<BlockId> out) noexcept {
    return walk(t, pool, tokens, key, extras, hasher, std::int64_t(out.size()), [&](std::int32_t i, BlockId b) { out[std::size_t(i)] = b; });
  }
  /// match() counting the hit without writing its blocks.
  template <BlockHasher H>
  static PrefixMatch count(const PageTable& t, const BlockPool& pool, std::span<const std::int32_t> tokens,
                           const PrefixKey& key, std::span<const ExtraKey> extras, const H& hasher) noexcept {
    return walk(t, pool, tokens, key, extras, hasher, INT64_MAX, [](std::int32_t, BlockId) {});
  }

  /// A new row for `key` holding the hit blocks (retained): the sequence
  /// starts with hits.size() full blocks. The caller checked a handle is free.
  static SeqId adopt(PageTable& t, BlockPool& pool, const PrefixKey& key, std::span<const BlockId> hits) noexcept {
    const SeqId s = *t.add(key);
    const std::int32_t m = static_cast<std::int32_t>(hits.size());
    for (std::int32_t b = 0; b < m; ++b) {
      t.row(s.index)[b] = hits[static_cast<std::size_t>(b)];
      (void)pool.retain(hits[static_cast<std::size_t>(b)]);
    }
    PageTable::Stream& st = t.st_[s.index];
    st.tokens = m * t.block_size_;
    st.nblocks = st.nhashed = m;
    st.appended = st.tokens;
    return s;
  }

  /// add() seeded with the cached prefix of `tokens`: the hit blocks are shared
  /// (retained), the sequence starts with cached_tokens tokens.
  template <BlockHasher H>
  static Result<PrefixHit> add(PageTable& t, BlockPool& pool, std::span<const std::int32_t> tokens,
                               const PrefixKey& key, std::span<const ExtraKey> extras, const H& hasher) noexcept {
    const auto next = t.free_.next();
    if (!next) return next.status();
    if (auto st = check_extras(extras); !st) return st;
    // Match straight into the row add() hands out next (still all null blocks).
    std::span<BlockId> row{t.row(*next), static_cast<std::size_t>(t.max_blocks_)};
    const PrefixMatch m = match(t, pool, tokens, key, extras, hasher, row);
    const SeqId s = adopt(t, pool, key, row.first(static_cast<std::size_t>(m.blocks)));
    return PrefixHit{s, m.blocks * t.block_size_};
  }

  /// Publishes the full blocks of `tokens` (the sequence's tokens from position
  /// 0, already written to the cache) for prefix reuse. Returns how many hashes
  /// entered the cache. The caller vouches that `tokens` is what was written.
  /// With a store (publish on reserve), the ids it lacks are recorded too.
  template <BlockHasher H>
  static Result<std::int32_t> publish(PageTable& t, BlockPool& pool, SeqId s, std::span<const std::int32_t> tokens,
                                      std::span<const ExtraKey> extras, const H& hasher, BlockTokens& store) noexcept {
    if (auto st = t.validate(s); !st) return st;
    const std::uint32_t i = s.index;
    if (evicted(t.st_[i]))
      return Status{Errc::invalid_argument, "evicted_tokens", t.st_[i].appended - t.st_[i].tokens, 0};
    if (std::int64_t(tokens.size()) > t.st_[i].tokens)
      return Status{Errc::prefix_too_long, "tokens.size", std::int64_t(tokens.size()), t.st_[i].tokens};
    if (auto st = check_extras(extras); !st) return st;
    if (store.on() && store.known(i) < std::int64_t(tokens.size())) {
      const std::int64_t from = store.known(i), B = t.block_size_;
      const BlockId* r = t.row(i);
      store.write(i, from, [&](std::size_t k) {
        const std::int64_t p = from + std::int64_t(k);
        return static_cast<std::int32_t>(r[p / B] * B + p % B);
      }, tokens.subspan(std::size_t(from)), t.st_[i].key.extra, extras);
    }
    const std::int32_t full = static_cast<std::int32_t>(tokens.size()) / t.block_size_;
    return publish_blocks(t, pool, i, full, hasher, [&](std::int32_t b) {
      const std::int64_t lo = std::int64_t(b) * t.block_size_;
      return std::pair{tokens.subspan(std::size_t(lo), std::size_t(t.block_size_)),
                       block_extra(t.st_[i].key.extra, extras, lo, lo + t.block_size_)};
    });
  }

  /// Publish on reserve, step one of a batch: when stream i has a full block
  /// to publish, hashes it, starts loading its index slot, and returns the
  /// hash (publish_known's `first`); nullopt when it has none.
  template <BlockHasher H>
  static std::optional<BlockHash> prefetch_known(const PageTable& t, const BlockPool& pool, std::uint32_t i,
                                                 const BlockTokens& store, const H& hasher) noexcept {
    const std::int32_t next = t.st_[i].nhashed;
    if (known_full(t, i, store) <= next) return std::nullopt;
    const BlockId blk = t.row(i)[next];
    const BlockHash h = hasher(chain_parent(t, pool, i), store.ids(blk), store.extra(blk));
    pool.prefetch(h);
    return h;
  }

  /// Publish on reserve: the full blocks of stream i whose ids the store has.
  /// Nothing once the stream has evicted (its row no longer holds the prefix).
  /// `first`: the hash of its first unpublished block when prefetch_known()
  /// just took it (the row unchanged since), so it is not hashed twice.
  template <BlockHasher H>
  static std::int32_t publish_known(PageTable& t, BlockPool& pool, std::uint32_t i, const BlockTokens& store,
                                    const H& hasher, std::optional<BlockHash> first = std::nullopt) noexcept {
    const std::int32_t full = known_full(t, i, store);
    if (full <= t.st_[i].nhashed) return 0;
    const BlockId* r = t.row(i);
    return publish_blocks(t, pool, i, full, hasher, [&](std::int32_t b) { return std::pair{store.ids(r[b]), store.extra(r[b])}; },
                          first);
  }

 private:
  // The hit's walk: block i of it is b (at most `room` blocks), reported to f.
  template <BlockHasher H, class F>
  static PrefixMatch walk(const PageTable& t, const BlockPool& pool, std::span<const std::int32_t> tokens, const PrefixKey& key,
                          std::span<const ExtraKey> extras, const H& hasher, std::int64_t room, F&& f) noexcept {
    const std::int64_t B = t.block_size_;
    const std::int64_t limit =
        std::min<std::int64_t>({tokens.empty() ? 0 : std::int64_t(tokens.size() - 1) / B, room, t.max_blocks_});
    BlockHash parent = chain_root(key);
    PrefixMatch m{};
    for (; m.blocks < limit; ++m.blocks) {
      const std::int64_t lo = m.blocks * B;
      parent = hasher(parent, tokens.subspan(std::size_t(lo), std::size_t(B)), block_extra(key.extra, extras, lo, lo + B));
      const BlockId b = pool.lookup(parent);
      if (b < 0) break;
      f(m.blocks, b);
      m.free_blocks += pool.ref_count(b) == 0 ? 1 : 0;
    }
    return m;
  }
  // After eviction the held tokens are no longer the written prefix: the row never publishes.
  static bool evicted(const PageTable::Stream& st) noexcept { return st.front != 0 || st.tokens != st.appended; }
  // Stream i's full blocks whose ids the store has (0 once it has evicted).
  static std::int32_t known_full(const PageTable& t, std::uint32_t i, const BlockTokens& store) noexcept {
    const PageTable::Stream& st = t.st_[i];
    return evicted(st) ? 0 : t.div_b(std::min<std::int64_t>(store.known(i), st.tokens));
  }
  // The hash stream i's next published block chains from.
  static BlockHash chain_parent(const PageTable& t, const BlockPool& pool, std::uint32_t i) noexcept {
    const PageTable::Stream& st = t.st_[i];
    return st.nhashed == 0 ? chain_root(st.key) : pool.hash(t.row(i)[st.nhashed - 1]);
  }

  // Hashes and publishes blocks [nhashed, full) of row i; block(b) gives a
  // block's token ids and extra. Returns the hashes new to the cache.
  // `first`, when given, is block nhashed's hash (taken by prefetch_known).
  template <BlockHasher H, class Block>
  static std::int32_t publish_blocks(PageTable& t, BlockPool& pool, std::uint32_t i, std::int32_t full, const H& hasher,
                                     Block&& block, std::optional<BlockHash> first = std::nullopt) noexcept {
    PageTable::Stream& st = t.st_[i];
    std::int32_t stored = 0;
    BlockHash parent = chain_parent(t, pool, i);
    for (std::int32_t b = st.nhashed; b < full; ++b) {
      const BlockId blk = t.row(i)[b];
      const auto [ids, extra] = block(b);
      const BlockHash h = b == st.nhashed && first ? *first : hasher(parent, ids, extra);
      if (!pool.has_hash(blk)) {
        const BlockId up = b == 0 ? PrefixIndex::kChainRoot : t.row(i)[b - 1];
        auto r = pool.publish(blk, h, parent, StoredBlock{.key = st.key, .block_extra = extra, .tokens = ids, .parent_block = up});
        stored += (r.ok() && *r) ? 1 : 0;
      }
      parent = h;
    }
    st.nhashed = std::max(st.nhashed, full);
    return stored;
  }
};

/// Longest run of cached full blocks for `tokens`, at most (len-1)/B blocks
/// (the last token is always recomputed for its logits), written to out.
template <BlockHasher H>
std::int32_t match_prefix(const PageTable& t, const BlockPool& pool, std::span<const std::int32_t> tokens,
                          const PrefixKey& key, const H& hasher, std::span<BlockId> out) noexcept {
  return PrefixSharing::match(t, pool, tokens, key, {}, hasher, out).blocks;
}
/// A new sequence starting with the cached prefix of `tokens` (blocks retained).
template <BlockHasher H>
Result<PrefixHit> add_with_prefix(PageTable& t, BlockPool& pool, std::span<const std::int32_t> tokens,
                                  const PrefixKey& key, const H& hasher) noexcept {
  return PrefixSharing::add(t, pool, tokens, key, {}, hasher);
}
/// Publishes the full blocks of the sequence's first tokens.size() tokens.
template <BlockHasher H>
Result<std::int32_t> publish_prefix(PageTable& t, BlockPool& pool, SeqId s, std::span<const std::int32_t> tokens,
                                    const H& hasher) noexcept {
  BlockTokens none;
  return PrefixSharing::publish(t, pool, s, tokens, {}, hasher, none);
}

KVCACHE_END_NAMESPACE
