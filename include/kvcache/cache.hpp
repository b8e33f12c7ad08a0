// The composed manager an engine holds: a block pool, a page table, and the
// three policies. Empty policies take no space ([[no_unique_address]]).
//
//   Cache<> cache({.geometry = g, .num_blocks = 4096, .max_sequences = 256,
//                  .max_blocks_per_sequence = 512});
//   auto seq = cache.add_sequence();                       // Result<SeqId>
//   auto r = cache.reserve(*seq, prompt_len, slots);       // slot mapping
//   cache.export_csr(seqs, indptr, indices, last_page_len);
//
// Cache<...> names one of two caches, picked by the admission policy's kind:
//   TokenPagedCache (cache/token_paged.hpp)  a row per sequence: reserve,
//       prefix sharing, per-sequence exports (every pass-through admission)
//   HeadPagedCache (cache/head_paged.hpp)    a row per (sequence, layer,
//       kv-head) that the admission places writes in (WriteGate); its own
//       name is GatedCache<WriteGate, Selection, Eviction>
// Both are thin coordinators over the same core (cache/core.hpp): a method
// makes its edit and then tells each participant (cache/hooks.hpp). What a
// policy decides lives in its own folder, behind those hooks; adding a policy
// never edits these files.
#pragma once

#include <concepts>

#include "kvcache/admission/admit_all.hpp"
#include "kvcache/core/block_hash.hpp"
#include "kvcache/pool/block_pool.hpp"
#include "kvcache/cache/contract.hpp"
#include "kvcache/cache/core.hpp"
#include "kvcache/cache/head_paged.hpp"
#include "kvcache/cache/token_paged.hpp"
#include "kvcache/config.hpp"
#include "kvcache/eviction/keep_all.hpp"
#include "kvcache/table/page_table.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/selection/select_all.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Score signals any cache can feed to policies: observe() takes the score
/// forms of ScoreKind (policy.hpp); a head-paged admission's write() also
/// takes gate scores, and a page-bounds selection reads the bounds the cache
/// keeps current.
inline constexpr Signals cache_signals{Signals::attention_sums | Signals::head_attention_sums | Signals::last_query_attention};

/// The signals a composition's policies need are the ones its cache feeds.
template <class Admission, class Selection, class Eviction>
struct SignalsCheck {
  static constexpr bool head_paged = Admission::kind == AdmissionKind::head_paged;  ///< Gate scores are fed.
  static constexpr bool selects = Selection::kind == SelectionKind::page_bounds;    ///< Page bounds are kept.
  static_assert(Signals{cache_signals.bits | (head_paged ? Signals::gate_scores : 0u)}.covers(Admission::required_signals),
                "kvcache::Cache: the admission policy needs score signals this cache does not provide");
  static_assert(Signals{cache_signals.bits | (selects ? Signals::page_key_bounds : 0u)}.covers(Selection::required_signals),
                "kvcache::Cache: the selection policy needs score signals this cache does not provide");
  static_assert(cache_signals.covers(Eviction::required_signals),
                "kvcache::Cache: the eviction policy needs score signals this cache does not provide");
};

/// Which cache a composition is: rows per sequence...
template <class Pool, class Table, class Admission, class Selection, class Eviction, class Hasher>
struct CacheFor : SignalsCheck<Admission, Selection, Eviction> {
  using type = TokenPagedCache<Pool, Table, Admission, Selection, Eviction, Hasher>;  ///< The cache.
};
/// ...or, for a head-paged admission, rows per (sequence, layer, kv-head).
template <class Pool, class Table, class Admission, class Selection, class Eviction, class Hasher>
  requires(Admission::kind == AdmissionKind::head_paged)
struct CacheFor<Pool, Table, Admission, Selection, Eviction, Hasher> : SignalsCheck<Admission, Selection, Eviction> {
  static_assert(HeadPagedAdmission<Admission>,
                "kvcache::Cache: a head_paged admission policy must model HeadPagedAdmission (table/head_rows.hpp)");
  static_assert(std::same_as<Pool, BlockPool> && std::same_as<Table, PageTable>,
                "kvcache::Cache: a head-paged admission policy (WriteGate) runs on BlockPool and PageTable");
  using type = HeadPagedCache<Admission, Selection, Eviction, Hasher>;  ///< The cache.
};

/// What a cache's constructor takes for selection policy S: the policy, or a page-bounds policy's Config.
template <class S>
struct SelectionArg {
  using type = typename RowSelection<S>::Arg;  ///< The argument's type.
};

/// The composed KV-cache manager: pool, page table, admission, selection and
/// eviction policies, block hasher. Constructor: (CacheConfig, admission,
/// selection, eviction, hasher), where a head-paged admission and a
/// page-bounds selection are given as their Config.
template <BlockAllocator Pool = BlockPool, BlockTableFor<Pool> Table = PageTable, AdmissionPolicy Admission = AdmitAll,
          SelectionPolicy Selection = SelectAll, EvictionPolicy Eviction = KeepAll, BlockHasher Hasher = FastBlockHasher>
using Cache = typename CacheFor<Pool, Table, Admission, Selection, Eviction, Hasher>::type;

/// The head-paged cache by its own name: rows per (sequence, layer, kv-head)
/// that a head-paged admission places writes in (GatedCache<WriteGate>, with
/// a selection and an eviction policy as Cache<> takes them). The same type
/// as Cache<BlockPool, PageTable, Admission, Selection, Eviction, Hasher>.
template <AdmissionPolicy Admission, SelectionPolicy Selection = SelectAll, EvictionPolicy Eviction = KeepAll,
          BlockHasher Hasher = FastBlockHasher>
  requires(Admission::kind == AdmissionKind::head_paged)
using GatedCache = Cache<BlockPool, PageTable, Admission, Selection, Eviction, Hasher>;

static_assert(SequenceHolds<Cache<>> && ImportingCache<Cache<>> && GrowingCache<Cache<>>,
              "kvcache::Cache<> keeps the sequence-cache contract (cache/contract.hpp)");

KVCACHE_END_NAMESPACE
