// WriteGate's definitions (declared in write_gate.hpp, which includes this
// file at its end): the per-head ring and global region, writes, rollback.
#pragma once

#include "kvcache/admission/write_gate.hpp"

KVCACHE_BEGIN_NAMESPACE

inline WriteGate::WriteGate(const WriteGateConfig& cfg, std::int32_t max_sequences, PageTable& table)
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

inline Status WriteGate::validate(SeqId s) const noexcept {
  if (s.index >= std::uint32_t(max_seqs_) || !live_[s.index] || gen_[s.index] != s.generation)
    return Status{Errc::unknown_sequence, "seq", s.index == UINT32_MAX ? -1 : std::int64_t(s.index), max_seqs_};
  return {};
}

inline Result<SeqId> WriteGate::add(PageTable&) noexcept {
  if (free_.empty()) return Status{Errc::capacity_exceeded, "max_sequences", max_seqs_ + std::int64_t{1}, max_seqs_};
  const auto i = std::uint32_t(free_.back());
  free_.pop_back();
  for (std::int32_t l = 0; l < cfg_.num_layers; ++l)
    for (std::int32_t h = 0; h < cfg_.num_kv_heads; ++h) heads_[head_index(i, l, h)] = Head{};  // rows are empty
  live_[i] = 1;
  forked_[i] = 0;
  std::fill_n(appended_.begin() + std::ptrdiff_t(i) * cfg_.num_layers, cfg_.num_layers, 0);
  return SeqId{i, gen_[i]};
}

inline Result<SeqId> WriteGate::fork(PageTable& table, BlockPool& pool, SeqId s) noexcept {
  if (auto st = validate(s); !st) return st;
  if (any_pending(s.index)) return Status{Errc::invalid_argument, "pending_writes (reconcile first)", 1, 0};
  if (free_.empty()) return Status{Errc::capacity_exceeded, "max_sequences", max_seqs_ + std::int64_t{1}, max_seqs_};
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

inline void WriteGate::mark(std::int32_t b) noexcept {
  if (touched_[std::size_t(b)]) return;
  touched_[std::size_t(b)] = 1;
  marked_.push_back(b);  // reserved to the row length: never allocates
}

inline void WriteGate::mark_rewritten(const Head& h, std::int64_t n, bool tail_grows, std::int32_t blocks) noexcept {
  const std::int32_t first = h.len < w_ ? h.len : h.start;  // the next ring slot written (a partial ring starts at 0)
  const auto count = std::int32_t(std::min<std::int64_t>(n, w_));
  for (std::int32_t k = 0; k < count;) {
    const std::int32_t r = (first + k) % w_, b = r / b_;
    if (b < blocks) mark(b);
    k += b_ - r % b_;  // on to the next block (W is a multiple of B: wrapping starts one)
  }
  if (const std::int32_t rt = row_tokens(h); tail_grows && rt % b_ != 0 && (rt - 1) / b_ < blocks) mark((rt - 1) / b_);
}

inline std::int32_t WriteGate::count_shared(const BlockPool& pool, std::span<const BlockId> row) noexcept {
  std::int32_t shared = 0;
  for (const std::int32_t b : marked_) {
    shared += std::size_t(b) < row.size() && pool.ref_count(row[std::size_t(b)]) > 1 ? 1 : 0;
    touched_[std::size_t(b)] = 0;
  }
  marked_.clear();
  return shared;
}

inline void WriteGate::privatize_marked(PageTable& table, BlockPool& pool, SeqId head, std::span<BlockCopy> copies,
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

inline Status WriteGate::free(PageTable& table, BlockPool& pool, SeqId s) noexcept {
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

inline void WriteGate::grow_row(PageTable& table, BlockPool& pool, std::uint32_t seq, std::size_t hi, std::int32_t grow,
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

inline void WriteGate::apply_head(std::size_t hi, std::int32_t h, std::int64_t n, std::span<const float> gates,
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

inline Result<GateWriteInfo> WriteGate::write(PageTable& table, BlockPool& pool, SeqId s, std::int32_t layer,
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

inline WriteGate::Head WriteGate::rolled_back(const Head& h, std::int32_t n) noexcept {
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

inline Result<GateWriteInfo> WriteGate::truncate(PageTable& table, BlockPool& pool, SeqId s, std::int32_t n,
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

inline Result<SeqId> WriteGate::head(SeqId s, std::int32_t layer, std::int32_t kv_head) const noexcept {
  if (auto st = validate(s); !st) return st;
  if (layer < 0 || layer >= cfg_.num_layers) return Status{Errc::invalid_argument, "layer", layer, cfg_.num_layers};
  if (kv_head < 0 || kv_head >= cfg_.num_kv_heads) return Status{Errc::invalid_argument, "kv_head", kv_head, cfg_.num_kv_heads};
  return ids_[head_index(s.index, layer, kv_head)];
}

inline Result<StridedSpan<const std::int32_t>> WriteGate::positions(SeqId s, std::int32_t layer,
                                                                  std::int32_t kv_head) const noexcept {
  auto id = head(s, layer, kv_head);
  if (!id) return id.status();
  const std::size_t hi = head_index(s.index, layer, kv_head);
  return pos(hi).first(std::size_t(row_tokens(heads_[hi])));
}

inline Result<WriteGate::HeadState> WriteGate::head_state(SeqId s, std::int32_t layer, std::int32_t kv_head) const noexcept {
  auto id = head(s, layer, kv_head);
  if (!id) return id.status();
  const Head& h = heads_[head_index(s.index, layer, kv_head)];
  return HeadState{h.len, h.global, h.start};
}

inline Result<std::int64_t> WriteGate::appended(SeqId s, std::int32_t layer) const noexcept {
  if (auto st = validate(s); !st) return st;
  if (layer < 0 || layer >= cfg_.num_layers) return Status{Errc::invalid_argument, "layer", layer, cfg_.num_layers};
  return appended_[std::size_t(s.index) * std::size_t(cfg_.num_layers) + std::size_t(layer)];
}

inline Result<std::int64_t> WriteGate::tokens_held(const PageTable& table, SeqId s) const noexcept {
  if (auto st = validate(s); !st) return st;
  std::int64_t total = 0;
  for (std::int32_t l = 0; l < cfg_.num_layers; ++l)
    for (std::int32_t h = 0; h < cfg_.num_kv_heads; ++h) total += table.tokens_unchecked(ids_[head_index(s.index, l, h)]);
  return total;
}

inline std::int64_t WriteGate::max_blocks_held(std::int64_t tokens) const noexcept {
  if (tokens <= 0) return 0;
  const std::int64_t ring = std::min<std::int64_t>(tokens, w_), global = std::min<std::int64_t>(cap_, tokens - ring);
  return std::int64_t{cfg_.num_layers} * cfg_.num_kv_heads * blocks_for_tokens(ring + global, b_);
}

inline Status WriteGate::check(const PageTable& table) const {
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

KVCACHE_END_NAMESPACE
