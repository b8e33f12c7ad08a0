// Write-Gated KV without a host sync: the host allots (no gates), the device
// decides and moves (ring_admit, host backend, against its own global lengths
// and ring bits), and the host reconciles later, with a random lag, from the
// gates it reads back. After every device write its global lengths match the
// per-head reference; whenever nothing is pending, the host's heads, rows and
// the K/V read back through the head-folded export match it too, and no
// allotted block is left over. Then the contract's errors.
#include <catch2/catch.hpp>

#include <kvcache/admission/write_gate.hpp>
#include <kvcache/kernels/ring_admit.hpp>
#include <kvcache/table/page_table_export.hpp>

#include "write_gate_testing.hpp"

#include <deque>
#include <string>
#include <vector>

using namespace kvcache;
using namespace gate_testing;

namespace {
// The device: each head's global length and ring bits, per layer.
struct Device {
  std::vector<std::int32_t> gl;    // [layer][head]
  std::vector<std::uint8_t> bits;  // [layer][head][W]
  Device(std::int32_t L, std::int32_t H, std::int32_t W) : gl(static_cast<std::size_t>(L * H), 0), bits(static_cast<std::size_t>(L * H * W), 0) {}
};

// The device's ring_admit launch of n tokens: the policy's parameters (window,
// heads, its effective cap, tau), then the engine's inputs and device state.
RingAdmitParams launch(const WriteGate& gate, const PoolView& pool, const KvSource& src, const std::vector<float>& gates,
                       std::int32_t n, const std::vector<std::int32_t>& start, const std::vector<std::int32_t>& len,
                       std::int32_t* global_len, std::uint8_t* bits, const std::vector<std::int32_t>& rows,
                       std::int32_t row_stride) {
  RingAdmitParams p = gate.ring_admit_params();
  p.cache = pool;
  p.src = src;
  p.gates = gates.data();
  p.num_tokens = n;
  p.ring_start = start.data();
  p.ring_len = len.data();
  p.global_len = global_len;
  p.bits = bits;
  p.rows = rows.data();
  p.row_stride = row_stride;
  return p;
}
}  // namespace

TEST_CASE("deferred writes: the device decides, the host reconciles later, and both match the reference") {
  auto rng = fresh_rng();
  std::int64_t reconciled_with_lag = 0, steps_run = 0;
  for (int trial = 0; trial < 20; ++trial) {
    const std::int32_t block = trial % 2 ? 4 : 2, w = block * (1 + std::int32_t(rng() % 3));
    WriteGateConfig cfg{.num_layers = 1 + std::int32_t(rng() % 2), .num_kv_heads = 1 + std::int32_t(rng() % 3),
                        .local_window = w, .tau = 0.5f, .at_cap = GlobalCapAction::drop};
    const std::int32_t row_blocks = w / block + 48, L = cfg.num_layers, H = cfg.num_kv_heads;
    cfg.global_cap = trial % 3 == 0 ? 2 + std::int32_t(rng() % 6) : 0;
    const std::int32_t blocks = L * H * row_blocks + 1;
    BlockPool pool(blocks, 0);
    PageTable table(pool, std::int32_t(WriteGate::streams_for(cfg, 1)), row_blocks, block);
    WriteGate gate(cfg, 1, table);
    KvMemory mem(block, blocks, H);
    const std::int32_t cap = gate.global_cap();
    CAPTURE(trial, block, w, L, H, cap);
    const SeqId s = *gate.add(table);
    Device dev(L, H, w);
    std::vector<RefHead> ref(static_cast<std::size_t>(L * H), RefHead(w));
    std::vector<std::deque<std::vector<float>>> pending(static_cast<std::size_t>(L));
    std::int64_t appended = 0;
    const SeqId one[] = {s};
    for (int step = 0; step < 50; ++step) {
      const int kind = int(rng() % 4);
      const std::int32_t n = kind == 0 ? 1 + std::int32_t(rng() % std::uint64_t(3 * w)) : 1;
      // Total allotments stay within a row: rows grow as if every leaving token were admitted.
      if (appended + n + 4 * w > (row_blocks - 1) * block - w && cap == 0) break;
      for (std::int32_t l = 0; l < L; ++l) {
        std::vector<std::int32_t> start(static_cast<std::size_t>(H)), len(static_cast<std::size_t>(H)), rows(static_cast<std::size_t>(H * row_blocks));
        auto a = gate.allot(table, pool, s, l, n, {.ring_start = start, .ring_len = len});
        REQUIRE(a.ok());
        REQUIRE(export_heads_block_table(table, gate, one, l, rows, row_blocks).ok());
        std::vector<float> gates(static_cast<std::size_t>(n * H));
        for (auto& g : gates) g = float(rng() % 1000) / 1000.0f;
        const KvSource src = mem.source(0, l, appended, n);
        const RingAdmitParams p =
            launch(gate, mem.view, src, gates, n, start, len, dev.gl.data() + l * H, dev.bits.data() + l * H * w, rows, row_blocks);
        REQUIRE(ring_admit_host(p).ok());
        std::int32_t at_cap = 0;
        for (std::int32_t t = 0; t < n; ++t)
          for (std::int32_t h = 0; h < H; ++h)
            REQUIRE(ref[std::size_t(l * H + h)].write(std::int32_t(appended + t), gates[std::size_t(t * H + h)] >= 0.5f, cap,
                                                     false, at_cap));
        for (std::int32_t h = 0; h < H; ++h)  // the device agrees with the method at once
          REQUIRE(dev.gl[std::size_t(l * H + h)] == std::int32_t(ref[std::size_t(l * H + h)].global.size()));
        pending[std::size_t(l)].push_back(gates);
      }
      appended += n;
      ++steps_run;
      // The host catches up later: lag 0, 1 or 2 writes per layer.
      const std::size_t lag = std::size_t(rng() % 3);
      for (std::int32_t l = 0; l < L; ++l)
        while (pending[std::size_t(l)].size() > lag) {
          reconciled_with_lag += pending[std::size_t(l)].size() > 1 ? 1 : 0;
          REQUIRE(gate.reconcile(table, pool, s, l, pending[std::size_t(l)].front()).ok());
          pending[std::size_t(l)].pop_front();
        }
      REQUIRE(gate.check(table).ok());
      REQUIRE(table.check(pool).ok());
      if (lag > 0) continue;
      // Nothing pending: the host's heads and rows are the method's, and hold only their tokens.
      std::vector<std::int32_t> indptr(static_cast<std::size_t>(L * H + 1)), indices(static_cast<std::size_t>(L * H * row_blocks)), last(static_cast<std::size_t>(L * H));
      REQUIRE(export_heads_csr(table, gate, one, -1, indptr, indices, last).ok());
      std::int64_t used = 0;
      for (std::int32_t l = 0; l < L; ++l)
        for (std::int32_t h = 0; h < H; ++h) {
          const auto want = ref[std::size_t(l * H + h)].row();
          const auto got = *gate.positions(s, l, h);
          REQUIRE(std::vector<std::int32_t>(got.begin(), got.end()) == want);
          REQUIRE(gate.head_state(s, l, h)->global == dev.gl[std::size_t(l * H + h)]);
          const std::size_t r = std::size_t(l * H + h);
          used += indptr[r + 1] - indptr[r];
          REQUIRE(std::int32_t(blocks_for_tokens(std::int64_t(want.size()), block)) == indptr[r + 1] - indptr[r]);
          for (std::size_t j = 0; j < want.size(); ++j) {
            const std::int32_t slot = indices[std::size_t(indptr[r]) + j / std::size_t(block)] * block + std::int32_t(j % std::size_t(block));
            INFO("layer " << l << " head " << h << " row index " << j << " position " << want[j]);
            REQUIRE(mem.k_at(slot) == key_of(0, l, h, want[j]));
            REQUIRE(mem.v_at(slot) == -key_of(0, l, h, want[j]));
          }
        }
      REQUIRE(blocks - 1 - pool.num_free() == used);  // every unused allotted block went back
    }
    REQUIRE(gate.free(table, pool, s).ok());
    REQUIRE(pool.num_free() == blocks - 1);
  }
  REQUIRE(reconciled_with_lag > 0);  // the host really ran behind the device
  REQUIRE(steps_run > 400);
}

TEST_CASE("deferred writes: refuse at the cap, nothing to reconcile, bad gates, mixing with synchronous calls and too many pending are typed errors, and nothing changes") {
  WriteGateConfig cfg{.num_layers = 1, .num_kv_heads = 2, .local_window = 4, .tau = 0.5f, .at_cap = GlobalCapAction::drop};
  BlockPool pool(64, 0);
  PageTable table(pool, 4, 16, 2);
  WriteGate gate(cfg, 2, table);
  const SeqId s = *gate.add(table);
  std::vector<std::int32_t> start(2), len(2), slots(16);
  std::vector<SlotMove> moves(16);
  REQUIRE(gate.allot(table, pool, s, 0, 3, {.ring_start = start, .ring_len = len}).ok());
  const WriteGate gate0 = gate;
  const PageTable table0 = table;
  const BlockPool pool0 = pool;
  auto expect = [&](const Status& st, Errc code, const std::string& what) {
    CHECK(st.code() == code);
    CHECK(std::string(st.what()).starts_with(what));
    CHECK(gate == gate0);
    CHECK(table == table0);
    CHECK(pool == pool0);
  };
  expect(gate.reconcile(table, pool, s, 0, std::vector<float>(4, 0.5f)).status(), Errc::invalid_argument, "gates.size");
  std::vector<float> g(6, 0.5f);
  g[3] = 2.0f;
  expect(gate.reconcile(table, pool, s, 0, g).status(), Errc::invalid_argument, "gates_at");
  expect(gate.reconcile(table, pool, s, 1, std::vector<float>(6, 0.5f)).status(), Errc::invalid_argument, "layer");
  expect(gate.write(table, pool, s, 0, std::vector<float>(2, 0.5f), {.slots = slots, .moves = moves}).status(),
         Errc::invalid_argument, "pending_writes");
  const SeqId batch[] = {s};
  expect(gate.write_batch(table, pool, batch, 0, std::vector<float>(2, 0.5f), {.slots = slots, .moves = moves}).status(),
         Errc::invalid_argument, "pending_writes");
  expect(gate.truncate(table, pool, s, 1, {.moves = moves}).status(), Errc::invalid_argument, "pending_writes");
  expect(gate.fork(table, pool, s).status(), Errc::invalid_argument, "pending_writes");
  expect(gate.allot(table, pool, s, 0, 1, {.ring_start = std::span<std::int32_t>(start.data(), 1), .ring_len = len}).status(),
         Errc::buffer_too_small, "ring_start");
  for (int k = 1; k < WriteGate::max_pending; ++k) REQUIRE(gate.allot(table, pool, s, 0, 1, {.ring_start = start, .ring_len = len}).ok());
  CHECK(gate.pending(s, 0).value() == WriteGate::max_pending);
  CHECK(gate.allot(table, pool, s, 0, 1, {.ring_start = start, .ring_len = len}).status().code() == Errc::capacity_exceeded);
  for (int k = 0; k < WriteGate::max_pending; ++k)
    REQUIRE(gate.reconcile(table, pool, s, 0, std::vector<float>(static_cast<std::size_t>(k == 0 ? 6 : 2), 0.5f)).ok());
  CHECK(gate.reconcile(table, pool, s, 0, std::vector<float>(2, 0.5f)).status().code() == Errc::invalid_argument);
  CHECK(gate.pending(s, 0).value() == 0);
  CHECK(gate.check(table).ok());
  // Refuse at the cap cannot be deferred: the device has no way to fail a write.
  WriteGateConfig refuse = cfg;
  refuse.at_cap = GlobalCapAction::refuse;
  BlockPool pool2(64, 0);
  PageTable table2(pool2, 4, 16, 2);
  WriteGate strict(refuse, 2, table2);
  const SeqId t = *strict.add(table2);
  auto r = strict.allot(table2, pool2, t, 0, 1, {.ring_start = start, .ring_len = len});
  CHECK(r.status().code() == Errc::invalid_argument);
  CHECK(std::string(r.status().what()).starts_with("at_cap"));
}

TEST_CASE("ring_admit's policy parameters come from the policy, so the device cannot diverge from the host's replay") {
  // The config's global_cap 0 means "as many as the row holds", and tau is
  // not the default: the launch takes both from ring_admit_params().
  const std::int32_t block = 2, w = 4, row_blocks = w / block + 16;
  const WriteGateConfig cfg{.num_layers = 1, .num_kv_heads = 2, .local_window = w, .tau = 0.7f, .global_cap = 0,
                            .at_cap = GlobalCapAction::drop};
  const std::int32_t blocks = 2 * row_blocks + 1, H = 2;
  BlockPool pool(blocks, 0);
  PageTable table(pool, std::int32_t(WriteGate::streams_for(cfg, 1)), row_blocks, block);
  WriteGate gate(cfg, 1, table);
  const RingAdmitParams policy = gate.ring_admit_params();
  CHECK(policy.window == w);
  CHECK(policy.num_heads == H);
  CHECK(policy.tau == 0.7f);
  CHECK(policy.global_limit == gate.global_cap());
  CHECK(policy.global_limit == row_blocks * block - w);  // the config's 0: the whole row past the ring, a number here
  KvMemory mem(block, blocks, H);
  const SeqId s = *gate.add(table);
  const SeqId one[] = {s};
  Device dev(1, H, w), typed(1, H, w);  // typed: a launch whose cap an engine copied from the config (0)
  std::int64_t appended = 0;
  for (int step = 0; step < 12; ++step, ++appended) {
    std::vector<std::int32_t> start(H), len(H), rows(static_cast<std::size_t>(H * row_blocks));
    REQUIRE(gate.allot(table, pool, s, 0, 1, {.ring_start = start, .ring_len = len}).ok());
    REQUIRE(export_heads_block_table(table, gate, one, 0, rows, row_blocks).ok());
    const std::vector<float> gates{0.9f, step % 2 ? 0.8f : 0.6f};  // head 0 admits all; head 1 every other token (>= 0.7)
    const RingAdmitParams p =
        launch(gate, mem.view, mem.source(0, 0, appended, 1), gates, 1, start, len, dev.gl.data(), dev.bits.data(), rows, row_blocks);
    REQUIRE(ring_admit_host(p).ok());
    RingAdmitParams q = p;  // the slip the issue found: a literal 0 where the policy's cap belongs
    q.global_limit = 0;
    q.global_len = typed.gl.data();
    q.bits = typed.bits.data();
    REQUIRE(ring_admit_host(q).ok());
    REQUIRE(gate.reconcile(table, pool, s, 0, gates).ok());
    for (std::int32_t h = 0; h < H; ++h) {  // the device's global length is the host's, after every step
      INFO("step " << step << " head " << h);
      REQUIRE(dev.gl[std::size_t(h)] == gate.head_state(s, 0, h)->global);
    }
  }
  // Tokens left the rings admitted: the host promoted them, and so did the
  // device given the policy's parameters; the hand-typed launch promoted none.
  CHECK(gate.head_state(s, 0, 0)->global == 12 - w);
  CHECK(gate.head_state(s, 0, 1)->global == (12 - w) / 2);
  CHECK(typed.gl[0] == 0);
  CHECK(gate.check(table).ok());
}

TEST_CASE("device_state seeds the device after host writes, and the deferred writes that follow agree with the host") {
  const std::int32_t block = 2, w = 4, row_blocks = w / block + 16, H = 2;
  const WriteGateConfig cfg{.num_layers = 1, .num_kv_heads = H, .local_window = w, .tau = 0.5f, .at_cap = GlobalCapAction::drop};
  const std::int32_t blocks = H * row_blocks + 1;
  BlockPool pool(blocks, 0);
  PageTable table(pool, std::int32_t(WriteGate::streams_for(cfg, 1)), row_blocks, block);
  WriteGate gate(cfg, 1, table);
  KvMemory mem(block, blocks, H);
  const SeqId s = *gate.add(table);
  const SeqId one[] = {s};
  // A host prefill of 7 tokens: the ring holds the last 4, the admitted older ones went global.
  std::vector<float> prefill(7 * H);
  for (std::size_t i = 0; i < prefill.size(); ++i) prefill[i] = i % 3 == 0 ? 0.9f : 0.1f;
  std::vector<std::int32_t> slots(7 * H);
  std::vector<SlotMove> moves(16);
  std::vector<BlockCopy> copies(8);
  REQUIRE(gate.write(table, pool, s, 0, prefill, {.slots = slots, .moves = moves, .copies = copies}).ok());
  Device dev(1, H, w);
  std::vector<std::int32_t> too_small(1);
  CHECK(gate.device_state(s, 0, too_small, dev.bits).code() == Errc::buffer_too_small);
  CHECK(gate.device_state(s, 1, dev.gl, dev.bits).code() == Errc::invalid_argument);  // no layer 1
  REQUIRE(gate.device_state(s, 0, dev.gl, dev.bits).ok());
  for (std::int32_t h = 0; h < H; ++h) {
    const auto st = *gate.head_state(s, 0, h);
    CHECK(dev.gl[std::size_t(h)] == st.global);
    for (std::int32_t r = 0; r < w; ++r) {  // ring slot r holds position p; its bit is p's gate >= tau
      const auto positions = *gate.positions(s, 0, h);
      const std::int32_t p = positions[std::size_t(r)];
      CHECK(dev.bits[std::size_t(h * w + r)] == (prefill[std::size_t(p * H + h)] >= 0.5f ? 1 : 0));
    }
  }
  // Decode on the device from the seeded state: after each reconcile the lengths agree.
  std::int64_t appended = 7;
  for (int step = 0; step < 10; ++step, ++appended) {
    std::vector<std::int32_t> start(H), len(H), rows(static_cast<std::size_t>(H * row_blocks));
    REQUIRE(gate.allot(table, pool, s, 0, 1, {.ring_start = start, .ring_len = len}).ok());
    CHECK(gate.device_state(s, 0, dev.gl, dev.bits).code() == Errc::invalid_argument);  // pending: the device is ahead
    REQUIRE(export_heads_block_table(table, gate, one, 0, rows, row_blocks).ok());
    const std::vector<float> gates{0.9f, step % 2 ? 0.9f : 0.1f};
    const RingAdmitParams p =
        launch(gate, mem.view, mem.source(0, 0, appended, 1), gates, 1, start, len, dev.gl.data(), dev.bits.data(), rows, row_blocks);
    REQUIRE(ring_admit_host(p).ok());
    REQUIRE(gate.reconcile(table, pool, s, 0, gates).ok());
    for (std::int32_t h = 0; h < H; ++h) REQUIRE(dev.gl[std::size_t(h)] == gate.head_state(s, 0, h)->global);
  }
  CHECK(gate.check(table).ok());
}
