// The composed manager an engine holds: a block pool, a page table, and the
// three policies. Empty policies take no space ([[no_unique_address]]).
//
//   Cache<> cache({.geometry = g, .num_blocks = 4096, .max_sequences = 256,
//                  .max_blocks_per_sequence = 512});
//   auto seq = cache.add_sequence();                       // Result<SeqId>
//   auto r = cache.reserve(*seq, prompt_len, slots);       // slot mapping
//   cache.export_csr(seqs, indptr, indices, last_page_len);
//
// Why one file of this size: every member is an entry point of the composed
// API (sequences, writes, eviction, selection, exports, accounting, for
// per-sequence rows and for head rows), a few lines of forwarding under its
// contract and its requires-clause, and a call into the policies' hooks; the
// policies' logic lives in their folders (admission/, selection/ with
// stale_rows.hpp and stale_heads.hpp, eviction/ with global_region.hpp).
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kvcache/admission/admit_all.hpp"
#include "kvcache/admission/head_paged.hpp"
#include "kvcache/block_hash.hpp"
#include "kvcache/bound_ledger.hpp"
#include "kvcache/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/eviction/compaction_plan.hpp"
#include "kvcache/eviction/global_region.hpp"
#include "kvcache/eviction/keep_all.hpp"
#include "kvcache/eviction/plan.hpp"
#include "kvcache/eviction/run.hpp"
#include "kvcache/geometry.hpp"
#include "kvcache/page_table.hpp"
#include "kvcache/page_table_edits.hpp"
#include "kvcache/page_table_export.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/prefix_cache.hpp"
#include "kvcache/prefix_sharing.hpp"
#include "kvcache/selection/page_bounds_selection.hpp"
#include "kvcache/selection/select_all.hpp"
#include "kvcache/selection/stale_heads.hpp"
#include "kvcache/selection/stale_rows.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// What a Cache is built from: geometry and capacities.
struct CacheConfig {
  Geometry geometry{};  ///< block_size comes from here
  std::int32_t num_blocks = 0;  ///< pool capacity, null block included
  std::int32_t max_sequences = 0;  ///< Live sequences at once (handles).
  std::int32_t max_blocks_per_sequence = 0;  ///< Longest row, in blocks.
  std::int32_t event_capacity = 0;  ///< 0: no block events
  /// Publish full blocks as reserve() is given their token ids (block_tokens.hpp), not only through publish().
  bool publish_on_reserve = false;
  Medium medium = Medium::gpu;  ///< The tier block events name.
};

template <class P>
concept BlockAllocator = requires(P& p, const P& cp, std::span<BlockId> out, BlockId b) {
  { p.allocate(out) } -> std::same_as<Status>;
  { p.retain(b) } -> std::same_as<Status>;
  { p.release(b) } -> std::same_as<Status>;
  { cp.num_free() } -> std::convertible_to<std::int32_t>;
  { cp.check() } -> std::same_as<Status>;
};

template <class T, class P>
concept BlockTableFor = requires(T& t, const T& ct, P& p, SeqId s, std::span<std::int32_t> slots) {
  { t.reserve(p, s, std::int32_t{1}, slots) } -> std::same_as<Result<ReserveInfo>>;
  { t.release(p, s) } -> std::same_as<Status>;
  { ct.tokens(s) } -> std::same_as<Result<std::int32_t>>;
  { ct.check(p) } -> std::same_as<Status>;
};

/// What a Cache's constructor takes for its admission policy: the policy itself...
template <class A>
struct AdmissionArg {
  using type = A;  ///< The policy.
};
/// ...or, for a head-paged one (it binds to the cache's table), its Config.
template <class A>
  requires(A::kind == AdmissionKind::head_paged)
struct AdmissionArg<A> {
  using type = typename A::Config;  ///< The policy's configuration.
};
/// What a Cache's constructor takes for its selection policy: the policy itself...
template <class S>
struct SelectionArg {
  using type = S;  ///< The policy.
};
/// ...or, for a page-bounds one (it binds to the cache's geometry and handles), its Config.
template <class S>
  requires(S::kind == SelectionKind::page_bounds)
struct SelectionArg<S> {
  using type = typename S::Config;  ///< The policy's configuration.
};

template <BlockAllocator Pool = BlockPool, BlockTableFor<Pool> Table = PageTable, AdmissionPolicy Admission = AdmitAll,
          SelectionPolicy Selection = SelectAll, EvictionPolicy Eviction = KeepAll, BlockHasher Hasher = FastBlockHasher>
/// The composed KV-cache manager: pool, page table, admission, selection and eviction policies, block hasher.
class Cache {
 public:
  /// Score signals this cache can feed to policies: observe() takes the score
  /// forms of ScoreKind (policy.hpp); a head-paged admission's write() also takes gate scores.
  static constexpr Signals provided_signals{Signals::attention_sums | Signals::head_attention_sums |
                                            Signals::last_query_attention};
  /// The selection policy reads key bounds per page: the cache keeps a
  /// page-bounds store current across its write paths (page_bounds_selection.hpp).
  static constexpr bool selects = Selection::kind == SelectionKind::page_bounds;
  static_assert(!selects || PageBoundsSelection<Selection>,
                "kvcache::Cache: a page_bounds selection policy must model PageBoundsSelection "
                "(selection/page_bounds_selection.hpp)");
  static_assert(Signals{provided_signals.bits | (Admission::kind == AdmissionKind::head_paged ? Signals::gate_scores : 0u)}
                    .covers(Admission::required_signals),
                "kvcache::Cache: the admission policy needs score signals this cache does not provide");
  static_assert(Signals{provided_signals.bits | (selects ? Signals::page_key_bounds : 0u)}.covers(Selection::required_signals),
                "kvcache::Cache: the selection policy needs score signals this cache does not provide");
  static_assert(provided_signals.covers(Eviction::required_signals),
                "kvcache::Cache: the eviction policy needs score signals this cache does not provide");

  /// Policies that can leave a stream above its bound between calls: the
  /// cache keeps a ledger of where each stream stands (bound_ledger.hpp).
  static constexpr bool evicts = BlockEviction<Eviction> || TokenEviction<Eviction> || WindowEviction<Eviction>;

  /// The admission policy owns one stream per (sequence, layer, kv-head) and
  /// places every write (WriteGate): writes are write(), rows are head rows,
  /// and reserve, prefix sharing and the per-sequence exports do not exist.
  static constexpr bool head_paged = Admission::kind == AdmissionKind::head_paged;
  static_assert(!head_paged || HeadPagedAdmission<Admission>,
                "kvcache::Cache: a head_paged admission policy must model HeadPagedAdmission (admission/head_paged.hpp)");
  static_assert(!head_paged || (std::same_as<Pool, BlockPool> && std::same_as<Table, PageTable>),
                "kvcache::Cache: a head-paged admission policy (WriteGate) runs on BlockPool and PageTable");
  static_assert(!(head_paged && WindowEviction<Eviction>),
                "kvcache::Cache: WriteGate (head-paged admission) with a window eviction policy (SlidingWindow): "
                "WriteGate's ring already is the local window, and dropping the front of a head row would drop the "
                "ring and leave the global region behind it; use KeepAll, or a token policy on the global region");
  static_assert(!(head_paged && BlockEviction<Eviction>),
                "kvcache::Cache: WriteGate (head-paged admission) with a block eviction policy (BlockScoreEviction, "
                "SinkWindowEviction): block policies re-rotate kept blocks by their shift in the row, which is a "
                "position shift only in a row of consecutive positions; a head row's global region holds scattered "
                "admitted positions; use a token policy (H2O, SnapKV, TOVA, average attention) on the global region");
  /// A token policy evicts from each head row's global region (eviction/global_region.hpp).
  static constexpr bool evicts_global = head_paged && TokenEviction<Eviction>;
  /// Per-sequence streams under an evicting policy: the bound ledger keeps where each stands.
  static constexpr bool ledgered = evicts && !head_paged;

  /// Builds the cache; throws ConfigError for a bad configuration (zero sizes, overflow, a policy unlike the
  /// geometry). With a head-paged admission, `admission` is its Config, the geometry holds one layer and one
  /// kv-head per block, and max_blocks_per_sequence bounds one head's row.
  explicit Cache(const CacheConfig& cfg, typename AdmissionArg<Admission>::type admission = {},
                 typename SelectionArg<Selection>::type selection = {}, Eviction eviction = {}, Hasher hasher = {})
      : geometry_(valid_geometry(cfg.geometry, eviction)),
        pool_(make_pool(cfg)),
        table_(pool_, streams(cfg, admission), cfg.max_blocks_per_sequence, cfg.geometry.block_size()),
        admission_(make_admission(cfg, admission, table_)),
        selection_(selection),
        eviction_(eviction),
        hasher_(hasher) {
    const std::int32_t cap = cfg.max_blocks_per_sequence * cfg.geometry.block_size();
    if constexpr (evicts_global) {  // one stream of the policy per head row, one group each
      if (eviction_.groups() != 1)
        throw ConfigError("kvcache::Cache", Status{Errc::invalid_argument, "eviction.groups (one per head row)", eviction_.groups(), 1});
      eviction_.bind(streams(cfg, admission), cap);
      global_.bind(streams(cfg, admission), cap);
    } else if constexpr (StatefulEviction<Eviction>) {
      eviction_.bind(cfg.max_sequences, cap);
    }
    if constexpr (ledgered) ledger_.bind(cfg.max_sequences);
    if constexpr (head_paged) {
      if (cfg.publish_on_reserve)
        throw ConfigError("kvcache::Cache", Status{Errc::invalid_argument, "publish_on_reserve (head-paged rows are not prefixes)", 1, 0});
    } else {
      prefix_ = PrefixState(cfg.num_blocks, cfg.geometry.block_size(), cfg.max_sequences, cfg.max_blocks_per_sequence,
                            cfg.publish_on_reserve);
    }
    if constexpr (selects)
      if (auto st = selection_.bind(selection_shape(cfg, admission)); !st) throw ConfigError("kvcache::Cache", st);
    if constexpr (TokenEviction<Eviction> && !head_paged) {
      scratch_.chosen.resize(std::size_t(cap));
      scratch_.index_moves.resize(std::size_t(cap));
    }
  }

  /// The geometry the cache was built with.
  const Geometry& geometry() const noexcept { return geometry_; }
  /// Tokens per block.
  std::int32_t block_size() const noexcept { return table_.block_size(); }
  /// The block pool (read-only).
  const Pool& pool() const noexcept { return pool_; }
  /// The page table (read-only): rows, front(), blocks().
  const Table& table() const noexcept { return table_; }
  /// The admission policy.
  const Admission& admission() const noexcept { return admission_; }
  /// The selection policy.
  const Selection& selection() const noexcept { return selection_; }
  /// The eviction policy (read-only: positions, scores, config).
  const Eviction& eviction() const noexcept { return eviction_; }

  // --- sequences -----------------------------------------------------------
  /// A new empty sequence; capacity_exceeded when every handle is in use.
  Result<SeqId> add_sequence(const PrefixKey& key = {}) noexcept
    requires(!head_paged)
  {
    auto s = table_.add(key);
    if (s) prefix_.started(s->index, 0);
    return s;
  }
  /// A new empty sequence (head-paged: layers x kv-heads empty head streams).
  Result<SeqId> add_sequence() noexcept
    requires head_paged
  {
    return admission_.add(table_);
  }
  /// A new sequence that starts with the cached prefix of `prompt` shared
  /// (nothing reserved: admit() also reserves the rest, all or nothing).
  Result<PrefixHit> add_sequence(std::span<const std::int32_t> prompt, const PrefixKey& key = {},
                                 std::span<const ExtraKey> extras = {}) noexcept
    requires(!head_paged)
  {
    auto hit = PrefixSharing::add(table_, pool_, prompt, key, extras, hasher_);
    if (hit) {
      prefix_.queried(std::int64_t(prompt.size()), hit->cached_tokens);
      prefix_.started(hit->seq.index, hit->cached_tokens);
    }
    return hit;
  }
  /// Atomic admission: a new sequence with the cached prefix of `prompt`
  /// shared and its next uncached prompt tokens reserved (all of them, or
  /// opt.reserve), their slots in slots[0..reserved). With opt.max_new >= 0
  /// its lifetime need is promised in the scheduler's ledger, and must fit
  /// the free pool less every promise outstanding. All or nothing: on an error
  /// nothing changes, the free queue's order included. With publish_on_reserve,
  /// the reserved tokens' full blocks are published.
  Result<AdmitResult> admit(std::span<const std::int32_t> prompt, std::span<std::int32_t> slots,
                            const AdmitOptions& opt = {}) noexcept
    requires(!head_paged)
  {
    auto plan = admit_plan(prompt, opt, static_cast<std::int64_t>(slots.size()));
    if (!plan) return plan.status();
    const SeqId s = PrefixSharing::adopt(table_, pool_, opt.key, prefix_.hits(plan->hit.blocks));
    const std::int32_t cached = plan->hit.blocks * block_size();
    prefix_.queried(std::int64_t(prompt.size()), cached);
    prefix_.started(s.index, cached);
    if (opt.max_new >= 0) prefix_.promise(s.index, plan->lifetime);
    auto r = reserve(s, prompt.subspan(std::size_t(cached), std::size_t(plan->reserve)), slots, opt.extras);
    if (!r) {  // unreachable: the plan checked every block and buffer
      (void)free(s);
      return r.status();
    }
    return AdmitResult{s, cached, plan->reserve, r->new_blocks, opt.max_new >= 0 ? plan->lifetime : 0};
  }
  /// A new sequence sharing every block of s (copy-on-write on the next write into a shared block).
  Result<SeqId> fork(SeqId s) noexcept {
    if constexpr (head_paged) {
      auto child = admission_.fork(table_, pool_, s);
      if constexpr (selects)
        if (child) stale_heads::forked(selection_.stale(), admission_, s, *child);
      if constexpr (evicts_global)
        if (child) global_.forked(admission_, eviction_, s, *child);
      return child;
    }
    auto child = table_.fork(pool_, s);
    if (child) prefix_.forked(s.index, child->index);
    if constexpr (StatefulEviction<Eviction>)
      if (child) eviction_.copy_state(s.index, child->index);
    if constexpr (ledgered)
      if (child) ledger_.copy(s.index, child->index);
    if constexpr (selects)
      if (child) selection_.stale().copy(s.index, child->index);
    return child;
  }
  /// Ends s: the handle dies, its blocks go back tail first; published blocks stay cached.
  Status free(SeqId s) noexcept {
    if constexpr (head_paged) {
      auto st = admission_.free(table_, pool_, s);
      if constexpr (selects)
        if (st) stale_heads::freed(selection_.stale(), admission_, s);
      if constexpr (evicts_global)
        if (st) global_.freed(admission_, eviction_, s);
      return st;
    }
    auto st = table_.release(pool_, s);
    if (st) prefix_.freed(s.index);
    if constexpr (StatefulEviction<Eviction>)
      if (st) eviction_.reset(s.index);
    if constexpr (ledgered)
      if (st) ledger_.reset(s.index);
    if constexpr (selects)
      if (st) selection_.stale().clear(s.index);
    return st;
  }

  // --- writes --------------------------------------------------------------
  /// Room for n more tokens of s, all or nothing: slots[0..n) get their slots, and a copy-on-write
  /// command comes back when the tail block is shared.
  Result<ReserveInfo> reserve(SeqId s, std::int32_t n, std::span<std::int32_t> slots) noexcept
    requires(!head_paged)
  {
    auto r = table_.reserve(pool_, s, n, slots);
    if (r) prefix_.copied(std::span(&r->copy, 1));
    if constexpr (selects)
      if (r) stale_rows::reserved(selection_.stale(), table_, s, n, r->copy);
    return r;
  }
  /// reserve() of ids.size() tokens given their ids: with publish_on_reserve,
  /// every block they fill is hashed and published (extras: the multimodal
  /// ranges overlapping them). The engine writes their K/V in the step that
  /// first reads them, so no hit can see a block before it is written.
  Result<ReserveInfo> reserve(SeqId s, std::span<const std::int32_t> ids, std::span<std::int32_t> slots,
                              std::span<const ExtraKey> extras = {}) noexcept
    requires(!head_paged)
  {
    if (prefix_.store().on())
      if (auto st = PrefixSharing::check_extras(extras); !st) return st;
    auto r = reserve(s, static_cast<std::int32_t>(ids.size()), slots);
    if (r) prefix_.reserved(table_, pool_, s, ids, slots, extras, hasher_);
    return r;
  }
  /// Reserves counts[k] tokens for seqs[k], all or nothing; slots padded with -1, copy-on-write commands in copies.
  Result<BatchInfo> reserve_batch(std::span<const SeqId> seqs, std::span<const std::int32_t> counts,
                                  std::span<std::int32_t> slots, std::span<BlockCopy> copies) noexcept
    requires(!head_paged)
  {
    auto r = table_.reserve_batch(pool_, seqs, counts, slots, copies);
    if (r) prefix_.copied(copies.first(std::size_t(r->copies)));
    if constexpr (selects)
      if (r) stale_rows::reserved(selection_.stale(), table_, seqs, counts, copies.first(std::size_t(r->copies)));
    return r;
  }
  /// reserve_batch() given the new tokens' ids, packed as the slots are: with
  /// publish_on_reserve, the blocks they fill are published (the decode step).
  Result<BatchInfo> reserve_batch(std::span<const SeqId> seqs, std::span<const std::int32_t> counts,
                                  std::span<const std::int32_t> ids, std::span<std::int32_t> slots,
                                  std::span<BlockCopy> copies) noexcept
    requires(!head_paged)
  {
    std::int64_t total = 0;
    for (const std::int32_t c : counts) total += c;  // a negative count is the table's error to report
    if (std::int64_t(ids.size()) != total && counts.size() == seqs.size() &&
        std::none_of(counts.begin(), counts.end(), [](std::int32_t c) { return c < 0; }))
      return Status{Errc::invalid_argument, "ids.size (the sum of counts)", std::int64_t(ids.size()), total};
    auto r = reserve_batch(seqs, counts, slots, copies);
    if (r && std::int64_t(ids.size()) == total) prefix_.reserved_batch(table_, pool_, seqs, counts, ids, slots, hasher_);
    return r;
  }
  /// Head-paged: writes layer `layer`'s n = gates.size() / kv_heads new tokens
  /// of s; the policy places each (token, head) and fills `out` with the
  /// engine's commands: copies, then moves, then the tokens at slots (the
  /// policy's write(), e.g. WriteGate::write). All or nothing.
  Result<GateWriteInfo> write(SeqId s, std::int32_t layer, std::span<const float> gates, const GateWriteSpans& out) noexcept
    requires head_paged
  {
    auto r = admission_.write(table_, pool_, s, layer, gates, out);
    if constexpr (selects)
      if (r) stale_heads::copied(selection_.stale(), table_, admission_, std::span(&s, 1), layer, layer + 1, out.copies.first(std::size_t(r->copies)));
    return r;
  }
  /// Head-paged decode step of one layer: one new token for each of seqs;
  /// gates, out.slots and out.promote are [seqs][kv_heads] (the policy's
  /// write_batch(), e.g. WriteGate::write_batch). All or nothing.
  Result<GateWriteInfo> write_batch(std::span<const SeqId> seqs, std::int32_t layer, std::span<const float> gates,
                                    const GateWriteSpans& out) noexcept
    requires head_paged
  {
    auto r = admission_.write_batch(table_, pool_, seqs, layer, gates, out);
    if constexpr (selects)
      if (r) stale_heads::copied(selection_.stale(), table_, admission_, seqs, layer, layer + 1, out.copies.first(std::size_t(r->copies)));
    return r;
  }
  /// Rollback: the n most recently appended tokens leave. A token policy's
  /// compaction reorders the row, so after an evict() that evicted tokens a
  /// rollback reaches back only to that call: n larger than the tokens
  /// appended since is truncate_too_many naming the limit, and nothing changes.
  Status truncate(SeqId s, std::int32_t n) noexcept
    requires(!head_paged)
  {
    if constexpr (TokenEviction<Eviction>) {
      if (auto st = table_.validate(s); !st) return st;
      const std::int64_t limit = ledger_.rollback_limit(s.index, table_.appended_unchecked(s));
      if (n > limit) return Status{Errc::truncate_too_many, "n_tokens", n, limit};
    }
    auto st = table_.truncate(pool_, s, n);
    if (st) prefix_.truncated(table_, s);
    if constexpr (StatefulEviction<Eviction>)
      if (st) eviction_.on_truncate(s.index, table_.tokens_unchecked(s));
    if constexpr (ledgered)
      if (st) ledger_.on_truncate(s.index, table_.appended_unchecked(s));
    if constexpr (selects)
      if (st && n > 0) stale_rows::truncated(selection_.stale(), table_, pool_, s);
    return st;
  }

  /// Head-paged, no host sync, part 1: room for n tokens of `layer` and the rings' state for the device's
  /// ring_admit launch (the policy's allot(), e.g. WriteGate::allot).
  Result<GateWriteInfo> allot(SeqId s, std::int32_t layer, std::int32_t n, const GateDeferredSpans& out) noexcept
    requires head_paged
  {
    return admission_.allot(table_, pool_, s, layer, n, out);
  }
  /// Head-paged, no host sync, part 2: replays the oldest allotted write of (s, layer) with the gates read
  /// back from the device and returns the blocks it did not use (the policy's reconcile()).
  Result<GateWriteInfo> reconcile(SeqId s, std::int32_t layer, std::span<const float> gates) noexcept
    requires head_paged
  {
    auto r = admission_.reconcile(table_, pool_, s, layer, gates);
    if constexpr (selects)
      if (r) stale_heads::reconciled(selection_.stale(), table_, admission_, s, layer, std::int32_t(gates.size()) / admission_.num_kv_heads());
    return r;
  }
  /// Head-paged rollback of the n newest tokens of every layer: the engine
  /// runs out.copies, then out.moves (the policy's truncate()). All or nothing.
  Result<GateWriteInfo> truncate(SeqId s, std::int32_t n, const GateWriteSpans& out) noexcept
    requires head_paged
  {
    auto r = admission_.truncate(table_, pool_, s, n, out);
    if constexpr (selects)
      if (r) {
        stale_heads::copied(selection_.stale(), table_, admission_, std::span(&s, 1), 0, admission_.num_layers(), out.copies.first(std::size_t(r->copies)));
        stale_heads::truncated(selection_.stale(), table_, pool_, admission_, s);
      }
    if constexpr (evicts_global)
      if (r) global_.truncated(admission_, eviction_, s);
    return r;
  }

  // --- eviction ----------------------------------------------------------------
  /// Feeds the policy one step's scores for the sequence's held tokens (slot
  /// order). Scores are finite and >= 0. A kind outside ScoreKind or one the
  /// policy does not read, a wrong shape, a NaN, an infinity or a negative
  /// value is an error naming it, and nothing changes.
  Status observe(SeqId s, const Scores& sc) noexcept
    requires(ObservingEviction<Eviction> && !head_paged)
  {
    if (auto st = table_.validate(s); !st) return st;
    if (!valid_kind(sc.kind) || !Eviction::required_signals.covers(signal_of(sc.kind)))
      return Status{Errc::invalid_argument, "scores.kind", std::int64_t(sc.kind), std::int64_t(Eviction::required_signals.bits)};
    const std::int64_t held = table_.tokens_unchecked(s);
    if (sc.rows < 1) return Status{Errc::invalid_argument, "scores.rows", sc.rows, 1};
    if (std::int64_t(sc.values.size()) != held * sc.rows)
      return Status{Errc::invalid_argument, "scores.size", std::int64_t(sc.values.size()), held * sc.rows};
    if (const std::int64_t bad = first_outside(sc.values, 0.0f, kMaxScore); bad >= 0)
      return Status{Errc::invalid_argument, "scores_at", bad, 0};
    return eviction_.observe(s.index, sc, view(s, 0));
  }
  /// Head-paged with a token policy on the global region: one layer's scores,
  /// each kv-head's row in turn, one score per token the row holds (ring
  /// slots, then global, as export_heads_csr lays them out); the policy reads
  /// each row's global part. Finite and >= 0; a kind the policy does not
  /// read, a wrong size or a bad value is an error naming it, and nothing changes.
  Status observe(SeqId s, std::int32_t layer, ScoreKind kind, std::span<const float> values) noexcept
    requires(evicts_global && ObservingEviction<Eviction>)
  {
    return global_.observe(table_, pool_, admission_, eviction_, s, layer, kind, values);
  }
  /// Head-paged with a token policy: every head row's global region of s is
  /// evicted and compacted; run `moves` (all rows) with the compaction kernel
  /// on the single-head pool. The ring is never a candidate; tokens in blocks
  /// a fork shares never leave. A buffer too small is an error, and nothing changes.
  Result<EvictionResult> evict(SeqId s, std::span<SlotMove> moves) noexcept
    requires evicts_global
  {
    StalePages* stale = nullptr;
    if constexpr (selects) stale = &selection_.stale();
    return global_.evict(table_, pool_, admission_, eviction_, s, moves, stale);
  }

  /// Shorthand: one score per held token, reduced over heads and queries.
  Status observe(SeqId s, std::span<const float> scores) noexcept
    requires(ObservingEviction<Eviction> && !head_paged)
  {
    return observe(s, Scores{ScoreKind::attention_sums, scores, 1});
  }

  /// Runs the policy on one sequence. What leaves and what the engine must do
  /// depends on the policy's kind (policy.hpp):
  ///   block   chosen logical blocks leave the row (ascending, into out.blocks);
  ///           kept blocks that moved go to out.rotations (block, new index,
  ///           position delta) for key re-rotation. Shared blocks never move:
  ///           candidates start after the sequence's last shared block.
  ///   token   each group's tokens leave; the survivors are compacted: run
  ///           out.moves[out.group_moves[g] .. out.group_moves[g+1]) with the
  ///           compaction kernel on group g's heads before the next write. The
  ///           row then drops its tail. Tokens in shared blocks never leave.
  ///           group_moves (groups() + 1 entries) is required and always
  ///           written: a call with nothing to evict writes empty ranges.
  ///   window  the oldest tokens leave the front; blocks with no live token go
  ///           back to the pool. Nothing to run. `pending_queries`: the last
  ///           held tokens whose attention has not run yet (evict between
  ///           reserve and attention); the window keeps what they need.
  /// pending_queries is for window policies; others take 0. A buffer too
  /// small for the plan is an error, and nothing changes.
  Result<EvictionResult> evict(SeqId s, const EvictionSpans& out, std::int32_t pending_queries = 0) noexcept
    requires(!head_paged)
  {
    if (auto st = table_.validate(s); !st) return st;
    const std::int32_t held = table_.tokens_unchecked(s);
    if (pending_queries < 0 || pending_queries > held || (!WindowEviction<Eviction> && pending_queries != 0))
      return Status{Errc::invalid_argument, "pending_queries", pending_queries, WindowEviction<Eviction> ? held : 0};
    Result<EvictionResult> r = EvictionResult{};
    if constexpr (BlockEviction<Eviction>) r = EvictionRun::blocks(table_, pool_, eviction_, s, out.blocks, out.rotations);
    else if constexpr (TokenEviction<Eviction>) r = EvictionRun::tokens(table_, pool_, eviction_, scratch_, s, out.moves, out.group_moves);
    else if constexpr (WindowEviction<Eviction>) r = EvictionRun::front(table_, pool_, eviction_, s, pending_queries);
    if constexpr (ledgered)
      if (r) settle(s, pending_queries, TokenEviction<Eviction> && r.value().tokens > 0);
    if constexpr (selects)
      if (r) stale_rows::evicted<Eviction>(selection_.stale(), s, *r, block_size());
    return r;
  }
  /// Shorthand for block policies: evict(s, {blocks, rotations}).
  Result<EvictionResult> evict(SeqId s, std::span<std::int32_t> blocks, std::span<BlockRotation> rotations) noexcept {
    return evict(s, EvictionSpans{.blocks = blocks, .rotations = rotations});
  }

  // --- prefix sharing ------------------------------------------------------
  /// Cached blocks of the longest published prefix of `tokens` into out; returns how many.
  /// A peek: nothing is retained and the query counters do not move.
  std::int32_t match_prefix(std::span<const std::int32_t> tokens, const PrefixKey& key, std::span<BlockId> out) const noexcept
    requires(!head_paged)
  {
    return PrefixSharing::match(table_, pool_, tokens, key, {}, hasher_, out).blocks;
  }
  /// match_prefix() of a prompt with multimodal inputs; bad extras are invalid_argument.
  Result<std::int32_t> match_prefix(std::span<const std::int32_t> tokens, const PrefixKey& key, std::span<BlockId> out,
                                    std::span<const ExtraKey> extras) const noexcept
    requires(!head_paged)
  {
    if (auto st = PrefixSharing::check_extras(extras); !st) return st;
    return PrefixSharing::match(table_, pool_, tokens, key, extras, hasher_, out).blocks;
  }
  /// Publishes s's full blocks of `tokens` (its first tokens) for prefix hits; returns the hashes newly cached.
  /// extras: the multimodal ranges among them. With publish_on_reserve it also supplies ids reserve() lacked.
  Result<std::int32_t> publish(SeqId s, std::span<const std::int32_t> tokens, std::span<const ExtraKey> extras = {}) noexcept
    requires(!head_paged)
  {
    return PrefixSharing::publish(table_, pool_, s, tokens, extras, hasher_, prefix_.store());
  }
  /// Moves pending block events (stored / removed / all_cleared) into out; returns how many.
  std::int32_t drain_events(std::span<BlockEvent> out) noexcept { return pool_.drain_events(out); }
  /// drain_events() with each stored block's token ids: event i's block_size ids at token_ids[i * block_size()].
  Result<std::int32_t> drain_events(std::span<BlockEvent> out, std::span<std::int32_t> token_ids) noexcept {
    return pool_.drain_events(out, token_ids);
  }
  /// Prefix-cache counters (queries, hit tokens, hashes stored, recycled, invalidated) and block states.
  PrefixStats prefix_stats() const noexcept { return prefix_.stats(pool_); }
  /// The prefix cache's state: publish-on-reserve ids, the lifetime ledger (read-only).
  const PrefixState& prefix_state() const noexcept { return prefix_; }
  /// Drops every cached hash (free-but-cached blocks become plain free); emits all_cleared.
  Status reset_prefix_cache() noexcept { return pool_.reset_prefix_cache(); }

  // --- exports for attention kernels ----------------------------------------
  /// Dense block table: row k of out (row_stride entries) holds seqs[k]'s blocks, null-padded.
  Status export_block_table(std::span<const SeqId> seqs, std::span<std::int32_t> out,
                            std::int32_t row_stride) const noexcept
    requires(!head_paged)
  {
    return kvcache::export_block_table(table_, seqs, out, row_stride);
  }
  /// FlashInfer paging for seqs: indptr (n+1), indices, last_page_len; returns pages written.
  Result<std::int32_t> export_csr(std::span<const SeqId> seqs, std::span<std::int32_t> indptr,
                                  std::span<std::int32_t> indices, std::span<std::int32_t> last_page_len) const noexcept
    requires(!head_paged)
  {
    return kvcache::export_csr(table_, seqs, indptr, indices, last_page_len);
  }
  /// Slots each row spans (front + tokens held) into out.
  Status export_lengths(std::span<const SeqId> seqs, std::span<std::int32_t> out) const noexcept
    requires(!head_paged)
  {
    return kvcache::export_lengths(table_, seqs, out);
  }
  /// Head-paged: dense block table with one row per (sequence, kv-head) of
  /// `layer`, or of every layer (layer -1, layer-major); rows as in head_paged.hpp.
  Status export_heads_block_table(std::span<const SeqId> seqs, std::int32_t layer, std::span<std::int32_t> out,
                                  std::int32_t row_stride) const noexcept
    requires head_paged
  {
    return kvcache::export_heads_block_table(table_, admission_, seqs, layer, out, row_stride);
  }
  /// Head-paged: FlashInfer paging with one row per (sequence, kv-head); returns pages written.
  Result<std::int32_t> export_heads_csr(std::span<const SeqId> seqs, std::int32_t layer, std::span<std::int32_t> indptr,
                                        std::span<std::int32_t> indices, std::span<std::int32_t> last_page_len) const noexcept
    requires head_paged
  {
    return kvcache::export_heads_csr(table_, admission_, seqs, layer, indptr, indices, last_page_len);
  }
  /// Head-paged: tokens each head row holds.
  Status export_heads_lengths(std::span<const SeqId> seqs, std::int32_t layer, std::span<std::int32_t> out) const noexcept
    requires head_paged
  {
    return kvcache::export_heads_lengths(table_, admission_, seqs, layer, out);
  }
  /// Head-paged: each head row's token positions (ring, then admitted global columns) for sparse prefill.
  Result<std::int32_t> export_head_columns(std::span<const SeqId> seqs, std::int32_t layer, std::span<std::int32_t> indptr,
                                           std::span<std::int32_t> columns) const noexcept
    requires head_paged
  {
    return kvcache::export_head_columns(admission_, seqs, layer, indptr, columns);
  }

  // --- selection (page-bounds policies: Quest) --------------------------------
  /// One pool layer's slice of the page-bounds store, [num_blocks][kv_heads][2][head_dim]:
  /// the bounds argument of that layer's page_bounds_update and page_bounds launches
  /// (head-paged: the pool has one layer, so slice 0 serves every model layer).
  Result<std::span<float>> page_bounds(std::int32_t layer) const noexcept
    requires selects
  {
    if (layer < 0 || layer >= geometry_.spec().num_layers)
      return Status{Errc::invalid_argument, "layer", layer, geometry_.spec().num_layers};
    return selection_.bounds(layer);
  }
  /// The pages of seqs whose bounds a copy-on-write, a compaction, a rotation,
  /// a rollback or a reconciled deferred write left stale (head-paged: of
  /// every head row), as (page, fill) for page_bounds on every pool layer;
  /// listing them marks them current. Run it after those edits' kernels and
  /// before select(). All or nothing; returns pages listed.
  Result<std::int32_t> stale_pages(std::span<const SeqId> seqs, const StaleSpans& out) noexcept
    requires selects
  {
    if constexpr (head_paged) {  // every layer's head rows of seqs
      if (auto rows = head_rows::count(admission_, seqs, -1); !rows) return rows.status();
      return take_stale_rows(selection_.stale(), table_, pool_,
                             [&](auto f) { head_rows::each(admission_, seqs, -1, [&](std::int64_t, SeqId h) { f(h); }); }, out);
    } else {
      return take_stale_pages(selection_.stale(), table_, pool_, seqs, out);
    }
  }
  /// Host selection: the pages each (sequence, kv-head) of seqs reads for
  /// `layer`'s queries ([seqs][kv_heads][query_group][head_dim] fp32) as a
  /// head-folded CSR (the policy's select(), e.g. QuestSelection::select).
  /// Returns pages written; no allocation; on an error nothing is written.
  Result<std::int32_t> select(std::span<const SeqId> seqs, std::int32_t layer, std::span<const float> queries,
                              const SelectSpans& out) noexcept
    requires selects
  {
    if constexpr (head_paged) return selection_.select_heads(table_, admission_, seqs, layer, queries, out);
    else return selection_.select(table_, seqs, layer, queries, out);
  }
  /// A page_select launch's inputs for a device backend: the rows' pages and
  /// output offsets into `plan`, and the params but queries, out_indices and
  /// scratch (the policy's plan(); the cache never reads the store here).
  Result<PageSelectParams> select_params(std::span<const SeqId> seqs, std::int32_t layer,
                                         const SelectPlanSpans& plan) const noexcept
    requires selects
  {
    if constexpr (head_paged) return selection_.plan_heads(table_, admission_, seqs, layer, plan);
    else return selection_.plan(table_, seqs, layer, plan);
  }

  // --- accounting (what the scheduler asks) ---------------------------------
  /// Live tokens s holds.
  Result<std::int64_t> tokens_held(SeqId s) const noexcept {
    if constexpr (head_paged) return admission_.tokens_held(table_, s);
    auto t = table_.tokens(s);
    if (!t) return t.status();
    return std::int64_t{*t};
  }
  /// Live tokens one head of s holds (head-paged: ring + global).
  Result<std::int64_t> tokens_held(SeqId s, std::int32_t layer, std::int32_t kv_head) const noexcept
    requires head_paged
  {
    auto h = admission_.head(s, layer, kv_head);
    if (!h) return h.status();
    return std::int64_t{table_.tokens_unchecked(*h)};
  }
  /// Blocks s's row holds (head-paged: its head rows together).
  Result<std::int32_t> blocks_held(SeqId s) const noexcept {
    if constexpr (head_paged) {
      const SeqId one[] = {s};
      auto rows = head_rows::count(admission_, one, -1);
      if (!rows) return rows.status();
      std::int32_t n = 0;
      head_rows::each(admission_, one, -1, [&](std::int64_t, SeqId h) { n += std::int32_t(table_.blocks_unchecked(h).size()); });
      return n;
    }
    auto b = table_.blocks(s);
    if (!b) return b.status();
    return static_cast<std::int32_t>(b->size());
  }
  /// Longest prompt_len + max_new accounting accepts (2^62: no overflow below).
  static constexpr std::int64_t max_length = std::int64_t{1} << 62;
  /// Pool blocks a new sequence needs over its whole life under the eviction
  /// policy's bound (the bound is non-decreasing in tokens appended). With
  /// prefill_chunk > 0 the engine runs evict() after every prefill chunk of at
  /// most that many tokens, so the prompt never sits whole in the cache.
  Result<std::int64_t> blocks_needed(std::int64_t prompt_len, std::int64_t max_new,
                                     std::int64_t prefill_chunk = 0) const noexcept {
    if (prompt_len < 0 || prompt_len > max_length) return Status{Errc::invalid_argument, "prompt_len", prompt_len, max_length};
    if (max_new < 0 || max_new > max_length - prompt_len)
      return Status{Errc::invalid_argument, "max_new", max_new, max_length - prompt_len};
    if (prefill_chunk < 0) return Status{Errc::invalid_argument, "prefill_chunk", prefill_chunk, 0};
    // Head-paged: every head holds at most its ring and its cap at any point, prefill included.
    if constexpr (head_paged) return admission_.max_blocks_held(prompt_len + max_new);
    std::int64_t peak = prompt_len;  // slots: held whole until the policy first runs
    const std::int64_t after = eviction_.max_tokens_after_eviction();
    // A window's dead front slots (< B), and, when it evicts before attention,
    // the W − 1 + chunk it keeps for the previous chunk's queries.
    const std::int64_t chunk = std::min(prefill_chunk, prompt_len);
    const std::int64_t slack = WindowEviction<Eviction> ? block_size() - 1 + std::max<std::int64_t>(0, chunk - 1) : 0;
    if (chunk > 0 && after < prompt_len) peak = std::min(prompt_len, after + chunk + slack);
    return std::max(blocks_for_tokens(peak, block_size()), eviction_.max_blocks_held(prompt_len + max_new, block_size()));
  }
  /// A sequence handle is free and blocks_needed fits the free pool less the
  /// blocks promised to running sequences (promised_blocks()).
  bool can_admit(std::int64_t prompt_len, std::int64_t max_new) const noexcept {
    auto need = blocks_needed(prompt_len, max_new);
    return need.ok() && free_sequences() > 0 && *need <= pool_.num_free() - promised_blocks();
  }
  /// What admit(prompt, slots, opt) would take, counting its prefix hit:
  /// from_free is its lifetime need less the hit blocks other sequences hold
  /// (free-but-cached hit blocks count against the free pool). Errors are admit()'s.
  Result<AdmitPlan> plan_admission(std::span<const std::int32_t> prompt, const AdmitOptions& opt = {}) const noexcept
    requires(!head_paged)
  {
    return admit_plan(prompt, opt, -1);
  }
  /// admit(prompt, ...) would succeed now.
  bool can_admit(std::span<const std::int32_t> prompt, const AdmitOptions& opt = {}) const noexcept
    requires(!head_paged)
  {
    return admit_plan(prompt, opt, -1).ok();
  }
  /// Blocks owed to running sequences: each promise (admit with max_new, or
  /// promise()) less the blocks the sequence holds. O(sequences).
  std::int64_t promised_blocks() const noexcept {
    if constexpr (head_paged) return 0;
    else return prefix_.outstanding(table_);
  }
  /// Promises s `blocks` (at most a row's blocks) over its lifetime (0 withdraws); admissions leave them free for it.
  Status promise(SeqId s, std::int64_t blocks) noexcept
    requires(!head_paged)
  {
    if (auto st = table_.validate(s); !st) return st;
    if (blocks < 0) return Status{Errc::invalid_argument, "blocks", blocks, 0};
    if (blocks > table_.max_blocks_per_stream())  // more than a row can hold is never owed
      return Status{Errc::invalid_argument, "blocks", blocks, table_.max_blocks_per_stream()};
    prefix_.promise(s.index, blocks);
    return {};
  }
  /// Blocks allocate() can hand out now (plain free + free-but-cached).
  std::int32_t free_blocks() const noexcept { return pool_.num_free(); }
  /// Sequence handles still free.
  std::int32_t free_sequences() const noexcept {
    if constexpr (head_paged) return admission_.free_sequences();
    return table_.free_streams();
  }
  /// The eviction policy's bound for any stream (INT64_MAX for keep-all).
  std::int64_t max_tokens_after_eviction() const noexcept { return eviction_.max_tokens_after_eviction(); }

  /// Tokens the sequence holds above its policy's bound because shared
  /// blocks (prefix sharing, fork) kept the last evict() from going lower.
  /// The scheduler counts them as memory it cannot reclaim yet; the next
  /// evict() after the sharing ends brings the sequence back within its bound.
  Result<std::int64_t> shared_excess(SeqId s) const noexcept
    requires(!head_paged)
  {
    if (auto st = table_.validate(s); !st) return st;
    if constexpr (ledgered) return ledger_.at(s.index).excess;
    else return std::int64_t{0};
  }
  /// The sum of shared_excess over every live sequence. O(sequences).
  std::int64_t shared_excess() const noexcept {
    std::int64_t total = 0;
    if constexpr (ledgered) table_.for_each_stream([&](SeqId s) { total += ledger_.at(s.index).excess; });
    return total;
  }

  /// Pool, table and the eviction contract; invariant_violated always means
  /// a library bug, never a legal state. A stream holds no more than the
  /// policy's bound for what it appended as of its last evict(), plus the
  /// tokens reserved since (not yet met by the policy) and its shared excess;
  /// a stream the policy has fully met also holds no more blocks than the
  /// policy advertised. O(pool + table).
  Status check_invariants() const {
    if (auto st = pool_.check(); !st) return st;
    if (auto st = table_.check(pool_); !st) return st;
    if constexpr (head_paged) return admission_.check(table_);  // rows within ring + cap, positions, lengths
    Status bad{};
    table_.for_each_stream([&](SeqId s) {
      const std::int64_t appended = table_.appended_unchecked(s), held = table_.tokens_unchecked(s);
      const std::int64_t blocks = std::int64_t(table_.blocks_unchecked(s).size());
      BoundLedger::Entry e{.settled = appended};
      if constexpr (ledgered) e = ledger_.at(s.index);
      const std::int64_t limit = eviction_.max_tokens_held(e.settled) + (appended - e.settled) + e.excess;
      if (bad.ok() && held > limit) bad = Status{Errc::invariant_violated, "tokens_held", held, limit};
      const bool met = e.settled == appended && e.excess == 0;
      if (bad.ok() && met && blocks > eviction_.max_blocks_held(appended, block_size()))
        bad = Status{Errc::invariant_violated, "blocks_held", blocks, eviction_.max_blocks_held(appended, block_size())};
    });
    return bad;
  }

  friend bool operator==(const Cache& a, const Cache& b) {
    if constexpr (StatefulEviction<Eviction>)
      if (!(a.eviction_ == b.eviction_)) return false;
    if constexpr (ledgered)
      if (!(a.ledger_ == b.ledger_)) return false;
    if constexpr (evicts_global)
      if (!(a.global_ == b.global_)) return false;
    if constexpr (selects)
      if (!(a.selection_ == b.selection_)) return false;
    if constexpr (head_paged)
      if (!(a.admission_ == b.admission_)) return false;
    return a.pool_ == b.pool_ && a.table_ == b.table_ && a.prefix_ == b.prefix_;
  }

 private:
  StreamView view(SeqId s, std::int32_t first_candidate) const noexcept {
    return {table_.tokens_unchecked(s), table_.appended_unchecked(s), first_candidate};
  }
  std::int32_t first_unshared_block(SeqId s) const noexcept { return EvictionRun::first_unshared_block(table_, pool_, s); }

  // The policy evicted (r ok): record where the stream now stands.
  void settle(SeqId s, std::int32_t pending, bool reordered) noexcept {
    const std::int64_t appended = table_.appended_unchecked(s), held = table_.tokens_unchecked(s);
    const std::int64_t settled = appended - std::max(0, pending - 1);  // later pending queries wait for attention
    const std::int64_t over = held - eviction_.max_tokens_held(settled) - (appended - settled);
    // Above the bound is legal only where shared blocks stopped the policy.
    ledger_.settle(s.index, settled, over > 0 && first_unshared_block(s) > 0 ? over : 0, reordered, appended);
  }

  // Table streams: one per sequence, or per (sequence, layer, kv-head).
  static std::int32_t streams(const CacheConfig& cfg, const typename AdmissionArg<Admission>::type& a) {
    if constexpr (head_paged) {
      const std::int64_t n = cfg.max_sequences < 1 ? cfg.max_sequences : Admission::streams_for(a, cfg.max_sequences);
      if (n > INT32_MAX) throw ConfigError("kvcache::Cache", Status{Errc::invalid_argument, "max_sequences x layers x kv_heads", n, INT32_MAX});
      return std::int32_t(n);
    } else {
      (void)a;
      return cfg.max_sequences;
    }
  }
  static Pool make_pool(const CacheConfig& cfg) {
    if constexpr (std::same_as<Pool, BlockPool>) return BlockPool(cfg.num_blocks, cfg.event_capacity, cfg.geometry.block_size(), cfg.medium);
    else return Pool(cfg.num_blocks, cfg.event_capacity);
  }

  // admit()'s checks and plan (prefix_cache.hpp), with the policy's lifetime
  // need; slots: the caller's slot buffer size (-1: a dry run).
  Result<AdmitPlan> admit_plan(std::span<const std::int32_t> prompt, const AdmitOptions& opt,
                               std::int64_t slots) const noexcept {
    if (free_sequences() == 0) return Status{Errc::capacity_exceeded, "max_sequences", table_.max_streams() + 1, table_.max_streams()};
    const auto life = blocks_needed(std::int64_t(prompt.size()), std::max<std::int64_t>(opt.max_new, 0), opt.prefill_chunk);
    return prefix_.plan(table_, pool_, prompt, opt, life, hasher_, slots);
  }

  static Admission make_admission(const CacheConfig& cfg, const typename AdmissionArg<Admission>::type& a, Table& t) {
    if constexpr (head_paged) {
      return Admission(a, cfg.max_sequences, t);
    } else {
      (void)cfg, (void)t;
      return a;
    }
  }

  // What the selection policy binds to: rows per sequence, or head rows.
  SelectionShape selection_shape(const CacheConfig& cfg, const typename AdmissionArg<Admission>::type& a) const {
    const GeometrySpec& g = cfg.geometry.spec();
    if constexpr (head_paged)
      return {cfg.geometry, cfg.num_blocks, admission_.num_layers(), streams(cfg, a), cfg.max_sequences * admission_.num_kv_heads(),
              cfg.max_blocks_per_sequence, admission_.num_kv_heads(), admission_.local_window() / g.block_size};
    else
      return {cfg.geometry, cfg.num_blocks, g.num_layers, cfg.max_sequences, cfg.max_sequences, cfg.max_blocks_per_sequence,
              g.num_kv_heads, 0};
  }

  // A usable geometry, and a policy that counts blocks in the geometry's size.
  static const Geometry& valid_geometry(const Geometry& g, const Eviction& e) {
    if (g.block_bytes() == 0)
      throw ConfigError("kvcache::Cache", Status{Errc::invalid_argument, "geometry (empty: build it with Geometry::make)", 0, 1});
    if constexpr (head_paged) {
      if (g.spec().num_layers != 1)
        throw ConfigError("kvcache::Cache", Status{Errc::invalid_argument, "geometry.num_layers (head-paged: one per block)", g.spec().num_layers, 1});
      if (g.spec().num_kv_heads != 1)
        throw ConfigError("kvcache::Cache", Status{Errc::invalid_argument, "geometry.num_kv_heads (head-paged: one per block)", g.spec().num_kv_heads, 1});
    }
    if constexpr (requires { e.block_size(); })
      if (e.block_size() != g.block_size())
        throw ConfigError("kvcache::Cache", Status{Errc::invalid_argument, "eviction.block_size", e.block_size(), g.block_size()});
    return g;
  }

  Geometry geometry_;
  Pool pool_;
  Table table_;
  [[no_unique_address]] Admission admission_;
  [[no_unique_address]] Selection selection_;
  [[no_unique_address]] Eviction eviction_;
  [[no_unique_address]] Hasher hasher_;
  struct NoLedger {};
  [[no_unique_address]] std::conditional_t<ledgered, BoundLedger, NoLedger> ledger_;
  struct NoRegion {};
  [[no_unique_address]] std::conditional_t<evicts_global, GlobalRegion, NoRegion> global_;
  PrefixState prefix_;
  struct NoScratch {};
  [[no_unique_address]] std::conditional_t<TokenEviction<Eviction> && !head_paged, EvictionRun::TokenScratch, NoScratch> scratch_;
};

KVCACHE_END_NAMESPACE
