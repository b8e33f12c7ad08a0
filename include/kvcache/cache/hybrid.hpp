// A cache for hybrid models: several layer groups (full, sliding window,
// chunked local, MLA, cross-attention) over one BlockPool, as vLLM v1's
// hybrid coordinator runs them. Each group has its own rows (GroupRows), its
// rule (GroupRule) and its keys in the one prefix index (GroupHits); this
// class only runs each call over the groups, all or nothing.
//
// A sequence's life: admit (a new sequence: a prefix hit, retained, plus the
// first chunk), reserve (each later chunk or decoded token), computed (the forward pass
// wrote K/V up to here: full blocks are published, and later reserves may
// free what left a window), free. advance = computed up to what is reserved,
// then reserve: the decode step in one call. Window and chunk groups free on processed
// tokens only, never on tokens reserved and not yet computed.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvcache/core/block_hash.hpp"
#include "kvcache/core/promise_ledger.hpp"
#include "kvcache/pool/block_holds.hpp"
#include "kvcache/pool/block_pool.hpp"
#include "kvcache/cache/contract.hpp"
#include "kvcache/cache/hybrid_accounting.hpp"
#include "kvcache/cache/hybrid_eviction.hpp"
#include "kvcache/cache/hybrid_exports.hpp"
#include "kvcache/cache/hybrid_growth.hpp"
#include "kvcache/cache/hybrid_imports.hpp"
#include "kvcache/cache/hybrid_prefix.hpp"
#include "kvcache/cache/hybrid_selection.hpp"
#include "kvcache/cache/pool_core.hpp"
#include "kvcache/config.hpp"
#include "kvcache/eviction/keep_all.hpp"
#include "kvcache/groups/group_hits.hpp"
#include "kvcache/groups/group_rows.hpp"
#include "kvcache/groups/group_rule.hpp"
#include "kvcache/groups/layer_groups.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/prefix/prefix_cache.hpp"
#include "kvcache/selection/select_all.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// HybridCache::admit() takes the AdmitOptions every cache takes (this name is kept for older code).
using HybridAdmitOptions [[deprecated("kvcache: HybridCache::admit takes AdmitOptions")]] = AdmitOptions;
/// HybridCache::admit() returns the AdmitResult every cache returns (this name is kept for older code).
using HybridAdmitResult [[deprecated("kvcache: HybridCache::admit returns AdmitResult")]] = AdmitResult;

/// Layer groups over one pool: all-or-nothing reserves across groups, per-group tables, hits and accounting.
/// Policies act on the global layers (the full and MLA groups; the others keep their own retention): a
/// page-bounds selection given as its Config (selection/group_selection.hpp), or a block eviction policy,
/// one stream per (sequence, global group) (eviction/group_eviction.hpp), or both.
template <BlockHasher Hasher = FastBlockHasher, SelectionPolicy Selection = SelectAll, EvictionPolicy Eviction = KeepAll>
class HybridCache : public PoolCore<BlockPool>,
                    public HybridGrowth<HybridCache<Hasher, Selection, Eviction>>,
                    public HybridAccounting<HybridCache<Hasher, Selection, Eviction>>,
                    public HybridImports<HybridCache<Hasher, Selection, Eviction>>,
                    public HybridExports<HybridCache<Hasher, Selection, Eviction>>,
                    public HybridSelection<HybridCache<Hasher, Selection, Eviction>, Selection>,
                    public HybridEviction<HybridCache<Hasher, Selection, Eviction>, Eviction> {
  friend class HybridGrowth<HybridCache>;
  friend class HybridAccounting<HybridCache>;
  friend class HybridImports<HybridCache>;
  friend class HybridExports<HybridCache>;
  friend class HybridSelection<HybridCache, Selection>;
  friend class HybridEviction<HybridCache, Eviction>;
  friend class HybridEvictionState<HybridCache>;
  static_assert(Selection::kind == SelectionKind::dense || Selection::kind == SelectionKind::page_bounds,
                "kvcache::HybridCache: a selection policy on layer groups is dense or page_bounds (Quest)");
  static_assert(Signals{Signals::page_key_bounds}.covers(Selection::required_signals),
                "kvcache::HybridCache: the selection policy needs score signals a layer group does not provide "
                "(its global layers keep page key bounds, nothing else)");
  static_assert(std::is_same_v<Eviction, KeepAll> || BlockEviction<Eviction>,
                "kvcache::HybridCache: an eviction policy on layer groups drops whole blocks (a block policy: "
                "SinkWindowEviction, BlockScoreEviction); token and window policies compact or shift a row of consecutive positions");
  static_assert(Signals{Signals::attention_sums}.covers(Eviction::required_signals),
                "kvcache::HybridCache: the eviction policy needs score signals a layer group does not provide "
                "(its global layers take attention sums per held token, observe(seq, group, scores))");

 public:
  /// The selection policy reads key bounds per page of the global layers: the cache lists the stale ones.
  static constexpr bool selects = GroupSelection<Selection>::selects;
  /// An eviction policy acts on the global layers: the cache answers evict (and observe, for a scored policy).
  static constexpr bool evicts = GroupEviction<Eviction>::evicts;

  /// An empty cache; ConfigError names a bad field of cfg.
  explicit HybridCache(const HybridConfig& cfg, Hasher hasher = {})
    requires std::is_default_constructible_v<Eviction>
      : HybridCache(cfg, typename GroupSelection<Selection>::Arg{}, hasher) {}
  /// An empty cache with a selection policy on its global layers (a
  /// page-bounds policy's Config); ConfigError names a bad field of cfg, or
  /// of the policy for this layout (selection/group_selection.hpp).
  HybridCache(const HybridConfig& cfg, const typename GroupSelection<Selection>::Arg& selection, Hasher hasher = {})
    requires std::is_default_constructible_v<Eviction>
      : HybridCache(cfg, selection, Eviction{}, hasher) {}
  /// An empty cache with policies on its global layers: a selection (a
  /// page-bounds policy's Config, or SelectAll{}) and an eviction policy (a
  /// block policy, bound here to each global group's block size);
  /// ConfigError names a bad field of cfg, or of a policy for this layout.
  HybridCache(const HybridConfig& cfg, const typename GroupSelection<Selection>::Arg& selection, Eviction eviction,
              Hasher hasher = {})
      : PoolCore(BlockPool(checked_hybrid_config(cfg).num_blocks, cfg.event_capacity, max_block_size(cfg.groups), cfg.medium),
                 hold_capacity(cfg.max_sequences, cfg.num_blocks)),
        cfg_(cfg),
        selection_(selection),
        eviction_(std::move(eviction)),
        hits_(cfg.groups, cfg.max_tokens, hasher),
        owner_(std::size_t(cfg.num_blocks), -1),
        seqs_(std::size_t(cfg.max_sequences)),
        free_(cfg.max_sequences),
        promises_(cfg.max_sequences) {
    std::size_t longest = 0;
    for (std::int32_t g = 0; g < groups(); ++g) {
      const GroupRule r = GroupRule::of(cfg.groups, g);
      rows_.emplace_back(r, cfg.max_sequences, std::int32_t(r.row_blocks(cfg.max_tokens)));
      longest = std::max(longest, std::size_t(r.row_blocks(cfg.max_tokens)));
    }
    prefix_ = HybridPrefix(rows_, [&](std::int32_t g) { return hits_.chain_owner(g); }, cfg.max_sequences, cfg.num_blocks,
                           cfg.prefix_caching);
    for (std::int32_t g = 0; g < groups(); ++g)
      if (prefix_.keeper(g) == g) distinct_.push_back(g);  // the first group of each rule
    scratch_.reserve(longest);  // the most blocks one call hands one group
    held_.reserve(std::size_t(groups()) * longest);
    this->idx_.reserve(seqs_.size());
    this->stamps_.assign(seqs_.size(), 0u);
    this->imports_ = PendingImports(cfg.max_sequences);
    if constexpr (selects) selection_.bind(cfg.groups, cfg.num_blocks, cfg.max_sequences, cfg.max_tokens);
    eviction_.bind(cfg.groups, cfg.max_sequences, cfg.max_tokens);
  }

  // --- the layout -----------------------------------------------------------
  const LayerGroups& layer_groups() const noexcept { return cfg_.groups; }  ///< The groups.
  std::int32_t groups() const noexcept { return cfg_.groups.num_groups(); }  ///< Number of groups.
  const HybridConfig& config() const noexcept { return cfg_; }  ///< The configuration.
  std::int32_t free_sequences() const noexcept { return free_.size(); }  ///< Handles free.

  // --- sequences (growth: hybrid_growth.hpp; accounting: hybrid_accounting.hpp) ---
  /// A new, empty sequence; `key` salts its hash chains (tenant, LoRA).
  Result<SeqId> add_sequence(const PrefixKey& key = {}) noexcept {
    auto slot = free_.take();
    if (!slot) return slot.status();
    const std::uint32_t i = *slot;
    Seq& s = seqs_[i];
    s.live = true, s.sealed = false, s.evicted_at = -1, s.reserved = s.computed = 0, s.key = key;
    s.ahead = cfg_.prefill_chunk > 0 ? cfg_.prefill_chunk : cfg_.max_tokens;  // admit() and import() bound it by the prompt
    prefix_.start(i, chain_root(key));
    return SeqId{i, s.generation};
  }

  // --- prefix cache: hits and the names of blocks ------------------------------
  /// The prefix of `prompt` every group can serve now (a multiple of
  /// hit_alignment(), below the prompt's length; a prompt past max_tokens is
  /// looked up as its first max_tokens); changes nothing but the scratch it looks up with.
  std::int64_t match(std::span<const std::int32_t> prompt, const PrefixKey& key = {}) {
    if (!cfg_.prefix_caching) return 0;
    return hits_.find(pool_, prompt.first(std::min<std::size_t>(prompt.size(), std::size_t(cfg_.max_tokens))), key, owner_of());
  }

  /// Group g's names of the full blocks of `tokens` (at most out.size())
  /// under `key`: the keys its blocks are published under (its hasher, its
  /// block size, keyed by g), in the pool and in every tier. Returns how many;
  /// invalid_argument for a bad group, or one that caches nothing (cross).
  Result<std::int32_t> hash_chain(std::int32_t g, std::span<const std::int32_t> tokens, const PrefixKey& key,
                                  std::span<BlockHash> out) const noexcept {
    auto n = block_chain(g, tokens, key, out);
    if (!n) return n;
    for (std::size_t j = 0; j < std::size_t(*n); ++j) out[j] = group_key(out[j], g);
    return n;
  }
  /// The group whose block_chain() group g shares: the first caching group
  /// of g's block size (-1 for a group that caches nothing). A caller naming
  /// blocks in several groups hashes once per owner.
  std::int32_t chain_owner(std::int32_t g) const noexcept { return hits_.chain_owner(g); }
  /// hash_chain() before the group's key: the chain every group of g's
  /// block size shares (group_key(out[j], g) is group g's name of block j).
  Result<std::int32_t> block_chain(std::int32_t g, std::span<const std::int32_t> tokens, const PrefixKey& key,
                                   std::span<BlockHash> out) const noexcept {
    if (g < 0 || g >= groups()) return Status{Errc::invalid_argument, "group", g, groups() - 1};
    const GroupRule& r = rows_[std::size_t(g)].rule();
    if (!r.caches()) return Status{Errc::invalid_argument, "group (cross-attention: its blocks are named by no prompt)", g, 0};
    const auto n = std::min<std::size_t>(tokens.size() / std::size_t(r.block_size), out.size());
    BlockHash parent = chain_root(key);
    for (std::size_t j = 0; j < n; ++j)
      out[j] = parent = hits_.hash(parent, tokens.subspan(j * std::size_t(r.block_size), std::size_t(r.block_size)), key.extra);
    return std::int32_t(n);
  }

  // --- admission and release ---------------------------------------------------
  /// What admit(), import() and GroupTiers::lookup() say of a prompt's
  /// length, in Cache<>'s words: empty is invalid_argument naming
  /// prompt.size, past max_tokens capacity_exceeded naming n_tokens.
  Status check_prompt(std::span<const std::int32_t> prompt) const noexcept {
    const auto len = std::int64_t(prompt.size());
    if (len < 1) return Status{Errc::invalid_argument, "prompt.size", len, 1};
    if (len > cfg_.max_tokens) return Status{Errc::capacity_exceeded, "n_tokens", len, cfg_.max_tokens};
    return {};
  }
  /// Atomic admission: a new sequence with the longest prefix of `prompt`
  /// every group serves from the cache, and its next uncached tokens reserved
  /// (all of them, or opt.reserve; by default at most the configured
  /// prefill_chunk, and an explicit opt.reserve that would reserve more is
  /// invalid_argument naming it). All or nothing across groups: hit blocks
  /// that are free but cached count as need, and every group's hits are
  /// retained before anything is allocated. slots: [groups][stride], stride =
  /// min(prompt length, opt.reserve): group g's slot of reserved token i at
  /// slots[g * stride + i] (-1 past `reserved`, and in cross groups).
  /// The options are every cache's: opt.max_new >= 0 promises
  /// blocks_needed(prompt, max_new) in the ledger, which must fit the free
  /// pool less every earlier promise (out_of_blocks naming max_new);
  /// opt.extras must be empty (a hybrid cache hashes no multimodal inputs);
  /// opt.prefill_chunk is 0 or the configured one (HybridConfig's: one bound).
  /// A prompt's length is refused as check_prompt() refuses it.
  Result<AdmitResult> admit(std::span<const std::int32_t> prompt, std::span<std::int32_t> slots, const AdmitOptions& opt = {}) {
    const auto len = std::int64_t(prompt.size());
    if (auto st = check_prompt(prompt); !st) return st;
    if (opt.reserve < 1) return Status{Errc::invalid_argument, "reserve", opt.reserve, 1};
    if (!opt.extras.empty())
      return Status{Errc::invalid_argument, "extras (a hybrid cache hashes no multimodal inputs)", std::int64_t(opt.extras.size()), 0};
    if (opt.prefill_chunk != 0 && opt.prefill_chunk != cfg_.prefill_chunk)
      return Status{Errc::invalid_argument, "prefill_chunk (HybridConfig::prefill_chunk is the bound)", opt.prefill_chunk, cfg_.prefill_chunk};
    std::int64_t promise = 0;
    if (opt.max_new >= 0) {
      auto life = this->blocks_needed(len, opt.max_new);
      if (!life) return life.status();
      promise = *life;
    }
    const auto stride = std::int32_t(std::min<std::int64_t>(len, opt.reserve));
    if (std::int64_t(slots.size()) < std::int64_t(groups()) * stride)
      return Status{Errc::buffer_too_small, "slots", std::int64_t(slots.size()), std::int64_t(groups()) * stride};
    if (free_.empty()) return no_free_handle(cfg_.max_sequences);
    const std::int64_t h = match(prompt, opt.key);
    auto n = std::int32_t(std::min<std::int64_t>(stride, len - h));
    if (const std::int32_t chunk = cfg_.prefill_chunk; chunk > 0 && n > chunk) {
      if (opt.reserve != INT32_MAX) return Status{Errc::invalid_argument, "reserve (past prefill_chunk)", opt.reserve, chunk};
      n = chunk;  // the default: one chunk now, the rest through reserve()
    }
    std::int64_t need = 0;
    for (std::int32_t g = 0; g < groups(); ++g) {
      const GroupRule& r = rows_[std::size_t(g)].rule();
      const std::int64_t hit_blocks = r.caches() ? h / r.block_size : 0;  // a cross row starts empty
      for (std::int64_t j = r.hit_first_block(h); j < hit_blocks; ++j) need += pool_.ref_count(hits_.block(g, j)) == 0;
      need += r.row_blocks(h + n) - hit_blocks;
    }
    if (need > pool_.num_free()) return Status{Errc::out_of_blocks, "n_blocks", need, pool_.num_free()};
    if (opt.max_new >= 0) {  // hit blocks other sequences hold draw nothing from the free pool
      std::int64_t shared = 0;
      for (std::int32_t g = 0; g < groups(); ++g) {
        const GroupRule& r = rows_[std::size_t(g)].rule();
        for (std::int64_t j = r.hit_first_block(h); r.caches() && j < h / r.block_size; ++j) shared += pool_.ref_count(hits_.block(g, j)) > 0;
      }
      if (const std::int64_t room = pool_.num_free() - this->promised_blocks() + shared; promise > room)
        return Status{Errc::out_of_blocks, "max_new (the lifetime need past the free pool less promises)", promise, room};
    }
    const SeqId id = *add_sequence(opt.key);
    Seq& s = seqs_[id.index];
    promises_.record(id.index, promise);
    queries_.queried(len, h);
    std::int32_t fresh = 0;
    for (std::int32_t g = 0; g < groups(); ++g) {  // retain every group's hits, then allocate
      const GroupRule& r = rows_[std::size_t(g)].rule();
      if (!r.caches()) continue;
      const std::int64_t first = std::min(r.hit_first_block(h), h / r.block_size);
      scratch_.clear();
      for (std::int64_t j = first; j < h / r.block_size; ++j) {
        (void)pool_.retain(hits_.block(g, j));
        scratch_.push_back(hits_.block(g, j));
      }
      rows_[std::size_t(g)].adopt(id.index, std::int32_t(first), scratch_);
      prefix_.adopt(g, id.index, std::int32_t(h / r.block_size), hits_.chain(g, s.key));
    }
    selection_.adopted(rows_, id.index);  // the rows hold their hits only
    s.computed = s.reserved = h;
    if (cfg_.prefill_chunk == 0) s.ahead = len;  // a whole prompt at once: what blocks_needed assumed
    for (const GroupRows& rows : rows_) fresh -= rows.live(id.index);
    this->grow(id.index, n, prompt.subspan(std::size_t(h), std::size_t(n)), slots, stride);
    for (std::int32_t g = 0; g < groups(); ++g)  // -1 past what was reserved
      std::fill(slots.begin() + std::ptrdiff_t(g) * stride + n, slots.begin() + std::ptrdiff_t(g + 1) * stride, -1);
    for (const GroupRows& rows : rows_) fresh += rows.live(id.index);
    return AdmitResult{id, std::int32_t(h), n, fresh, promise};
  }

  /// Frees every block of sequence id (last index first, into the cached-free LRU) and its handle.
  Status free(SeqId id) noexcept {
    if (auto st = validate(id); !st) return st;
    for (GroupRows& rows : rows_) rows.cut(pool_, id.index, 0), rows.clear(id.index);
    selection_.freed(id.index);
    eviction_.freed(id.index);
    Seq& s = seqs_[id.index];
    s.live = false;
    ++s.generation;
    promises_.forget(id.index);
    free_.give(id.index);
    return {};
  }

  // --- holds, events and the prefix cache's counters (imports: hybrid_imports.hpp;
  // exports: hybrid_exports.hpp; policies: hybrid_selection.hpp, hybrid_eviction.hpp) ---
  using PoolCore::hold;  // hold(blocks), as every cache (pool_core.hpp)
  /// hold() of every group's live blocks of sequence id (what a sender pins so that id can be freed before
  /// its consumers have read it); invalid_argument once id evicted (a peer would take them for its prompt's).
  Result<std::uint64_t> hold(SeqId id) {
    if (auto st = this->live_blocks(id, held_); !st) return st;  // held_ has room for every group's row
    if (seqs_[id.index].evicted_at >= 0)
      return Status{Errc::invalid_argument, "seq (it evicted: its rows are not its prompt's K/V for a peer)", id.index, 0};
    return holds_.hold(pool_, held_);
  }

  // Block events (each naming its group; HybridConfig::event_capacity):
  // drain_events(out[, token_ids]), as every cache (pool_core.hpp).
  /// Token ids a drained event keeps at most: the largest group block size.
  std::int32_t tokens_per_event() const noexcept { return prefix_.max_block_size(); }
  /// Prefix-cache counters (admissions and imports looked up, tokens they
  /// hit; the pool's hashes stored, recycled, invalidated) and block states,
  /// over every group: what Cache<>::prefix_stats() reports.
  PrefixStats prefix_stats() const noexcept { return queries_.stats(pool_); }
  /// Drops every cached hash of every group (free-but-cached blocks become
  /// plain free; emits all_cleared); blocks_in_use while any block is held, as Cache<>.
  Status reset_prefix_cache() noexcept { return pool_.reset_prefix_cache(); }


  /// Equal state (the hit finder's scratch aside): what error paths are tested against.
  friend bool operator==(const HybridCache& a, const HybridCache& b) {
    return a.same_pool(b) && a.selection_ == b.selection_ && a.eviction_ == b.eviction_ && a.rows_ == b.rows_ && a.owner_ == b.owner_ && a.seqs_ == b.seqs_ &&
           a.free_ == b.free_ && a.promises_ == b.promises_ && a.prefix_ == b.prefix_ && a.imports_ == b.imports_ && a.queries_ == b.queries_;
  }

 private:
  struct Seq {
    friend bool operator==(const Seq&, const Seq&) = default;
    std::uint32_t generation = 0;
    bool live = false, sealed = false;  // sealed: an import's row (hybrid_imports.hpp), named by no call
    std::int64_t evicted_at = -1;  // computed when a block first left a global row (-1: never); nothing more is published
    std::int64_t reserved = 0, computed = 0;
    std::int64_t ahead = 0;  // the most tokens it may hold reserved and not computed (HybridConfig::prefill_chunk)
    PrefixKey key{};
  };
  static std::int32_t max_block_size(const LayerGroups& lg) noexcept {
    std::int32_t m = 1;
    for (std::int32_t g = 0; g < lg.num_groups(); ++g) m = std::max(m, GroupRule::of(lg, g).block_size);
    return m;
  }
  Status validate(SeqId id) const noexcept {
    return check_handle(id, std::uint32_t(seqs_.size()), [&](std::uint32_t i) {
      return HandleSlot{.in_use = seqs_[i].live, .sealed = seqs_[i].sealed, .generation = seqs_[i].generation};
    });
  }
  // After the checks: tokens [0, tokens) are computed; every caching group publishes its full blocks there.
  Status mark_computed(std::uint32_t i, std::int64_t tokens) noexcept {
    seqs_[i].computed = tokens;
    if (!cfg_.prefix_caching || seqs_[i].evicted_at >= 0) return {};
    return prefix_.publish(pool_, rows_, hits_, i, tokens, seqs_[i].key);
  }
  auto owner_of() const noexcept {
    return [this](BlockId b) { return std::int32_t(owner_[std::size_t(b)]); };
  }

  HybridConfig cfg_;
  [[no_unique_address]] GroupSelection<Selection> selection_;
  [[no_unique_address]] GroupEviction<Eviction> eviction_;
  GroupHits<Hasher> hits_;
  std::vector<GroupRows> rows_;
  std::vector<std::int8_t> owner_;  // [block]: the group that last allocated it
  std::vector<Seq> seqs_;
  FreeHandles free_;        // handle slots no sequence holds
  PromiseLedger promises_;  // the scheduler's ledger (core/promise_ledger.hpp)
  HybridPrefix prefix_;  // what is published, and the ids it is hashed from
  PrefixQueries queries_;  // what admissions and imports looked up and hit
  std::vector<std::int32_t> distinct_;  // the first group of each rule (kind, block size, span)
  std::vector<BlockId> scratch_;
  std::vector<BlockId> held_;            // import(): the window hits its hold keeps
};

static_assert(SequenceHolds<HybridCache<>> && ImportingCache<HybridCache<>> && GrowingCache<HybridCache<>>,
              "kvcache::HybridCache keeps the sequence-cache contract (cache/contract.hpp)");

KVCACHE_END_NAMESPACE
