// fuzz_cache's run for the head-paged cache (Cache<..., WriteGate>): random
// writes with gates of any value, rollbacks, forks, frees, exports and
// accounting into buffers of any size. The pool is real memory: K of a slot
// holds the position of the token written there; copies, moves and tokens run
// through the host kernels in the order the cache hands them out. After every
// call each head row must read back exactly the positions WriteGate tracks,
// distinct and older than the next one, within ring + cap; a failed call must
// leave the cache and the memory exactly as they were. With Quest (Selection)
// the run keeps each page's key bounds as an engine does (page_bounds_update
// on what a write stores; stale pages recomputed after every call) and every
// live global key must lie within its page's bounds; with a token policy
// (Eviction) on the global regions it observes any scores and evicts.
#pragma once

#include <kvcache/admission/write_gate.hpp>
#include <kvcache/cache.hpp>
#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/page_bounds.hpp>
#include <kvcache/kernels/ring_admit.hpp>
#include <kvcache/selection/quest.hpp>

#include "checks.hpp"

#include <algorithm>
#include <deque>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace fuzz_gate {
namespace kv = kvcache;

template <class In, class Fail, class Selection = kv::SelectAll, class Eviction = kv::KeepAll>
struct GateRun {
  using C = kv::GatedCache<kv::WriteGate, Selection, Eviction>;
  static constexpr bool quest = C::selects;
  static constexpr std::int32_t B = 2, kBlocks = 48, kSeqs = 3, kRow = 8;
  kv::Geometry geo = *kv::Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = 1, .block_size = B, .dtype = kv::DType::f32});
  std::vector<float> bounds = std::vector<float>(quest ? std::size_t(kBlocks * 2) : 0);
  C cache;
  std::vector<float> mem = std::vector<float>(std::size_t(kBlocks * 2 * B), -1.0f);  // [block][K,V][token]
  kv::PoolView pool = *kv::make_pool_view(geo, mem.data(), kBlocks);
  std::vector<kv::SeqId> live;
  Fail fail;
  // The device side of deferred writes, per (sequence index, layer): global lengths, ring bits, gates to read back.
  struct DeviceHeads {
    std::vector<std::int32_t> gl;
    std::vector<std::uint8_t> bits;
    std::deque<std::vector<float>> pending;
    int mode = 0;  // 0: unwritten, 1: synchronous writes, 2: deferred (an engine uses one; the device state follows only its own)
  };
  std::vector<DeviceHeads> device = std::vector<DeviceHeads>(kSeqs * 2);
  DeviceHeads& dev(kv::SeqId s, std::int32_t l) { return device[std::size_t(s.index % kSeqs) * 2 + std::size_t(l & 1)]; }
  bool deferred(kv::SeqId s) { return dev(s, 0).mode == 2 || dev(s, 1).mode == 2; }

  GateRun(In& in, Fail f, Eviction e = Eviction{})
      : cache({.geometry = geo, .num_blocks = kBlocks, .max_sequences = kSeqs, .max_blocks_per_sequence = kRow},
              kv::WriteGateConfig{.num_layers = 1 + in.upto(1), .num_kv_heads = 1 + in.upto(1), .local_window = B * (1 + in.upto(2)),
                                  .tau = float(in.byte()) / 255.0f, .global_cap = in.upto(6),
                                  .at_cap = kv::GlobalCapAction(in.byte() % 2)},
              selection(in), std::move(e)),
        fail(f) {}
  typename kv::SelectionArg<Selection>::type selection(In& in) {
    if constexpr (quest) {
      const std::int32_t first = in.upto(1);
      return kv::QuestConfig{.token_budget = B * (1 + first + in.upto(3)), .first_pages = first, .last_pages = 1,
                             .dense_layers = in.upto(1), .query_group = 1 + in.upto(1), .bounds = bounds};
    } else {
      return {};
    }
  }
  // Quest: the keys a call stored enter their pages' bounds (as an engine runs page_bounds_update after it).
  void fold(std::span<const std::int32_t> slots) {
    if constexpr (quest)
      if (!slots.empty() && !kv::page_bounds_update_host({pool, 0, slots.data(), std::int64_t(slots.size()), bounds.data()}))
        fail("page_bounds_update");
  }
  void fold(std::span<const kv::SlotMove> moves) {
    std::vector<std::int32_t> dst;
    for (const auto& m : moves) dst.push_back(m.dst);
    fold(std::span<const std::int32_t>(dst));
  }

  // Quest: recompute the stale pages, then every live global key lies within its page's bounds.
  void check_bounds() {
    std::vector<std::int32_t> pages(static_cast<std::size_t>(kSeqs * 4 * kRow)), fill(pages.size());
    auto n = cache.stale_pages(live, {pages, fill});
    if (!n) fail("stale_pages", n.status().message());
    if (!kv::page_bounds_host({pool, 0, pages.data(), fill.data(), *n, bounds.data()})) fail("page_bounds");
    const std::int32_t W = cache.admission().local_window();
    for (const kv::SeqId s : live)
      for (std::int32_t l = 0; l < L(); ++l) {
        if (*cache.admission().pending(s, l) > 0) continue;  // the device is ahead: reconcile lists its pages
        for (std::int32_t h = 0; h < H(); ++h) {
          const kv::SeqId row = *cache.admission().head(s, l, h);
          const auto blocks = *cache.table().blocks(row);
          const std::int32_t used = *cache.table().tokens(row);
          for (std::int32_t j = W; j < used; ++j) {
            const std::int32_t page = blocks[std::size_t(j / B)];
            const float k = at(page * B + j % B);
            if (!(bounds[std::size_t(page * 2 + 1)] <= k && k <= bounds[std::size_t(page * 2)]))
              fail("a live global key outside its page's bounds", "page " + std::to_string(page));
          }
        }
      }
  }
  // Quest: select() with any queries and buffers; a result is each head row's pages, ring and last included.
  void select(In& in) {
    std::vector<kv::SeqId> seqs = live;
    if (in.byte() % 8 == 0) seqs.push_back(kv::SeqId{in.byte() % 4, in.byte()});
    const std::int32_t layer = in.upto(2) - 1, group = cache.selection().config().query_group;
    std::vector<float> q(std::size_t(std::max<std::int64_t>(0, std::int64_t(seqs.size()) * H() * group + in.upto(2) - 1)));
    for (auto& x : q) x = in.byte() % 32 == 0 ? in.score() : float(in.byte()) / 32.0f - 4.0f;
    std::vector<std::int32_t> indptr(std::size_t(in.upto(8))), indices(std::size_t(in.upto(48)));
    auto r = cache.select(seqs, layer, q, {indptr, indices});
    if (!r) return;
    const std::int32_t ring = cache.admission().local_window() / B;
    for (std::size_t k = 0; k < seqs.size(); ++k)
      for (std::int32_t h = 0; h < H(); ++h) {
        const auto blocks = *cache.table().blocks(*cache.admission().head(seqs[k], layer, h));
        const std::size_t row = k * std::size_t(H()) + std::size_t(h);
        const std::int32_t lo = indptr[row], hi = indptr[row + 1];
        for (std::int32_t j = 0; j < std::min<std::int32_t>(ring, std::int32_t(blocks.size())); ++j)
          if (hi - lo <= j || indices[std::size_t(lo + j)] != blocks[std::size_t(j)]) fail("select: a ring page left out");
        if (!blocks.empty() && (hi == lo || indices[std::size_t(hi - 1)] != blocks.back())) fail("select: the last page left out");
      }
  }

  float at(std::int32_t slot) const { return mem[std::size_t((slot / B) * 2 * B + slot % B)]; }
  std::int32_t L() const { return cache.admission().num_layers(); }
  std::int32_t H() const { return cache.admission().num_kv_heads(); }

  void check() {
    if (auto st = cache.check_invariants(); !st) fail("check_invariants", st.message());
    if constexpr (quest) check_bounds();
    const std::int32_t W = cache.admission().local_window(), cap = cache.admission().global_cap();
    for (const kv::SeqId s : live)
      for (std::int32_t l = 0; l < L(); ++l) {
        const kv::SeqId one[] = {s};
        auto ptr = std::vector<std::int32_t>(std::size_t(H() + 1)), idx = std::vector<std::int32_t>(std::size_t(H() * kRow)),
             last = std::vector<std::int32_t>(std::size_t(H()));
        if (!cache.export_heads_csr(one, l, ptr, idx, last)) fail("export_heads_csr");
        const std::int64_t appended = *cache.admission().appended(s, l);
        if (*cache.admission().pending(s, l) > 0) continue;  // the device is ahead: rows hold their allotment
        for (std::int32_t h = 0; h < H(); ++h) {
          const auto pos = *cache.admission().positions(s, l, h);
          if (std::int64_t(pos.size()) > W + cap) fail("a head holds more than ring + cap");
          std::vector<std::int32_t> sorted(pos.begin(), pos.end());
          std::sort(sorted.begin(), sorted.end());
          if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) fail("positions repeat");
          if (!sorted.empty() && (sorted.front() < 0 || sorted.back() >= appended)) fail("position out of range");
          for (std::size_t j = 0; j < pos.size(); ++j) {
            const std::int32_t slot = idx[std::size_t(ptr[std::size_t(h)]) + j / B] * B + std::int32_t(j % B);
            if (at(slot) != float(pos[j])) {
              std::string row;
              for (std::size_t x = 0; x < pos.size(); ++x) row += std::to_string(pos[x]) + "@" + std::to_string(idx[std::size_t(ptr[std::size_t(h)]) + x / B] * B + std::int32_t(x % B)) + " ";
              fail("memory differs from the tracked position", std::to_string(pos[j]) + " layer " + std::to_string(l) + " head " +
                   std::to_string(h) + " W " + std::to_string(W) + " row " + row + " memory " + std::to_string(at(slot)));
            }
          }
        }
      }
  }

  void step(In& in) {
    const auto before = cache;
    const auto mem_before = mem;
    kv::Status st{};
    const kv::SeqId s = live.empty() ? kv::SeqId{in.byte() % 4, 0} : live[in.byte() % live.size()];
    std::vector<kv::BlockCopy> copies(std::size_t(in.upto(12)));
    std::vector<kv::SlotMove> moves(std::size_t(in.upto(16)));
    const std::uint32_t op = in.byte() % 10;
    const bool trace = std::getenv("KVCACHE_FUZZ_TRACE") != nullptr;
    if (trace) std::fprintf(stderr, "gate op %u seq %u\n", op, s.index);
    if constexpr (C::evicts_global)
      if (op == 6) {  // scores of any shape for one layer, then the global regions' eviction and its moves
        if (live.empty() || deferred(s)) return check();
        const std::int32_t layer = in.upto(2) - (in.byte() % 16 == 0);
        std::int64_t want = 0;
        for (std::int32_t h = 0; h < H() && layer >= 0 && layer < L(); ++h)
          want += std::int64_t(cache.admission().positions(s, layer, h)->size());
        std::vector<float> sc(std::size_t(std::max<std::int64_t>(0, want + in.upto(2) - 1)));
        for (auto& x : sc) x = in.byte() % 32 == 0 ? in.score() : float(in.byte()) / 64.0f;
        st = cache.observe(s, layer, kv::ScoreKind(in.byte() % 3), sc);
        fuzz_checks::failed_call_changed_nothing(st, cache, before, mem, mem_before, fail);
        const auto before_evict = cache;
        auto r = cache.evict(s, moves);
        if (r && r->moves > 0 && !kv::compaction_host({pool, moves.data(), r->moves})) fail("compaction");
        fuzz_checks::failed_call_changed_nothing(r.status(), cache, before_evict, mem, mem, fail);
        return check();
      }
    switch (op) {
      case 0: {
        auto r = cache.add_sequence();
        if (r) {
          live.push_back(*r);
          for (std::int32_t l = 0; l < 2; ++l)
            dev(*r, l) = {std::vector<std::int32_t>(std::size_t(H()), 0),
                          std::vector<std::uint8_t>(std::size_t(H() * cache.admission().local_window()), 0), {}, 0};
        }
        st = r.status();
        break;
      }
      case 1:
      case 2: {  // one layer's write of n tokens; the step's first position is that layer's appended count
        const std::int32_t layer = in.upto(2) - (in.byte() % 16 == 0), n = in.upto(9);
        if (layer >= 0 && dev(s, layer).mode == 2) break;  // this layer's writes are deferred
        std::vector<float> gates(std::size_t(std::max(0, n * H() + (in.byte() % 16 == 0 ? 1 : 0))));
        for (auto& g : gates) g = in.byte() % 32 == 0 ? in.score() : float(in.byte()) / 255.0f;
        std::vector<std::int32_t> slots(std::size_t(in.upto(20))), promote;
        if (in.byte() % 2) promote.assign(std::size_t(in.upto(20)), 0);
        const std::int64_t first = layer >= 0 && layer < L() ? cache.admission().appended(s, layer).value_or(0) : 0;
        auto r = cache.write(s, layer, gates, {.slots = slots, .moves = moves, .promote = promote, .copies = copies});
        st = r.status();
        if (!r) break;
        dev(s, layer).mode = 1;
        const auto m = std::int32_t(gates.size()) / H();  // tokens written (n, or one more when H is 1)
        if (trace) {
          std::fprintf(stderr, "  write layer %d n %d first %ld copies %d moves %d promote %d:", layer, m, long(first), r->copies, r->moves, int(!promote.empty()));
          for (std::int32_t i = 0; i < m * H(); ++i) std::fprintf(stderr, " %d", slots[std::size_t(i)]);
          std::fprintf(stderr, "\n");
        }
        if (r->copies > 0 && !kv::block_copy_host({pool, pool, copies.data(), r->copies})) fail("block_copy");
        if (!promote.empty()) {  // ring_write: promotions, then the tokens, per (token, head)
          for (std::int32_t i = 0; i < m * H(); ++i) {
            if (promote[std::size_t(i)] >= 0) mem[std::size_t(promote[std::size_t(i)] / B * 2 * B + promote[std::size_t(i)] % B)] = at(slots[std::size_t(i)]);
            mem[std::size_t(slots[std::size_t(i)] / B * 2 * B + slots[std::size_t(i)] % B)] = float(first + i / H());
          }
          std::vector<std::int32_t> stored(slots.begin(), slots.begin() + m * H());
          for (std::int32_t i = 0; i < m * H(); ++i)
            if (promote[std::size_t(i)] >= 0) stored.push_back(promote[std::size_t(i)]);
          fold(std::span<const std::int32_t>(stored));
          break;
        }
        if (r->moves > 0 && !kv::compaction_host({pool, moves.data(), r->moves})) fail("compaction");
        for (std::int32_t i = 0; i < m * H(); ++i)
          if (slots[std::size_t(i)] >= 0) mem[std::size_t(slots[std::size_t(i)] / B * 2 * B + slots[std::size_t(i)] % B)] = float(first + i / H());
        fold(std::span<const kv::SlotMove>(moves.data(), std::size_t(r->moves)));
        fold(std::span<const std::int32_t>(slots.data(), std::size_t(m * H())));
        break;
      }
      case 3: {
        if (deferred(s)) break;  // a rollback would need the device state rolled back too
        auto r = cache.truncate(s, in.upto(6) - 1, {.moves = moves, .copies = copies});
        st = r.status();
        if (r && r->copies > 0 && !kv::block_copy_host({pool, pool, copies.data(), r->copies})) fail("block_copy");
        if (r && r->moves > 0 && !kv::compaction_host({pool, moves.data(), r->moves})) fail("compaction");
        if (r) fold(std::span<const kv::SlotMove>(moves.data(), std::size_t(r->moves)));
        break;
      }
      case 4: {
        auto r = cache.fork(s);
        if (r) {
          live.push_back(*r);
          for (std::int32_t l = 0; l < 2; ++l) dev(*r, l) = dev(s, l);  // the fork's device state is a copy
        }
        st = r.status();
        break;
      }
      case 7: {  // a deferred write: allot, the device decides (ring_admit), the gates wait for reconcile
        const std::int32_t layer = in.upto(1), n = in.upto(6);
        if (dev(s, layer).mode == 1) break;  // this layer's writes are synchronous
        std::vector<std::int32_t> start(std::size_t(in.upto(3))), len(start.size()), rows(std::size_t(H() * kRow));
        auto r = cache.allot(s, layer, n, {.ring_start = start, .ring_len = len, .copies = copies});
        st = r.status();
        if (!r) break;
        if (r->copies > 0 && !kv::block_copy_host({pool, pool, copies.data(), r->copies})) fail("block_copy");
        const kv::SeqId one[] = {s};
        if (!cache.export_heads_block_table(one, layer, rows, kRow)) fail("export_heads_block_table");
        std::vector<float> gates(std::size_t(n * H()));
        for (auto& g : gates) g = float(in.byte()) / 255.0f;
        const std::int64_t first = *cache.admission().appended(s, layer) + [&] {
          std::int64_t ahead = 0;  // tokens of this layer's pending writes, already on the device
          for (const auto& g : dev(s, layer).pending) ahead += std::int64_t(g.size()) / H();
          return ahead;
        }();
        std::vector<float> k(std::size_t(n * H())), v(k.size());
        for (std::int32_t i = 0; i < n * H(); ++i) k[std::size_t(i)] = v[std::size_t(i)] = float(first + i / H());
        DeviceHeads& d = dev(s, layer);
        kv::RingAdmitParams p = cache.admission().ring_admit_params();
        p.cache = pool;
        p.src = {k.data(), v.data(), kv::DType::f32, 0, 4, 0};
        p.gates = gates.data();
        p.num_tokens = n;
        p.ring_start = start.data();
        p.ring_len = len.data();
        p.global_len = d.gl.data();
        p.bits = d.bits.data();
        p.rows = rows.data();
        p.row_stride = kRow;
        if (!kv::ring_admit_host(p)) fail("ring_admit");
        d.pending.push_back(gates);
        d.mode = 2;
        break;
      }
      case 8: {  // the host catches up with the oldest deferred write of a layer
        const std::int32_t layer = in.upto(1);
        if (s.index >= std::uint32_t(kSeqs) || layer >= L() || dev(s, layer).pending.empty()) {
          st = cache.reconcile(s, layer, {}).status();
          break;
        }
        auto r = cache.reconcile(s, layer, dev(s, layer).pending.front());
        st = r.status();
        if (!r) fail("reconcile of a write the device ran", r.status().message());
        dev(s, layer).pending.pop_front();
        for (std::int32_t h = 0; h < H() && dev(s, layer).pending.empty(); ++h)
          if (cache.admission().head_state(s, layer, h)->global != dev(s, layer).gl[std::size_t(h)])
            fail("host and device global lengths differ after catching up");
        break;
      }
      case 9: {  // a decode step of several sequences, one token each (a sequence twice, a stale one: errors)
        const std::int32_t layer = in.upto(2) - (in.byte() % 16 == 0);
        std::vector<kv::SeqId> seqs;
        for (std::int32_t k = in.upto(3); k > 0; --k) seqs.push_back(live.empty() ? s : live[in.byte() % live.size()]);
        if (in.byte() % 16 == 0) seqs.push_back(kv::SeqId{in.byte() % 4, in.byte()});  // maybe stale
        std::vector<std::int64_t> first;
        for (const kv::SeqId q : seqs) {
          const auto a = layer >= 0 && layer < L() ? cache.admission().appended(q, layer) : kv::Result<std::int64_t>(kv::Status{});
          if (a.ok() && dev(q, layer).mode == 2) return check();  // that layer's writes are deferred
          first.push_back(a.value_or(0));
        }
        std::vector<float> gates(seqs.size() * std::size_t(H()) + (in.byte() % 16 == 0 ? 1 : 0));
        for (auto& g : gates) g = in.byte() % 32 == 0 ? in.score() : float(in.byte()) / 255.0f;
        std::vector<std::int32_t> slots(std::size_t(in.upto(12))), promote;
        if (in.byte() % 2) promote.assign(std::size_t(in.upto(12)), 0);
        auto r = cache.write_batch(seqs, layer, gates, {.slots = slots, .moves = moves, .promote = promote, .copies = copies});
        st = r.status();
        if (!r) break;
        for (const kv::SeqId q : seqs) dev(q, layer).mode = 1;
        if (r->copies > 0 && !kv::block_copy_host({pool, pool, copies.data(), r->copies})) fail("block_copy");
        const auto put = [&](std::int32_t slot, float x) { mem[std::size_t(slot / B * 2 * B + slot % B)] = x; };
        const auto rows = std::int32_t(seqs.size()) * H();
        if (promote.empty() && r->moves > 0 && !kv::compaction_host({pool, moves.data(), r->moves})) fail("compaction");
        std::vector<std::int32_t> stored(slots.begin(), slots.begin() + rows);
        for (std::int32_t i = 0; i < rows; ++i) {  // ring_write: per (sequence, head), the promotion, then the token
          if (!promote.empty() && promote[std::size_t(i)] >= 0) put(promote[std::size_t(i)], at(slots[std::size_t(i)])), stored.push_back(promote[std::size_t(i)]);
          put(slots[std::size_t(i)], float(first[std::size_t(i / H())]));
        }
        if (promote.empty()) fold(std::span<const kv::SlotMove>(moves.data(), std::size_t(r->moves)));
        fold(std::span<const std::int32_t>(stored));
        break;
      }
      case 5:
        st = cache.free(s);
        if (st) {
          std::erase(live, s);
          for (std::int32_t l = 0; l < 2; ++l) dev(s, l).pending.clear();
        }
        break;
      default: {  // exports into buffers of any size, accounting with extreme values
        std::vector<std::int32_t> a(std::size_t(in.upto(20))), b(std::size_t(in.upto(40))), c(std::size_t(in.upto(12)));
        std::vector<kv::SeqId> seqs = live;
        if (in.byte() % 8 == 0) seqs.push_back(kv::SeqId{in.byte() % 4, in.byte()});  // maybe stale
        const std::int32_t layer = in.upto(3) - 2;
        (void)cache.export_heads_csr(seqs, layer, a, b, c);
        (void)cache.export_heads_block_table(seqs, layer, b, in.upto(10) - 1);
        (void)cache.export_heads_lengths(seqs, layer, c);
        (void)cache.export_head_columns(seqs, layer, a, b);
        (void)cache.blocks_needed(in.wide(), in.wide(), in.wide());
        (void)cache.can_admit(in.wide(), in.wide());
        (void)cache.tokens_held(s, in.upto(2) - 1, in.upto(2) - 1);
        if constexpr (quest) select(in);
        if (!(cache == before)) fail("a read-only call changed the cache");
        return check();
      }
    }
    fuzz_checks::failed_call_changed_nothing(st, cache, before, mem, mem_before, fail);
    check();
  }
};
}  // namespace fuzz_gate
