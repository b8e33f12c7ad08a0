// Write-Gated KV admission against a plain, unpaged reference of the method
// (per head: a ring of W logical slots and a global list), on random gate
// streams through chunked prefill, decode, rollback and free. The K/V the
// engine would write (compaction for the moves, then scatter or ring_write)
// go to a real single-head pool, and every head's row read back through a
// head-folded CSR export must hold exactly the reference's tokens, in order.
#include <catch2/catch.hpp>

#include <kvcache/admission/write_gate.hpp>
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/ring_write.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/page_table_export.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>

using namespace kvcache;

namespace {
std::mt19937_64 fresh_rng() { return std::mt19937_64(Catch::rngSeed() ^ std::random_device{}()); }

// The method on lists: one head.
struct RefHead {
  struct Entry {
    std::int32_t pos = -1;
    bool admitted = false;
  };
  std::vector<Entry> ring;
  std::int32_t start = 0, len = 0;
  std::vector<std::int32_t> global;
  explicit RefHead(std::int32_t w) : ring(std::size_t(w)) {}
  std::int32_t w() const { return std::int32_t(ring.size()); }

  // One token; false when a promotion meets the cap under `refuse`.
  bool write(std::int32_t pos, bool admitted, std::int32_t cap, bool refuse, std::int32_t& dropped_at_cap) {
    if (len < w()) {
      ring[std::size_t((start + len++) % w())] = {pos, admitted};
      return true;
    }
    Entry& victim = ring[std::size_t(start)];
    start = (start + 1) % w();
    if (victim.admitted) {
      if (std::int32_t(global.size()) < cap) global.push_back(victim.pos);
      else if (refuse) return false;
      else ++dropped_at_cap;
    }
    victim = {pos, admitted};
    return true;
  }
  void truncate(std::int32_t n) {
    const bool was_full = len == w();
    len -= n;
    if (was_full)
      for (std::int32_t j = 0; j < n && !global.empty(); ++j) {
        start = (start - 1 + w()) % w();
        ring[std::size_t(start)] = {global.back(), true};
        global.pop_back();
        ++len;
      }
    if (len < w() && start != 0) {  // re-pack into [0, len): kept slots past len, in ring order, fill the holes
      auto valid = [&](std::int32_t x) { return (x - start + w()) % w() < len; };
      std::vector<Entry> next = ring;
      std::int32_t hole = 0;
      for (std::int32_t k = 0; k < len; ++k) {
        const std::int32_t r = (start + k) % w();
        if (r < len) continue;
        while (valid(hole)) ++hole;
        next[std::size_t(hole++)] = ring[std::size_t(r)];
      }
      ring = next;
      start = 0;
    }
  }
  // Newest tokens the ring's back holds as a run of consecutive positions ending at appended - 1.
  std::int32_t rollback_limit(std::int64_t appended) const {
    std::int32_t run = 0;
    while (run < len && ring[std::size_t((start + len - 1 - run) % w())].pos == appended - 1 - run) ++run;
    return run;
  }
  // The row the head's stream must hold: ring slots, then global.
  std::vector<std::int32_t> row() const {
    std::vector<std::int32_t> out;
    const std::int32_t live = len < w() ? len : w();
    for (std::int32_t r = 0; r < live; ++r) out.push_back(ring[std::size_t(r)].pos);
    out.insert(out.end(), global.begin(), global.end());
    return out;
  }
};

constexpr std::int32_t kDim = 4;
// The K value a (sequence, layer, head, position) writes: distinct, exact in f32.
float key_of(std::int32_t seq, std::int32_t layer, std::int32_t head, std::int32_t pos) {
  return float(((seq * 8 + layer) * 8 + head) * 4096 + pos);
}

struct Rig {
  WriteGateConfig cfg;
  std::int32_t block, max_seqs, max_blocks;
  BlockPool pool;
  PageTable table;
  WriteGate gate;
  Geometry geo;
  std::vector<float> memory;
  PoolView view;
  std::int32_t num_blocks;

  Rig(const WriteGateConfig& c, std::int32_t b, std::int32_t seqs, std::int32_t row_blocks, std::int32_t blocks)
      : cfg(c),
        block(b),
        max_seqs(seqs),
        max_blocks(row_blocks),
        pool(blocks, 0),
        table(pool, std::int32_t(WriteGate::streams_for(c, seqs)), row_blocks, b),
        gate(c, seqs, table),
        geo(*Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = kDim, .block_size = b, .dtype = DType::f32})),
        memory(std::size_t(*geo.pool_bytes(blocks)) / 4, -1.0f),
        view(*make_pool_view(geo, memory.data(), blocks)),
        num_blocks(blocks) {}

  // K of token slot `slot` (f32 element 0).
  float k_at(std::int32_t slot) const { return *reinterpret_cast<const float*>(view.row(slot / block, 0, 0, slot % block, 0)); }
  float v_at(std::int32_t slot) const { return *reinterpret_cast<const float*>(view.row(slot / block, 0, 1, slot % block, 0)); }

  // What the engine does for one layer's write: moves, then the tokens (scatter, or ring_write when n <= W).
  void run(std::span<const SlotMove> moves, std::span<const std::int32_t> slots, std::span<const std::int32_t> promote,
           std::int32_t seq, std::int32_t layer, std::int64_t pos0, std::int32_t n) {
    const std::int32_t H = cfg.num_kv_heads;
    std::vector<float> k(std::size_t(n * H * kDim)), v(k.size());
    for (std::int32_t t = 0; t < n; ++t)
      for (std::int32_t h = 0; h < H; ++h)
        for (std::int32_t d = 0; d < kDim; ++d) {
          k[std::size_t((t * H + h) * kDim + d)] = key_of(seq, layer, h, std::int32_t(pos0 + t));
          v[std::size_t((t * H + h) * kDim + d)] = -key_of(seq, layer, h, std::int32_t(pos0 + t));
        }
    const KvSource src{k.data(), v.data(), DType::f32, 0, kDim * 4, 0};
    if (!promote.empty()) {
      REQUIRE(ring_write_host({view, src, n * H, 0, 1, slots.data(), promote.data()}).ok());
      return;
    }
    if (!moves.empty()) REQUIRE(compaction_host({view, moves.data(), std::int32_t(moves.size())}).ok());
    REQUIRE(scatter_host({view, src, TokenAddress{slots.data()}, n * H}).ok());
  }
};

// Every head of s against the reference, through a head-folded CSR export per layer.
void require_matches(const Rig& rig, SeqId s, std::int32_t seq_tag, const std::vector<RefHead>& ref) {
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
        REQUIRE(rig.k_at(slot) == key_of(seq_tag, l, h, want[x]));
        REQUIRE(rig.v_at(slot) == -key_of(seq_tag, l, h, want[x]));
      }
    }
  }
}
}  // namespace

TEST_CASE("write gate admission matches the per-head reference through prefill chunks, decode, rollback and free") {
  auto rng = fresh_rng();
  for (int trial = 0; trial < 24; ++trial) {
    const std::int32_t block = trial % 2 ? 4 : 2, w = block * (1 + std::int32_t(rng() % 4));
    WriteGateConfig cfg{.num_layers = 1 + std::int32_t(rng() % 2), .num_kv_heads = 1 + std::int32_t(rng() % 3),
                        .local_window = w, .tau = 0.5f};
    cfg.global_cap = trial % 3 == 0 ? 3 + std::int32_t(rng() % 6) : 0;
    cfg.at_cap = GlobalCapAction::drop;
    const std::int32_t row_blocks = w / block + 6, L = cfg.num_layers, H = cfg.num_kv_heads;
    Rig rig(cfg, block, 2, row_blocks, 2 * L * H * row_blocks + 1);
    const std::int32_t cap = rig.gate.global_cap();
    CAPTURE(trial, block, w, L, H, cap);
    for (int life = 0; life < 2; ++life) {
      SeqId s = *rig.gate.add(rig.table);
      std::vector<RefHead> ref(std::size_t(L * H), RefHead(w));
      std::int64_t appended = 0;
      const double admit_rate = 0.2 + 0.6 * double(rng() % 100) / 100.0;
      for (int step = 0; step < 40; ++step) {
        const int kind = int(rng() % 8);
        if (kind == 0 && appended > 0) {  // rollback
          const std::int32_t n = 1 + std::int32_t(rng() % std::uint64_t(std::min<std::int64_t>(appended, w)));
          std::vector<SlotMove> moves(std::size_t(L * H * 2 * w));
          std::int32_t limit = std::int32_t(appended);
          for (const auto& h : ref) limit = std::min(limit, h.rollback_limit(appended));
          auto r = rig.gate.truncate(rig.table, rig.pool, s, n, moves);
          if (n > limit) {
            REQUIRE(r.status().code() == Errc::truncate_too_many);
            REQUIRE(r.status().limit() == limit);
            continue;
          }
          REQUIRE(r.ok());
          for (auto& h : ref) h.truncate(n);
          appended -= n;
          if (*r > 0) REQUIRE(compaction_host({rig.view, moves.data(), *r}).ok());
        } else {  // a prefill chunk (long or short) or a decode step, every layer
          const std::int32_t n = kind == 1 ? 1 + std::int32_t(rng() % std::uint64_t(3 * w)) : (kind == 2 ? 1 + std::int32_t(rng() % std::uint64_t(w)) : 1);
          if (appended + n > 4000) break;
          for (std::int32_t l = 0; l < L; ++l) {
            std::vector<float> gates(std::size_t(n * H));
            for (auto& g : gates) g = double(rng() % 1000) / 1000.0 < admit_rate ? 0.5f + float(rng() % 500) / 1000.0f : float(rng() % 500) / 1000.0f;
            std::vector<std::int32_t> slots(gates.size(), -7), promote;
            const bool fused = n <= w && rng() % 2;
            if (fused) promote.assign(gates.size(), -7);
            std::vector<SlotMove> moves(std::size_t(n * H + H * w));
            auto info = rig.gate.write(rig.table, rig.pool, s, l, gates, slots, moves, promote);
            REQUIRE(info.ok());
            std::int32_t at_cap = 0;
            for (std::int32_t t = 0; t < n; ++t)
              for (std::int32_t h = 0; h < H; ++h)
                REQUIRE(ref[std::size_t(l * H + h)].write(std::int32_t(appended + t), gates[std::size_t(t * H + h)] >= 0.5f, cap, false, at_cap));
            REQUIRE(info->dropped_at_cap == at_cap);
            // A parallel scatter needs every written slot once, and no move to land where a token is written.
            std::vector<std::int32_t> written;
            for (auto x : slots)
              if (x >= 0) written.push_back(x);
            for (std::int32_t m = 0; m < info->moves; ++m) written.push_back(moves[std::size_t(m)].dst);
            std::sort(written.begin(), written.end());
            REQUIRE(std::adjacent_find(written.begin(), written.end()) == written.end());
            REQUIRE(std::count(slots.begin(), slots.end(), -7) == 0);
            rig.run(std::span<const SlotMove>(moves.data(), std::size_t(info->moves)), slots, promote, life, l, appended, n);
          }
          appended += n;
        }
        REQUIRE(rig.gate.appended(s).value() == appended);
        REQUIRE(rig.gate.check(rig.table).ok());
        REQUIRE(rig.table.check(rig.pool).ok());
        REQUIRE(rig.pool.check().ok());
        require_matches(rig, s, life, ref);
        REQUIRE(std::int64_t(rig.num_blocks - 1 - rig.pool.num_free()) <= rig.gate.max_blocks_held(appended));
      }
      REQUIRE(rig.gate.free(rig.table, rig.pool, s).ok());
      REQUIRE(rig.pool.num_free() == rig.num_blocks - 1);
      REQUIRE(rig.gate.positions(s, 0, 0).status().code() == Errc::unknown_sequence);
    }
  }
}

TEST_CASE("write gate admission: bad gates, small buffers, the cap, the pool and rollback limits are typed errors, and nothing changes") {
  WriteGateConfig cfg{.num_layers = 2, .num_kv_heads = 2, .local_window = 4, .tau = 0.5f, .global_cap = 2};
  Rig rig(cfg, 2, 2, 5, 16);
  SeqId s = *rig.gate.add(rig.table);
  std::vector<std::int32_t> slots(64);
  std::vector<SlotMove> moves(64);
  std::vector<float> ones(12, 1.0f);  // 6 tokens x 2 heads, all admitted
  for (std::int32_t l = 0; l < 2; ++l) REQUIRE(rig.gate.write(rig.table, rig.pool, s, l, ones, slots, moves).ok());
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
  expect(rig.gate.write(rig.table, rig.pool, s, 0, g, slots, moves).status(), Errc::invalid_argument, "gates_at");
  g[1] = 1.5f;
  expect(rig.gate.write(rig.table, rig.pool, s, 0, g, slots, moves).status(), Errc::invalid_argument, "gates_at");
  g[1] = -0.1f;
  expect(rig.gate.write(rig.table, rig.pool, s, 0, g, slots, moves).status(), Errc::invalid_argument, "gates_at");
  expect(rig.gate.write(rig.table, rig.pool, s, 0, std::vector<float>{0.5f, 0.5f, 0.5f}, slots, moves).status(),
         Errc::invalid_argument, "gates.size");
  expect(rig.gate.write(rig.table, rig.pool, s, 2, std::vector<float>{0.5f, 0.5f}, slots, moves).status(),
         Errc::invalid_argument, "layer");
  expect(rig.gate.write(rig.table, rig.pool, s, 0, std::vector<float>{0.5f, 0.5f}, std::span<std::int32_t>(slots.data(), 1), moves).status(),
         Errc::buffer_too_small, "slots");
  // The ring is full and holds admitted tokens: the next write promotes, and each head is at its cap of 2.
  expect(rig.gate.write(rig.table, rig.pool, s, 0, std::vector<float>{0.5f, 0.5f}, slots, moves).status(),
         Errc::capacity_exceeded, "global_cap");
  expect(rig.gate.truncate(rig.table, rig.pool, s, 5, moves).status(), Errc::truncate_too_many, "n_tokens");
  expect(rig.gate.truncate(rig.table, rig.pool, s, 1, std::span<SlotMove>(moves.data(), 0)).status(), Errc::buffer_too_small, "moves");
  expect(rig.gate.truncate(rig.table, rig.pool, s, -1, moves).status(), Errc::invalid_argument, "n_tokens");
  // Half a step (layer 0 only) cannot be rolled back.
  SeqId t = *rig.gate.add(rig.table);
  REQUIRE(rig.gate.write(rig.table, rig.pool, t, 0, std::vector<float>{0.5f, 0.5f}, slots, moves).ok());
  CHECK(std::string(rig.gate.truncate(rig.table, rig.pool, t, 1, moves).status().what()).starts_with("layers_appended"));
  REQUIRE(rig.gate.free(rig.table, rig.pool, t).ok());
  CHECK(rig.gate.free(rig.table, rig.pool, t).code() == Errc::unknown_sequence);
  CHECK(rig.gate.write(rig.table, rig.pool, t, 0, g, slots, moves).status().code() == Errc::unknown_sequence);
  CHECK(rig.pool.num_free() == pool0.num_free());  // t's blocks are back
  // The pool: 15 usable blocks, 12 in use (4 heads x (2 ring blocks + 1 global)); a fresh sequence's
  // 4-token prefill of one layer needs 2 heads x 2 blocks.
  SeqId u = *rig.gate.add(rig.table);
  const PageTable table1 = rig.table;
  const BlockPool pool1 = rig.pool;
  auto r = rig.gate.write(rig.table, rig.pool, u, 0, std::vector<float>(8, 0.5f), slots, moves);
  CHECK(r.status().code() == Errc::out_of_blocks);
  CHECK(rig.table == table1);
  CHECK(rig.pool == pool1);
  // Under `drop`, the same full heads drop the promotion instead, and count it.
  WriteGateConfig dcfg = cfg;
  dcfg.at_cap = GlobalCapAction::drop;
  Rig d(dcfg, 2, 1, 5, 16);
  SeqId q = *d.gate.add(d.table);
  for (std::int32_t l = 0; l < 2; ++l) REQUIRE(d.gate.write(d.table, d.pool, q, l, ones, slots, moves).ok());
  auto info = d.gate.write(d.table, d.pool, q, 0, std::vector<float>{0.5f, 0.5f}, slots, moves);
  REQUIRE(info.ok());
  CHECK(info->dropped_at_cap == 2);
  CHECK(d.gate.head_state(q, 0, 0)->global == 2);
  CHECK_THROWS_AS(WriteGate(WriteGateConfig{.local_window = 3}, 1, d.table), ConfigError);
  CHECK_THROWS_AS(WriteGate(WriteGateConfig{.tau = 1.5f}, 1, d.table), ConfigError);
  CHECK_THROWS_AS(WriteGate(WriteGateConfig{.num_layers = 9}, 1, d.table), ConfigError);
}
