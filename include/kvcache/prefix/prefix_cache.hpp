// What the composed cache keeps for prefix caching beside the pool's index:
//   - the token ids per block when it publishes on reserve (prefix/block_tokens.hpp);
//   - the scheduler's ledger (a PromiseLedger, core/promise_ledger.hpp, as
//     every cache keeps it): blocks promised to running sequences over their
//     lifetime, so that admitting by lifetime need never has to preempt;
//   - the query counters a router or dashboard reads (hit rate).
// And the plan of an atomic admission: the prefix hit and every block it
// needs, found before anything changes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/core/block_hash.hpp"
#include "kvcache/core/block_math.hpp"
#include "kvcache/core/promise_ledger.hpp"
#include "kvcache/pool/block_pool.hpp"
#include "kvcache/prefix/block_tokens.hpp"
#include "kvcache/config.hpp"
#include "kvcache/table/page_table.hpp"
#include "kvcache/prefix/prefix_sharing.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// How admit() admits a prompt.
struct AdmitOptions {
  PrefixKey key{};  ///< The sequence's salt (tenant, cache salt) and extra (LoRA id).
  std::span<const ExtraKey> extras{};  ///< Multimodal inputs: positions and content hashes (sorted, not overlapping).
  /// Tokens the sequence may generate: its lifetime need, blocks_needed(prompt, max_new, prefill_chunk), is
  /// promised in the scheduler's ledger and must fit the free pool less every earlier promise. -1: no promise.
  std::int64_t max_new = -1;
  std::int64_t prefill_chunk = 0;  ///< As blocks_needed(): the engine evicts after every chunk of this many tokens.
  /// Uncached prompt tokens to reserve now (chunked prefill reserves one chunk; the rest through reserve()).
  std::int32_t reserve = INT32_MAX;
};

/// What admit() did.
struct AdmitResult {
  SeqId seq{};  ///< The new sequence.
  std::int32_t cached_tokens = 0;  ///< Prompt tokens served by the cache (whole blocks, at most the prompt's length - 1).
  std::int32_t reserved = 0;  ///< Prompt tokens reserved after them: their slots are slots[0..reserved).
  std::int32_t new_blocks = 0;  ///< Blocks allocated for them.
  std::int64_t promised = 0;  ///< Lifetime blocks promised in the ledger (0 without max_new).
};

/// What admitting a prompt would take, found without changing anything.
struct AdmitPlan {
  PrefixMatch hit{};  ///< The prefix hit.
  std::int32_t reserve = 0;  ///< Uncached tokens reserved now.
  std::int32_t fresh = 0;  ///< New blocks those take.
  std::int64_t lifetime = 0;  ///< Blocks the sequence holds at its peak (hit blocks included).
  /// Blocks the admission takes from the free pool over the sequence's life: lifetime less the hit blocks
  /// other sequences already hold (a free-but-cached hit block counts: adopting it takes it from the pool).
  std::int64_t from_free = 0;
  std::int64_t available = 0;  ///< Free blocks less every promise outstanding.
};

/// Prefix-cache counters and block states.
struct PrefixStats {
  std::int64_t queries = 0;  ///< Admissions that looked a prompt up (add_sequence(prompt), admit).
  std::int64_t query_tokens = 0;  ///< Their prompt tokens.
  std::int64_t hit_tokens = 0;  ///< Of those, tokens served from the cache.
  PoolCounters pool{};  ///< Hashes stored, copies, cached blocks recycled, blocks invalidated.
  std::int32_t hashes = 0;  ///< Distinct hashes cached now.
  std::int32_t used_hashed = 0;  ///< Used blocks holding a hash (they serve hits while held).
  std::int32_t used_plain = 0;  ///< Used blocks without one (partial tails, unpublished, evicted rows).
  std::int32_t free_cached = 0;  ///< Free blocks keeping cached content (recycled least recently freed first).
  std::int32_t free_plain = 0;  ///< Free blocks without content.
};

/// The query counters every cache keeps (Cache<> in its PrefixState, HybridCache beside its groups), and the
/// PrefixStats they give over a pool: one definition of what prefix_stats() reports.
class PrefixQueries {
 public:
  /// A prompt of `tokens` was looked up by an admission; `cached` of them hit.
  void queried(std::int64_t tokens, std::int64_t cached) noexcept {
    ++queries_;
    query_tokens_ += tokens;
    hit_tokens_ += cached;
  }
  /// The counters, with pool's counters and block states now.
  PrefixStats stats(const BlockPool& pool) const noexcept {
    PrefixStats st{.queries = queries_, .query_tokens = query_tokens_, .hit_tokens = hit_tokens_, .pool = pool.counters()};
    st.hashes = pool.num_published();
    st.free_cached = pool.num_cached();
    st.free_plain = pool.num_free() - pool.num_cached();
    st.used_hashed = pool.prefix_index().members() - pool.num_cached();
    st.used_plain = pool.num_used() - st.used_hashed;
    return st;
  }
  friend bool operator==(const PrefixQueries&, const PrefixQueries&) = default;

 private:
  std::int64_t queries_ = 0, query_tokens_ = 0, hit_tokens_ = 0;
};

/// Publish-on-reserve ids, the lifetime ledger and the query counters.
class PrefixState {
 public:
  PrefixState() = default;
  /// Sized once: `streams` sequences of up to `max_blocks` blocks; the id store only when publishing on reserve.
  PrefixState(std::int32_t num_blocks, std::int32_t block_size, std::int32_t streams, std::int32_t max_blocks,
              bool publish_on_reserve)
      : store_(publish_on_reserve ? BlockTokens(num_blocks, block_size, streams) : BlockTokens()),
        ledger_(streams),
        due_(publish_on_reserve ? static_cast<std::size_t>(streams) : 0),
        due_hash_(due_.size()),
        hits_(static_cast<std::size_t>(max_blocks)) {}

  /// The id store (off unless publishing on reserve).
  const BlockTokens& store() const noexcept { return store_; }
  /// The id store, for publish().
  BlockTokens& store() noexcept { return store_; }
  /// The scheduler's ledger (core/promise_ledger.hpp), every cache's.
  const PromiseLedger& ledger() const noexcept { return ledger_; }
  /// The ledger, for admit(), import() and promise().
  PromiseLedger& ledger() noexcept { return ledger_; }
  /// reserve_batch()'s ids are packed as its slots: one per token counted
  /// (counts that the table will refuse are the table's error to report).
  static Status check_batch_ids(std::span<const SeqId> seqs, std::span<const std::int32_t> counts,
                                std::span<const std::int32_t> ids) noexcept {
    std::int64_t total = 0;
    bool negative = false;
    for (const std::int32_t c : counts) total += c, negative |= c < 0;
    if (std::int64_t(ids.size()) != total && counts.size() == seqs.size() && !negative)
      return Status{Errc::invalid_argument, "ids.size (the sum of counts)", std::int64_t(ids.size()), total};
    return {};
  }

  /// Blocks still owed to running sequences: each one's promise less the blocks it holds. O(sequences).
  std::int64_t outstanding(const PageTable& t) const noexcept {
    return ledger_.outstanding([&](std::uint32_t i) { return t.blocks_unchecked(SeqId{i, 0}).size(); });
  }

  /// admit()'s checks and plan, changing nothing: `lifetime` is the policy's
  /// blocks_needed() for the prompt and max_new; the hit blocks are kept for
  /// hits(); `slots` is the caller's slot buffer size (-1: a dry run).
  template <BlockHasher H>
  Result<AdmitPlan> plan(const PageTable& t, const BlockPool& pool, std::span<const std::int32_t> prompt,
                         const AdmitOptions& opt, const Result<std::int64_t>& lifetime, const H& hasher,
                         std::int64_t slots) const noexcept {
    if (prompt.empty()) return Status{Errc::invalid_argument, "prompt.size", 0, 1};
    if (std::int64_t(prompt.size()) > INT32_MAX) return Status{Errc::capacity_exceeded, "prompt.size", std::int64_t(prompt.size()), INT32_MAX};
    if (opt.reserve < 0) return Status{Errc::invalid_argument, "reserve", opt.reserve, 0};
    if (opt.max_new < -1) return Status{Errc::invalid_argument, "max_new", opt.max_new, -1};
    if (auto st = PrefixSharing::check_extras(opt.extras); !st) return st;
    if (!lifetime) return lifetime.status();
    AdmitPlan p{};
    p.hit = PrefixSharing::match(t, pool, prompt, opt.key, opt.extras, hasher, hits_);
    const std::int32_t B = t.block_size(), cached = p.hit.blocks * B;
    p.reserve = std::min<std::int32_t>(opt.reserve, std::int32_t(prompt.size()) - cached);
    if (std::int64_t{cached} + p.reserve > t.max_tokens())
      return Status{Errc::capacity_exceeded, "n_tokens", p.reserve, t.max_tokens() - cached};
    p.fresh = BlockMath::of(B).blocks_for(std::int64_t{cached} + p.reserve) - p.hit.blocks;
    p.lifetime = std::max<std::int64_t>(*lifetime, p.hit.blocks + p.fresh);
    p.from_free = p.lifetime - (p.hit.blocks - p.hit.free_blocks);
    p.available = pool.num_free() - outstanding(t);
    if (slots >= 0 && slots < p.reserve) return Status{Errc::buffer_too_small, "slots", slots, p.reserve};
    if (p.fresh > pool.num_free() - p.hit.free_blocks)
      return Status{Errc::out_of_blocks, "n_blocks", p.fresh, pool.num_free() - p.hit.free_blocks};
    if (opt.max_new >= 0 && p.from_free > p.available)
      return Status{Errc::out_of_blocks, "lifetime_blocks (promises outstanding subtracted)", p.from_free, p.available};
    return p;
  }
  /// The hit blocks of the last plan().
  std::span<const BlockId> hits(std::int32_t n) const noexcept { return std::span(hits_).first(static_cast<std::size_t>(n)); }

  /// A prompt was looked up; `cached` of its tokens hit.
  void queried(std::int64_t tokens, std::int64_t cached) noexcept { queries_.queried(tokens, cached); }

  /// A sequence started with `cached` positions (a hit, or empty).
  void started(std::uint32_t s, std::int64_t cached) noexcept {
    if (store_.on()) store_.start(s, cached);
  }
  /// A new sequence adopted the `cached` tokens of a prompt of `tokens` that hit.
  void adopted(SeqId s, std::int64_t tokens, std::int64_t cached) noexcept {
    queried(tokens, cached);
    started(s.index, cached);
  }

  // --- hooks of a token-paged cache (cache/hooks.hpp) ---
  /// A fork: the child knows what the parent knows and carries its promise.
  template <class Rows>
  void forked(const Rows&, SeqId p, SeqId c) noexcept {
    if (store_.on()) store_.start(c.index, store_.known(p.index));
    ledger_.copy(p.index, c.index);
  }
  /// The sequence ended.
  template <class Rows>
  void freed(const Rows&, SeqId s) noexcept {
    if (store_.on()) store_.start(s.index, 0);
    ledger_.forget(s.index);
  }
  /// A rollback: the ids past the row's new end are forgotten.
  template <class Rows>
  void truncated(const Rows& r, SeqId s, std::int32_t) noexcept {
    if (!store_.on()) return;
    const auto blocks = r.table.blocks_unchecked(s);
    store_.truncate(s.index, r.table.appended_unchecked(s), blocks.empty() ? -1 : blocks.back());
  }
  /// A reserve copied a shared tail (copy-on-write): so are its ids.
  template <class Rows>
  void reserved(const Rows&, SeqId, std::int32_t, const BlockCopy& copy) noexcept { copied(std::span(&copy, 1)); }
  /// A reserve_batch copied shared tails: so are their ids.
  template <class Rows>
  void reserved_batch(const Rows&, std::span<const SeqId>, std::span<const std::int32_t>,
                      std::span<const BlockCopy> copies) noexcept {
    copied(copies);
  }

  /// reserve() of ids.size() tokens of s succeeded (copies done): record the
  /// ids and publish the blocks they fill. Returns the hashes newly cached.
  template <BlockHasher H>
  std::int32_t publish_reserved(PageTable& t, BlockPool& pool, SeqId s, std::span<const std::int32_t> ids,
                        std::span<const std::int32_t> slots, std::span<const ExtraKey> extras, const H& hasher) noexcept {
    if (!store_.on()) return 0;
    const std::int64_t first = t.appended_unchecked(s) - std::int64_t(ids.size());
    store_.write(s.index, first, [&](std::size_t k) { return slots[k]; }, ids, t.key_unchecked(s).extra, extras);
    return PrefixSharing::publish_known(t, pool, s.index, store_, hasher);
  }

  /// reserve_batch() succeeded (copies done): ids are packed as the slots are.
  /// Publishes the blocks each entry fills; returns the hashes newly cached.
  template <BlockHasher H>
  std::int32_t publish_reserved_batch(PageTable& t, BlockPool& pool, std::span<const SeqId> seqs,
                              std::span<const std::int32_t> counts, std::span<const std::int32_t> ids,
                              std::span<const std::int32_t> slots, const H& hasher) noexcept {
    if (!store_.on()) return 0;
    std::size_t at = 0, due = 0;
    const std::int64_t B = t.block_size(), mask = (B & (B - 1)) == 0 ? B - 1 : -1;
    // Record the ids; the entries that fill a block start loading the index
    // slot their hash lands in, so their cache misses overlap...
    for (std::size_t k = 0; k < seqs.size(); ++k) {
      const std::int32_t n = counts[k];
      const SeqId s = seqs[k];
      const std::int64_t first = t.appended_unchecked(s) - n;
      store_.write(s.index, first, [&](std::size_t j) { return slots[at + j]; }, ids.subspan(at, std::size_t(n)),
                   t.key_unchecked(s).extra, {});
      if (n > 0 && (mask >= 0 ? first & mask : first % B) + n >= B)
        if (const auto h = PrefixSharing::prefetch_known(t, pool, s.index, store_, hasher)) due_[due] = s.index, due_hash_[due++] = *h;
      at += std::size_t(n);
    }
    // ...then publish them.
    std::int32_t stored = 0;
    for (std::size_t k = 0; k < due; ++k) stored += PrefixSharing::publish_known(t, pool, due_[k], store_, hasher, due_hash_[k]);
    return stored;
  }

  /// The counters and the pool's block states now.
  PrefixStats stats(const BlockPool& pool) const noexcept { return queries_.stats(pool); }

  /// Equality of state (the ledger and the counters included; scratch excluded).
  friend bool operator==(const PrefixState& a, const PrefixState& b) {
    return a.store_ == b.store_ && a.ledger_ == b.ledger_ && a.queries_ == b.queries_;
  }

 private:
  void copied(std::span<const BlockCopy> copies) noexcept {
    if (!store_.on()) return;
    for (const BlockCopy& c : copies)
      if (c.src >= 0) store_.copy_block(c.src, c.dst);
  }

  BlockTokens store_;
  PromiseLedger ledger_;  // lifetime blocks promised per stream
  PrefixQueries queries_;
  std::vector<std::uint32_t> due_;  // reserved_batch(): streams with a block to publish (scratch)
  std::vector<BlockHash> due_hash_;  // reserved_batch(): the hash of each one's first block, taken once (scratch)
  mutable std::vector<BlockId> hits_;  // plan(): the hit blocks (scratch; a const dry run writes it too)
};

KVCACHE_END_NAMESPACE
