// A cache whose rows are sequences (token-paged): every layer and kv-head of
// a token shares its slot. The core (pool, table) makes each edit; then the
// participants hear of it (cache/hooks.hpp): the prefix state
// (prefix/prefix_cache.hpp), the eviction state with its ledger
// (eviction/row_eviction.hpp) and the selection's stale pages
// (selection/row_selection.hpp); the admission decides how reserve takes
// room (admission/row_admission.hpp). The policies' logic lives with them;
// a peer's prefill lands through cache/token_imports.hpp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>

#include "kvcache/admission/row_admission.hpp"
#include "kvcache/core/block_hash.hpp"
#include "kvcache/cache/accounting.hpp"
#include "kvcache/cache/core.hpp"
#include "kvcache/cache/hooks.hpp"
#include "kvcache/cache/token_imports.hpp"
#include "kvcache/config.hpp"
#include "kvcache/eviction/plan.hpp"
#include "kvcache/eviction/row_eviction.hpp"
#include "kvcache/table/page_table_edits.hpp"
#include "kvcache/table/page_table_export.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/prefix/prefix_cache.hpp"
#include "kvcache/prefix/prefix_sharing.hpp"
#include "kvcache/selection/row_selection.hpp"
#include "kvcache/status.hpp"
#include "kvcache/core/sequence_id.hpp"

KVCACHE_BEGIN_NAMESPACE

/// The token-paged cache: one row per sequence (Cache picks it for a pass-through admission).
template <class Pool, class Table, class Admission, class Selection, class Eviction, class Hasher>
class TokenPagedCache : public CacheCore<Pool, Table>,
                        public RowAccounting<TokenPagedCache<Pool, Table, Admission, Selection, Eviction, Hasher>>,
                        public TokenImports<TokenPagedCache<Pool, Table, Admission, Selection, Eviction, Hasher>> {
  using Core = CacheCore<Pool, Table>;
  using Core::pool_, Core::table_;
  using TokenImports<TokenPagedCache>::imports_;
  friend class RowAccounting<TokenPagedCache>;  // accounting.hpp reads the parts
  friend class TokenImports<TokenPagedCache>;   // token_imports.hpp: the import calls

 public:
  static constexpr bool head_paged = false;  ///< Rows are sequences.
  /// The selection policy reads key bounds per page: the cache keeps a page-bounds store current.
  static constexpr bool selects = Selection::kind == SelectionKind::page_bounds;
  /// The eviction policy can leave a stream above its bound between calls (a ledger keeps where each stands).
  static constexpr bool ledgered = RowEviction<Eviction>::ledgered;
  static constexpr bool evicts = ledgered;       ///< The policy evicts at all.
  static constexpr bool evicts_global = false;   ///< Head-paged only.
  /// Score signals this cache feeds to policies (cache.hpp's cache_signals).
  static constexpr Signals provided_signals{Signals::attention_sums | Signals::head_attention_sums |
                                            Signals::last_query_attention};
  /// Longest prompt_len + max_new accounting accepts.
  static constexpr std::int64_t max_length = max_request_length;

  /// Builds the cache; throws ConfigError for a bad configuration (zero sizes, overflow, a policy unlike the geometry).
  explicit TokenPagedCache(const CacheConfig& cfg, Admission admission = {},
                           typename RowSelection<Selection>::Arg selection = {}, Eviction eviction = {}, Hasher hasher = {})
      : Core(cfg, cfg.max_sequences),
        TokenImports<TokenPagedCache>(cfg.max_sequences),
        admission_(admission),
        selection_(selection),
        eviction_(eviction),
        hasher_(hasher),
        prefix_(cfg.num_blocks, cfg.geometry.block_size(), cfg.max_sequences, cfg.max_blocks_per_sequence, cfg.publish_on_reserve) {
    const GeometrySpec& g = cfg.geometry.spec();
    admission_.bind(cfg.max_sequences, cfg.publish_on_reserve);
    eviction_.bind({cfg.max_sequences, cfg.max_blocks_per_sequence * g.block_size, g.block_size});
    if constexpr (selects)
      selection_.bind({cfg.geometry, cfg.num_blocks, g.num_layers, cfg.max_sequences, cfg.max_sequences,
                       cfg.max_blocks_per_sequence, g.num_kv_heads, 0});
  }

  const Admission& admission() const noexcept { return admission_.policy(); } ///< The admission policy.
  const Selection& selection() const noexcept { return selection_.policy(); } ///< The selection policy.
  const Eviction& eviction() const noexcept { return eviction_.policy(); }    ///< The eviction policy.

  // --- sequences -----------------------------------------------------------
  /// A new empty sequence; capacity_exceeded when every handle is in use.
  Result<SeqId> add_sequence(const PrefixKey& key = {}) noexcept {
    auto s = table_.add(key);
    if (s) prefix_.started(s->index, 0);
    return s;
  }
  /// A new sequence that starts with the cached prefix of `prompt` shared
  /// (nothing reserved: admit() also reserves the rest, all or nothing).
  Result<PrefixHit> add_sequence(std::span<const std::int32_t> prompt, const PrefixKey& key = {},
                                 std::span<const ExtraKey> extras = {}) noexcept {
    auto hit = PrefixSharing::add(table_, pool_, prompt, key, extras, hasher_);
    if (hit) {
      prefix_.adopted(hit->seq, std::int64_t(prompt.size()), hit->cached_tokens);
      notify(hooks::adopted, hit->seq, hit->cached_tokens / this->block_size());
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
                            const AdmitOptions& opt = {}) noexcept {
    auto plan = admit_plan(prompt, opt, static_cast<std::int64_t>(slots.size()));
    if (!plan) return plan.status();
    const SeqId s = PrefixSharing::adopt(table_, pool_, opt.key, prefix_.hits(plan->hit.blocks));
    const std::int32_t cached = plan->hit.blocks * this->block_size();
    prefix_.adopted(s, std::int64_t(prompt.size()), cached);
    notify(hooks::adopted, s, plan->hit.blocks);
    if (opt.max_new >= 0) prefix_.ledger().record(s.index, plan->lifetime);
    auto r = reserve(s, prompt.subspan(std::size_t(cached), std::size_t(plan->reserve)), slots, opt.extras);
    if (!r) {  // unreachable: the plan checked every block and buffer
      (void)free(s);
      return r.status();
    }
    return AdmitResult{s, cached, plan->reserve, r->new_blocks, opt.max_new >= 0 ? plan->lifetime : 0};
  }
  /// A new sequence sharing every block of s (copy-on-write on the next write into a shared block).
  Result<SeqId> fork(SeqId s) noexcept {
    auto child = table_.fork(pool_, s);
    if (child) notify(hooks::forked, s, *child);
    return child;
  }
  /// Ends s: the handle dies, its blocks go back tail first; published blocks stay cached.
  Status free(SeqId s) noexcept {
    auto st = table_.release(pool_, s);
    if (st) notify(hooks::freed, s);
    return st;
  }
  using Core::hold;
  /// hold() of every block s's row holds: what a sender pins so that s can be
  /// freed before its consumers have read it (transfer/transfer_holds.hpp).
  Result<std::uint64_t> hold(SeqId s) {
    auto blocks = table_.blocks(s);
    if (!blocks) return blocks.status();
    return Core::hold(*blocks);
  }

  // --- writes --------------------------------------------------------------
  /// Room for n more tokens of s, all or nothing: slots[0..n) get their slots, and a copy-on-write
  /// command comes back when the tail block is shared.
  Result<ReserveInfo> reserve(SeqId s, std::int32_t n, std::span<std::int32_t> slots) noexcept {
    auto r = admission_.reserve(table_, pool_, s, n, slots);
    if (r) notify(hooks::reserved, s, n, r->copy);
    return r;
  }
  /// reserve() of ids.size() tokens given their ids: with publish_on_reserve,
  /// every block they fill is hashed and published (extras: the multimodal
  /// ranges overlapping them). The engine writes their K/V in the step that
  /// first reads them, so no hit can see a block before it is written.
  Result<ReserveInfo> reserve(SeqId s, std::span<const std::int32_t> ids, std::span<std::int32_t> slots,
                              std::span<const ExtraKey> extras = {}) noexcept {
    if (prefix_.store().on())
      if (auto st = PrefixSharing::check_extras(extras); !st) return st;
    auto r = reserve(s, static_cast<std::int32_t>(ids.size()), slots);
    if (r) prefix_.publish_reserved(table_, pool_, s, ids, slots, extras, hasher_);
    return r;
  }
  /// The decode step in one call, as on every cache (GrowingCache in
  /// cache/contract.hpp): every token reserved so far counts as computed,
  /// then ids are reserved. This cache publishes when it reserves
  /// (publish_on_reserve) or on publish(), never on computed(), so it is reserve(s, ids, slots).
  Result<ReserveInfo> advance(SeqId s, std::span<const std::int32_t> ids, std::span<std::int32_t> slots) noexcept {
    return reserve(s, ids, slots);
  }
  /// advance() of n tokens without their ids: reserve(s, n, slots).
  Result<ReserveInfo> advance(SeqId s, std::int32_t n, std::span<std::int32_t> slots) noexcept { return reserve(s, n, slots); }
  /// advance() of a batch (GrowingCache): reserve_batch(), as advance() is reserve().
  Result<BatchInfo> advance_batch(std::span<const SeqId> seqs, std::span<const std::int32_t> counts, std::span<const std::int32_t> ids,
                                  std::span<std::int32_t> slots, std::span<BlockCopy> copies = {}) noexcept {
    return reserve_batch(seqs, counts, ids, slots, copies);
  }
  /// advance_batch() without the ids: reserve_batch(seqs, counts, slots, copies).
  Result<BatchInfo> advance_batch(std::span<const SeqId> seqs, std::span<const std::int32_t> counts, std::span<std::int32_t> slots,
                                  std::span<BlockCopy> copies = {}) noexcept {
    return reserve_batch(seqs, counts, slots, copies);
  }
  /// The forward pass wrote K/V for tokens [0, tokens) of s, as every cache
  /// is told (GrowingCache). Nothing waits on it here (blocks publish on
  /// reserve or on publish()), so it only checks: unknown_sequence, and
  /// invalid_argument for tokens outside [0, tokens(s)].
  Status computed(SeqId s, std::int64_t tokens) const noexcept {
    const auto n = this->tokens(s);
    if (!n) return n.status();
    if (tokens < 0 || tokens > *n) return Status{Errc::invalid_argument, "tokens (computed)", tokens, *n};
    return {};
  }
  /// Reserves counts[k] tokens for seqs[k], all or nothing; slots padded with -1, copy-on-write commands in copies.
  /// copies may be left out (as on every cache) while no entry shares a partial
  /// tail block (no fork): a batch that needs a copy then is buffer_too_small naming copies.
  Result<BatchInfo> reserve_batch(std::span<const SeqId> seqs, std::span<const std::int32_t> counts,
                                  std::span<std::int32_t> slots, std::span<BlockCopy> copies = {}) noexcept {
    auto r = admission_.reserve_batch(table_, pool_, seqs, counts, slots, copies);
    if (r) notify(hooks::reserved_batch, seqs, counts, std::span<const BlockCopy>(copies.first(std::size_t(r->copies))));
    return r;
  }
  /// reserve_batch() given the new tokens' ids, packed as the slots are: with
  /// publish_on_reserve, the blocks they fill are published (the decode step).
  Result<BatchInfo> reserve_batch(std::span<const SeqId> seqs, std::span<const std::int32_t> counts,
                                  std::span<const std::int32_t> ids, std::span<std::int32_t> slots,
                                  std::span<BlockCopy> copies = {}) noexcept {
    if (auto st = PrefixState::check_batch_ids(seqs, counts, ids); !st) {
      std::fill(slots.begin(), slots.end(), -1);  // as every refused batch leaves them
      return st;
    }
    auto r = reserve_batch(seqs, counts, slots, copies);
    if (r) prefix_.publish_reserved_batch(table_, pool_, seqs, counts, ids, slots, hasher_);
    return r;
  }
  /// Rollback: the n most recently appended tokens leave. A token policy's
  /// compaction reorders the row, so after an evict() that evicted tokens a
  /// rollback reaches back only to that call: n larger than the tokens
  /// appended since is truncate_too_many naming the limit, and nothing changes.
  Status truncate(SeqId s, std::int32_t n) noexcept {
    if (auto st = table_.validate(s); !st) return st;
    if (auto st = admission_.check_truncate(); !st) return st;
    if (auto st = eviction_.check_truncate(table_, s, n); !st) return st;
    auto st = table_.truncate(pool_, s, n);
    if (st) notify(hooks::truncated, s, n);
    return st;
  }

  // --- eviction ----------------------------------------------------------------
  /// Feeds the policy one step's scores for the sequence's held tokens (slot
  /// order). Scores are finite and >= 0. A kind outside ScoreKind or one the
  /// policy does not read, a wrong shape, a NaN, an infinity or a negative
  /// value is an error naming it, and nothing changes.
  Status observe(SeqId s, const Scores& sc) noexcept
    requires ObservingEviction<Eviction>
  {
    return eviction_.observe(table_, s, sc);
  }
  /// Shorthand: one score per held token, reduced over heads and queries.
  Status observe(SeqId s, std::span<const float> scores) noexcept
    requires ObservingEviction<Eviction>
  {
    return observe(s, Scores{ScoreKind::attention_sums, scores, 1});
  }
  /// Runs the policy on one sequence; what leaves and what the engine must
  /// do depend on the policy's kind (block: out.blocks and out.rotations;
  /// token: out.moves by out.group_moves; window: nothing to run), as
  /// RowEviction::evict documents (eviction/row_eviction.hpp).
  /// pending_queries is for window policies; others take 0. A buffer too
  /// small for the plan is an error, and nothing changes.
  Result<EvictionResult> evict(SeqId s, const EvictionSpans& out, std::int32_t pending_queries = 0) noexcept {
    auto r = eviction_.evict(table_, pool_, s, out, pending_queries);
    if (r) notify(hooks::evicted, s, *r);
    return r;
  }
  /// Shorthand for block policies: evict(s, {blocks, rotations}).
  Result<EvictionResult> evict(SeqId s, std::span<std::int32_t> blocks, std::span<BlockRotation> rotations) noexcept {
    return evict(s, EvictionSpans{.blocks = blocks, .rotations = rotations});
  }

  // --- prefix sharing ------------------------------------------------------
  /// Cached blocks of the longest published prefix of `tokens` into out; returns how many.
  /// A peek: nothing is retained and the query counters do not move.
  std::int32_t match_prefix(std::span<const std::int32_t> tokens, const PrefixKey& key, std::span<BlockId> out) const noexcept {
    return PrefixSharing::match(table_, pool_, tokens, key, {}, hasher_, out).blocks;
  }
  /// Prompt tokens the cache serves now, whole blocks of the longest
  /// published prefix of `tokens` (at most its length - 1): the word every
  /// cache has (HybridCache::match). A peek, as match_prefix() is.
  std::int64_t match(std::span<const std::int32_t> tokens, const PrefixKey& key = {}) const noexcept {
    return std::int64_t{PrefixSharing::count(table_, pool_, tokens, key, {}, hasher_).blocks} * this->block_size();
  }
  /// match_prefix() of a prompt with multimodal inputs; bad extras are invalid_argument.
  Result<std::int32_t> match_prefix(std::span<const std::int32_t> tokens, const PrefixKey& key, std::span<BlockId> out,
                                    std::span<const ExtraKey> extras) const noexcept {
    if (auto st = PrefixSharing::check_extras(extras); !st) return st;
    return PrefixSharing::match(table_, pool_, tokens, key, extras, hasher_, out).blocks;
  }
  /// Publishes s's full blocks of `tokens` (its first tokens) for prefix hits; returns the hashes newly cached.
  /// extras: the multimodal ranges among them. With publish_on_reserve it also supplies ids reserve() lacked.
  Result<std::int32_t> publish(SeqId s, std::span<const std::int32_t> tokens, std::span<const ExtraKey> extras = {}) noexcept {
    if (auto st = admission_.check_prefix(); !st) return st;
    return PrefixSharing::publish(table_, pool_, s, tokens, extras, hasher_, prefix_.store());
  }
  /// The hashes of the full blocks of `tokens` (at most out.size()) under
  /// `key`, as this cache names them when they are published (its hasher and
  /// block size): the chain Tiers::lookup and the stores take. Returns how many.
  std::int32_t hash_chain(std::span<const std::int32_t> tokens, const PrefixKey& key, std::span<BlockHash> out,
                          std::span<const ExtraKey> extras = {}) const noexcept {
    return kvcache::hash_chain(hasher_, tokens, this->block_size(), key, out, extras);
  }
  /// Prefix-cache counters (queries, hit tokens, hashes stored, recycled, invalidated) and block states.
  PrefixStats prefix_stats() const noexcept { return prefix_.stats(pool_); }
  /// The prefix cache's state: publish-on-reserve ids, the lifetime ledger (read-only).
  const PrefixState& prefix_state() const noexcept { return prefix_; }
  /// Drops every cached hash (free-but-cached blocks become plain free); emits all_cleared.
  Status reset_prefix_cache() noexcept { return pool_.reset_prefix_cache(); }

  // --- exports for attention kernels ----------------------------------------
  /// Dense block table: row k of out (row_stride entries) holds seqs[k]'s blocks, null-padded.
  Status export_block_table(std::span<const SeqId> seqs, std::span<std::int32_t> out, std::int32_t row_stride) const noexcept {
    return kvcache::export_block_table(table_, seqs, out, row_stride);
  }
  /// FlashInfer paging for seqs: indptr (n+1), indices, last_page_len; returns pages written.
  Result<std::int32_t> export_csr(std::span<const SeqId> seqs, std::span<std::int32_t> indptr, std::span<std::int32_t> indices,
                                  std::span<std::int32_t> last_page_len) const noexcept {
    return kvcache::export_csr(table_, seqs, indptr, indices, last_page_len);
  }
  /// Slots each row spans (front + tokens held) into out.
  Status export_lengths(std::span<const SeqId> seqs, std::span<std::int32_t> out) const noexcept {
    return kvcache::export_lengths(table_, seqs, out);
  }

  // --- selection (page-bounds policies: Quest) --------------------------------
  /// One pool layer's slice of the page-bounds store, [num_blocks][kv_heads][2][head_dim]:
  /// the bounds argument of that layer's page_bounds_update and page_bounds launches.
  Result<std::span<float>> page_bounds(std::int32_t layer) const noexcept
    requires selects
  {
    return selection_.page_bounds(layer);
  }
  /// The pages of seqs whose bounds a copy-on-write, a compaction, a rotation
  /// or a rollback left stale, as (page, fill) for page_bounds on every pool
  /// layer; listing them marks them current. Run it after those edits'
  /// kernels and before select(). All or nothing; returns pages listed.
  Result<std::int32_t> stale_pages(std::span<const SeqId> seqs, const StaleSpans& out) noexcept
    requires selects
  {
    return selection_.stale_pages(table_, pool_, seqs, out);
  }
  /// Host selection: the pages each (sequence, kv-head) of seqs reads for
  /// `layer`'s queries ([seqs][kv_heads][query_group][head_dim] fp32) as a
  /// head-folded CSR (the policy's select(), e.g. QuestSelection::select).
  /// Returns pages written; no allocation; on an error nothing is written.
  Result<std::int32_t> select(std::span<const SeqId> seqs, std::int32_t layer, std::span<const float> queries,
                              const SelectSpans& out) noexcept
    requires selects
  {
    return selection_.select(table_, seqs, layer, queries, out);
  }
  /// A page_select launch's inputs for a device backend: the rows' pages and
  /// output offsets into `plan`, and the params but queries, out_indices and
  /// scratch (the policy's plan(); the cache never reads the store here).
  Result<PageSelectParams> select_params(std::span<const SeqId> seqs, std::int32_t layer, const SelectPlanSpans& plan) const noexcept
    requires selects
  {
    return selection_.select_params(table_, seqs, layer, plan);
  }

  friend bool operator==(const TokenPagedCache& a, const TokenPagedCache& b) {
    return a.admission_ == b.admission_ && a.eviction_ == b.eviction_ && a.selection_ == b.selection_ && a.same_core(b) && a.prefix_ == b.prefix_ &&
           a.imports_ == b.imports_;
  }

 private:
  // The one loop over the participants: each hears what the core did.
  template <class Hook, class... Args>
  void notify(Hook, const Args&... args) noexcept {
    const RowsRef<Table, Pool> rows{table_, pool_};
    Hook::call(prefix_, rows, args...);
    Hook::call(eviction_, rows, args...);
    Hook::call(selection_, rows, args...);
  }
  // admit()'s checks and plan (prefix/prefix_cache.hpp), with the policy's lifetime
  // need; slots: the caller's slot buffer size (-1: a dry run).
  Result<AdmitPlan> admit_plan(std::span<const std::int32_t> prompt, const AdmitOptions& opt, std::int64_t slots) const noexcept {
    if (this->free_sequences() == 0) return no_free_handle(table_.max_streams());
    const auto life = this->blocks_needed(std::int64_t(prompt.size()), std::max<std::int64_t>(opt.max_new, 0), opt.prefill_chunk);
    return prefix_.plan(table_, pool_, prompt, opt, life, hasher_, slots);
  }

  [[no_unique_address]] RowAdmission<Admission> admission_;
  [[no_unique_address]] RowSelection<Selection> selection_;
  [[no_unique_address]] RowEviction<Eviction> eviction_;
  [[no_unique_address]] Hasher hasher_;
  PrefixState prefix_;
};

KVCACHE_END_NAMESPACE
