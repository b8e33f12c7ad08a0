// Write-Gated KV's per-head state (admission/write_gate.hpp has the
// policy as a whole): every (sequence, layer, kv-head) is its own stream of
// a PageTable over single-head blocks, holding a ring of its last W tokens
// and a global region of admitted ones. This class owns the streams, their
// rings, positions and admission bits, the sequence handles, the queue of
// deferred writes per (sequence, layer), and the ring arithmetic; writes
// (gate_writes.hpp, gate_batch.hpp), deferred writes (gate_deferred.hpp) and
// the global region's eviction (write_gate.hpp) build on it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/admission/write_gate_config.hpp"
#include "kvcache/core/block_math.hpp"
#include "kvcache/pool/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/table/head_rows.hpp"
#include "kvcache/table/page_table.hpp"
#include "kvcache/table/page_table_edits.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/core/slot_move.hpp"
#include "kvcache/status.hpp"
#include "kvcache/core/strided_span.hpp"

KVCACHE_BEGIN_NAMESPACE

class GateWrites;
class GateBatch;
class GateDeferred;
class WriteGate;

/// The per-head state of Write-Gated KV: streams, rings, positions, handles (the base of WriteGate).
class GateHeads {
  friend class GateWrites;
  friend class GateBatch;
  friend class GateDeferred;
  friend class WriteGate;

 public:
  /// Binds the configuration to a table and takes all of its streams: `table`
  /// must be unused and hold max_sequences x layers x kv-heads streams
  /// (streams_for) of single-head blocks. Stream (layer, seq, head) of the
  /// table is row (layer x max_sequences + seq) x kv_heads + head, so one
  /// layer's head rows lie together (a decode step and a layer's export walk
  /// them in order). Throws ConfigError for bad values.
  GateHeads(const WriteGateConfig& cfg, std::int32_t max_sequences, PageTable& table);

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

  /// Allotted writes of one (sequence, layer) not reconciled yet, at most.
  static constexpr std::int32_t max_pending = 8;
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
  friend bool operator==(const GateHeads& a, const GateHeads& b) {
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

inline GateHeads::GateHeads(const WriteGateConfig& cfg, std::int32_t max_sequences, PageTable& table)
    : cfg_(cfg), w_(cfg.local_window), b_(table.block_size()), max_seqs_(max_sequences),
      bm_(BlockMath::of(table.block_size())), wm_(BlockMath::of(std::max(1, cfg.local_window))) {
  auto bad = [](const char* what, std::int64_t v, std::int64_t limit) {
    throw ConfigError("kvcache::WriteGate", Status{Errc::invalid_argument, what, v, limit});
  };
  if (cfg.num_layers < 1) bad("num_layers", cfg.num_layers, 1);
  if (cfg.num_kv_heads < 1) bad("num_kv_heads", cfg.num_kv_heads, 1);
  if (max_sequences < 1) bad("max_sequences", max_sequences, 1);
  if (cfg.local_window < b_ || cfg.local_window % b_ != 0) bad("local_window (a multiple of the block size)", cfg.local_window, b_);
  if (!(cfg.tau >= 0.0f && cfg.tau <= 1.0f)) bad("tau (in [0, 1])", 0, 1);
  if (cfg.at_cap != GlobalCapAction::refuse && cfg.at_cap != GlobalCapAction::drop) bad("at_cap", std::int64_t(cfg.at_cap), 1);
  const std::int64_t streams = streams_for(cfg, max_sequences);
  if (streams > table.max_streams()) bad("table.max_streams (max_sequences x layers x kv_heads)", table.max_streams(), streams);
  if (table.num_streams() != 0) bad("table.num_streams (the table must be unused)", table.num_streams(), 0);
  row_cap_ = table.max_blocks_per_stream() * b_;
  if (row_cap_ < w_) bad("table.max_blocks_per_stream x block_size (< local_window)", row_cap_, w_);
  if (cfg.global_cap < 0 || cfg.global_cap > row_cap_ - w_) bad("global_cap", cfg.global_cap, row_cap_ - w_);
  cap_ = cfg.global_cap > 0 ? cfg.global_cap : row_cap_ - w_;
  words_ = (w_ + 63) / 64;
  const auto n = std::size_t(streams);
  heads_.resize(n);
  pos_.assign(n * std::size_t(row_cap_), -1);
  bits_.assign(n * std::size_t(words_), 0);
  ids_.resize(n);
  appended_.assign(std::size_t(max_sequences) * std::size_t(cfg.num_layers), 0);
  gen_.assign(std::size_t(max_sequences), 0);
  live_.assign(std::size_t(max_sequences), 0);
  forked_.assign(std::size_t(max_sequences), 0);
  stamp_.assign(std::size_t(max_sequences), 0);
  pending_.assign(std::size_t(max_sequences) * std::size_t(cfg.num_layers) * max_pending, 0);
  npending_.assign(std::size_t(max_sequences) * std::size_t(cfg.num_layers), 0);
  for (std::int32_t i = max_sequences; i-- > 0;) free_.push_back(i);
  plan_.resize(std::size_t(cfg.num_kv_heads));
  src_.resize(std::size_t(w_));
  touched_.assign(std::size_t(table.max_blocks_per_stream()), 0);
  marked_.reserve(std::size_t(table.max_blocks_per_stream()));
  // Every head stream for good, in head order: rows are then in head order
  // too, and a sequence's add and free touch no table handle.
  for (auto& id : ids_) id = *table.add();  // enough streams: checked above
}

inline Status GateHeads::validate(SeqId s) const noexcept {
  return check_handle(s, std::uint32_t(max_seqs_), [&](std::uint32_t i) {
    return HandleSlot{.in_use = live_[i] != 0, .sealed = false, .generation = gen_[i]};
  });
}

inline Result<SeqId> GateHeads::add(PageTable&) noexcept {
  if (free_.empty()) return no_free_handle(max_seqs_);
  const auto i = std::uint32_t(free_.back());
  free_.pop_back();
  for (std::int32_t l = 0; l < cfg_.num_layers; ++l)
    for (std::int32_t h = 0; h < cfg_.num_kv_heads; ++h) heads_[head_index(i, l, h)] = Head{};  // rows are empty
  live_[i] = 1;
  forked_[i] = 0;
  std::fill_n(appended_.begin() + std::ptrdiff_t(i) * cfg_.num_layers, cfg_.num_layers, 0);
  return SeqId{i, gen_[i]};
}

inline Result<SeqId> GateHeads::fork(PageTable& table, BlockPool& pool, SeqId s) noexcept {
  if (auto st = validate(s); !st) return st;
  if (any_pending(s.index)) return Status{Errc::invalid_argument, "pending_writes (reconcile first)", 1, 0};
  if (free_.empty()) return no_free_handle(max_seqs_);
  const auto c = std::uint32_t(free_.back());
  free_.pop_back();
  for (std::int32_t l = 0; l < cfg_.num_layers; ++l)
    for (std::int32_t h = 0; h < cfg_.num_kv_heads; ++h) {
      const std::size_t from = head_index(s.index, l, h), to = head_index(c, l, h);
      (void)share_into(table, pool, ids_[from], ids_[to]);  // a free sequence's rows are empty
      heads_[to] = heads_[from];
      std::copy_n(pos(from).begin(), row_cap_, pos(to).begin());
      std::copy_n(bits_.begin() + std::ptrdiff_t(from) * words_, words_, bits_.begin() + std::ptrdiff_t(to) * words_);
    }
  std::copy_n(appended_.begin() + std::ptrdiff_t(s.index) * cfg_.num_layers, cfg_.num_layers,
              appended_.begin() + std::ptrdiff_t(c) * cfg_.num_layers);
  live_[c] = 1;
  forked_[c] = forked_[s.index] = 1;  // both now share blocks
  return SeqId{c, gen_[c]};
}

inline Status GateHeads::free(PageTable& table, BlockPool& pool, SeqId s) noexcept {
  if (auto st = validate(s); !st) return st;
  for (std::int32_t l = 0; l < cfg_.num_layers; ++l)
    for (std::int32_t h = 0; h < cfg_.num_kv_heads; ++h) {
      const std::size_t hi = head_index(s.index, l, h);
      (void)table.truncate(pool, ids_[hi], table.tokens_unchecked(ids_[hi]));  // its blocks go back; the row stays the gate's
      heads_[hi] = Head{};
    }
  live_[s.index] = 0;
  for (std::int32_t l = 0; l < cfg_.num_layers; ++l) npending(s.index, l) = 0;  // allotted rows went back with the rest
  ++gen_[s.index];
  free_.push_back(std::int32_t(s.index));
  return {};
}

inline Result<SeqId> GateHeads::head(SeqId s, std::int32_t layer, std::int32_t kv_head) const noexcept {
  if (auto st = validate(s); !st) return st;
  if (layer < 0 || layer >= cfg_.num_layers) return Status{Errc::invalid_argument, "layer", layer, cfg_.num_layers};
  if (kv_head < 0 || kv_head >= cfg_.num_kv_heads) return Status{Errc::invalid_argument, "kv_head", kv_head, cfg_.num_kv_heads};
  return ids_[head_index(s.index, layer, kv_head)];
}

inline Result<StridedSpan<const std::int32_t>> GateHeads::positions(SeqId s, std::int32_t layer,
                                                                  std::int32_t kv_head) const noexcept {
  auto id = head(s, layer, kv_head);
  if (!id) return id.status();
  const std::size_t hi = head_index(s.index, layer, kv_head);
  return pos(hi).first(std::size_t(row_tokens(heads_[hi])));
}

inline Result<GateHeads::HeadState> GateHeads::head_state(SeqId s, std::int32_t layer, std::int32_t kv_head) const noexcept {
  auto id = head(s, layer, kv_head);
  if (!id) return id.status();
  const Head& h = heads_[head_index(s.index, layer, kv_head)];
  return HeadState{h.len, h.global, h.start};
}

inline Result<std::int64_t> GateHeads::appended(SeqId s, std::int32_t layer) const noexcept {
  if (auto st = validate(s); !st) return st;
  if (layer < 0 || layer >= cfg_.num_layers) return Status{Errc::invalid_argument, "layer", layer, cfg_.num_layers};
  return appended_[std::size_t(s.index) * std::size_t(cfg_.num_layers) + std::size_t(layer)];
}

inline Result<std::int64_t> GateHeads::tokens_held(const PageTable& table, SeqId s) const noexcept {
  if (auto st = validate(s); !st) return st;
  std::int64_t total = 0;
  for (std::int32_t l = 0; l < cfg_.num_layers; ++l)
    for (std::int32_t h = 0; h < cfg_.num_kv_heads; ++h) total += table.tokens_unchecked(ids_[head_index(s.index, l, h)]);
  return total;
}

inline std::int64_t GateHeads::max_blocks_held(std::int64_t tokens) const noexcept {
  if (tokens <= 0) return 0;
  const std::int64_t ring = std::min<std::int64_t>(tokens, w_), global = std::min<std::int64_t>(cap_, tokens - ring);
  return std::int64_t{cfg_.num_layers} * cfg_.num_kv_heads * blocks_for_tokens(ring + global, b_);
}

inline Status GateHeads::check(const PageTable& table) const {
  const std::size_t per_seq = std::size_t(cfg_.num_layers) * std::size_t(cfg_.num_kv_heads);
  std::vector<std::int32_t> seen;
  for (std::size_t hi = 0; hi < heads_.size(); ++hi)  // a free sequence's rows stay the gate's, empty
    if (!table.live(ids_[hi]) || (!live_[(hi / std::size_t(cfg_.num_kv_heads)) % std::size_t(max_seqs_)] &&
                                  table.tokens_unchecked(ids_[hi]) != 0))
      return Status{Errc::invariant_violated, "head_stream", std::int64_t(hi), 0};
  for (std::size_t q = 0; q < std::size_t(max_seqs_); ++q) {
    if (!live_[q]) continue;
    for (std::size_t k = 0; k < per_seq; ++k) {
      const std::size_t hi = head_index(std::uint32_t(q), std::int32_t(k / std::size_t(cfg_.num_kv_heads)),
                                        std::int32_t(k % std::size_t(cfg_.num_kv_heads)));
      const Head& h = heads_[hi];
      const std::int64_t appended = appended_[q * std::size_t(cfg_.num_layers) + k / std::size_t(cfg_.num_kv_heads)];
      if (h.len < 0 || h.len > w_ || h.start < 0 || h.start >= w_ || h.global < 0 || h.global > cap_)
        return Status{Errc::invariant_violated, "head_state", std::int64_t(hi), w_};
      if (h.len < w_ && (h.global != 0 || h.start != 0))  // a partial ring is the row's first slots
        return Status{Errc::invariant_violated, "partial_ring", std::int64_t(hi), h.global};
      const std::int32_t layer = std::int32_t(k / std::size_t(cfg_.num_kv_heads));
      if (table.tokens_unchecked(ids_[hi]) != allotted_row_tokens(hi, std::uint32_t(q), layer))
        return Status{Errc::invariant_violated, "row_tokens", table.tokens_unchecked(ids_[hi]),
                      allotted_row_tokens(hi, std::uint32_t(q), layer)};
      seen.assign(pos(hi).begin(), pos(hi).begin() + row_tokens(h));
      std::sort(seen.begin(), seen.end());
      if (!seen.empty() && (seen.front() < 0 || seen.back() >= appended))
        return Status{Errc::invariant_violated, "positions", std::int64_t(hi), appended};
      if (std::adjacent_find(seen.begin(), seen.end()) != seen.end())
        return Status{Errc::invariant_violated, "positions_distinct", std::int64_t(hi), 0};
    }
  }
  return {};
}

inline GateHeads::Head GateHeads::advanced(Head h, std::int64_t n, std::int64_t& leaving) const noexcept {
  const std::int64_t fill = std::min<std::int64_t>(n, w_ - h.len);
  h.len += std::int32_t(fill);
  n -= fill;
  leaving += n;  // the ring is full: every further token replaces one
  h.start = std::int32_t((h.start + n) % w_);
  return h;
}

inline GateHeads::Head GateHeads::after_pending(std::size_t hi, std::uint32_t seq, std::int32_t layer,
                                                std::int64_t& leaving) const noexcept {
  Head h = heads_[hi];
  for (std::int32_t k = 0; k < npending(seq, layer); ++k) h = advanced(h, queue(seq, layer)[k], leaving);
  return h;
}

inline std::int32_t GateHeads::allotted_row_tokens(std::size_t hi, std::uint32_t seq, std::int32_t layer,
                                                   std::int64_t more) const noexcept {
  std::int64_t leaving = 0;
  Head h = after_pending(hi, seq, layer, leaving);
  if (more > 0) h = advanced(h, more, leaving);
  h.global = std::int32_t(std::min<std::int64_t>(cap_, h.global + leaving));
  return row_tokens(h);
}

KVCACHE_END_NAMESPACE
