// Write-Gated KV's synchronous writes and rollback, on the per-head state
// (gate_heads.hpp): where each new token of a layer goes (its ring slot, a
// global slot, or nowhere), the promotion of the token it replaces, the
// copy-on-write of blocks a fork shares, and the rollback that refills the
// ring from the global region.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>

#include "kvcache/admission/gate_heads.hpp"
#include "kvcache/pool/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/table/head_rows.hpp"
#include "kvcache/table/page_table.hpp"
#include "kvcache/table/page_table_edits.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/core/slot_move.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Write-Gated KV's writes and rollback (a base of WriteGate).
class GateWrites : public GateHeads {
  friend class GateBatch;
  friend class GateDeferred;
  friend class WriteGate;

 public:
  using GateHeads::GateHeads;

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

 private:
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
  // A head's state after rolling back n tokens; src_[r]: the row index ring slot r's content comes from.
  Head rolled_back(const Head& h, std::int32_t n) noexcept;

};

inline void GateWrites::mark(std::int32_t b) noexcept {
  if (touched_[std::size_t(b)]) return;
  touched_[std::size_t(b)] = 1;
  marked_.push_back(b);  // reserved to the row length: never allocates
}

inline void GateWrites::mark_rewritten(const Head& h, std::int64_t n, bool tail_grows, std::int32_t blocks) noexcept {
  const std::int32_t first = h.len < w_ ? h.len : h.start;  // the next ring slot written (a partial ring starts at 0)
  const auto count = std::int32_t(std::min<std::int64_t>(n, w_));
  for (std::int32_t k = 0; k < count;) {
    const std::int32_t r = (first + k) % w_, b = r / b_;
    if (b < blocks) mark(b);
    k += b_ - r % b_;  // on to the next block (W is a multiple of B: wrapping starts one)
  }
  if (const std::int32_t rt = row_tokens(h); tail_grows && rt % b_ != 0 && (rt - 1) / b_ < blocks) mark((rt - 1) / b_);
}

inline std::int32_t GateWrites::count_shared(const BlockPool& pool, std::span<const BlockId> row) noexcept {
  std::int32_t shared = 0;
  for (const std::int32_t b : marked_) {
    shared += std::size_t(b) < row.size() && pool.ref_count(row[std::size_t(b)]) > 1 ? 1 : 0;
    touched_[std::size_t(b)] = 0;
  }
  marked_.clear();
  return shared;
}

inline void GateWrites::privatize_marked(PageTable& table, BlockPool& pool, SeqId head, std::span<BlockCopy> copies,
                                        std::int32_t& n) {
  const auto blocks = std::int32_t(table.blocks_unchecked(head).size());
  for (const std::int32_t b : marked_) {
    touched_[std::size_t(b)] = 0;
    if (b >= blocks) continue;
    const auto copy = privatize(table, pool, head, b);  // planned: the pool has the blocks
    if (copy.ok() && copy->src >= 0) copies[std::size_t(n++)] = *copy;
  }
  marked_.clear();
}

inline void GateWrites::grow_row(PageTable& table, BlockPool& pool, std::uint32_t seq, std::size_t hi, std::int32_t grow,
                                const Head& ring, std::int64_t n, std::span<BlockCopy> copies, GateWriteInfo& info) noexcept {
  if (grow > 0) {
    if (const std::int32_t off = bm_.mod(table.tokens_unchecked(ids_[hi])); !forked_[seq] && off != 0 && grow <= b_ - off) {
      (void)extend_tail(table, ids_[hi], grow);  // never forked: nobody else holds the tail (the common decode step)
    } else {  // reserve() copies a shared tail it appends to
      if (std::int64_t(reserved_.size()) < grow) reserved_.resize(std::size_t(grow));
      const auto r = table.reserve(pool, ids_[hi], grow, std::span<std::int32_t>(reserved_.data(), std::size_t(grow)));
      if (r.ok() && r->copy.src >= 0) copies[std::size_t(info.copies++)] = r->copy;  // planned: cannot fail
    }
  }
  if (forked_[seq]) {
    mark_rewritten(ring, n, false, std::int32_t(table.blocks_unchecked(ids_[hi]).size()));
    privatize_marked(table, pool, ids_[hi], copies, info.copies);
  }
}

inline void GateWrites::apply_head(std::size_t hi, std::int32_t h, std::int64_t n, std::span<const float> gates,
                                  std::span<const BlockId> row, std::int64_t first, GateWriteInfo& info,
                                  const GateWriteSpans* out) noexcept {
  const std::int32_t H = cfg_.num_kv_heads;
  Head& st = heads_[hi];
  const BlockMath bm = bm_, wm = wm_;
  auto phys = [&](std::int32_t x) { return row[std::size_t(bm.div(x))] * bm.size + bm.mod(x); };
  const auto p = pos(hi);
  std::int32_t old_left = st.len;
  for (std::int64_t t = 0; t < n; ++t) {
    const std::size_t at = std::size_t(t * H + h);
    std::int32_t r, promoted_to = -1;
    if (st.len < w_) {
      r = wm.mod(st.start + st.len);
      ++st.len;
    } else {
      r = st.start;
      st.start = wm.mod(st.start + 1);
      const bool old = old_left > 0;
      old_left -= old ? 1 : 0;
      std::int32_t dst = -1;
      if (bit(hi, r) && st.global < cap_) {
        dst = w_ + st.global++;
        p[dst] = p[r];
      } else {
        ++(bit(hi, r) ? info.dropped_at_cap : info.dropped);
      }
      if (old && dst >= 0) {
        if (out) out->moves[std::size_t(info.moves++)] = SlotMove{phys(r), phys(dst)};
        ++info.promoted;
        promoted_to = phys(dst);
      } else if (!old) {  // token t - W of this call leaves the ring before it was ever written there
        if (out) out->slots[std::size_t((t - w_) * H + h)] = dst >= 0 ? phys(dst) : -1;
        info.direct += dst >= 0 ? 1 : 0;
      }
    }
    p[r] = std::int32_t(first + t);
    set_bit(hi, r, gates[at] >= cfg_.tau);
    if (out) {
      out->slots[at] = phys(r);
      if (!out->promote.empty()) out->promote[at] = promoted_to;
    }
  }
}

inline Result<GateWriteInfo> GateWrites::write(PageTable& table, BlockPool& pool, SeqId s, std::int32_t layer,
                                              std::span<const float> gates, const GateWriteSpans& out) noexcept {
  if (auto st = validate(s); !st) return st;
  if (layer >= 0 && layer < cfg_.num_layers && npending(s.index, layer) > 0)
    return Status{Errc::invalid_argument, "pending_writes (reconcile first)", npending(s.index, layer), 0};
  const std::span<std::int32_t> slots = out.slots, promote = out.promote;
  const std::span<SlotMove> moves = out.moves;
  const std::int32_t H = cfg_.num_kv_heads;
  if (layer < 0 || layer >= cfg_.num_layers) return Status{Errc::invalid_argument, "layer", layer, cfg_.num_layers};
  if (gates.size() % std::size_t(H) != 0) return Status{Errc::invalid_argument, "gates.size", std::int64_t(gates.size()), H};
  const std::int64_t n = std::int64_t(gates.size()) / H;
  if (n > INT32_MAX / H) return Status{Errc::invalid_argument, "gates.size", std::int64_t(gates.size()), INT32_MAX};
  if (const std::int64_t bad = first_outside(gates, 0.0f, 1.0f); bad >= 0)
    return Status{Errc::invalid_argument, "gates_at", bad, 1};
  if (std::int64_t(slots.size()) < n * H) return Status{Errc::buffer_too_small, "slots", std::int64_t(slots.size()), n * H};
  if (!promote.empty()) {
    if (n > w_) return Status{Errc::invalid_argument, "promote (needs n <= local_window)", n, w_};
    if (std::int64_t(promote.size()) < n * H) return Status{Errc::buffer_too_small, "promote", std::int64_t(promote.size()), n * H};
  }
  // Plan: each head's state after the call (row growth), its moves, the cap,
  // copy-on-write of blocks a fork shares, the pool. Nothing changes.
  std::int64_t blocks = 0, nmoves = 0, ncopies = 0;
  for (std::int32_t h = 0; h < H; ++h) {
    const std::size_t hi = head_index(s.index, layer, h);
    Head st = heads_[hi];
    std::int32_t old_left = st.len;  // the first replacements take the tokens the ring held before the call
    for (std::int64_t t = 0; t < n; ++t) {
      if (st.len < w_) {
        ++st.len;
        continue;
      }
      const bool old = old_left > 0;
      const bool admitted = old ? bit(hi, st.start) : gates[std::size_t((t - w_) * H + h)] >= cfg_.tau;
      old_left -= old ? 1 : 0;
      st.start = (st.start + 1) % w_;
      if (!admitted) continue;
      if (st.global < cap_) {
        ++st.global;
        nmoves += old ? 1 : 0;
      } else if (cfg_.at_cap == GlobalCapAction::refuse) {
        return Status{Errc::capacity_exceeded, "global_cap", std::int64_t{st.global} + 1, cap_};
      }
    }
    plan_[std::size_t(h)] = st;
    const auto row = table.blocks_unchecked(ids_[hi]);
    blocks += std::max<std::int64_t>(0, blocks_for_tokens(row_tokens(st), b_) - std::int64_t(row.size()));
    if (forked_[s.index]) {  // only a fork shares a head's blocks
      mark_rewritten(heads_[hi], n, row_tokens(st) > row_tokens(heads_[hi]), std::int32_t(row.size()));
      ncopies += count_shared(pool, row);
    }
  }
  if (std::int64_t(moves.size()) < nmoves) return Status{Errc::buffer_too_small, "moves", std::int64_t(moves.size()), nmoves};
  if (std::int64_t(out.copies.size()) < ncopies)
    return Status{Errc::buffer_too_small, "copies", std::int64_t(out.copies.size()), ncopies};
  if (blocks + ncopies > pool.num_free()) return Status{Errc::out_of_blocks, "n_blocks", blocks + ncopies, pool.num_free()};

  // Apply: grow each row, then replay the plan writing slots, moves, positions and bits.
  GateWriteInfo info{};
  std::int64_t& appended = appended_[std::size_t(s.index) * std::size_t(cfg_.num_layers) + std::size_t(layer)];
  for (std::int32_t h = 0; h < H; ++h) {
    const std::size_t hi = head_index(s.index, layer, h);
    Head& st = heads_[hi];
    grow_row(table, pool, s.index, hi, row_tokens(plan_[std::size_t(h)]) - row_tokens(st), st, n, out.copies, info);
    apply_head(hi, h, n, gates, table.blocks_unchecked(ids_[hi]), appended, info, &out);
  }
  appended += n;
  return info;
}

inline GateHeads::Head GateWrites::rolled_back(const Head& h, std::int32_t n) noexcept {
  Head st = h;
  for (std::int32_t r = 0; r < w_; ++r) src_[std::size_t(r)] = r;
  const std::int32_t refill = st.len == w_ ? std::min(n, st.global) : 0;
  st.len -= n;
  for (std::int32_t j = 0; j < refill; ++j)  // the newest global token to the ring's oldest end
    src_[std::size_t(((st.start - 1 - j) % w_ + w_) % w_)] = w_ + st.global - 1 - j;
  st.start = ((st.start - refill) % w_ + w_) % w_;
  st.len += refill;
  st.global -= refill;
  if (st.len < w_ && st.start != 0) {  // re-pack into slots [0, len), lowest source to lowest hole
    auto in_range = [&](std::int32_t x) { return ((x - st.start) % w_ + w_) % w_ < st.len; };
    std::int32_t hole = 0;
    for (std::int32_t k = 0; k < st.len; ++k) {
      const std::int32_t r = (st.start + k) % w_;
      if (r < st.len) continue;
      while (in_range(hole)) ++hole;
      src_[std::size_t(hole++)] = src_[std::size_t(r)];
    }
    st.start = 0;
  }
  return st;
}

inline Result<GateWriteInfo> GateWrites::truncate(PageTable& table, BlockPool& pool, SeqId s, std::int32_t n,
                                                 const GateWriteSpans& out) noexcept {
  if (auto st = validate(s); !st) return st;
  if (any_pending(s.index)) return Status{Errc::invalid_argument, "pending_writes (reconcile first)", 1, 0};
  const std::int32_t L = cfg_.num_layers, H = cfg_.num_kv_heads;
  const auto at = [&](std::int32_t l) { return appended_[std::size_t(s.index) * std::size_t(L) + std::size_t(l)]; };
  for (std::int32_t l = 1; l < L; ++l)
    if (at(l) != at(0)) return Status{Errc::invalid_argument, "layers_appended (a step not written by every layer)", at(l), at(0)};
  if (n < 0) return Status{Errc::invalid_argument, "n_tokens", n, 0};
  // Plan: every head's limit (its ring's newest run of consecutive positions),
  // its moves and the shared ring blocks they write into.
  std::int64_t limit = at(0), nmoves = 0, ncopies = 0;
  for (std::int32_t l = 0; l < L; ++l)
    for (std::int32_t h = 0; h < H; ++h) {
      const std::size_t hi = head_index(s.index, l, h);
      const Head& st = heads_[hi];
      const auto p = pos(hi);
      std::int32_t run = 0;
      while (run < st.len && run < n && p[(st.start + st.len - 1 - run) % w_] == at(0) - 1 - run) ++run;
      if (run < n) limit = std::min<std::int64_t>(limit, run);
      if (n > limit) continue;
      const Head next = rolled_back(st, n);
      for (std::int32_t r = 0; r < std::min(next.len, w_); ++r)
        if (src_[std::size_t(r)] != r) {
          ++nmoves;
          if (forked_[s.index]) mark(r / b_);
        }
      ncopies += count_shared(pool, table.blocks_unchecked(ids_[hi]));
    }
  if (n > limit) return Status{Errc::truncate_too_many, "n_tokens", n, limit};
  if (std::int64_t(out.moves.size()) < nmoves)
    return Status{Errc::buffer_too_small, "moves", std::int64_t(out.moves.size()), nmoves};
  if (std::int64_t(out.copies.size()) < ncopies)
    return Status{Errc::buffer_too_small, "copies", std::int64_t(out.copies.size()), ncopies};
  if (ncopies > pool.num_free()) return Status{Errc::out_of_blocks, "n_blocks", ncopies, pool.num_free()};
  // Copies first, for every head: a block this call releases (a global tail
  // whose tokens moved into the ring) must not come back as a copy target
  // before the moves that read it have run.
  GateWriteInfo info{};
  for (std::int32_t k = 0; k < L * H; ++k) {
    const std::size_t hi = head_index(s.index, k / H, k % H);
    const Head next = rolled_back(heads_[hi], n);
    for (std::int32_t r = 0; r < std::min(next.len, w_); ++r)
      if (src_[std::size_t(r)] != r && forked_[s.index]) mark(r / b_);
    privatize_marked(table, pool, ids_[hi], out.copies, info.copies);
  }
  for (std::int32_t k = 0; k < L * H; ++k) {
    const std::size_t hi = head_index(s.index, k / H, k % H);
    Head& st = heads_[hi];
    const std::int32_t rt0 = row_tokens(st);
    st = rolled_back(st, n);
    const auto row = table.blocks_unchecked(ids_[hi]);
    auto phys = [&](std::int32_t x) { return row[std::size_t(x / b_)] * b_ + x % b_; };
    const auto p = pos(hi);
    for (std::int32_t r = 0; r < std::min(st.len, w_); ++r) {  // sources are never destinations: any order
      const std::int32_t from = src_[std::size_t(r)];
      if (from == r) continue;
      out.moves[std::size_t(info.moves++)] = SlotMove{phys(from), phys(r)};
      p[r] = p[from];
      set_bit(hi, r, from >= w_ || bit(hi, from));  // a global token was admitted
    }
    (void)table.truncate(pool, ids_[hi], rt0 - row_tokens(st));  // the row's tail: global tokens, ring slots past len
  }
  for (std::int32_t l = 0; l < L; ++l) appended_[std::size_t(s.index) * std::size_t(L) + std::size_t(l)] -= n;
  return info;
}

KVCACHE_END_NAMESPACE
