// kvcache, composed: Write-Gated KV admits (a ring of the last W tokens per
// head, older tokens kept only when their gate passed), Quest selects the
// pages a decode query reads, H2O keeps each head's heaviest admitted tokens.
// Prefill writes synchronously; decode writes without waiting for its gates
// (allot, ring_admit with the policy's parameters, reconcile a step later),
// as a GPU engine does. At the end every head row is read back through the
// exported table and checked against the positions the cache says it holds.
#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/gather.hpp>
#include <kvcache/kernels/page_bounds.hpp>
#include <kvcache/kernels/ring_admit.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kvcache.hpp>

#include <fmt/format.h>

#include <cstdint>
#include <vector>

namespace kv = kvcache;

namespace {
constexpr std::int32_t L = 2, H = 2, D = 4, B = 4, W = 8, kRow = 16, kBlocks = 160;
float key(std::int32_t l, std::int32_t h, std::int64_t pos) { return 1000.0f * float(l) + 100.0f * float(h) + float(pos); }
float gate(std::int32_t l, std::int32_t h, std::int64_t pos) { return (pos * 7 + l * 3 + h) % 3 == 0 ? 0.9f : 0.05f; }
// One layer's K (V = -K) of tokens [first, first + n): [n][H][D], head h of token t at t * H + h.
std::vector<float> layer_kv(std::int32_t l, std::int64_t first, std::int32_t n, float sign) {
  std::vector<float> x(std::size_t(n * H * D));
  for (std::int32_t t = 0; t < n; ++t)
    for (std::int32_t h = 0; h < H; ++h)
      for (std::int32_t d = 0; d < D; ++d) x[std::size_t((t * H + h) * D + d)] = sign * key(l, h, first + t);
  return x;
}
std::vector<float> layer_gates(std::int32_t l, std::int64_t first, std::int32_t n) {
  std::vector<float> g(std::size_t(n * H));
  for (std::int32_t t = 0; t < n; ++t)
    for (std::int32_t h = 0; h < H; ++h) g[std::size_t(t * H + h)] = gate(l, h, first + t);
  return g;
}
}  // namespace

int main() {
  const auto g = kv::Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = D, .block_size = B,
                                     .dtype = kv::DType::f32}).value();  // single-head blocks: one row per head
  std::vector<std::byte> memory(std::size_t(g.pool_bytes(kBlocks).value()));
  const auto pool = kv::make_pool_view(g, memory.data(), kBlocks).value();
  std::vector<float> bounds(std::size_t(kv::QuestSelection::bounds_floats(g, kBlocks)));
  kv::GatedCache<kv::WriteGate, kv::QuestSelection, kv::H2OEviction> cache(
      {.geometry = g, .num_blocks = kBlocks, .max_sequences = 2, .max_blocks_per_sequence = kRow},
      kv::WriteGateConfig{.num_layers = L, .num_kv_heads = H, .local_window = W, .tau = 0.5f,
                          .at_cap = kv::GlobalCapAction::drop},  // deferred writes need drop
      kv::QuestConfig{.token_budget = 2 * B, .dense_layers = 1, .bounds = bounds}, kv::H2OEviction({.heavy = 12, .recent = 0}));
  const kv::SeqId seq = cache.add_sequence().value(), batch[] = {seq};
  float* page_bounds = cache.page_bounds(0)->data();
  std::vector<std::int32_t> slots(256), stale(L * H * kRow), fill(stale.size()), rows(H * kRow);
  std::vector<kv::SlotMove> moves(128), evicted(L * H * kRow * B);
  std::vector<kv::BlockCopy> copies(L * H * kRow);
  auto fail = [](const char* what, const kv::Status& st) { return fmt::print("{}: {}\n", what, st.message()), 1; };

  // Prefill, synchronous: where each token goes, then copies, promotions, the tokens; their bounds.
  const std::int32_t prompt = 24;
  for (std::int32_t l = 0; l < L; ++l) {
    const auto gates = layer_gates(l, 0, prompt), k = layer_kv(l, 0, prompt, 1), v = layer_kv(l, 0, prompt, -1);
    auto r = cache.write(seq, l, gates, {.slots = slots, .moves = moves, .copies = copies});
    if (!r) return fail("write", r.status());
    const kv::KvSource src{.k = k.data(), .v = v.data(), .dtype = kv::DType::f32, .token_stride = D * 4, .head_stride = D * 4};
    if (!kv::block_copy_host({.src = pool, .dst = pool, .pairs = copies.data(), .num_pairs = r->copies}) ||
        !kv::compaction_host({.cache = pool, .moves = moves.data(), .num_moves = r->moves}) ||
        !kv::scatter_host({.cache = pool, .src = src, .addr = {.slots = slots.data()}, .num_tokens = prompt * H}))
      return 1;
    for (std::int32_t m = 0; m < r->moves; ++m) slots[std::size_t(prompt * H + m)] = moves[std::size_t(m)].dst;
    if (!kv::page_bounds_update_host({.cache = pool, .layer = 0, .slots = slots.data(),
                                      .num_tokens = prompt * H + r->moves, .bounds = page_bounds}))
      return 1;
  }

  // Decode without a host sync: the device decides promotions against its own state (global
  // lengths, ring bits), the host replays them one step later with the gates it copied back.
  std::vector<std::int32_t> global_len(L * H);
  std::vector<std::uint8_t> ring_bits(L * H * W);
  auto seed_device = [&] {  // the device's state := the host's (after host writes or an eviction)
    for (std::int32_t l = 0; l < L; ++l)
      if (!cache.admission().device_state(seq, l, std::span(global_len).subspan(std::size_t(l * H), H),
                                          std::span(ring_bits).subspan(std::size_t(l * H * W), H * W)))
        return false;
    return true;
  };
  if (!seed_device()) return 1;
  std::vector<std::vector<float>> landed(L);  // each layer's gates of the previous step
  std::int64_t pos = prompt, pages_read = 0;
  for (int step = 0; step < 40; ++step, ++pos) {
    for (std::int32_t l = 0; l < L; ++l)  // the host catches up: last step's gates have landed
      if (!landed[std::size_t(l)].empty())
        if (auto r = cache.reconcile(seq, l, landed[std::size_t(l)]); !r) return fail("reconcile", r.status());
    auto listed = cache.stale_pages(batch, {stale, fill});  // promotions, compactions: recompute their bounds
    if (!listed || !kv::page_bounds_host({.cache = pool, .layer = 0, .pages = stale.data(), .fill = fill.data(),
                                          .num_pages = *listed, .bounds = page_bounds}))
      return 1;
    for (std::int32_t l = 0; l < L; ++l) {
      std::vector<std::int32_t> start(H), len(H);
      auto a = cache.allot(seq, l, 1, {.ring_start = start, .ring_len = len, .copies = copies});
      if (!a || !cache.export_heads_block_table(batch, l, rows, kRow)) return 1;
      const auto gates = layer_gates(l, pos, 1), k = layer_kv(l, pos, 1, 1), v = layer_kv(l, pos, 1, -1);
      kv::RingAdmitParams p = cache.admission().ring_admit_params();  // window, cap, tau: the policy's
      p.cache = pool;
      p.src = {.k = k.data(), .v = v.data(), .dtype = kv::DType::f32, .token_stride = D * 4};  // entry t * H + h
      p.gates = gates.data();
      p.num_tokens = 1;
      p.ring_start = start.data(), p.ring_len = len.data();
      p.global_len = global_len.data() + l * H, p.bits = ring_bits.data() + l * H * W;
      p.rows = rows.data(), p.row_stride = kRow;
      if (!kv::ring_admit_host(p)) return 1;
      landed[std::size_t(l)] = gates;
      std::vector<float> queries(H * D, 1.0f);  // Quest: the pages this layer's query reads
      std::vector<std::int32_t> indptr(H + 1), indices(H * kRow);
      auto n = cache.select(batch, l, queries, {indptr, indices});
      if (!n) return fail("select", n.status());
      pages_read += *n;
    }
    if (step % 8 != 7) continue;
    for (std::int32_t l = 0; l < L; ++l) {  // reconcile first: nothing moves while a write is pending
      if (auto r = cache.reconcile(seq, l, landed[std::size_t(l)]); !r) return fail("reconcile", r.status());
      landed[std::size_t(l)].clear();
      std::vector<std::int32_t> lengths(H);
      if (!cache.export_heads_lengths(batch, l, lengths)) return 1;
      std::vector<float> scores;  // attention's column sums: here the newer the heavier
      for (std::int32_t h = 0; h < H; ++h)
        for (std::int32_t j = 0; j < lengths[std::size_t(h)]; ++j) scores.push_back(float(j % 5));
      if (auto st = cache.observe(seq, l, kv::ScoreKind::head_attention_sums, scores); !st) return fail("observe", st);
    }
    auto e = cache.evict(seq, evicted);  // each head's global region back to its 12 heaviest
    if (!e || !kv::compaction_host({.cache = pool, .moves = evicted.data(), .num_moves = e->moves}) || !seed_device())
      return 1;
  }
  for (std::int32_t l = 0; l < L; ++l)
    if (!landed[std::size_t(l)].empty() && !cache.reconcile(seq, l, landed[std::size_t(l)])) return 1;

  // Read every head row back through the exported CSR: each token's K is the one of its position.
  std::int64_t checked = 0;
  for (std::int32_t l = 0; l < L; ++l) {
    std::vector<std::int32_t> indptr(H + 1), indices(H * kRow), last(H), lengths(H);
    if (!cache.export_heads_csr(batch, l, indptr, indices, last) || !cache.export_heads_lengths(batch, l, lengths)) return 1;
    const std::vector<std::int32_t> out_indptr{0, lengths[0], lengths[0] + lengths[1]};
    std::vector<float> k_out(std::size_t(out_indptr[2] * D)), v_out(k_out.size());
    if (!kv::gather_host({.cache = pool, .indptr = indptr.data(), .indices = indices.data(), .out_indptr = out_indptr.data(),
                          .num_seqs = H, .num_rows = out_indptr[2], .k_out = k_out.data(), .v_out = v_out.data(),
                          .out_dtype = kv::DType::f32, .token_stride = D * 4, .head_stride = D * 4}))
      return 1;
    for (std::int32_t h = 0; h < H; ++h) {
      const auto positions = cache.admission().positions(seq, l, h).value();
      for (std::int32_t j = 0; j < lengths[std::size_t(h)]; ++j, ++checked)
        if (k_out[std::size_t((out_indptr[std::size_t(h)] + j) * D)] != key(l, h, positions[std::size_t(j)]))
          return fmt::print("layer {} head {}: row token {} is not position {} (read {})\n", l, h, j, positions[std::size_t(j)], k_out[std::size_t((out_indptr[std::size_t(h)] + j) * D)]), 1;
    }
  }
  if (auto st = cache.check_invariants(); !st) return fail("invariants", st);
  fmt::print("{} tokens written per head, {} held over {} head rows, every one read back ({}), {} pages read by Quest\n",
             pos, *cache.tokens_held(seq), L * H, checked, pages_read);
}
