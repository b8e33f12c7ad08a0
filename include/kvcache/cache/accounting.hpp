// What a scheduler asks of a cache before it admits a request, and while
// requests run: the checks on the lengths it names (both modes), and the
// accounting of a token-paged cache (RowAccounting, the calls a scheduler
// makes: what a sequence holds, what a request needs over its life, what is
// promised, what sharing pins). What a request needs is the eviction state's
// answer (eviction/row_eviction.hpp); the cache adds the pool's free blocks
// and the blocks it promised (prefix/prefix_cache.hpp's ledger).
#pragma once

#include <cstdint>

#include <algorithm>
#include <span>
#include <vector>

#include "kvcache/config.hpp"
#include "kvcache/prefix/prefix_cache.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Longest prompt_len + max_new accounting accepts (2^62: no overflow below).
inline constexpr std::int64_t max_request_length = std::int64_t{1} << 62;

/// blocks_needed()'s arguments: lengths in [0, max_request_length] whose sum
/// fits it, a chunk >= 0. The error names the value and the bound it broke
/// (the lower one for a negative value).
inline Status check_request_lengths(std::int64_t prompt_len, std::int64_t max_new, std::int64_t prefill_chunk) noexcept {
  if (prompt_len < 0) return Status{Errc::invalid_argument, "prompt_len", prompt_len, 0};
  if (prompt_len > max_request_length) return Status{Errc::invalid_argument, "prompt_len", prompt_len, max_request_length};
  if (max_new < 0) return Status{Errc::invalid_argument, "max_new", max_new, 0};
  if (max_new > max_request_length - prompt_len)
    return Status{Errc::invalid_argument, "max_new", max_new, max_request_length - prompt_len};
  if (prefill_chunk < 0) return Status{Errc::invalid_argument, "prefill_chunk", prefill_chunk, 0};
  return {};
}

/// The accounting calls of a token-paged cache (the coordinator `Cache`
/// derives from it and befriends it): they read the table, the pool, the
/// eviction state and the prefix ledger, and change nothing but promises.
template <class Cache>
class RowAccounting {
 public:
  /// Tokens s was given over its life (reserved, whether computed or
  /// evicted since): its length, the next token's position. The word every
  /// cache has (HybridCache::tokens); tokens_held() is what it holds now.
  Result<std::int64_t> tokens(SeqId s) const noexcept {
    if constexpr (requires { self().table_.appended(s); }) {
      return self().table_.appended(s);
    } else {  // a table that keeps no count past what it holds
      return tokens_held(s);
    }
  }
  /// Live tokens s holds.
  Result<std::int64_t> tokens_held(SeqId s) const noexcept {
    auto t = self().table_.tokens(s);
    if (!t) return t.status();
    return std::int64_t{*t};
  }
  /// Blocks s's row holds.
  Result<std::int32_t> blocks_held(SeqId s) const noexcept {
    auto b = self().table_.blocks(s);
    if (!b) return b.status();
    return static_cast<std::int32_t>(b->size());
  }
  /// Pool blocks a new sequence needs over its whole life under the eviction
  /// policy's bound (the bound is non-decreasing in tokens appended). With
  /// prefill_chunk > 0 the engine runs evict() after every prefill chunk of at
  /// most that many tokens, so the prompt never sits whole in the cache.
  Result<std::int64_t> blocks_needed(std::int64_t prompt_len, std::int64_t max_new, std::int64_t prefill_chunk = 0) const noexcept {
    if (auto st = check_request_lengths(prompt_len, max_new, prefill_chunk); !st) return st;
    return self().eviction_.blocks_needed(prompt_len, max_new, prefill_chunk, self().block_size());
  }
  /// A sequence handle is free and blocks_needed fits the free pool less the
  /// blocks promised to running sequences (promised_blocks()).
  bool can_admit(std::int64_t prompt_len, std::int64_t max_new) const noexcept {
    auto need = blocks_needed(prompt_len, max_new);
    return need.ok() && free_sequences() > 0 && *need <= self().pool_.num_free() - promised_blocks();
  }
  /// What admit(prompt, slots, opt) would take, counting its prefix hit:
  /// from_free is its lifetime need less the hit blocks other sequences hold
  /// (free-but-cached hit blocks count against the free pool). Errors are admit()'s.
  Result<AdmitPlan> plan_admission(std::span<const std::int32_t> prompt, const AdmitOptions& opt = {}) const noexcept {
    return self().admit_plan(prompt, opt, -1);
  }
  /// admit(prompt, ...) would succeed now.
  bool can_admit(std::span<const std::int32_t> prompt, const AdmitOptions& opt = {}) const noexcept {
    return self().admit_plan(prompt, opt, -1).ok();
  }
  /// Blocks owed to running sequences: each promise (admit with max_new, or
  /// promise()) less the blocks the sequence holds. O(sequences).
  std::int64_t promised_blocks() const noexcept { return self().prefix_.outstanding(self().table_); }
  /// Promises s `blocks` (at most a row's blocks) over its lifetime (0 withdraws); admissions leave them free for it.
  Status promise(SeqId s, std::int64_t blocks) noexcept {
    if (auto st = self().table_.validate(s); !st) return st;
    return self().prefix_.ledger().promise(s.index, blocks, self().table_.max_blocks_per_stream());
  }
  /// Sequence handles still free.
  std::int32_t free_sequences() const noexcept { return self().table_.free_streams(); }
  /// The eviction policy's bound for any stream (INT64_MAX for keep-all).
  std::int64_t max_tokens_after_eviction() const noexcept { return self().eviction().max_tokens_after_eviction(); }
  /// Tokens the sequence holds above its policy's bound because shared
  /// blocks (prefix sharing, fork) kept the last evict() from going lower.
  /// The scheduler counts them as memory it cannot reclaim yet; the next
  /// evict() after the sharing ends brings the sequence back within its bound.
  Result<std::int64_t> shared_excess(SeqId s) const noexcept {
    if (auto st = self().table_.validate(s); !st) return st;
    return self().eviction_.shared_excess(s);
  }
  /// The sum of shared_excess over every live sequence. O(sequences).
  std::int64_t shared_excess() const noexcept {
    std::int64_t total = 0;
    self().table_.for_each_stream([&](SeqId s) { total += self().eviction_.shared_excess(s); });
    return total;
  }
  /// Pool, table and the eviction contract (eviction/row_eviction.hpp's
  /// check()); invariant_violated always means a library bug, never a legal
  /// state. O(pool + table).
  Status check_invariants() const {
    if (auto st = self().pool_.check(); !st) return st;
    if (auto st = self().table_.check(self().pool_, self().holds_); !st) return st;
    if (auto st = self().imports_.check(self().table_, self().pool_, self().holds_); !st) return st;
    std::vector<bool> live(static_cast<std::size_t>(self().table_.max_streams()));  // a free handle owes nothing
    self().table_.for_each_stream([&](SeqId s) { live[s.index] = true; });
    if (auto st = self().prefix_.ledger().check([&](std::uint32_t i) { return bool(live[i]); }); !st) return st;
    return self().eviction_.check(self().table_);
  }

 private:
  const Cache& self() const noexcept { return static_cast<const Cache&>(*this); }
  Cache& self() noexcept { return static_cast<Cache&>(*this); }
};

KVCACHE_END_NAMESPACE
