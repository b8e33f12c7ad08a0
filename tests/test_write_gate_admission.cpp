// Write-Gated KV admission against a plain, unpaged reference of the method
// (per head: a ring of W logical slots and a global list), on random gate
// streams through chunked prefill, decode, rollback and free. The K/V the
// engine would write (compaction for the moves, then scatter or ring_write)
// go to a real single-head pool, and every head's row read back through a
// head-folded CSR export must hold exactly the reference's tokens, in order.
#include <catch2/catch.hpp>

#include <kvcache/admission/write_gate.hpp>

#include "write_gate_testing.hpp"
#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/ring_write.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/table/page_table_export.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>

using namespace kvcache;
using namespace gate_testing;

namespace {
struct Rig : KvMemory {
  WriteGateConfig cfg;
  std::int32_t max_seqs, max_blocks;
  BlockPool pool;
  PageTable table;
  WriteGate gate;
  std::int32_t num_blocks;

  Rig(const WriteGateConfig& c, std::int32_t b, std::int32_t seqs, std::int32_t row_blocks, std::int32_t blocks)
      : KvMemory(b, blocks, c.num_kv_heads),
        cfg(c),
        max_seqs(seqs),
        max_blocks(row_blocks),
        pool(blocks, 0),
        table(pool, std::int32_t(WriteGate::streams_for(c, seqs)), row_blocks, b),
        gate(c, seqs, table),
        num_blocks(blocks) {}
};

// Every head of s against the reference, through a head-folded CSR export per layer.
void require_matches(const Rig& rig, SeqId s, const std::vector<std::int32_t>& tag, const std::vector<RefHead>& ref) {
  const std::int32_t L = rig.cfg.num_layers, H = rig.cfg.num_kv_heads;
  for (std::int32_t l = 0; l < L; ++l) {
    std::vector<SeqId> rows;
    for (std::int32_t h = 0; h < H; ++h) rows.push_back(*rig.gate.head(s, l, h));
    std::vector<std::int32_t> indptr(std::size_t(H + 1)), indices(std::size_t(H * rig.max_blocks)), last(static_cast<std::size_t>(H));
    REQUIRE(export_csr(rig.table, rows, indptr, indices, last).ok());
    for (std::int32_t h = 0; h < H; ++h) {
      const RefHead& r = ref[std::size_t(l * H + h)];
      const auto want = r.row();
      const auto got = *rig.gate.positions(s, l, h);
      REQUIRE(std::vector<std::int32_t>(got.begin(), got.end()) == want);
      const auto st = *rig.gate.head_state(s, l, h);
      REQUIRE(st.ring == r.len);
      REQUIRE(st.global == std::int32_t(r.global.size()));
      REQUIRE(st.oldest == r.start);
      const std::int32_t pages = indptr[std::size_t(h + 1)] - indptr[std::size_t(h)];
      const std::int64_t length = pages == 0 ? 0 : std::int64_t{pages - 1} * rig.block + last[std::size_t(h)];
      REQUIRE(length == std::int64_t(want.size()));
      for (std::size_t x = 0; x < want.size(); ++x) {
        const std::int32_t slot = indices[std::size_t(indptr[std::size_t(h)]) + x / std::size_t(rig.block)] * rig.block +
                                  std::int32_t(x % std::size_t(rig.block));
        INFO("layer " << l << " head " << h << " row index " << x << " position " << want[x]);
        const std::int32_t who = tag[std::size_t(want[x])];
        REQUIRE(rig.k_at(slot) == key_of(who, l, h, want[x]));
        REQUIRE(rig.v_at(slot) == -key_of(who, l, h, want[x]));
      }
    }
  }
}
}  // namespace

TEST_CASE("write gate admission matches the per-head reference through prefill chunks, decode, rollback, fork and free") {
  auto rng = fresh_rng();
  // One live sequence as the reference sees it: its heads, and which lineage
  // wrote each position (a fork shares its parent's tokens, then writes its own).
  struct Live {
    SeqId id;
    std::vector<RefHead> ref;
    std::vector<std::int32_t> tag;  // [position]: the key_of tag its K/V carry
    std::int32_t own = 0;           // tag of this sequence's writes
  };
  std::int32_t total_forks = 0, total_copies = 0;
  for (int trial = 0; trial < 24; ++trial) {
    const std::int32_t block = trial % 2 ? 4 : 2, w = block * (1 + std::int32_t(rng() % 4));
    WriteGateConfig cfg{.num_layers = 1 + std::int32_t(rng() % 2), .num_kv_heads = 1 + std::int32_t(rng() % 3),
                        .local_window = w, .tau = 0.5f};
    cfg.global_cap = trial % 3 == 0 ? 3 + std::int32_t(rng() % 6) : 0;
    cfg.at_cap = GlobalCapAction::drop;
    const std::int32_t row_blocks = w / block + 6, L = cfg.num_layers, H = cfg.num_kv_heads;
    // Two sequences' rows, plus a copy of every block a fork shares.
    Rig rig(cfg, block, 3, row_blocks, 4 * L * H * row_blocks + 1);
    const std::int32_t cap = rig.gate.global_cap();
    CAPTURE(trial, block, w, L, H, cap);
    std::vector<Live> live;
    std::int32_t next_tag = 0, forks = 0, copies_run = 0;
    const double admit_rate = 0.2 + 0.6 * double(rng() % 100) / 100.0;
    for (int step = 0; step < 100; ++step) {
      if (live.empty()) live.push_back(Live{*rig.gate.add(rig.table), std::vector<RefHead>(std::size_t(L * H), RefHead(w)), {}, next_tag++});
      Live& q = live[rng() % live.size()];
      const std::int32_t appended = std::int32_t(q.tag.size());
      const int kind = int(rng() % 10);
      std::vector<BlockCopy> copies(std::size_t(L * H * row_blocks));
      auto run_copies = [&](std::int32_t n) {
        copies_run += n;
        rig.copy_blocks(std::span<const BlockCopy>(copies.data(), std::size_t(n)));
      };
      if (kind == 0 && appended > 0) {  // rollback
        const std::int32_t n = 1 + std::int32_t(rng() % std::uint64_t(std::min(appended, w)));
        std::vector<SlotMove> moves(std::size_t(L * H * 2 * w));
        std::int32_t limit = appended;
        for (const auto& h : q.ref) limit = std::min(limit, h.rollback_limit(appended));
        auto r = rig.gate.truncate(rig.table, rig.pool, q.id, n, {.moves = moves, .copies = copies});
        if (n > limit) {
          REQUIRE(r.status().code() == Errc::truncate_too_many);
          REQUIRE(r.status().limit() == limit);
          continue;
        }
        REQUIRE(r.ok());
        for (auto& h : q.ref) h.truncate(n);
        q.tag.resize(std::size_t(appended - n));
        run_copies(r->copies);
        if (r->moves > 0) REQUIRE(compaction_host({rig.view, moves.data(), r->moves}).ok());
      } else if (kind == 1 && live.size() < 2) {  // fork: the child shares every block
        auto child = rig.gate.fork(rig.table, rig.pool, q.id);
        REQUIRE(child.ok());
        ++forks;
        Live c{*child, q.ref, q.tag, next_tag++};
        live.push_back(std::move(c));
      } else if (kind == 2 && live.size() > 1) {  // free one
        const std::size_t k = rng() % live.size();
        REQUIRE(rig.gate.free(rig.table, rig.pool, live[k].id).ok());
        REQUIRE(rig.gate.positions(live[k].id, 0, 0).status().code() == Errc::unknown_sequence);
        live.erase(live.begin() + std::ptrdiff_t(k));
      } else {  // a prefill chunk (long or short) or a decode step, every layer
        const std::int32_t n = kind == 3 ? 1 + std::int32_t(rng() % std::uint64_t(3 * w)) : (kind == 4 ? 1 + std::int32_t(rng() % std::uint64_t(w)) : 1);
        if (appended + n > 4000) continue;
        for (std::int32_t l = 0; l < L; ++l) {
          std::vector<float> gates(std::size_t(n * H));
          for (auto& g : gates) g = double(rng() % 1000) / 1000.0 < admit_rate ? 0.5f + float(rng() % 500) / 1000.0f : float(rng() % 500) / 1000.0f;
          std::vector<std::int32_t> slots(gates.size(), -7), promote;
          const bool fused = n <= w && rng() % 2;
          if (fused) promote.assign(gates.size(), -7);
          std::vector<SlotMove> moves(std::size_t(n * H + H * w));
          auto info = rig.gate.write(rig.table, rig.pool, q.id, l, gates, {.slots = slots, .moves = moves, .promote = promote, .copies = copies});
          REQUIRE(info.ok());
          std::int32_t at_cap = 0;
          for (std::int32_t t = 0; t < n; ++t)
            for (std::int32_t h = 0; h < H; ++h)
              REQUIRE(q.ref[std::size_t(l * H + h)].write(appended + t, gates[std::size_t(t * H + h)] >= 0.5f, cap, false, at_cap));
          REQUIRE(info->dropped_at_cap == at_cap);
          // A parallel scatter needs every written slot once, and no move to land where a token is written.
          std::vector<std::int32_t> written;
          for (auto x : slots)
            if (x >= 0) written.push_back(x);
          for (std::int32_t m = 0; m < info->moves; ++m) written.push_back(moves[std::size_t(m)].dst);
          std::sort(written.begin(), written.end());
          REQUIRE(std::adjacent_find(written.begin(), written.end()) == written.end());
          REQUIRE(std::count(slots.begin(), slots.end(), -7) == 0);
          run_copies(info->copies);
          rig.run(std::span<const SlotMove>(moves.data(), std::size_t(info->moves)), slots, promote, q.own, l, appended, n);
        }
        q.tag.resize(std::size_t(appended + n), q.own);
      }
      REQUIRE(rig.gate.check(rig.table).ok());
      REQUIRE(rig.table.check(rig.pool).ok());
      REQUIRE(rig.pool.check().ok());
      std::int64_t bound = 0;
      for (const Live& x : live) {
        REQUIRE(rig.gate.appended(x.id).value() == std::int64_t(x.tag.size()));
        require_matches(rig, x.id, x.tag, x.ref);
        bound += rig.gate.max_blocks_held(std::int64_t(x.tag.size()));
      }
      REQUIRE(std::int64_t(rig.num_blocks - 1 - rig.pool.num_free()) <= bound);
    }
    for (const Live& x : live) REQUIRE(rig.gate.free(rig.table, rig.pool, x.id).ok());
    REQUIRE(rig.pool.num_free() == rig.num_blocks - 1);
    total_forks += forks;
    total_copies += copies_run;
  }
  REQUIRE(total_forks > 0);  // copy-on-write was exercised
  REQUIRE(total_copies > 0);
}

TEST_CASE("write gate admission: bad gates, small buffers, the cap, the pool and rollback limits are typed errors, and nothing changes") {
  WriteGateConfig cfg{.num_layers = 2, .num_kv_heads = 2, .local_window = 4, .tau = 0.5f, .global_cap = 2};
  Rig rig(cfg, 2, 2, 5, 16);
  SeqId s = *rig.gate.add(rig.table);
  std::vector<std::int32_t> slots(64);
  std::vector<SlotMove> moves(64);
  std::vector<float> ones(12, 1.0f);  // 6 tokens x 2 heads, all admitted
  for (std::int32_t l = 0; l < 2; ++l) REQUIRE(rig.gate.write(rig.table, rig.pool, s, l, ones, {.slots = slots, .moves = moves}).ok());
  const PageTable table0 = rig.table;
  const BlockPool pool0 = rig.pool;
  auto snapshot = [&] {
    std::vector<std::int32_t> all;
    for (std::int32_t l = 0; l < 2; ++l)
      for (std::int32_t h = 0; h < 2; ++h) {
        const auto p = *rig.gate.positions(s, l, h);
        all.insert(all.end(), p.begin(), p.end());
        all.push_back(rig.gate.head_state(s, l, h)->oldest);
      }
    all.push_back(std::int32_t(*rig.gate.appended(s, 0)));
    return all;
  };
  const auto before = snapshot();
  auto expect = [&](const Status& st, Errc code, const std::string& what) {
    CHECK(st.code() == code);
    CHECK(std::string(st.what()) == what);
    CHECK(rig.table == table0);
    CHECK(rig.pool == pool0);
    CHECK(snapshot() == before);
  };
  std::vector<float> g{0.2f, 0.9f};
  g[1] = std::numeric_limits<float>::quiet_NaN();
  expect(rig.gate.write(rig.table, rig.pool, s, 0, g, {.slots = slots, .moves = moves}).status(), Errc::invalid_argument, "gates_at");
  g[1] = 1.5f;
  expect(rig.gate.write(rig.table, rig.pool, s, 0, g, {.slots = slots, .moves = moves}).status(), Errc::invalid_argument, "gates_at");
  g[1] = -0.1f;
  expect(rig.gate.write(rig.table, rig.pool, s, 0, g, {.slots = slots, .moves = moves}).status(), Errc::invalid_argument, "gates_at");
  expect(rig.gate.write(rig.table, rig.pool, s, 0, std::vector<float>{0.5f, 0.5f, 0.5f}, {.slots = slots, .moves = moves}).status(),
         Errc::invalid_argument, "gates.size");
  expect(rig.gate.write(rig.table, rig.pool, s, 2, std::vector<float>{0.5f, 0.5f}, {.slots = slots, .moves = moves}).status(),
         Errc::invalid_argument, "layer");
  expect(rig.gate.write(rig.table, rig.pool, s, 0, std::vector<float>{0.5f, 0.5f}, {.slots = std::span<std::int32_t>(slots.data(), 1), .moves = moves}).status(),
         Errc::buffer_too_small, "slots");
  // The ring is full and holds admitted tokens: the next write promotes, and each head is at its cap of 2.
  expect(rig.gate.write(rig.table, rig.pool, s, 0, std::vector<float>{0.5f, 0.5f}, {.slots = slots, .moves = moves}).status(),
         Errc::capacity_exceeded, "global_cap");
  expect(rig.gate.truncate(rig.table, rig.pool, s, 5, {.moves = moves}).status(), Errc::truncate_too_many, "n_tokens");
  expect(rig.gate.truncate(rig.table, rig.pool, s, 1, {.moves = std::span<SlotMove>(moves.data(), 0)}).status(), Errc::buffer_too_small, "moves");
  expect(rig.gate.truncate(rig.table, rig.pool, s, -1, {.moves = moves}).status(), Errc::invalid_argument, "n_tokens");
  // Half a step (layer 0 only) cannot be rolled back.
  SeqId t = *rig.gate.add(rig.table);
  REQUIRE(rig.gate.write(rig.table, rig.pool, t, 0, std::vector<float>{0.5f, 0.5f}, {.slots = slots, .moves = moves}).ok());
  CHECK(std::string(rig.gate.truncate(rig.table, rig.pool, t, 1, {.moves = moves}).status().what()).starts_with("layers_appended"));
  REQUIRE(rig.gate.free(rig.table, rig.pool, t).ok());
  CHECK(rig.gate.free(rig.table, rig.pool, t).code() == Errc::unknown_sequence);
  CHECK(rig.gate.write(rig.table, rig.pool, t, 0, g, {.slots = slots, .moves = moves}).status().code() == Errc::unknown_sequence);
  CHECK(rig.pool.num_free() == pool0.num_free());  // t's blocks are back
  // The pool: 15 usable blocks, 12 in use (4 heads x (2 ring blocks + 1 global)); a fresh sequence's
  // 4-token prefill of one layer needs 2 heads x 2 blocks.
  SeqId u = *rig.gate.add(rig.table);
  const PageTable table1 = rig.table;
  const BlockPool pool1 = rig.pool;
  auto r = rig.gate.write(rig.table, rig.pool, u, 0, std::vector<float>(8, 0.5f), {.slots = slots, .moves = moves});
  CHECK(r.status().code() == Errc::out_of_blocks);
  CHECK(rig.table == table1);
  CHECK(rig.pool == pool1);
  // Under `drop`, the same full heads drop the promotion instead, and count it.
  WriteGateConfig dcfg = cfg;
  dcfg.at_cap = GlobalCapAction::drop;
  Rig d(dcfg, 2, 1, 5, 16);
  SeqId q = *d.gate.add(d.table);
  for (std::int32_t l = 0; l < 2; ++l) REQUIRE(d.gate.write(d.table, d.pool, q, l, ones, {.slots = slots, .moves = moves}).ok());
  auto info = d.gate.write(d.table, d.pool, q, 0, std::vector<float>{0.5f, 0.5f}, {.slots = slots, .moves = moves});
  REQUIRE(info.ok());
  CHECK(info->dropped_at_cap == 2);
  CHECK(d.gate.head_state(q, 0, 0)->global == 2);
  // Fork: a second handle is needed, and a write into a ring block the fork
  // shares needs room for its copy; without it nothing changes.
  WriteGateConfig fcfg = cfg;
  fcfg.global_cap = 0;
  Rig f(fcfg, 2, 2, 5, 40);
  SeqId a = *f.gate.add(f.table);
  for (std::int32_t l = 0; l < 2; ++l) REQUIRE(f.gate.write(f.table, f.pool, a, l, ones, {.slots = slots, .moves = moves}).ok());
  SeqId b = *f.gate.fork(f.table, f.pool, a);
  CHECK(f.gate.fork(f.table, f.pool, a).status().code() == Errc::capacity_exceeded);
  CHECK(f.gate.fork(f.table, f.pool, SeqId{7, 0}).status().code() == Errc::unknown_sequence);
  const WriteGate gate_f = f.gate;
  const PageTable table_f = f.table;
  const BlockPool pool_f = f.pool;
  auto no_room = f.gate.write(f.table, f.pool, a, 0, std::vector<float>{0.5f, 0.5f}, {.slots = slots, .moves = moves});
  CHECK(no_room.status().code() == Errc::buffer_too_small);
  CHECK(std::string(no_room.status().what()) == "copies");
  CHECK(no_room.status().limit() == 2);  // one shared ring block per head
  CHECK(f.gate == gate_f);
  CHECK(f.table == table_f);
  CHECK(f.pool == pool_f);
  std::vector<BlockCopy> copies(8);
  auto ok = f.gate.write(f.table, f.pool, a, 0, std::vector<float>{0.5f, 0.5f}, {.slots = slots, .moves = moves, .copies = copies});
  REQUIRE(ok.ok());
  CHECK(ok->copies == 2);
  CHECK(f.gate.positions(b, 0, 0)->size() == 6);  // the child is untouched
  CHECK(f.gate.check(f.table).ok());
  CHECK(f.table.check(f.pool).ok());
  CHECK_THROWS_AS(WriteGate(WriteGateConfig{.local_window = 3}, 1, d.table), ConfigError);
  CHECK_THROWS_AS(WriteGate(WriteGateConfig{.tau = 1.5f}, 1, d.table), ConfigError);
  CHECK_THROWS_AS(WriteGate(WriteGateConfig{.num_layers = 9}, 1, d.table), ConfigError);
}
