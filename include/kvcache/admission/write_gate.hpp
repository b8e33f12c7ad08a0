// Write-Gated KV admission (arXiv 2512.17452): every (sequence, layer,
// kv-head) is its own stream over a pool of single-head blocks, holding a
// local ring of the last W tokens and a global region of admitted ones.
//
//   row of one head stream:  [ ring: W slots ........ ][ global: admitted tokens ... ]
//                             row index 0          W-1   W ...
//
// A token enters the ring. When the ring is full, the token a write replaces
// (the oldest) is promoted to the end of the global region if its gate was
// >= tau, else dropped: lazy promotion. A prefill chunk longer than the ring
// sends its early tokens straight to global (or nowhere). Heads keep ragged
// lengths; each head's live tokens are always the row's first tokens (the ring
// is full whenever the global region is not empty), so stock paged kernels
// read a head as one row of a head-folded table.
//
// The engine writes a call's tokens with two kernels: `compaction` runs the
// promotions (ring slot -> global slot, disjoint), then `scatter` puts the new
// tokens at their slots (-1: dropped). When a call writes at most W tokens,
// `ring_write(slots, promote)` does both in one launch.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/head_rows.hpp"
#include "kvcache/kernels/ring_admit.hpp"
#include "kvcache/block_math.hpp"
#include "kvcache/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/page_table.hpp"
#include "kvcache/page_table_edits.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/sequence_id.hpp"
#include "kvcache/slot_move.hpp"
#include "kvcache/status.hpp"
#include "kvcache/strided_span.hpp"

KVCACHE_BEGIN_NAMESPACE

/// What a write does when a head's global region is at its cap.
enum class GlobalCapAction : std::uint8_t {
  refuse,  ///< the call fails with capacity_exceeded naming the cap; nothing changes
  drop,    ///< the promotion is skipped: the token leaves like an unadmitted one (counted)
};

/// Write-Gated KV's configuration.
struct WriteGateConfig {
  std::int32_t num_layers = 1;       ///< Layers per sequence.
  std::int32_t num_kv_heads = 1;     ///< Kv-heads per layer.
  std::int32_t local_window = 256;   ///< W_local: ring tokens per head, a multiple of the block size.
  float tau = 0.1f;                  ///< A token is admitted when its gate is >= tau.
  std::int32_t global_cap = 0;       ///< Admitted tokens a head keeps at most; 0: as many as its row holds.
  GlobalCapAction at_cap = GlobalCapAction::refuse;  ///< What a promotion past the cap does.
};

/// Write-Gated KV admission over a PageTable of single-head streams.
class WriteGate {
 public:
  static constexpr Signals required_signals{Signals::gate_scores};  ///< Reads gate scores.
  static constexpr AdmissionKind kind = AdmissionKind::head_paged;  ///< Owns one stream per (sequence, layer, kv-head).
  using Config = WriteGateConfig;  ///< What a Cache is given to build it.

  /// Binds the configuration to a table and takes all of its streams: `table`
  /// must be unused and hold max_sequences x layers x kv-heads streams
  /// (streams_for) of single-head blocks. Stream (layer, seq, head) of the
  /// table is row (layer x max_sequences + seq) x kv_heads + head, so one
  /// layer's head rows lie together (a decode step and a layer's export walk
  /// them in order). Throws ConfigError for bad values.
  WriteGate(const WriteGateConfig& cfg, std::int32_t max_sequences, PageTable& table);

  /// Page-table streams a cache of `max_sequences` sequences needs.
  static constexpr std::int64_t streams_for(const WriteGateConfig& c, std::int32_t max_sequences) noexcept {
    return std::int64_t{max_sequences} * c.num_layers * c.num_kv_heads;
  }
  const WriteGateConfig& config() const noexcept { return cfg_; }  ///< The configuration.
  /// The effective per-head cap: the config's global_cap, or, when that is 0,
  /// what a row holds past its ring (a number; ring_admit's global_limit).
  std::int32_t global_cap() const noexcept { return cap_; }
  std::int32_t num_layers() const noexcept { return cfg_.num_layers; }  ///< Layers per sequence.
  std::int32_t num_kv_heads() const noexcept { return cfg_.num_kv_heads; }  ///< Kv-heads per layer.
  std::int32_t local_window() const noexcept { return w_; }  ///< W_local: ring slots per head.
  std::int32_t free_sequences() const noexcept { return std::int32_t(free_.size()); }  ///< Sequence handles still free.

  // --- sequences ------------------------------------------------------------
  /// A new sequence: layers x kv-heads empty streams. capacity_exceeded when none is free.
  Result<SeqId> add(PageTable& table) noexcept;
  /// A new sequence sharing every block of s: each head stream forks. A later
  /// write or rollback that rewrites a shared block copies it first (`copies`).
  Result<SeqId> fork(PageTable& table, BlockPool& pool, SeqId s) noexcept;
  /// Ends s: every head stream goes back with its blocks.
  Status free(PageTable& table, BlockPool& pool, SeqId s) noexcept;

  // --- writes ---------------------------------------------------------------
  /// Writes n = gates.size() / kv_heads new tokens of layer `layer`: gates,
  /// out.slots and out.promote are [n][kv_heads] (token-major, like the
  /// layer's K). slots[t][h]: where token t of head h goes (its ring slot, a
  /// global slot, or -1 when it is dropped within this call). out.moves:
  /// promotions of tokens the ring held before the call (ring slot -> global
  /// slot). out.promote (may be empty; needs n <= W): the promotion of the
  /// token slots[t][h] replaces, or -1, for ring_write. out.copies: blocks a
  /// fork shares that this write rewrites. All or nothing: a gate outside
  /// [0, 1] or NaN, a buffer too small, the pool or a row out of room, or a
  /// head at its cap under `refuse` is an error naming the value, and nothing changes.
  Result<GateWriteInfo> write(PageTable& table, BlockPool& pool, SeqId s, std::int32_t layer,
                              std::span<const float> gates, const GateWriteSpans& out) noexcept;

  /// A decode step of layer `layer` for a batch: one new token for each of
  /// `seqs` (each at most once). gates, out.slots and out.promote are
  /// [seqs][kv_heads]; out.moves and out.copies take the whole batch's
  /// commands. The same result as write() per sequence in batch order, with
  /// one check of the arguments and one pass over the layer's heads in
  /// memory order. All or nothing, with write()'s errors; a sequence twice is
  /// invalid_argument naming its index in `seqs`.
  Result<GateWriteInfo> write_batch(PageTable& table, BlockPool& pool, std::span<const SeqId> seqs, std::int32_t layer,
                                    std::span<const float> gates, const GateWriteSpans& out) noexcept;

  /// Rollback of the n newest tokens of every layer (all layers must have
  /// written the same tokens). Per head: they leave the ring; the newest
  /// global tokens refill it from its oldest end (so a head's row stays
  /// contiguous); if the global region runs out first, the ring is re-packed
  /// into its first slots (kept tokens past the new length fill the holes
  /// below it) and its order becomes slot order. Tokens the rolled-back writes
  /// dropped do not come back. Moves (src -> dst, disjoint) go to out.moves,
  /// for the compaction kernel, after out.copies (ring blocks a fork shares).
  /// n past the newest run of consecutive positions a head holds is
  /// truncate_too_many naming the limit, and nothing changes.
  Result<GateWriteInfo> truncate(PageTable& table, BlockPool& pool, SeqId s, std::int32_t n,
                                 const GateWriteSpans& out) noexcept;

  // --- deferred writes: the gates stay on the device ----------------------------
  /// Allotted writes of one (sequence, layer) not reconciled yet, at most.
  static constexpr std::int32_t max_pending = 8;
  using DeferredSpans = GateDeferredSpans;  ///< Where allot() puts what the device's launch needs.
  /// The no-host-sync write, part 1 (no gates needed): allots layer `layer`
  /// of s room for n new tokens, as if every token leaving a ring were
  /// admitted (rows grow to ring + min(cap, global + leaving)), and gives the
  /// rings' state before the write. The engine then exports the head rows
  /// and launches ring_admit with the gates, the rows, and its device state
  /// (each head's global length and ring bits), which decides and moves on
  /// the device. Needs GlobalCapAction::drop (the device cannot fail a
  /// write). Up to max_pending writes of a (sequence, layer) may wait for
  /// reconcile(). All or nothing.
  Result<GateWriteInfo> allot(PageTable& table, BlockPool& pool, SeqId s, std::int32_t layer, std::int32_t n,
                              const DeferredSpans& out) noexcept;
  /// Part 2, any time later (gates read back from the device): replays the
  /// oldest allotted write of (s, layer) with its gates, exactly as the
  /// device ran it, and gives back the blocks its allotment did not use (rows
  /// keep what later allotted writes may need). Returns what it did.
  Result<GateWriteInfo> reconcile(PageTable& table, BlockPool& pool, SeqId s, std::int32_t layer,
                                  std::span<const float> gates) noexcept;
  /// Allotted writes of (s, layer) not reconciled yet.
  Result<std::int32_t> pending(SeqId s, std::int32_t layer) const noexcept;
  /// The device state ring_admit advances, as the host holds it for (s,
  /// layer): each head's global length ([kv_heads]) and its ring's admission
  /// bits ([kv_heads][W], 0 or 1, by ring slot). Seed the device's copy with
  /// it when a sequence's writes move from write() to allot() (a prefill on
  /// the host, then decode without host syncs), after a fork, and after an
  /// eviction of the global regions (their lengths shrink). With
  /// deferred writes pending the device is ahead of the host: reconcile first
  /// (invalid_argument naming them). A buffer too small is buffer_too_small.
  Status device_state(SeqId s, std::int32_t layer, std::span<std::int32_t> global_len,
                      std::span<std::uint8_t> bits) const noexcept;
  /// The ring_admit launch's policy parameters, exactly as reconcile()
  /// replays them: num_heads, window (W), global_limit (the effective cap,
  /// global_cap()) and tau. The engine fills in the rest (pool, K/V, gates,
  /// the allotted rings' state, its device state, the rows), so the device
  /// and the host's bookkeeping cannot disagree through a parameter.
  RingAdmitParams ring_admit_params() const noexcept {
    RingAdmitParams p{};
    p.num_heads = cfg_.num_kv_heads;
    p.window = w_;
    p.global_limit = cap_;
    p.tau = cfg_.tau;
    return p;
  }

  // --- eviction of the global region (a token policy through the cache) --------
  /// Global tokens of (s, layer, kv_head) that a token eviction may choose
  /// from: past the blocks the row shares (a fork), as a global token index.
  /// 0 when s has deferred writes pending (nothing may move then: reconcile first).
  std::int32_t first_evictable(const PageTable& table, const BlockPool& pool, SeqId s, std::int32_t layer,
                               std::int32_t kv_head) const noexcept;
  /// A token eviction of the head's global region ran (write_gate_evict.hpp):
  /// global token m.dst now holds what m.src held (global token indices, the
  /// engine runs them as slot moves), and its last `count` tokens leave; the
  /// first `first_changed` stay where they were. The caller planned it
  /// (first_evictable, no pending writes): it cannot fail.
  void compact_global(PageTable& table, BlockPool& pool, SeqId s, std::int32_t layer, std::int32_t kv_head,
                      std::span<const SlotMove> index_moves, std::int32_t count, std::int32_t first_changed) noexcept;

  // --- what a head holds ------------------------------------------------------
  /// The head stream of (s, layer, head) in the table (for exports: one row per head).
  Result<SeqId> head(SeqId s, std::int32_t layer, std::int32_t kv_head) const noexcept;
  /// Positions of the head's live tokens in row order (ring slots, then global).
  Result<StridedSpan<const std::int32_t>> positions(SeqId s, std::int32_t layer, std::int32_t kv_head) const noexcept;
  /// What a head holds.
  struct HeadState {
    std::int32_t ring = 0;    ///< Tokens in the ring.
    std::int32_t global = 0;  ///< Tokens in the global region.
    std::int32_t oldest = 0;  ///< Ring slot of the oldest ring token (the next one replaced).
  };
  /// head() without the checks, for exports that validated s, layer and kv_head.
  SeqId head_unchecked(SeqId s, std::int32_t layer, std::int32_t kv_head) const noexcept {
    return ids_[head_index(s.index, layer, kv_head)];
  }
  /// Ring tokens, global tokens and the ring's oldest slot of (s, layer, kv_head).
  Result<HeadState> head_state(SeqId s, std::int32_t layer, std::int32_t kv_head) const noexcept;
  /// Tokens layer `layer` of s has written (its next position).
  Result<std::int64_t> appended(SeqId s, std::int32_t layer = 0) const noexcept;
  /// Live tokens of s over all its heads.
  Result<std::int64_t> tokens_held(const PageTable& table, SeqId s) const noexcept;
  /// Blocks a sequence of `tokens` tokens holds at most: per head, the ring
  /// (min(tokens, W)) plus min(cap, tokens - W) admitted tokens, in blocks.
  std::int64_t max_blocks_held(std::int64_t tokens) const noexcept;
  /// Every head's ring, global length, positions and row agree. O(heads x W).
  Status check(const PageTable& table) const;
  /// Equality of observable state (scratch excluded).
  friend bool operator==(const WriteGate& a, const WriteGate& b) {
    const auto same = [](const Head& x, const Head& y) { return x.start == y.start && x.len == y.len && x.global == y.global; };
    return a.w_ == b.w_ && a.cap_ == b.cap_ && a.ids_ == b.ids_ && a.pos_ == b.pos_ && a.bits_ == b.bits_ &&
           a.appended_ == b.appended_ && a.gen_ == b.gen_ && a.free_ == b.free_ && a.live_ == b.live_ &&
           a.forked_ == b.forked_ && a.pending_ == b.pending_ && a.npending_ == b.npending_ &&
           std::equal(a.heads_.begin(), a.heads_.end(), b.heads_.begin(), b.heads_.end(), same);
  }

 private:
  struct Head {
    std::int32_t start = 0;   // ring slot of the oldest ring token
    std::int32_t len = 0;     // ring tokens
    std::int32_t global = 0;  // global tokens
  };
  // Layer-major: a layer's heads of every sequence are one slice of each array.
  std::size_t head_index(std::uint32_t seq, std::int32_t layer, std::int32_t h) const noexcept {
    return (std::size_t(layer) * std::size_t(max_seqs_) + std::size_t(seq)) * std::size_t(cfg_.num_kv_heads) +
           std::size_t(h);
  }
  Status validate(SeqId s) const noexcept;
  // A head's row positions: a sequence's heads lie side by side per row slot
  // ([layer][seq][row slot][head]), so a decode step's H writes share a line.
  std::size_t pos_base(std::size_t hi) const noexcept {
    const auto H = std::size_t(cfg_.num_kv_heads);
    return (hi / H) * std::size_t(row_cap_) * H + hi % H;
  }
  StridedSpan<std::int32_t> pos(std::size_t hi) noexcept {
    return {pos_.data() + pos_base(hi), std::size_t(row_cap_), cfg_.num_kv_heads};
  }
  StridedSpan<const std::int32_t> pos(std::size_t hi) const noexcept {
    return {pos_.data() + pos_base(hi), std::size_t(row_cap_), cfg_.num_kv_heads};
  }
  bool bit(std::size_t hi, std::int32_t r) const noexcept {
    return (bits_[hi * std::size_t(words_) + std::size_t(r >> 6)] >> (r & 63)) & 1u;
  }
  void set_bit(std::size_t hi, std::int32_t r, bool v) noexcept {
    auto& w = bits_[hi * std::size_t(words_) + std::size_t(r >> 6)];
    w = (w & ~(std::uint64_t{1} << (r & 63))) | (std::uint64_t{v} << (r & 63));
  }
  // Row tokens of a head: the ring's extent (all W slots once it has cycled) plus global.
  std::int32_t row_tokens(const Head& h) const noexcept { return h.global > 0 || h.len == w_ ? w_ + h.global : h.len; }
  // Marks logical block b of the head being planned or written (once).
  void mark(std::int32_t b) noexcept;
  // Marks the blocks (below `blocks`) whose ring slots n tokens written from state h
  // rewrite, and the row's partial tail block when the row grows into it.
  void mark_rewritten(const Head& h, std::int64_t n, bool tail_grows, std::int32_t blocks) noexcept;
  // Shared blocks among those marked in touched_ (logical indices below `have`), clearing the marks.
  std::int32_t count_shared(const BlockPool& pool, std::span<const BlockId> row) noexcept;
  // Copies every shared block marked in touched_ (clearing the marks); planned, so it cannot fail.
  void privatize_marked(PageTable& table, BlockPool& pool, SeqId head, std::span<BlockCopy> copies, std::int32_t& n);
  // Replays n tokens of one head with their gates on `row` (grown already):
  // positions, bits, promotions; records slots, moves and promote into *out when given.
  void apply_head(std::size_t hi, std::int32_t h, std::int64_t n, std::span<const float> gates,
                  std::span<const BlockId> row, std::int64_t first, GateWriteInfo& info, const GateWriteSpans* out) noexcept;
  // Whether one more token grows the head's row: the ring is filling, or its
  // oldest token leaves admitted for a global region under the cap.
  bool grows_by_one(std::size_t hi) const noexcept {
    const Head& h = heads_[hi];
    return h.len < w_ || (bit(hi, h.start) && h.global < cap_);
  }
  // Grows a head's row by `grow` tokens (reserve copies a shared tail) and, after a fork, copies the
  // ring blocks n tokens written from state `ring` rewrite. Planned by the caller: cannot fail.
  void grow_row(PageTable& table, BlockPool& pool, std::uint32_t seq, std::size_t hi, std::int32_t grow, const Head& ring,
                std::int64_t n, std::span<BlockCopy> copies, GateWriteInfo& info) noexcept;
  // The head's ring after its (s, layer)'s pending deferred writes; `leaving` counts tokens that leave it.
  Head after_pending(std::size_t hi, std::uint32_t seq, std::int32_t layer, std::int64_t& leaving) const noexcept;
  // The ring after n more tokens (gates play no part); `leaving` counts the tokens that leave it.
  Head advanced(Head h, std::int64_t n, std::int64_t& leaving) const noexcept;
  // Tokens a head's row holds: its real ones, or with pending writes (and `more` tokens) their allotment.
  std::int32_t allotted_row_tokens(std::size_t hi, std::uint32_t seq, std::int32_t layer, std::int64_t more = 0) const noexcept;
  std::int32_t* queue(std::uint32_t seq, std::int32_t layer) noexcept {
    return pending_.data() + (std::size_t(seq) * std::size_t(cfg_.num_layers) + std::size_t(layer)) * max_pending;
  }
  const std::int32_t* queue(std::uint32_t seq, std::int32_t layer) const noexcept {
    return pending_.data() + (std::size_t(seq) * std::size_t(cfg_.num_layers) + std::size_t(layer)) * max_pending;
  }
  std::uint8_t& npending(std::uint32_t seq, std::int32_t layer) noexcept {
    return npending_[std::size_t(seq) * std::size_t(cfg_.num_layers) + std::size_t(layer)];
  }
  std::uint8_t npending(std::uint32_t seq, std::int32_t layer) const noexcept {
    return npending_[std::size_t(seq) * std::size_t(cfg_.num_layers) + std::size_t(layer)];
  }
  bool any_pending(std::uint32_t seq) const noexcept {
    for (std::int32_t l = 0; l < cfg_.num_layers; ++l)
      if (npending(seq, l) > 0) return true;
    return false;
  }
  // A head's state after rolling back n tokens; src_[r]: the row index ring slot r's content comes from.
  Head rolled_back(const Head& h, std::int32_t n) noexcept;

  WriteGateConfig cfg_;
  std::int32_t w_ = 0, b_ = 0, cap_ = 0, row_cap_ = 0, words_ = 0, max_seqs_ = 0;
  BlockMath bm_, wm_;                  // division by the block size and by W (shifts when powers of two)
  std::vector<Head> heads_;
  std::vector<std::int32_t> pos_;      // [layer][seq][row slot][kv_head]: position of each row token
  std::vector<std::uint64_t> bits_;    // [head][words]: admission bit per ring slot
  std::vector<SeqId> ids_;             // [head]: its stream in the table
  std::vector<std::int64_t> appended_; // [seq][layer]: positions written
  std::vector<std::uint32_t> gen_;     // [seq]: generation, for stale handles
  std::vector<std::int32_t> free_;     // free sequence indices (a stack)
  std::vector<std::uint8_t> live_;     // [seq]
  std::vector<std::uint8_t> forked_;   // [seq]: forked, or a fork: its blocks may be shared (copy-on-write checks)
  std::vector<std::int32_t> pending_;  // [seq][layer][max_pending]: allotted writes' token counts, oldest first
  std::vector<std::uint8_t> npending_; // [seq][layer]
  std::vector<Head> plan_;             // [kv_head]: a write's planned end state
  std::vector<std::int32_t> reserved_; // slots a row growth returns (unused: rows are read back)
  std::vector<std::int32_t> src_;      // [W]: rollback, where each ring slot's content comes from
  std::vector<std::uint8_t> touched_;  // [row blocks]: blocks a call rewrites in place (copy-on-write marks)
  std::vector<std::int32_t> marked_;   // the marked blocks, so a decode step visits one or two, not the row
  std::vector<std::uint32_t> stamp_;   // [seq]: write_batch's duplicate check (scratch)
  std::uint32_t epoch_ = 0;            // the stamp of the current write_batch call
};

KVCACHE_END_NAMESPACE

#include "kvcache/admission/write_gate_impl.hpp"
#include "kvcache/admission/write_gate_batch.hpp"
#include "kvcache/admission/write_gate_deferred.hpp"
#include "kvcache/admission/write_gate_evict.hpp"
