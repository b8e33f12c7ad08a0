// The composed manager an engine holds: a block pool, a page table, and the
// three policies. Empty policies take no space ([[no_unique_address]]).
//
//   Cache<> cache({.geometry = g, .num_blocks = 4096, .max_sequences = 256,
//                  .max_blocks_per_sequence = 512});
//   auto seq = cache.add_sequence();                       // Result<SeqId>
//   auto r = cache.reserve(*seq, prompt_len, slots);       // slot mapping
//   cache.export_csr(seqs, indptr, indices, last_page_len);
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>

#include "kvcache/admission/admit_all.hpp"
#include "kvcache/block_hash.hpp"
#include "kvcache/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/eviction/keep_all.hpp"
#include "kvcache/eviction/plan.hpp"
#include "kvcache/geometry.hpp"
#include "kvcache/page_table.hpp"
#include "kvcache/page_table_export.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/prefix_sharing.hpp"
#include "kvcache/selection/select_all.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

struct CacheConfig {
  Geometry geometry{};                     // block_size comes from here
  std::int32_t num_blocks = 0;             // pool capacity, null block included
  std::int32_t max_sequences = 0;
  std::int32_t max_blocks_per_sequence = 0;
  std::int32_t event_capacity = 0;         // 0: no block events
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

template <BlockAllocator Pool = BlockPool, BlockTableFor<Pool> Table = PageTable, AdmissionPolicy Admission = AdmitAll,
          SelectionPolicy Selection = SelectAll, EvictionPolicy Eviction = KeepAll, BlockHasher Hasher = FastBlockHasher>
class Cache {
 public:
  // Score signals this cache can feed to policies: observe() takes one score
  // per held token, already reduced over heads and the step's queries.
  static constexpr Signals provided_signals{Signals::attention_sums};
  static_assert(provided_signals.covers(Admission::required_signals),
                "kvcache::Cache: the admission policy needs score signals this cache does not provide");
  static_assert(provided_signals.covers(Selection::required_signals),
                "kvcache::Cache: the selection policy needs score signals this cache does not provide");
  static_assert(provided_signals.covers(Eviction::required_signals),
                "kvcache::Cache: the eviction policy needs score signals this cache does not provide");

  explicit Cache(const CacheConfig& cfg, Admission admission = {}, Selection selection = {}, Eviction eviction = {},
                 Hasher hasher = {})
      : geometry_(valid_geometry(cfg.geometry)),
        pool_(cfg.num_blocks, cfg.event_capacity),
        table_(pool_, cfg.max_sequences, cfg.max_blocks_per_sequence, cfg.geometry.block_size()),
        admission_(admission),
        selection_(selection),
        eviction_(eviction),
        hasher_(hasher) {
    if constexpr (ObservingEviction<Eviction>)
      eviction_.bind(cfg.max_sequences, cfg.max_blocks_per_sequence * cfg.geometry.block_size());
  }

  const Geometry& geometry() const noexcept { return geometry_; }
  std::int32_t block_size() const noexcept { return table_.block_size(); }
  const Pool& pool() const noexcept { return pool_; }
  const Table& table() const noexcept { return table_; }
  const Admission& admission() const noexcept { return admission_; }
  const Selection& selection() const noexcept { return selection_; }
  const Eviction& eviction() const noexcept { return eviction_; }

  // --- sequences -----------------------------------------------------------
  Result<SeqId> add_sequence(const PrefixKey& key = {}) noexcept { return table_.add(key); }
  // A new sequence that starts with the cached prefix of `prompt` shared.
  Result<PrefixHit> add_sequence(std::span<const std::int32_t> prompt, const PrefixKey& key = {}) noexcept {
    return add_with_prefix(table_, pool_, prompt, key, hasher_);
  }
  Result<SeqId> fork(SeqId s) noexcept {
    auto child = table_.fork(pool_, s);
    if constexpr (ObservingEviction<Eviction>)
      if (child) eviction_.copy_state(s.index, child->index);
    return child;
  }
  Status free(SeqId s) noexcept {
    auto st = table_.release(pool_, s);
    if constexpr (ObservingEviction<Eviction>)
      if (st) eviction_.reset(s.index);
    return st;
  }

  // --- writes --------------------------------------------------------------
  Result<ReserveInfo> reserve(SeqId s, std::int32_t n, std::span<std::int32_t> slots) noexcept {
    return table_.reserve(pool_, s, n, slots);
  }
  Result<BatchInfo> reserve_batch(std::span<const SeqId> seqs, std::span<const std::int32_t> counts,
                                  std::span<std::int32_t> slots, std::span<BlockCopy> copies) noexcept {
    return table_.reserve_batch(pool_, seqs, counts, slots, copies);
  }
  Status truncate(SeqId s, std::int32_t n) noexcept {
    auto st = table_.truncate(pool_, s, n);
    if constexpr (ObservingEviction<Eviction>)
      if (st) eviction_.on_truncate(s.index, *table_.tokens(s));
    return st;
  }

  // --- eviction ----------------------------------------------------------------
  // Feeds the policy one score per token the sequence holds.
  Status observe(SeqId s, std::span<const float> scores) noexcept
    requires ObservingEviction<Eviction>
  {
    if (auto st = table_.validate(s); !st) return st;
    const std::int32_t held = table_.tokens_unchecked(s);
    if (std::int64_t(scores.size()) != held)
      return Status{Errc::invalid_argument, "scores.size", std::int64_t(scores.size()), held};
    return eviction_.observe(s.index, scores);
  }
  // Runs the policy on one sequence: the chosen logical blocks leave its page
  // table (ascending, into `evicted`), and the kept blocks that moved are
  // listed in `rotations` for key re-rotation. Shared blocks never move:
  // candidates start after the sequence's last shared block. Buffers too
  // small for the plan are an error, and nothing changes.
  Result<EvictionResult> evict(SeqId s, std::span<std::int32_t> evicted, std::span<BlockRotation> rotations) noexcept {
    if (auto st = table_.validate(s); !st) return st;
    if constexpr (!ObservingEviction<Eviction>) {
      return EvictionResult{};
    } else {
      const auto blocks = table_.blocks_unchecked(s);
      std::int32_t first_candidate = 0;
      for (std::int32_t b = 0; b < std::int32_t(blocks.size()); ++b)
        if (pool_.ref_count(blocks[std::size_t(b)]) > 1) first_candidate = b + 1;
      auto n = eviction_.plan(s.index, table_.tokens_unchecked(s), first_candidate, evicted);
      if (!n) return n.status();
      if (*n == 0) return EvictionResult{};
      const std::int32_t first = evicted[0], moved = std::int32_t(blocks.size()) - first - *n;
      if (std::int64_t(rotations.size()) < moved)
        return Status{Errc::buffer_too_small, "rotations", std::int64_t(rotations.size()), moved};
      std::int32_t k = 0, r = 0;
      for (std::int32_t b = first; b < std::int32_t(blocks.size()); ++b) {
        if (k < *n && evicted[std::size_t(k)] == b) {
          ++k;
          continue;
        }
        rotations[std::size_t(r++)] = BlockRotation{blocks[std::size_t(b)], b - k, -k * block_size()};
      }
      const auto chosen = std::span<const std::int32_t>(evicted.data(), std::size_t(*n));
      (void)table_.remove_blocks(pool_, s, chosen);  // cannot fail: the plan is valid and unshared
      eviction_.on_removed(s.index, chosen);
      return EvictionResult{*n, r};
    }
  }

  // --- prefix sharing ------------------------------------------------------
  std::int32_t match_prefix(std::span<const std::int32_t> tokens, const PrefixKey& key,
                            std::span<BlockId> out) const noexcept {
    return kvcache::match_prefix(table_, pool_, tokens, key, hasher_, out);
  }
  Result<std::int32_t> publish(SeqId s, std::span<const std::int32_t> tokens) noexcept {
    return publish_prefix(table_, pool_, s, tokens, hasher_);
  }
  std::int32_t drain_events(std::span<BlockEvent> out) noexcept { return pool_.drain_events(out); }
  Status reset_prefix_cache() noexcept { return pool_.reset_prefix_cache(); }

  // --- exports for attention kernels ----------------------------------------
  Status export_block_table(std::span<const SeqId> seqs, std::span<std::int32_t> out,
                            std::int32_t row_stride) const noexcept {
    return kvcache::export_block_table(table_, seqs, out, row_stride);
  }
  Result<std::int32_t> export_csr(std::span<const SeqId> seqs, std::span<std::int32_t> indptr,
                                  std::span<std::int32_t> indices, std::span<std::int32_t> last_page_len) const noexcept {
    return kvcache::export_csr(table_, seqs, indptr, indices, last_page_len);
  }
  Status export_lengths(std::span<const SeqId> seqs, std::span<std::int32_t> out) const noexcept {
    return kvcache::export_lengths(table_, seqs, out);
  }

  // --- accounting (what the scheduler asks) ---------------------------------
  Result<std::int64_t> tokens_held(SeqId s) const noexcept {
    auto t = table_.tokens(s);
    if (!t) return t.status();
    return std::int64_t{*t};
  }
  Result<std::int32_t> blocks_held(SeqId s) const noexcept {
    auto b = table_.blocks(s);
    if (!b) return b.status();
    return static_cast<std::int32_t>(b->size());
  }
  // Pool blocks a new sequence needs over its whole life under the eviction
  // policy's bound (the bound is non-decreasing in tokens appended).
  Result<std::int64_t> blocks_needed(std::int64_t prompt_len, std::int64_t max_new) const noexcept {
    if (prompt_len < 0) return Status{Errc::invalid_argument, "prompt_len", prompt_len, 0};
    if (max_new < 0) return Status{Errc::invalid_argument, "max_new", max_new, 0};
    // The prompt is held whole until the policy first runs (prefill peak).
    const std::int64_t prefill = (prompt_len + block_size() - 1) / block_size();
    return std::max(prefill, eviction_.max_blocks_held(prompt_len + max_new, block_size()));
  }
  // A sequence handle is free and the pool can cover blocks_needed now.
  bool can_admit(std::int64_t prompt_len, std::int64_t max_new) const noexcept {
    auto need = blocks_needed(prompt_len, max_new);
    return need.ok() && table_.free_streams() > 0 && *need <= pool_.num_free();
  }
  std::int32_t free_blocks() const noexcept { return pool_.num_free(); }
  std::int32_t free_sequences() const noexcept { return table_.free_streams(); }
  std::int64_t max_tokens_after_eviction() const noexcept { return eviction_.max_tokens_after_eviction(); }

  // Pool, table and the eviction contract: every live stream holds no more
  // than the policy advertised for what it appended. O(pool + table).
  Status check_invariants() const {
    if (auto st = pool_.check(); !st) return st;
    if (auto st = table_.check(pool_); !st) return st;
    Status bad{};
    table_.for_each_stream([&](SeqId s) {
      const std::int64_t appended = *table_.appended(s), held = *table_.tokens(s);
      const std::int64_t blocks = std::int64_t(table_.blocks_unchecked(s).size());
      if (bad.ok() && held > eviction_.max_tokens_held(appended))
        bad = Status{Errc::invariant_violated, "tokens_held", held, eviction_.max_tokens_held(appended)};
      if (bad.ok() && blocks > eviction_.max_blocks_held(appended, block_size()))
        bad = Status{Errc::invariant_violated, "blocks_held", blocks, eviction_.max_blocks_held(appended, block_size())};
    });
    return bad;
  }

  friend bool operator==(const Cache& a, const Cache& b) {
    if constexpr (ObservingEviction<Eviction>)
      if (!(a.eviction_ == b.eviction_)) return false;
    return a.pool_ == b.pool_ && a.table_ == b.table_;
  }

 private:
  static const Geometry& valid_geometry(const Geometry& g) {
    if (g.block_bytes() == 0)
      throw std::invalid_argument("kvcache::Cache: CacheConfig.geometry is empty; build it with Geometry::make");
    return g;
  }

  Geometry geometry_;
  Pool pool_;
  Table table_;
  [[no_unique_address]] Admission admission_;
  [[no_unique_address]] Selection selection_;
  [[no_unique_address]] Eviction eviction_;
  [[no_unique_address]] Hasher hasher_;
};

KVCACHE_END_NAMESPACE
