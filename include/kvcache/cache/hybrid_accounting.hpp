// What a scheduler asks of a hybrid cache: what a sequence holds per group,
// what a request needs over its life summed over the groups, how many fit,
// each group's share of the pool, and the invariants the property test
// checks after every operation. Admission and pool sizing read one bound
// (GroupRule::max_blocks with the configured prefill chunk), so a pool sized
// for a request of the model's length admits one.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/pool/block_pool.hpp"
#include "kvcache/cache/accounting.hpp"
#include "kvcache/cache/pool_core.hpp"
#include "kvcache/config.hpp"
#include "kvcache/groups/group_rule.hpp"
#include "kvcache/groups/layer_groups.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// What a HybridCache is built from.
struct HybridConfig {
  LayerGroups groups;  ///< The layer groups (LayerGroups::make).
  std::int32_t num_blocks = 0;  ///< Pool pages, the null block included (hybrid_pool_blocks sizes it).
  std::int32_t max_sequences = 0;  ///< Live sequences at once.
  std::int32_t max_tokens = 0;  ///< Tokens per sequence at most (the model's length).
  /// The most tokens a sequence may hold reserved and not yet computed (the
  /// scheduler's prefill chunk), enforced: a reserve or advance past it is
  /// invalid_argument, and admit()'s default reserve stops at it. 0: a whole
  /// prompt at once (a sequence admitted or imported may hold its prompt's
  /// length in flight; one from add_sequence() is not bounded). A window
  /// group holds at most W - 1 + this tokens, a chunk group C - 1 + this;
  /// admission (blocks_needed) and pool sizing (hybrid_pool_blocks) read the same bound.
  std::int32_t prefill_chunk = 0;
  bool prefix_caching = true;  ///< Publish full computed blocks and serve hits.
  /// Block events kept for routers (stored / removed, each naming its group;
  /// drain_events()); 0: no events. As CacheConfig::event_capacity.
  std::int32_t event_capacity = 0;
  Medium medium = Medium::gpu;  ///< The tier block events name.
};

/// cfg, or ConfigError naming its first bad field.
inline const HybridConfig& checked_hybrid_config(const HybridConfig& c) {
  const auto fail = [](const char* what, std::int64_t v, std::int64_t lim) {
    throw ConfigError("kvcache::HybridCache", Status{Errc::invalid_argument, what, v, lim});
  };
  if (c.groups.num_groups() < 1) fail("groups (LayerGroups::make builds them)", 0, 1);
  check_pool_config("kvcache::HybridCache", c.num_blocks, c.max_sequences, c.event_capacity);  // every cache's fields
  if (c.max_tokens < 1) fail("max_tokens", c.max_tokens, 1);
  if (c.prefill_chunk < 0) fail("prefill_chunk", c.prefill_chunk, 0);
  return c;
}

/// Blocks one request of `length` tokens holds at most over every group of lg,
/// with at most `in_flight` tokens reserved beyond those computed.
inline std::int64_t hybrid_blocks_needed(const LayerGroups& lg, std::int64_t length, std::int64_t in_flight) noexcept {
  std::int64_t n = 0;
  for (std::int32_t g = 0; g < lg.num_groups(); ++g) n += GroupRule::of(lg, g).max_blocks(length, in_flight);
  return n;
}
/// Pool pages (null block included) so that `requests` requests of `length` tokens run at once.
inline std::int64_t hybrid_pool_blocks(const LayerGroups& lg, std::int64_t requests, std::int64_t length,
                                       std::int64_t prefill_chunk) noexcept {
  return requests * hybrid_blocks_needed(lg, length, prefill_chunk > 0 ? prefill_chunk : length) + 1;
}

/// One group's blocks: held by its rows (shared ones once) and free but cached for it.
struct GroupUsage {
  std::int32_t held = 0;  ///< Distinct blocks the group's rows hold.
  std::int32_t cached = 0;  ///< Free blocks holding the group's published content.
};

/// The accounting calls of HybridCache (which derives from it and befriends it); they change nothing but promises.
template <class Cache>
class HybridAccounting {
 public:
  /// Tokens reserved for s (computed or not).
  Result<std::int64_t> tokens(SeqId s) const noexcept {
    if (auto st = self().validate(s); !st) return st;
    return self().seqs_[s.index].reserved;
  }
  /// Tokens of s whose K/V the forward pass wrote (Cache::computed).
  Result<std::int64_t> computed_tokens(SeqId s) const noexcept {
    if (auto st = self().validate(s); !st) return st;
    return self().seqs_[s.index].computed;
  }
  /// Tokens s holds in group g: those of its live blocks (a cross group: the
  /// encoder's). A kernel's length for the group's rows as exported: less
  /// than tokens(s) where a window freed blocks or an eviction left holes.
  Result<std::int64_t> tokens_held(SeqId s, std::int32_t g) const noexcept {
    if (auto st = check(s, g); !st) return st;
    const auto& rows = self().rows_[std::size_t(g)];
    const GroupRule& r = rows.rule();
    if (!r.caches()) return rows.live(s.index) > 0 ? std::int64_t{r.span} : 0;
    return self().seqs_[s.index].reserved - rows.not_held(s.index);
  }
  /// Blocks s holds in group g.
  Result<std::int32_t> blocks_held(SeqId s, std::int32_t g) const noexcept {
    if (auto st = check(s, g); !st) return st;
    return self().rows_[std::size_t(g)].live(s.index);
  }
  /// Group g's row of s: block j holds positions [j * block_size(g), ...),
  /// the null block where a window or chunk freed it or an eviction let it go
  /// (Cache<>'s table().blocks(s), which an eviction compacts instead).
  Result<std::span<const BlockId>> blocks(SeqId s, std::int32_t g) const noexcept {
    if (auto st = check(s, g); !st) return st;
    return self().rows_[std::size_t(g)].row(s.index);
  }
  /// Blocks s holds over every group.
  Result<std::int32_t> blocks_held(SeqId s) const noexcept {
    if (auto st = self().validate(s); !st) return st;
    return held_blocks(s.index);
  }
  /// Blocks a request of prompt_len then max_new tokens holds at most, summed
  /// over the groups, reserving at most the configured prefill chunk ahead of
  /// what is computed; a global group under an eviction policy within the
  /// policy's bound (the prompt, or a chunk past the bound, held until it first runs).
  /// prefill_chunk: 0 or the configured one (the arguments every cache takes;
  /// HybridConfig::prefill_chunk is the one bound), else invalid_argument naming it.
  Result<std::int64_t> blocks_needed(std::int64_t prompt_len, std::int64_t max_new, std::int64_t prefill_chunk = 0) const noexcept {
    if (auto st = check_request_lengths(prompt_len, max_new, 0); !st) return st;
    if (prefill_chunk != 0 && prefill_chunk != self().cfg_.prefill_chunk)
      return Status{Errc::invalid_argument, "prefill_chunk (HybridConfig::prefill_chunk is the bound)", prefill_chunk,
                    self().cfg_.prefill_chunk};
    const std::int64_t len = prompt_len + max_new;
    if (len > self().cfg_.max_tokens) return Status{Errc::invalid_argument, "max_new", max_new, self().cfg_.max_tokens - prompt_len};
    const std::int64_t chunk = self().cfg_.prefill_chunk, in_flight = chunk > 0 ? chunk : std::max<std::int64_t>(prompt_len, 1);
    std::int64_t n = 0;  // hybrid_blocks_needed, each global group within its eviction policy's bound
    for (std::int32_t g = 0; g < self().groups(); ++g)
      n += self().eviction_.blocks_needed(g, self().rows_[std::size_t(g)].rule().max_blocks(len, in_flight), prompt_len, max_new, chunk);
    return n;
  }
  /// A handle is free and blocks_needed fits the free pool less the blocks promised to running sequences.
  bool can_admit(std::int64_t prompt_len, std::int64_t max_new) const noexcept {
    auto need = blocks_needed(prompt_len, max_new);
    return need.ok() && self().free_sequences() > 0 && *need <= self().pool_.num_free() - promised_blocks();
  }
  /// The scheduler's ledger: s will hold up to `blocks` over its life (its
  /// blocks_needed); until it does, promised_blocks() counts the difference,
  /// so admitting by lifetime need never has to preempt. 0 withdraws it.
  /// At most the blocks one sequence's rows hold at max_tokens (every
  /// group's row); a negative or larger promise is invalid_argument naming it, as on every cache.
  Status promise(SeqId s, std::int64_t blocks) noexcept {
    if (auto st = self().validate(s); !st) return st;
    std::int64_t most = 0;
    for (const auto& rows : self().rows_) most += rows.rule().row_blocks(self().cfg_.max_tokens);
    return static_cast<Cache&>(*this).promises_.promise(s.index, blocks, most);
  }
  /// Blocks promised to live sequences that they do not hold yet. O(sequences).
  std::int64_t promised_blocks() const noexcept {
    return self().promises_.outstanding([&](std::uint32_t i) { return held_blocks(i); });
  }
  /// Requests of max_len tokens the whole pool holds at once: (num_blocks -
  /// 1) / blocks_needed(max_len, 0), the null block not counted. (vLLM's
  /// get_max_concurrency_for_kv_cache_config counts it, and returns a float:
  /// 3.0 for 387 blocks of 129-block requests, where this says 2.)
  std::int64_t max_concurrency(std::int64_t max_len) const noexcept {
    auto need = blocks_needed(max_len, 0);
    return need.ok() && *need > 0 ? (self().pool_.capacity() - 1) / *need : 0;
  }
  /// Group g's share of the pool: distinct blocks its rows hold, free blocks
  /// cached for it. O(pool + rows): for schedulers' statistics, not per step.
  GroupUsage usage(std::int32_t g) const {
    GroupUsage u;
    if (g < 0 || g >= self().groups()) return u;
    const BlockPool& pool = self().pool_;
    std::vector<char> seen(std::size_t(pool.capacity()), 0);
    for (std::uint32_t i = 0; i < self().seqs_.size(); ++i)
      if (self().seqs_[i].live)
        for (const BlockId b : self().rows_[std::size_t(g)].row(i))
          if (b != BlockPool::null_block && !seen[std::size_t(b)]) seen[std::size_t(b)] = 1, ++u.held;
    for (BlockId b = 1; b < pool.capacity(); ++b)
      u.cached += pool.ref_count(b) == 0 && pool.has_hash(b) && self().owner_[std::size_t(b)] == g;
    return u;
  }

  /// Every invariant, O(pool + rows): the pool's own; each row null below its
  /// first live block and live after it but for the holes an eviction left
  /// (wholly computed blocks, counted), as long as its tokens need; the
  /// pool's reference counts equal the rows' references (conservation: free
  /// + held by all groups = capacity - 1, cached blocks among the free); no
  /// block in two groups; a cached block's group is known; published blocks
  /// of chained groups still hashed (prefix closure per group; past an
  /// eviction's hole a block may have lost its hash with its recycled parent).
  Status check_invariants() const {
    const BlockPool& pool = self().pool_;
    if (auto st = pool.check(); !st) return st;
    std::vector<std::int32_t> refs(std::size_t(pool.capacity()), 0);
    std::vector<std::int32_t> group(std::size_t(pool.capacity()), -1);
    self().holds_.add_refs(refs);  // transfers hold blocks beside the rows
    for (std::uint32_t i = 0; i < self().seqs_.size(); ++i) {
      const auto& s = self().seqs_[i];
      if (!s.live) continue;
      if (s.computed > s.reserved || s.reserved > self().cfg_.max_tokens) return Status{Errc::invariant_violated, "tokens", i, s.reserved};
      // Within the bound admission and pool sizing assumed (an import's row holds what its peer computed).
      if (!s.sealed && s.reserved - s.computed > s.ahead) return Status{Errc::invariant_violated, "tokens in flight", i, s.ahead};
      // An import's row holds the hit's window for an abort's recompute (from
      // the hit) beside the received blocks for the query past the prompt:
      // what it receives is in flight.
      const std::int64_t in_flight = s.sealed ? std::max(s.ahead, s.reserved - s.computed) : s.ahead;
      for (std::int32_t g = 0; g < self().groups(); ++g) {
        const auto& rows = self().rows_[std::size_t(g)];
        const GroupRule& r = rows.rule();
        const auto row = rows.row(i);
        const std::int64_t want = r.caches() ? r.blocks_for(s.reserved) : (row.empty() ? 0 : r.blocks_for(r.span));
        if (std::int64_t(row.size()) != want) return Status{Errc::invariant_violated, "row_length", g, std::int64_t(row.size())};
        if (const std::int64_t live = rows.live(i); live > r.max_blocks(self().cfg_.max_tokens, in_flight))
          return Status{Errc::invariant_violated, "blocks past the group's bound", g, live};
        std::int32_t holes = 0;  // null entries past the first live block: an eviction's, and only where one may act
        for (std::size_t j = 0; j < row.size(); ++j) {
          const bool live = std::int32_t(j) >= rows.first_live(i);
          if (!live && row[j] != BlockPool::null_block) return Status{Errc::invariant_violated, "row_entry", g, std::int64_t(j)};
          if (live && row[j] == BlockPool::null_block) {
            if (s.evicted_at < 0 || std::int64_t(j + 1) * r.block_size > s.computed) return Status{Errc::invariant_violated, "row_entry", g, std::int64_t(j)};
            ++holes;
          }
          if (row[j] == BlockPool::null_block) continue;
          ++refs[std::size_t(row[j])];
          if (group[std::size_t(row[j])] >= 0 && group[std::size_t(row[j])] != g)
            return Status{Errc::invariant_violated, "block_in_two_groups", row[j], g};
          group[std::size_t(row[j])] = g;
          if (self().owner_[std::size_t(row[j])] != g) return Status{Errc::invariant_violated, "owner", row[j], g};
        }
        if (r.caches() && self().cfg_.prefix_caching) {
          const std::int32_t pub = self().prefix_.published(g, i);
          if (std::int64_t(pub) * r.block_size > s.computed) return Status{Errc::invariant_violated, "published", g, pub};
          // Past an eviction's hole a chained block may have lost its hash: its
          // parent, let go, was recycled, and the index drops what chains from it.
          bool past_hole = false;
          for (std::int32_t j = rows.first_live(i); j < pub; ++j) {
            const bool hole = row[std::size_t(j)] == BlockPool::null_block;
            if (!hole && !past_hole && !pool.has_hash(row[std::size_t(j)])) return Status{Errc::invariant_violated, "unhashed", g, j};
            past_hole = past_hole || hole;
          }
        }
        if (holes != rows.holes(i)) return Status{Errc::invariant_violated, "holes", g, holes};
      }
    }
    if (auto st = self().check_imports(); !st) return st;
    if (auto st = self().promises_.check([&](std::uint32_t i) { return self().seqs_[i].live; }); !st) return st;
    for (BlockId b = 1; b < pool.capacity(); ++b) {
      if (refs[std::size_t(b)] != pool.ref_count(b)) return Status{Errc::invariant_violated, "ref_count", b, refs[std::size_t(b)]};
      if (pool.has_hash(b) && self().owner_[std::size_t(b)] < 0) return Status{Errc::invariant_violated, "hash_owner", b, -1};
    }
    return {};
  }

 private:
  const Cache& self() const noexcept { return static_cast<const Cache&>(*this); }
  std::int32_t held_blocks(std::uint32_t i) const noexcept {  // every group's live blocks of row i
    std::int32_t n = 0;
    for (const auto& rows : self().rows_) n += rows.live(i);
    return n;
  }
  Status check(SeqId s, std::int32_t g) const noexcept {
    if (auto st = self().validate(s); !st) return st;
    if (g < 0 || g >= self().groups()) return Status{Errc::invalid_argument, "group", g, self().groups() - 1};
    return {};
  }
};

KVCACHE_END_NAMESPACE
