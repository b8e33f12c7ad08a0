// The eviction calls of a HybridCache whose global layers (its full and MLA
// groups) carry a block eviction policy: evict() as Cache<>'s, run on every
// global group's row of the sequence, and observe() for a policy that reads
// attention sums, per group. What the policy decides and how the rows keep
// holes live in eviction/group_eviction.hpp; KeepAll adds no call of its
// own, and every HybridCache says whether and where a sequence evicted
// (HybridEvictionState: evicted, computed_before_eviction).
#pragma once

#include <cstdint>

#include "kvcache/config.hpp"
#include "kvcache/eviction/group_eviction.hpp"
#include "kvcache/eviction/plan.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// What every HybridCache says of a sequence's evictions (none without a policy).
template <class Cache>
class HybridEvictionState {
 public:
  /// Sequence id let a block go: it publishes no more blocks (what kernels
  /// read of it is no longer its prompt's context).
  Result<bool> evicted(SeqId id) const noexcept {
    if (auto st = self().validate(id); !st) return st;
    return self().seqs_[id.index].evicted_at >= 0;
  }

  /// The tokens of sequence id whose K/V read its prompt's own context: what
  /// it had computed when its first block left (every computed token if none
  /// left; computed tokens never roll back). Past them the K/V is not the
  /// prompt's for a tier or a peer (GroupTiers::plan_offload names no block past them).
  Result<std::int64_t> computed_before_eviction(SeqId id) const noexcept {
    if (auto st = self().validate(id); !st) return st;
    const auto& s = self().seqs_[id.index];
    return s.evicted_at < 0 ? s.computed : s.evicted_at;
  }

 private:
  const Cache& self() const noexcept { return static_cast<const Cache&>(*this); }
};

/// No eviction: the policy alone.
template <class Cache, class Eviction>
class HybridEviction : public HybridEvictionState<Cache> {
 public:
  /// The eviction policy.
  const Eviction& eviction() const noexcept { return static_cast<const Cache&>(*this).eviction_.policy(); }
};

/// A block policy on the global layers (HybridCache derives from it and befriends it).
template <class Cache, class Eviction>
  requires(GroupEviction<Eviction>::evicts)
class HybridEviction<Cache, Eviction> : public HybridEvictionState<Cache> {
 public:
  /// The eviction policy as given (each global group runs a copy bound to its block size).
  const Eviction& eviction() const noexcept { return self().eviction_.policy(); }
  /// Group g's copy, bound to its block size (its bounds: max_tokens_held,
  /// max_blocks_held); invalid_argument for a group that is not full or MLA.
  Result<const Eviction*> eviction(std::int32_t g) const noexcept { return self().eviction_.policy(g); }

  /// Feeds one step's attention sums of group g's layers for sequence id:
  /// one float per token the group holds (tokens_held(id, g)), in the order
  /// export_group_csr lists them. invalid_argument names a group that is not
  /// full or MLA, and scores.kind / scores.size / scores_at as Cache<>'s
  /// observe(); nothing changes on error.
  Status observe(SeqId id, std::int32_t g, const Scores& scores) noexcept
    requires ObservingEviction<Eviction>
  {
    Cache& c = static_cast<Cache&>(*this);
    if (auto st = c.validate(id); !st) return st;
    return c.eviction_.observe(c.rows_, id.index, c.seqs_[id.index].reserved, g, scores);
  }

  /// Runs the policy on each full and MLA group's row of sequence id. The
  /// blocks it chooses leave their rows as holes: the later blocks keep their
  /// indices and their keys their positions (no rotation: out.rotations is
  /// not written), and what the kernels read of the row is its live blocks
  /// (export_group_csr, export_block_table; tokens_held(id, g) tokens).
  /// out.blocks gets the block indices that left, group after group. Only
  /// whole computed blocks leave. From the first block that leaves, the
  /// sequence publishes nothing more in any group (what it computes next
  /// read a context that is not its prompt's). All or nothing:
  /// buffer_too_small names blocks and the size every group's plan needs;
  /// invalid_argument when the plan takes a block holding a token reserved
  /// and not computed (run the policy after the forward pass).
  Result<EvictionResult> evict(SeqId id, const EvictionSpans& out) noexcept {
    Cache& c = static_cast<Cache&>(*this);
    if (auto st = c.validate(id); !st) return st;
    auto& s = c.seqs_[id.index];
    auto r = c.eviction_.evict(c.rows_, c.pool_, id.index, s.reserved, s.computed, out);
    if (r && r->evicted > 0 && s.evicted_at < 0) s.evicted_at = s.computed;
    return r;
  }

 private:
  const Cache& self() const noexcept { return static_cast<const Cache&>(*this); }
};

KVCACHE_END_NAMESPACE
