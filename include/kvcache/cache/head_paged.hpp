// A cache whose rows are (sequence, layer, kv-head) head rows: a head-paged
// admission policy (WriteGate) owns them and places every write. The
// admission makes each edit; then the participants hear of it
// (cache/hooks.hpp): the selection's stale pages
// (selection/head_selection.hpp) and the global region's eviction
// (eviction/head_eviction.hpp). No reserve, prefix sharing or per-sequence
// exports: head rows are not prefixes.
#pragma once

#include <cstdint>
#include <span>

#include "kvcache/cache/accounting.hpp"
#include "kvcache/cache/core.hpp"
#include "kvcache/cache/hooks.hpp"
#include "kvcache/config.hpp"
#include "kvcache/eviction/head_eviction.hpp"
#include "kvcache/table/head_rows.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/selection/head_selection.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// The head-paged cache: one row per (sequence, layer, kv-head) over a pool of
/// single-head blocks (Cache picks it for a head-paged admission).
template <HeadPagedAdmission Admission, class Selection, class Eviction, class Hasher>
class HeadPagedCache : public CacheCore<BlockPool, PageTable> {
  using Core = CacheCore<BlockPool, PageTable>;
  static_assert(!WindowEviction<Eviction>,
                "kvcache::Cache: WriteGate (head-paged admission) with a window eviction policy (SlidingWindow): "
                "WriteGate's ring already is the local window, and dropping the front of a head row would drop the "
                "ring and leave the global region behind it; use KeepAll, or a token policy on the global region");
  static_assert(!BlockEviction<Eviction>,
                "kvcache::Cache: WriteGate (head-paged admission) with a block eviction policy (BlockScoreEviction, "
                "SinkWindowEviction): block policies re-rotate kept blocks by their shift in the row, which is a "
                "position shift only in a row of consecutive positions; a head row's global region holds scattered "
                "admitted positions; use a token policy (H2O, SnapKV, TOVA, average attention) on the global region");

 public:
  static constexpr bool head_paged = true;  ///< Rows are head rows.
  /// The selection policy reads key bounds per page: the cache keeps a page-bounds store current.
  static constexpr bool selects = Selection::kind == SelectionKind::page_bounds;
  /// A token policy evicts from each head row's global region (eviction/global_region.hpp).
  static constexpr bool evicts_global = HeadEviction<Eviction>::evicts;
  static constexpr bool evicts = evicts_global;  ///< The policy evicts at all.
  static constexpr bool ledgered = false;        ///< Head rows stay within ring + cap: no ledger.
  /// Score signals this cache feeds to policies (cache.hpp's cache_signals).
  static constexpr Signals provided_signals{Signals::attention_sums | Signals::head_attention_sums |
                                            Signals::last_query_attention};
  /// Longest prompt_len + max_new accounting accepts.
  static constexpr std::int64_t max_length = max_request_length;

  /// Builds the cache; throws ConfigError for a bad configuration. `admission`
  /// is the policy's Config; the geometry holds one layer and one kv-head per
  /// block, and max_blocks_per_sequence bounds one head's row.
  explicit HeadPagedCache(const CacheConfig& cfg, const typename Admission::Config& admission = {},
                          typename HeadSelection<Selection>::Arg selection = {}, Eviction eviction = {}, Hasher hasher = {})
      : Core(single_head(cfg), streams(cfg, admission)),
        admission_(admission, cfg.max_sequences, table_),
        selection_(selection),
        eviction_(eviction),
        hasher_(hasher) {
    const std::int32_t rows = table_.max_streams();
    eviction_.bind({rows, cfg.max_blocks_per_sequence * cfg.geometry.block_size(), cfg.geometry.block_size()});
    if constexpr (selects)
      selection_.bind({cfg.geometry, cfg.num_blocks, admission_.num_layers(), rows, cfg.max_sequences * admission_.num_kv_heads(),
                       cfg.max_blocks_per_sequence, admission_.num_kv_heads(), admission_.local_window() / cfg.geometry.block_size()});
  }

  const Admission& admission() const noexcept { return admission_; }          ///< The admission policy.
  const Selection& selection() const noexcept { return selection_.policy(); } ///< The selection policy.
  const Eviction& eviction() const noexcept { return eviction_.policy(); }    ///< The eviction policy.

  // --- sequences -----------------------------------------------------------
  /// A new empty sequence: layers x kv-heads empty head rows.
  Result<SeqId> add_sequence() noexcept { return admission_.add(table_); }
  /// A new sequence sharing every head row of s (copy-on-write on the next write into a shared block).
  Result<SeqId> fork(SeqId s) noexcept {
    auto child = admission_.fork(table_, pool_, s);
    if (child) notify(hooks::forked, s, *child);
    return child;
  }
  /// Ends s: its head rows go back to the pool.
  Status free(SeqId s) noexcept {
    auto st = admission_.free(table_, pool_, s);
    if (st) notify(hooks::freed, s);
    return st;
  }

  // --- writes --------------------------------------------------------------
  /// Writes layer `layer`'s n = gates.size() / kv_heads new tokens
  /// of s; the policy places each (token, head) and fills `out` with the
  /// engine's commands: copies, then moves, then the tokens at slots (the
  /// policy's write(), e.g. WriteGate::write). All or nothing.
  Result<GateWriteInfo> write(SeqId s, std::int32_t layer, std::span<const float> gates, const GateWriteSpans& out) noexcept {
    auto r = admission_.write(table_, pool_, s, layer, gates, out);
    if (r) notify(hooks::written, std::span<const SeqId>(&s, 1), layer, layer + 1, copies_of(out, *r));
    return r;
  }
  /// Decode step of one layer: one new token for each of seqs;
  /// gates, out.slots and out.promote are [seqs][kv_heads] (the policy's
  /// write_batch(), e.g. WriteGate::write_batch). All or nothing.
  Result<GateWriteInfo> write_batch(std::span<const SeqId> seqs, std::int32_t layer, std::span<const float> gates,
                                    const GateWriteSpans& out) noexcept {
    auto r = admission_.write_batch(table_, pool_, seqs, layer, gates, out);
    if (r) notify(hooks::written, seqs, layer, layer + 1, copies_of(out, *r));
    return r;
  }
  /// No host sync, part 1: room for n tokens of `layer` and the rings' state for the device's
  /// ring_admit launch (the policy's allot(), e.g. WriteGate::allot).
  Result<GateWriteInfo> allot(SeqId s, std::int32_t layer, std::int32_t n, const GateDeferredSpans& out) noexcept {
    return admission_.allot(table_, pool_, s, layer, n, out);
  }
  /// No host sync, part 2: replays the oldest allotted write of (s, layer) with the gates read
  /// back from the device and returns the blocks it did not use (the policy's reconcile()).
  Result<GateWriteInfo> reconcile(SeqId s, std::int32_t layer, std::span<const float> gates) noexcept {
    auto r = admission_.reconcile(table_, pool_, s, layer, gates);
    if (r) notify(hooks::reconciled, s, layer, std::int32_t(gates.size()) / admission_.num_kv_heads());
    return r;
  }
  /// Rollback of the n newest tokens of every layer: the engine
  /// runs out.copies, then out.moves (the policy's truncate()). All or nothing.
  Result<GateWriteInfo> truncate(SeqId s, std::int32_t n, const GateWriteSpans& out) noexcept {
    auto r = admission_.truncate(table_, pool_, s, n, out);
    if (r) {
      notify(hooks::written, std::span<const SeqId>(&s, 1), 0, admission_.num_layers(), copies_of(out, *r));
      notify(hooks::truncated, s);
    }
    return r;
  }

  // --- eviction of the global regions (a token policy) -----------------------
  /// One layer's scores, each kv-head's row in turn, one score per token the
  /// row holds (ring slots, then global, as export_heads_csr lays them out);
  /// the policy reads each row's global part. Finite and >= 0; a kind the
  /// policy does not read, a wrong size or a bad value is an error naming it,
  /// and nothing changes.
  Status observe(SeqId s, std::int32_t layer, ScoreKind kind, std::span<const float> values) noexcept
    requires(evicts_global && ObservingEviction<Eviction>)
  {
    return eviction_.observe(table_, pool_, admission_, s, layer, kind, values);
  }
  /// Every head row's global region of s is evicted and compacted; run
  /// `moves` (all rows) with the compaction kernel on the single-head pool.
  /// The ring is never a candidate; tokens in blocks a fork shares never
  /// leave. A buffer too small is an error, and nothing changes.
  Result<EvictionResult> evict(SeqId s, std::span<SlotMove> moves) noexcept
    requires evicts_global
  {
    return eviction_.evict(table_, pool_, admission_, s, moves,
                           [&](SeqId row, std::int32_t page) { notify(hooks::region_compacted, row, page); });
  }

  // --- exports for attention kernels (rows as in table/head_rows.hpp) ---------------
  /// Dense block table with one row per (sequence, kv-head) of `layer`, or of every layer (layer -1, layer-major).
  Status export_heads_block_table(std::span<const SeqId> seqs, std::int32_t layer, std::span<std::int32_t> out,
                                  std::int32_t row_stride) const noexcept {
    return kvcache::export_heads_block_table(table_, admission_, seqs, layer, out, row_stride);
  }
  /// FlashInfer paging with one row per (sequence, kv-head); returns pages written.
  Result<std::int32_t> export_heads_csr(std::span<const SeqId> seqs, std::int32_t layer, std::span<std::int32_t> indptr,
                                        std::span<std::int32_t> indices, std::span<std::int32_t> last_page_len) const noexcept {
    return kvcache::export_heads_csr(table_, admission_, seqs, layer, indptr, indices, last_page_len);
  }
  /// Tokens each head row holds.
  Status export_heads_lengths(std::span<const SeqId> seqs, std::int32_t layer, std::span<std::int32_t> out) const noexcept {
    return kvcache::export_heads_lengths(table_, admission_, seqs, layer, out);
  }
  /// Each head row's token positions (ring, then admitted global columns) for sparse prefill.
  Result<std::int32_t> export_head_columns(std::span<const SeqId> seqs, std::int32_t layer, std::span<std::int32_t> indptr,
                                           std::span<std::int32_t> columns) const noexcept {
    return kvcache::export_head_columns(admission_, seqs, layer, indptr, columns);
  }

  // --- selection (page-bounds policies: Quest) --------------------------------
  /// The page-bounds store's slice of pool layer `layer` (the pool has one layer: slice 0 serves every model layer).
  Result<std::span<float>> page_bounds(std::int32_t layer) const noexcept
    requires selects
  {
    return selection_.page_bounds(layer);
  }
  /// The pages of every head row of seqs whose bounds a copy-on-write, a
  /// compaction, a rollback or a reconciled deferred write left stale, as
  /// (page, fill); listing them marks them current. All or nothing.
  Result<std::int32_t> stale_pages(std::span<const SeqId> seqs, const StaleSpans& out) noexcept
    requires selects
  {
    return selection_.stale_pages(table_, pool_, admission_, seqs, out);
  }
  /// Host selection over head rows (the policy's select_heads()); as TokenPagedCache::select.
  Result<std::int32_t> select(std::span<const SeqId> seqs, std::int32_t layer, std::span<const float> queries,
                              const SelectSpans& out) noexcept
    requires selects
  {
    return selection_.select(table_, admission_, seqs, layer, queries, out);
  }
  /// A page_select launch's inputs over head rows (the policy's plan_heads()).
  Result<PageSelectParams> select_params(std::span<const SeqId> seqs, std::int32_t layer, const SelectPlanSpans& plan) const noexcept
    requires selects
  {
    return selection_.select_params(table_, admission_, seqs, layer, plan);
  }

  // --- accounting (what the scheduler asks) ---------------------------------
  /// Live tokens s holds, over its head rows.
  Result<std::int64_t> tokens_held(SeqId s) const noexcept { return admission_.tokens_held(table_, s); }
  /// Live tokens one head of s holds (ring + global).
  Result<std::int64_t> tokens_held(SeqId s, std::int32_t layer, std::int32_t kv_head) const noexcept {
    auto h = admission_.head(s, layer, kv_head);
    if (!h) return h.status();
    return std::int64_t{table_.tokens_unchecked(*h)};
  }
  /// Blocks s's head rows hold together.
  Result<std::int32_t> blocks_held(SeqId s) const noexcept {
    const SeqId one[] = {s};
    if (auto rows = head_rows::count(admission_, one, -1); !rows) return rows.status();
    std::int32_t n = 0;
    head_rows::each(admission_, one, -1, [&](std::int64_t, SeqId h) { n += std::int32_t(table_.blocks_unchecked(h).size()); });
    return n;
  }
  /// Pool blocks a new sequence needs over its life: every head holds at most
  /// its ring and its cap at any point, prefill included.
  Result<std::int64_t> blocks_needed(std::int64_t prompt_len, std::int64_t max_new, std::int64_t prefill_chunk = 0) const noexcept {
    if (auto st = check_request_lengths(prompt_len, max_new, prefill_chunk); !st) return st;
    return admission_.max_blocks_held(prompt_len + max_new);
  }
  /// A sequence handle is free and blocks_needed fits the free pool.
  bool can_admit(std::int64_t prompt_len, std::int64_t max_new) const noexcept {
    auto need = blocks_needed(prompt_len, max_new);
    return need.ok() && free_sequences() > 0 && *need <= pool_.num_free();
  }
  /// Blocks owed to running sequences: none (no promises on head rows).
  std::int64_t promised_blocks() const noexcept { return 0; }
  /// Sequence handles still free.
  std::int32_t free_sequences() const noexcept { return admission_.free_sequences(); }
  /// The eviction policy's bound for any stream (INT64_MAX for keep-all).
  std::int64_t max_tokens_after_eviction() const noexcept { return eviction().max_tokens_after_eviction(); }
  /// Tokens above the bound that sharing pinned: none on head rows.
  std::int64_t shared_excess() const noexcept { return 0; }
  /// Pool, table and the admission's rows (within ring + cap, positions,
  /// lengths); invariant_violated always means a library bug.
  Status check_invariants() const {
    if (auto st = pool_.check(); !st) return st;
    if (auto st = table_.check(pool_, holds_); !st) return st;
    return admission_.check(table_);
  }

  friend bool operator==(const HeadPagedCache& a, const HeadPagedCache& b) {
    return a.eviction_ == b.eviction_ && a.selection_ == b.selection_ && a.admission_ == b.admission_ && a.same_core(b);
  }

 private:
  template <class Hook, class... Args>
  void notify(Hook, const Args&... args) noexcept {
    const HeadsRef<PageTable, BlockPool, Admission> heads{table_, pool_, admission_};
    Hook::call(selection_, heads, args...);
    Hook::call(eviction_, heads, args...);
  }
  static std::span<const BlockCopy> copies_of(const GateWriteSpans& out, const GateWriteInfo& r) noexcept {
    return out.copies.first(std::size_t(r.copies));
  }
  // Head rows hold one layer and one kv-head per block.
  static const CacheConfig& single_head(const CacheConfig& cfg) {
    const GeometrySpec& g = cfg.geometry.spec();
    if (cfg.geometry.block_bytes() != 0 && g.num_layers != 1)
      throw ConfigError("kvcache::Cache", Status{Errc::invalid_argument, "geometry.num_layers (head-paged: one per block)", g.num_layers, 1});
    if (cfg.geometry.block_bytes() != 0 && g.num_kv_heads != 1)
      throw ConfigError("kvcache::Cache", Status{Errc::invalid_argument, "geometry.num_kv_heads (head-paged: one per block)", g.num_kv_heads, 1});
    if (cfg.publish_on_reserve)
      throw ConfigError("kvcache::Cache", Status{Errc::invalid_argument, "publish_on_reserve (head-paged rows are not prefixes)", 1, 0});
    return cfg;
  }
  // Table streams: one per (sequence, layer, kv-head).
  static std::int32_t streams(const CacheConfig& cfg, const typename Admission::Config& a) {
    const std::int64_t n = cfg.max_sequences < 1 ? cfg.max_sequences : Admission::streams_for(a, cfg.max_sequences);
    if (n > INT32_MAX) throw ConfigError("kvcache::Cache", Status{Errc::invalid_argument, "max_sequences x layers x kv_heads", n, INT32_MAX});
    return std::int32_t(n);
  }

  Admission admission_;
  [[no_unique_address]] HeadSelection<Selection> selection_;
  [[no_unique_address]] HeadEviction<Eviction> eviction_;
  [[no_unique_address]] Hasher hasher_;
};

KVCACHE_END_NAMESPACE
