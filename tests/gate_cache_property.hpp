// The composed cache under Write-Gated KV as a property: used by
// test_cache_write_gate (small) and test_property (large).
#pragma once

#include <kvcache/admission/write_gate.hpp>
#include <kvcache/cache.hpp>

#include <algorithm>
#include <random>
#include <vector>

#include "write_gate_testing.hpp"

namespace gate_testing {
using GateCache = GatedCache<WriteGate>;

inline std::vector<std::int32_t> ints(std::int64_t n) { return std::vector<std::int32_t>(static_cast<std::size_t>(n)); }

inline Geometry single_head(std::int32_t block) {
  return *Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = kDim, .block_size = block, .dtype = DType::f32});
}

struct Live {
  SeqId id;
  std::vector<RefHead> ref;       // [layer * H + head]
  std::vector<std::int32_t> tag;  // [position]: key_of tag of its K/V
  std::int32_t own = 0;
};

// Every export of every live sequence against the reference.
inline void require_exports(const GateCache& c, const KvMemory& mem, const std::vector<Live>& live, std::int32_t L,
                     std::int32_t H, std::int32_t row_blocks) {
  std::vector<SeqId> seqs;
  for (const Live& x : live) seqs.push_back(x.id);
  const auto S = std::int32_t(seqs.size()), rows = L * S * H, B = c.block_size();
  auto indptr = ints(rows + 1), indices = ints(rows * row_blocks), last = ints(rows);
  REQUIRE(c.export_heads_csr(seqs, -1, indptr, indices, last).ok());
  auto cptr = ints(rows + 1), cols = ints(rows * row_blocks * B), lens = ints(rows);
  REQUIRE(c.export_head_columns(seqs, -1, cptr, cols).ok());
  REQUIRE(c.export_heads_lengths(seqs, -1, lens).ok());
  for (std::int32_t l = 0; l < L; ++l) {
    // One layer's export is the all-layer export's slice l.
    const auto per = std::size_t(S * H);
    auto lp = ints(std::int64_t(per) + 1), li = ints(std::int64_t(per) * row_blocks), ll = ints(std::int64_t(per)),
         table = ints(std::int64_t(per) * row_blocks);
    REQUIRE(c.export_heads_csr(seqs, l, lp, li, ll).ok());
    REQUIRE(c.export_heads_block_table(seqs, l, table, row_blocks).ok());
    for (std::size_t r = 0; r < per; ++r) {
      const std::size_t g = std::size_t(l) * per + r;
      REQUIRE(lp[r + 1] - lp[r] == indptr[g + 1] - indptr[g]);
      REQUIRE(ll[r] == last[g]);
      for (std::int32_t k = 0; k < row_blocks; ++k) {
        const std::int32_t want = k < lp[r + 1] - lp[r] ? indices[std::size_t(indptr[g] + k)] : BlockPool::null_block;
        if (k < lp[r + 1] - lp[r]) REQUIRE(li[std::size_t(lp[r] + k)] == want);
        REQUIRE(table[r * std::size_t(row_blocks) + std::size_t(k)] == want);
      }
    }
    for (std::int32_t k = 0; k < S; ++k)
      for (std::int32_t h = 0; h < H; ++h) {
        const std::size_t r = std::size_t((l * S + k) * H + h);
        const Live& x = live[std::size_t(k)];
        const auto want = x.ref[std::size_t(l * H + h)].row();
        const std::int32_t pages = indptr[r + 1] - indptr[r];
        REQUIRE((pages == 0 ? 0 : (pages - 1) * B + last[r]) == std::int32_t(want.size()));
        REQUIRE(lens[r] == std::int32_t(want.size()));
        REQUIRE(std::vector<std::int32_t>(cols.begin() + cptr[r], cols.begin() + cptr[r + 1]) == want);
        REQUIRE(c.tokens_held(x.id, l, h).value() == std::int64_t(want.size()));
        for (std::size_t j = 0; j < want.size(); ++j) {
          const std::int32_t slot = indices[std::size_t(indptr[r]) + j / std::size_t(B)] * B + std::int32_t(j % std::size_t(B));
          INFO("layer " << l << " seq " << k << " head " << h << " row index " << j << " position " << want[j]);
          REQUIRE(mem.k_at(slot) == key_of(x.tag[std::size_t(want[j])], l, h, want[j]));
          REQUIRE(mem.v_at(slot) == -key_of(x.tag[std::size_t(want[j])], l, h, want[j]));
        }
      }
  }
}
// Random writes (prefill chunks, decode), rollbacks, forks and frees through
// Cache<..., WriteGate> against the per-head reference; after every step the
// K/V read back through each head-folded export are the reference's, slot for
// slot, and accounting matches. `trials` configurations of `steps` operations.
inline void gate_cache_property(std::mt19937_64& rng, int trials, int steps) {
  std::int32_t forks = 0, copies_run = 0, batches = 0;
  for (int trial = 0; trial < trials; ++trial) {
    const std::int32_t block = trial % 2 ? 4 : 2, w = block * (1 + std::int32_t(rng() % 3));
    WriteGateConfig gcfg{.num_layers = 1 + std::int32_t(rng() % 2), .num_kv_heads = 1 + std::int32_t(rng() % 3),
                         .local_window = w, .tau = 0.5f, .at_cap = GlobalCapAction::drop};
    gcfg.global_cap = trial % 3 == 0 ? 2 + std::int32_t(rng() % 6) : 0;
    const std::int32_t L = gcfg.num_layers, H = gcfg.num_kv_heads, row_blocks = w / block + 5;
    const std::int32_t num_blocks = 4 * L * H * row_blocks + 1;
    GateCache cache({.geometry = single_head(block), .num_blocks = num_blocks, .max_sequences = 2,
                     .max_blocks_per_sequence = row_blocks},
                    gcfg);
    const std::int32_t cap = cache.admission().global_cap();
    KvMemory mem(block, num_blocks, H);
    CAPTURE(trial, block, w, L, H, cap);
    std::vector<Live> live;
    std::int32_t next_tag = 0;
    for (int step = 0; step < steps; ++step) {
      if (live.empty()) live.push_back(Live{*cache.add_sequence(), std::vector<RefHead>(std::size_t(L * H), RefHead(w)), {}, next_tag++});
      Live& q = live[rng() % live.size()];
      const auto appended = std::int32_t(q.tag.size());
      const int kind = int(rng() % 10);
      std::vector<BlockCopy> copies(std::size_t(L * H * row_blocks));
      if (kind == 0 && appended > 0) {
        const std::int32_t n = 1 + std::int32_t(rng() % std::uint64_t(std::min(appended, w)));
        std::int32_t limit = appended;
        for (const auto& h : q.ref) limit = std::min(limit, h.rollback_limit(appended));
        std::vector<SlotMove> moves(std::size_t(L * H * w));
        const GateCache before = cache;
        auto r = cache.truncate(q.id, n, {.moves = moves, .copies = copies});
        if (n > limit) {
          REQUIRE(r.status().code() == Errc::truncate_too_many);
          REQUIRE(cache == before);
          continue;
        }
        REQUIRE(r.ok());
        for (auto& h : q.ref) h.truncate(n);
        q.tag.resize(std::size_t(appended - n));
        copies_run += r->copies;
        mem.copy_blocks(std::span<const BlockCopy>(copies.data(), std::size_t(r->copies)));
        mem.move(std::span<const SlotMove>(moves.data(), std::size_t(r->moves)));
      } else if (kind == 1 && live.size() < 2) {
        auto child = cache.fork(q.id);
        REQUIRE(child.ok());
        ++forks;
        live.push_back(Live{*child, q.ref, q.tag, next_tag++});
      } else if (kind == 2 && live.size() > 1) {
        const std::size_t k = rng() % live.size();
        REQUIRE(cache.free(live[k].id).ok());
        REQUIRE(cache.tokens_held(live[k].id).status().code() == Errc::unknown_sequence);
        live.erase(live.begin() + std::ptrdiff_t(k));
      } else if (kind == 5) {  // a decode step of every live sequence, in a random order, one write_batch per layer
        std::vector<std::size_t> order(live.size());
        for (std::size_t k = 0; k < order.size(); ++k) order[k] = k;
        std::shuffle(order.begin(), order.end(), rng);
        const auto S = std::int32_t(order.size());
        std::vector<SeqId> seqs;
        for (const std::size_t k : order) seqs.push_back(live[k].id);
        for (std::int32_t l = 0; l < L; ++l) {
          std::vector<float> gates(std::size_t(S * H));
          for (auto& g : gates) g = float(rng() % 1000) / 1000.0f;
          std::vector<std::int32_t> slots(gates.size()), promote;
          if (rng() % 2) promote.assign(gates.size(), -7);
          std::vector<SlotMove> moves(std::size_t(S * H));
          // The same step through write(), one sequence after another, on a copy: the same state and commands.
          GateCache twin = cache;
          std::vector<std::int32_t> twin_slots(gates.size()), twin_promote(promote.size());
          std::vector<SlotMove> twin_moves(moves.size());
          std::vector<BlockCopy> twin_copies(copies.size());
          std::int32_t twin_nmoves = 0, twin_ncopies = 0;
          for (std::int32_t k = 0; k < S; ++k) {
            const auto at = std::size_t(k * H), h = std::size_t(H);
            auto one = twin.write(seqs[std::size_t(k)], l, std::span<const float>(gates).subspan(at, h),
                                  {.slots = std::span(twin_slots).subspan(at, h),
                                   .moves = std::span(twin_moves).subspan(std::size_t(twin_nmoves)),
                                   .promote = promote.empty() ? std::span<std::int32_t>{} : std::span(twin_promote).subspan(at, h),
                                   .copies = std::span(twin_copies).subspan(std::size_t(twin_ncopies))});
            REQUIRE(one.ok());
            twin_nmoves += one->moves;
            twin_ncopies += one->copies;
          }
          auto info = cache.write_batch(seqs, l, gates, {.slots = slots, .moves = moves, .promote = promote, .copies = copies});
          REQUIRE(info.ok());
          REQUIRE(cache == twin);
          REQUIRE(slots == twin_slots);
          REQUIRE(promote == twin_promote);
          REQUIRE(info->moves == twin_nmoves);
          REQUIRE(info->copies == twin_ncopies);
          REQUIRE(std::equal(moves.begin(), moves.begin() + info->moves, twin_moves.begin()));
          for (std::int32_t k = 0; k < S; ++k) {
            Live& x = live[order[std::size_t(k)]];
            std::int32_t at_cap = 0;
            for (std::int32_t h = 0; h < H; ++h)
              REQUIRE(x.ref[std::size_t(l * H + h)].write(std::int32_t(x.tag.size()), gates[std::size_t(k * H + h)] >= 0.5f, cap,
                                                          false, at_cap));
          }
          // The engine's order for the whole batch: copies, moves (or ring_write's promotions), then the tokens.
          copies_run += info->copies;
          mem.copy_blocks(std::span<const BlockCopy>(copies.data(), std::size_t(info->copies)));
          if (promote.empty()) mem.move(std::span<const SlotMove>(moves.data(), std::size_t(info->moves)));
          for (std::int32_t k = 0; k < S; ++k) {
            const Live& x = live[order[std::size_t(k)]];
            const auto at = std::size_t(k * H), h = std::size_t(H);
            mem.run({}, std::span<const std::int32_t>(slots).subspan(at, h),
                    promote.empty() ? std::span<const std::int32_t>{} : std::span<const std::int32_t>(promote).subspan(at, h), x.own,
                    l, std::int64_t(x.tag.size()), 1);
          }
        }
        for (Live& x : live) x.tag.push_back(x.own);
        batches += live.size() > 1 ? 1 : 0;
      } else {
        const std::int32_t n = kind == 3 ? 1 + std::int32_t(rng() % std::uint64_t(3 * w)) : (kind == 4 ? 1 + std::int32_t(rng() % std::uint64_t(w)) : 1);
        for (std::int32_t l = 0; l < L; ++l) {
          std::vector<float> gates(std::size_t(n * H));
          for (auto& g : gates) g = float(rng() % 1000) / 1000.0f;
          std::vector<std::int32_t> slots(gates.size()), promote;
          if (n <= w && rng() % 2) promote.assign(gates.size(), -7);
          std::vector<SlotMove> moves(std::size_t(n * H + H * w));
          auto info = cache.write(q.id, l, gates, {.slots = slots, .moves = moves, .promote = promote, .copies = copies});
          REQUIRE(info.ok());
          std::int32_t at_cap = 0;
          for (std::int32_t t = 0; t < n; ++t)
            for (std::int32_t h = 0; h < H; ++h)
              REQUIRE(q.ref[std::size_t(l * H + h)].write(appended + t, gates[std::size_t(t * H + h)] >= 0.5f, cap, false, at_cap));
          copies_run += info->copies;
          mem.copy_blocks(std::span<const BlockCopy>(copies.data(), std::size_t(info->copies)));
          mem.run(std::span<const SlotMove>(moves.data(), std::size_t(info->moves)), slots, promote, q.own, l, appended, n);
        }
        q.tag.resize(std::size_t(appended + n), q.own);
      }
      REQUIRE(cache.check_invariants().ok());
      std::int64_t blocks = 0;
      for (const Live& x : live) {
        std::int64_t held = 0;
        for (const auto& h : x.ref) held += std::int64_t(h.row().size());
        REQUIRE(cache.tokens_held(x.id).value() == held);
        REQUIRE(cache.blocks_held(x.id).value() <= cache.blocks_needed(std::int64_t(x.tag.size()), 0).value());
        blocks += *cache.blocks_held(x.id);
      }
      REQUIRE(num_blocks - 1 - cache.free_blocks() <= blocks);  // shared blocks count once in the pool
      require_exports(cache, mem, live, L, H, row_blocks);
    }
  }
  REQUIRE(forks > 0);
  REQUIRE(copies_run > 0);
  REQUIRE(batches > 0);  // write_batch ran over more than one sequence
}
}  // namespace gate_testing
