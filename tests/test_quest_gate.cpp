// Write-Gated KV admission and Quest selection in one cache: every head row
// is a row of Quest's selection (one head per page), its ring pages always
// read on top of the budget, its global pages ranked by their key bounds.
// Random writes, batch steps, forks, rollbacks and frees run the engine's
// commands on a real pool and keep the bounds as an engine does; after each,
// every global page that misses a live key is listed stale, none does after
// the recompute, and select() equals a plain top-k per head row.
#include <catch2/catch.hpp>

#include <kvcache/admission/write_gate.hpp>
#include <kvcache/kernels/page_bounds.hpp>
#include <kvcache/kernels/page_select.hpp>
#include <kvcache/kernels/ring_admit.hpp>
#include <kvcache/kvcache.hpp>

#include <algorithm>
#include <cfloat>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "write_gate_testing.hpp"

using namespace kvcache;
using gate_testing::KvMemory;
using gate_testing::kDim;

namespace {
std::mt19937_64 fresh_rng() { return std::mt19937_64(Catch::rngSeed() ^ std::random_device{}()); }

constexpr std::int32_t B = 4, W = 8, L = 2, H = 2, kBlocks = 400, kRow = 24, kSeqs = 4, kGroup = 2;
// E: KeepAll (admission and selection), or a token policy on the global regions (all three).
template <class E = KeepAll>
struct Rig {
  std::mt19937_64& rng;
  KvMemory mem{B, kBlocks, H};
  std::vector<float> store = std::vector<float>(std::size_t(QuestSelection::bounds_floats(mem.geo, kBlocks)));
  GatedCache<WriteGate, QuestSelection, E> cache;
  std::vector<SeqId> live;
  std::vector<std::int32_t> tag;  // key_of's sequence number per handle index (forks copy it)

  Rig(std::mt19937_64& r, std::int32_t budget_pages, GlobalCapAction at_cap = GlobalCapAction::refuse, E policy = {})
      : rng(r),
        cache({.geometry = mem.geo, .num_blocks = kBlocks, .max_sequences = kSeqs, .max_blocks_per_sequence = kRow},
              WriteGateConfig{.num_layers = L, .num_kv_heads = H, .local_window = W, .tau = 0.5f, .at_cap = at_cap},
              QuestConfig{.token_budget = budget_pages * B, .dense_layers = 1, .query_group = kGroup, .bounds = store},
              policy),
        tag(kSeqs, 0) {}

  // The commands of one write or rollback, then the new keys into the bounds.
  void run(const GateWriteSpans& out, const GateWriteInfo& info, SeqId s, std::int32_t layer, std::int64_t pos0,
           std::int32_t n) {
    mem.copy_blocks(out.copies.first(std::size_t(info.copies)));
    const auto moves = out.moves.first(std::size_t(info.moves));
    if (n > 0) mem.run(moves, out.slots.first(std::size_t(n * H)), {}, tag[s.index], layer, pos0, n);
    else mem.move(moves);
    std::vector<std::int32_t> written;
    for (const SlotMove& m : moves) written.push_back(m.dst);
    for (std::int32_t i = 0; i < n * H; ++i) written.push_back(out.slots[std::size_t(i)]);
    REQUIRE(page_bounds_update_host({mem.view, 0, written.data(), std::int64_t(written.size()), store.data()}).ok());
  }

  bool write(SeqId s, std::int32_t n) {
    gate_testing::RandomWrite w;
    for (std::int32_t l = 0; l < L; ++l) {
      auto r = gate_testing::random_write(cache, rng, s, l, n, 4, w);
      if (!r) return false;
      run(w.spans(), *r, s, l, w.pos0, n);
    }
    return true;
  }
  void step() {  // a decode step of every live sequence, layer by layer
    for (std::int32_t l = 0; l < L; ++l) {
      std::vector<float> gates(live.size() * H);
      for (auto& g : gates) g = rng() % 3 == 0 ? 0.9f : 0.1f;
      std::vector<std::int32_t> slots(gates.size());
      std::vector<SlotMove> moves(gates.size());
      std::vector<BlockCopy> copies(gates.size() * 2);
      std::vector<std::int64_t> pos0;
      for (const SeqId s : live) pos0.push_back(*cache.admission().appended(s, l));
      auto r = cache.write_batch(live, l, gates, {slots, moves, {}, copies});
      if (!r) return;
      mem.copy_blocks(std::span(copies).first(std::size_t(r->copies)));
      mem.move(std::span(moves).first(std::size_t(r->moves)));
      for (std::size_t k = 0; k < live.size(); ++k)  // each sequence's token through the scatter
        mem.run({}, std::span(slots).subspan(k * H, H), {}, tag[live[k].index], l, pos0[k], 1);
      std::vector<std::int32_t> written(slots.begin(), slots.end());
      for (std::int32_t i = 0; i < r->moves; ++i) written.push_back(moves[std::size_t(i)].dst);
      REQUIRE(page_bounds_update_host({mem.view, 0, written.data(), std::int64_t(written.size()), store.data()}).ok());
    }
  }
  void truncate(SeqId s, std::int32_t n) {
    std::vector<SlotMove> moves(std::size_t(L * H * W));
    std::vector<BlockCopy> copies(std::size_t(L * H * 4));
    auto r = cache.truncate(s, n, {{}, moves, {}, copies});
    if (r) run({{}, moves, {}, copies}, *r, s, 0, 0, 0);
  }

  // Scores for every head row of s (a function of position), then the eviction and its moves.
  void evict(SeqId s) {
    if constexpr (TokenEviction<E>) {
      for (std::int32_t l = 0; l < L; ++l) {
        std::vector<float> v;
        for (std::int32_t h = 0; h < H; ++h) {
          const auto held = *cache.admission().positions(s, l, h);
          for (const std::int32_t p : held) v.push_back(float((p * 7919 + h * 13 + l * 5) % 97) / 16.0f);
        }
        REQUIRE(cache.observe(s, l, ScoreKind::head_attention_sums, v).ok());
      }
      std::vector<SlotMove> moves(std::size_t(L * H * kRow * B));
      auto r = cache.evict(s, moves);
      REQUIRE(r.ok());
      mem.move(std::span(moves).first(std::size_t(r->moves)));
    }
  }

  std::set<std::int32_t> refresh() {
    std::vector<std::int32_t> pages(std::size_t(kSeqs * L * H * kRow)), fill(pages.size());
    auto n = cache.stale_pages(live, {pages, fill});
    REQUIRE(n.ok());
    REQUIRE(page_bounds_host({mem.view, 0, pages.data(), fill.data(), *n, store.data()}).ok());
    return {pages.begin(), pages.begin() + *n};
  }
  // Calls f(page, tokens in it) for every global page (past the ring) of every live head row.
  template <class F>
  void each_global_page(F&& f) {
    for (const SeqId s : live)
      for (std::int32_t l = 0; l < L; ++l)
        for (std::int32_t h = 0; h < H; ++h) {
          const SeqId row = *cache.admission().head(s, l, h);
          const auto blocks = *cache.table().blocks(row);
          const std::int32_t used = *cache.table().tokens(row);
          for (std::int32_t j = W / B; j < std::int32_t(blocks.size()); ++j) f(blocks[std::size_t(j)], std::min(B, used - j * B));
        }
  }
  // Global pages whose bounds miss a live key.
  std::set<std::int32_t> uncovered() {
    std::set<std::int32_t> bad;
    each_global_page([&](std::int32_t page, std::int32_t fill) {
      const float* e = store.data() + std::size_t(page) * 2 * kDim;
      for (std::int32_t t = 0; t < fill; ++t)
        for (std::int32_t d = 0; d < kDim; ++d)
          if (!(e[d] >= mem.k_at(page * B + t) && e[kDim + d] <= mem.k_at(page * B + t))) bad.insert(page);
    });
    return bad;
  }
  // Private global pages whose bounds differ from the max and min of their tokens.
  std::set<std::int32_t> inexact() {
    std::set<std::int32_t> bad;
    each_global_page([&](std::int32_t page, std::int32_t fill) {
      if (cache.pool().ref_count(page) > 1) return;
      float mx = -FLT_MAX, mn = FLT_MAX;
      for (std::int32_t t = 0; t < fill; ++t) mx = std::max(mx, mem.k_at(page * B + t)), mn = std::min(mn, mem.k_at(page * B + t));
      if (store[std::size_t(page) * 2 * kDim] != mx || store[std::size_t(page) * 2 * kDim + kDim] != mn) bad.insert(page);
    });
    return bad;
  }
  // select() per layer against a plain top-k per head row: its ring and first
  // global page, its last page, and the best bounds between, ties to the lower page.
  void check_select() {
    const std::int32_t budget = cache.selection().config().token_budget / B, ring = W / B;
    for (std::int32_t l = 0; l < L; ++l) {
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      std::vector<float> q(live.size() * H * kGroup * kDim);
      for (auto& x : q) x = u(rng);
      std::vector<std::int32_t> indptr(live.size() * H + 1), indices(live.size() * H * kRow);
      auto n = cache.select(live, l, q, {indptr, indices});
      REQUIRE(n.ok());
      PageSelectParams p{};
      p.bounds = store.data(), p.num_blocks = kBlocks, p.num_kv_heads = 1, p.head_dim = kDim, p.queries = q.data(), p.group = kGroup;
      for (std::size_t k = 0; k < live.size(); ++k)
        for (std::int32_t h = 0; h < H; ++h) {
          const std::size_t r = k * H + std::size_t(h);
          const auto blocks = *cache.table().blocks(*cache.admission().head(live[k], l, h));
          const auto m = std::int32_t(blocks.size());
          std::vector<std::int32_t> want;
          if (l < 1 || m <= ring + budget) {
            want.assign(blocks.begin(), blocks.end());
          } else {
            std::vector<std::pair<float, std::int32_t>> ranked;
            for (std::int32_t j = ring + 1; j < m - 1; ++j) ranked.push_back({-page_select_bound(p, std::int32_t(r), 0, blocks[std::size_t(j)]), j});
            std::sort(ranked.begin(), ranked.end());
            std::vector<std::int32_t> idx;
            for (std::int32_t j = 0; j <= ring; ++j) idx.push_back(j);
            for (std::int32_t c = 0; c < budget - 2; ++c) idx.push_back(ranked[std::size_t(c)].second);
            idx.push_back(m - 1);
            std::sort(idx.begin(), idx.end());
            for (const std::int32_t j : idx) want.push_back(blocks[std::size_t(j)]);
          }
          const std::vector<std::int32_t> got(indices.begin() + indptr[r], indices.begin() + indptr[r + 1]);
          REQUIRE(got == want);
        }
    }
  }
};
}  // namespace

namespace {
template <class E = KeepAll>
void random_run(std::mt19937_64& rng, int trials, E policy = {}) {
  for (int trial = 0; trial < trials; ++trial) {
    Rig<E> rig(rng, 2 + std::int32_t(rng() % 3), GlobalCapAction::refuse, policy);
    std::int32_t next_tag = 0;
    for (int op = 0; op < 80; ++op) {
      const auto pick = [&] { return rig.live[std::size_t(rng() % rig.live.size())]; };
      const std::uint64_t what = rig.live.empty() ? 0 : rng() % 10;
      if (what == 0 && rig.live.size() < 3) {
        auto s = rig.cache.add_sequence();
        REQUIRE(s.ok());
        rig.live.push_back(*s);
        rig.tag[s->index] = next_tag++;
        (void)rig.write(*s, 1 + std::int32_t(rng() % 30));
      } else if (what <= 3) {
        (void)rig.write(pick(), 1 + std::int32_t(rng() % 12));
      } else if (what <= 5) {
        rig.step();
      } else if (what == 6 && rig.live.size() < 3 && trial % 2 == 1) {
        const SeqId parent = pick();
        auto c = rig.cache.fork(parent);
        if (c) rig.live.push_back(*c), rig.tag[c->index] = rig.tag[parent.index];
      } else if (what == 7 && TokenEviction<E>) {
        rig.evict(pick());
      } else if (what <= 8) {
        rig.truncate(pick(), 1 + std::int32_t(rng() % 4));
      } else if (rig.live.size() > 1) {
        const auto k = std::size_t(rng() % rig.live.size());
        REQUIRE(rig.cache.free(rig.live[k]).ok());
        rig.live.erase(rig.live.begin() + std::ptrdiff_t(k));
      }
      const auto bad = rig.uncovered();
      const auto listed = rig.refresh();
      for (const std::int32_t page : bad) {
        INFO("op " << op << ": global page " << page << " misses a live key and is not listed stale");
        REQUIRE(listed.count(page) == 1);
      }
      REQUIRE(rig.uncovered().empty());
      if (trial % 2 == 0) REQUIRE(rig.inexact().empty());  // without forks: every global page exact
      REQUIRE(rig.cache.check_invariants().ok());
      if (!rig.live.empty()) rig.check_select();
    }
  }
}
}  // namespace

TEST_CASE("Write-Gated KV + Quest: every head row's global pages keep true bounds and select the plain top-k") {
  auto rng = fresh_rng();
  random_run(rng, 8);
}

TEST_CASE("all three: Write-Gated KV + Quest + H2O on the global regions keep true bounds and select the plain top-k") {
  auto rng = fresh_rng();
  random_run(rng, 8, H2OEviction({.heavy = 6, .recent = 2}));
}

TEST_CASE("Write-Gated KV + Quest: errors name the value and change nothing") {
  auto rng = fresh_rng();
  Rig<> rig(rng, 2);
  const SeqId s = *rig.cache.add_sequence();
  rig.live.push_back(s);
  REQUIRE(rig.write(s, 40));
  const auto snapshot = rig.cache;
  const SeqId one[] = {s};
  std::vector<float> q(std::size_t(H * kGroup * kDim), 0.5f);
  std::vector<std::int32_t> indptr(H + 1, -7), indices(64, -7);
  auto bad = rig.cache.select(one, L, q, {indptr, indices});
  REQUIRE(bad.status().code() == Errc::invalid_argument);
  REQUIRE(bad.status().message().find("layer") != std::string::npos);
  q.pop_back();
  bad = rig.cache.select(one, 1, q, {indptr, indices});
  REQUIRE(bad.status().message().find("queries.size") != std::string::npos);
  q.push_back(0.5f);
  bad = rig.cache.select(one, 1, q, {indptr, std::span(indices).first(2)});
  REQUIRE(bad.status().code() == Errc::buffer_too_small);
  REQUIRE(rig.cache == snapshot);
  REQUIRE(std::count(indptr.begin(), indptr.end(), -7) == H + 1);
  REQUIRE(std::count(indices.begin(), indices.end(), -7) == 64);
  REQUIRE(rig.cache.page_bounds(1).status().code() == Errc::invalid_argument);  // one pool layer
  REQUIRE(rig.cache.select(one, 1, q, {indptr, indices}).ok());
  // The ring is read on top of the budget: W / B ring pages + 2 budget pages.
  for (std::int32_t h = 0; h < H; ++h) REQUIRE(indptr[std::size_t(h) + 1] - indptr[std::size_t(h)] <= W / B + 2);
}

TEST_CASE("Write-Gated KV + Quest without a host sync: reconcile marks the promoted pages stale") {
  auto rng = fresh_rng();
  Rig<> rig(rng, 2, GlobalCapAction::drop);  // the deferred path drops at the cap
  const SeqId s = *rig.cache.add_sequence();
  rig.live.push_back(s);
  std::vector<std::int32_t> gl(std::size_t(L * H), 0);  // the device's state
  std::vector<std::uint8_t> bits(std::size_t(L * H * W), 0);
  std::int64_t appended = 0;
  const SeqId one[] = {s};
  for (int step = 0; step < 40; ++step) {
    const std::int32_t n = step % 5 == 0 ? 1 + std::int32_t(rng() % 10) : 1;
    if (appended + n > 50) break;  // rows grow to the worst case: stay within kRow blocks
    for (std::int32_t l = 0; l < L; ++l) {
      std::vector<std::int32_t> start(H), len(H), rows(std::size_t(H * kRow));
      std::vector<BlockCopy> copies(8);
      auto a = rig.cache.allot(s, l, n, {start, len, copies});
      INFO("step " << step << " n " << n << ": " << a.status().message());
      REQUIRE(a.ok());
      REQUIRE(rig.cache.export_heads_block_table(one, l, rows, kRow).ok());
      std::vector<float> gates(std::size_t(n * H));
      for (auto& g : gates) g = rng() % 3 == 0 ? 0.9f : 0.1f;
      const KvSource src = rig.mem.source(0, l, appended, n);
      // The policy's parameters (W, its effective cap, tau) come from the
      // policy, so the device promotes exactly what reconcile() replays.
      RingAdmitParams p = rig.cache.admission().ring_admit_params();
      p.cache = rig.mem.view;
      p.src = src;
      p.gates = gates.data();
      p.num_tokens = n;
      p.ring_start = start.data();
      p.ring_len = len.data();
      p.global_len = gl.data() + l * H;
      p.bits = bits.data() + l * H * W;
      p.rows = rows.data();
      p.row_stride = kRow;
      REQUIRE(ring_admit_host(p).ok());
      REQUIRE(rig.cache.reconcile(s, l, gates).ok());
    }
    appended += n;
    const auto bad = rig.uncovered();  // the device's promotions are in no bounds yet...
    const auto listed = rig.refresh();  // ...but reconcile listed their pages
    for (const std::int32_t page : bad) REQUIRE(listed.count(page) == 1);
    REQUIRE(rig.uncovered().empty());
    rig.check_select();
  }
  REQUIRE(appended > 20);
}
