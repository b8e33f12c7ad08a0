// The contract every cache keeps, whatever its rows (token-paged,
// head-paged, layer groups): the calls a scheduler makes to run sequences
// over a shared pool, hold blocks for transfers, follow the pool's events
// and keep the admission ledger. Each is the same name, arguments and result
// on every cache; static_asserts beside each cache (cache.hpp, hybrid.hpp)
// keep it so. What differs is the rows: how a head-paged cache's tokens get
// slots (write), and how a kernel reads them (the exports); token rows and
// layer groups grow by the same calls (GrowingCache).
#pragma once

#include <concepts>
#include <cstdint>
#include <span>
#include <utility>

#include "kvcache/pool/block_holds.hpp"
#include "kvcache/pool/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/core/events.hpp"
#include "kvcache/prefix/prefix_cache.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"
#include "kvcache/transfer/pending_imports.hpp"
#include "kvcache/transfer/transfer_plan.hpp"

KVCACHE_BEGIN_NAMESPACE

/// A cache of sequences over one block pool (Cache<>, HybridCache<>, the head-paged Cache<WriteGate...>).
template <class C>
concept SequenceCache = requires(C& c, const C& cc, SeqId s, std::span<const BlockId> blocks, std::uint64_t id,
                                 std::span<BlockEvent> events, std::span<std::int32_t> token_ids, std::int64_t n) {
  // sequences
  { c.add_sequence() } -> std::same_as<Result<SeqId>>;  ///< a new, empty sequence
  { c.free(s) } -> std::same_as<Status>;                ///< its blocks back to the pool, the handle dead
  { cc.free_sequences() } -> std::same_as<std::int32_t>;
  { cc.blocks_held(s) } -> std::same_as<Result<std::int32_t>>;
  // the pool
  { cc.pool() } -> std::same_as<const BlockPool&>;
  { cc.free_blocks() } -> std::same_as<std::int32_t>;
  { c.drain_events(events) } -> std::same_as<std::int32_t>;
  { c.drain_events(events, token_ids) } -> std::same_as<Result<std::int32_t>>;
  // holds: blocks a transfer keeps after their rows let go
  { c.hold(blocks) } -> std::same_as<Result<std::uint64_t>>;
  { c.release_hold(id) } -> std::same_as<Status>;
  { cc.holds() } -> std::same_as<const BlockHolds&>;
  // the admission ledger: lifetime need, promises, room
  { cc.blocks_needed(n, n) } -> std::same_as<Result<std::int64_t>>;     ///< (prompt_len, max_new), the cache's chunking
  { cc.blocks_needed(n, n, n) } -> std::same_as<Result<std::int64_t>>;  ///< ... with prefill_chunk
  { cc.can_admit(n, n) } -> std::same_as<bool>;
  { cc.promised_blocks() } -> std::same_as<std::int64_t>;
  { cc.check_invariants() } -> std::same_as<Status>;
};

/// A cache whose sequences have token rows and a prefix cache (Cache<>,
/// HybridCache<>): admission with a hit, the sequence's length, the hit's length.
template <class C>
concept PrefixCache = SequenceCache<C> && requires(C& c, SeqId s, std::span<const std::int32_t> prompt, std::span<std::int32_t> slots,
                                                   const AdmitOptions& opt, const PrefixKey& key, std::int64_t blocks) {
  { c.admit(prompt, slots, opt) } -> std::same_as<Result<AdmitResult>>;  ///< a new sequence: the hit shared, the first chunk reserved
  { c.promise(s, blocks) } -> std::same_as<Status>;                      ///< the ledger: s's lifetime need (core/promise_ledger.hpp)
  { c.match(prompt, key) } -> std::same_as<std::int64_t>;                ///< tokens the cache serves now
  { c.tokens(s) } -> std::same_as<Result<std::int64_t>>;                 ///< the sequence's length
  { std::as_const(c).prefix_stats() } -> std::same_as<PrefixStats>;     ///< what admissions looked up and hit; block states
  { c.reset_prefix_cache() } -> std::same_as<Status>;                    ///< every hash dropped (blocks_in_use while any is held)
};

/// A prefix cache whose sequences grow by calls every such cache makes the
/// same (Cache<>, HybridCache<>): slots are [groups()][n] (one group: [n]),
/// the result the blocks taken and a copy-on-write to run first (none on
/// layer groups). computed() tells the cache the forward pass wrote K/V up
/// to a length (what a hybrid publishes and frees windows by; Cache<>
/// publishes on reserve and only checks it); advance() is the decode step,
/// every reserved token computed and the next ones reserved; truncate()
/// rolls back reserved tokens. reserve_batch() and advance_batch() do a
/// batch's reserve() or advance() all or nothing, slots [groups()][stride]
/// (stride = slots.size() / groups(), -1 past the batch's).
template <class C>
concept GrowingCache = PrefixCache<C> && requires(C& c, SeqId s, std::span<const std::int32_t> ids, std::span<std::int32_t> slots,
                                                  std::int64_t tokens, std::int32_t n, std::span<const SeqId> seqs,
                                                  std::span<const std::int32_t> counts, std::span<BlockCopy> copies) {
  { c.reserve(s, ids, slots) } -> std::same_as<Result<ReserveInfo>>;
  { c.advance(s, ids, slots) } -> std::same_as<Result<ReserveInfo>>;
  { c.reserve_batch(seqs, counts, ids, slots, copies) } -> std::same_as<Result<BatchInfo>>;
  { c.advance_batch(seqs, counts, ids, slots, copies) } -> std::same_as<Result<BatchInfo>>;
  { c.reserve_batch(seqs, counts, ids, slots) } -> std::same_as<Result<BatchInfo>>;  ///< no copies: none needed without a fork
  { c.advance_batch(seqs, counts, ids, slots) } -> std::same_as<Result<BatchInfo>>;
  { c.computed(s, tokens) } -> std::same_as<Status>;
  { c.truncate(s, n) } -> std::same_as<Status>;
};

/// A prefix cache that admits a sequence a peer prefilled (disaggregated
/// decode, transfer/pending_imports.hpp): import, the blocks each group
/// receives, and the landing, the same calls on every cache. A single-group
/// cache has one group, 0.
template <class C>
concept ImportingCache = PrefixCache<C> && requires(C& c, const C& cc, std::span<const std::int32_t> prompt, const ImportOptions& opt,
                                                    std::uint64_t id, std::int32_t g) {
  { cc.groups() } -> std::same_as<std::int32_t>;
  { c.import(prompt, opt) } -> std::same_as<Result<ImportPlan>>;          ///< the row sealed, its fresh blocks pending
  { cc.import_blocks(id, g) } -> std::same_as<Result<GroupBlocks>>;      ///< group g's: local[i] receives the peer's skip + i
  { c.commit_import(id, prompt) } -> std::same_as<Result<ImportCommit>>;  ///< landed: published; the prompt must be the one imported
  { c.abort_import(id) } -> std::same_as<Result<ImportAbort>>;            ///< failed: the hit kept, the rest to recompute
  { cc.imports() } -> std::same_as<const PendingImports&>;
};

/// A sequence cache a disaggregated sender holds a whole sequence of (transfer/transfer_holds.hpp).
template <class C>
concept SequenceHolds = SequenceCache<C> && requires(C& c, SeqId s) {
  { c.hold(s) } -> std::same_as<Result<std::uint64_t>>;
};

KVCACHE_END_NAMESPACE
