// Write-Gated KV's host bookkeeping. A decode step of 256 sequences x 32
// layers x 8 kv-heads (W = 256, block 16, a fifth of the tokens admitted)
// through Cache<..., WriteGate>::write_batch (and per-sequence write), against
// the bare cache's decode step over as many single-head streams (and over 256
// sequences) in the same run, and the head-folded CSR export against today's
// CSR export over rows of the same lengths. Reference: memcpy
// of the bytes each row writes (out_bytes), same run; bench/report.py makes
// the table. Per-stream figures: time / streams (counter).
#include <kvcache/admission/write_gate.hpp>
#include <kvcache/kvcache.hpp>

#include <benchmark/benchmark.h>

#include "memcpy_reference.hpp"

#include <cstring>
#include <random>
#include <vector>

namespace kv = kvcache;

namespace {
constexpr std::int32_t kSeqs = 256, kLayers = 32, kHeads = 8, kW = 256, kB = 16, kPrefill = 512, kSteps = 256;
constexpr std::int32_t kRowBlocks = 40;  // ring 16 blocks + a global region that stays under 24 blocks here
using GateCache = kv::GatedCache<kv::WriteGate>;

// Gates: a fifth admitted, fixed seed.
std::vector<float> gates_for(std::int64_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> g(static_cast<std::size_t>(n));
  for (auto& x : g) x = rng() % 5 == 0 ? 0.9f : 0.02f;
  return g;
}

GateCache make_gate_cache() {
  return GateCache({.geometry = *kv::Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = 128, .block_size = kB}),
                    .num_blocks = kSeqs * kLayers * kHeads * 28 + 1, .max_sequences = kSeqs,
                    .max_blocks_per_sequence = kRowBlocks},
                   kv::WriteGateConfig{.num_layers = kLayers, .num_kv_heads = kHeads, .local_window = kW, .tau = 0.1f});
}

// 256 sequences, each layer prefilled with 512 tokens (ragged global lengths per head).
std::vector<kv::SeqId> prefill(GateCache& cache) {
  std::vector<kv::SeqId> seqs;
  std::vector<std::int32_t> slots(static_cast<std::size_t>(kPrefill * kHeads));
  std::vector<kv::SlotMove> moves(static_cast<std::size_t>(kW * kHeads));
  for (std::int32_t k = 0; k < kSeqs; ++k) {
    seqs.push_back(*cache.add_sequence());
    for (std::int32_t l = 0; l < kLayers; ++l) {
      const auto g = gates_for(std::int64_t(kPrefill) * kHeads, std::uint32_t(k * kLayers + l));
      if (!cache.write(seqs.back(), l, g, {.slots = slots, .moves = moves})) std::abort();
    }
  }
  return seqs;
}

// One decode step, one write_batch per layer: every sequence writes one token (8 gates).
void BM_gate_decode_step_256x32x8(benchmark::State& state) {
  auto cache = make_gate_cache();
  const auto seqs = prefill(cache);
  const auto gates = gates_for(std::int64_t(kSteps + 1) * kHeads * kSeqs * 7, 9);  // a window of it per call
  std::vector<std::int32_t> slots(static_cast<std::size_t>(kSeqs * kLayers * kHeads)), promote(slots.size());
  std::vector<kv::SlotMove> moves(static_cast<std::size_t>(kSeqs * kHeads));
  constexpr std::size_t per_layer = std::size_t(kSeqs) * kHeads;
  std::size_t at = 0;
  for (auto _ : state) {
    for (std::int32_t l = 0; l < kLayers; ++l) {
      const std::size_t off = std::size_t(l) * per_layer;
      auto r = cache.write_batch(seqs, l, std::span<const float>(gates.data() + at, per_layer),
                                 {.slots = {slots.data() + off, per_layer}, .moves = moves, .promote = {promote.data() + off, per_layer}});
      benchmark::DoNotOptimize(r);
      at = (at + per_layer) % (gates.size() - per_layer);
    }
    benchmark::ClobberMemory();
  }
  state.counters["out_bytes"] = double(slots.size() * 4);
  state.counters["streams"] = double(kSeqs) * kLayers * kHeads;
}

// The same step with one write() per (sequence, layer).
void BM_gate_decode_step_256x32x8_per_sequence(benchmark::State& state) {
  auto cache = make_gate_cache();
  const auto seqs = prefill(cache);
  const auto gates = gates_for(std::int64_t(kSteps + 1) * kHeads * kLayers * 7, 9);  // a window of it per call
  std::vector<std::int32_t> slots(static_cast<std::size_t>(kSeqs * kLayers * kHeads));
  std::vector<kv::SlotMove> moves(static_cast<std::size_t>(kHeads));
  std::size_t at = 0;
  for (auto _ : state) {
    std::int32_t* out = slots.data();
    for (std::int32_t l = 0; l < kLayers; ++l)
      for (const kv::SeqId s : seqs) {
        auto r = cache.write(s, l, std::span<const float>(gates.data() + at, kHeads), {.slots = {out, kHeads}, .moves = moves});
        benchmark::DoNotOptimize(r);
        out += kHeads;
        at = (at + kHeads) % (gates.size() - kHeads);
      }
    benchmark::ClobberMemory();
  }
  state.counters["out_bytes"] = double(slots.size() * 4);
  state.counters["streams"] = double(kSeqs) * kLayers * kHeads;
}

// The bare cache's decode step: `streams` rows of `prefill` tokens, then
// reserve_batch of one token each (kSteps iterations: rows never overflow).
void bare_decode_step(benchmark::State& state, std::int32_t layers, std::int32_t heads, std::int32_t streams,
                      std::int32_t prefill) {
  const std::int32_t per_row = (prefill + kSteps) / kB + 2;
  kv::Cache<> cache({.geometry = *kv::Geometry::make({.num_layers = layers, .num_kv_heads = heads, .head_dim = 128, .block_size = kB}),
                     .num_blocks = streams * per_row + 1, .max_sequences = streams, .max_blocks_per_sequence = per_row});
  std::vector<kv::SeqId> seqs(static_cast<std::size_t>(streams));
  std::vector<std::int32_t> slots(static_cast<std::size_t>(prefill)), ones(seqs.size(), 1), step(seqs.size());
  std::vector<kv::BlockCopy> copies(seqs.size());
  for (auto& s : seqs) {
    s = *cache.add_sequence();
    (void)cache.reserve(s, prefill, slots);
  }
  for (auto _ : state) {
    auto r = cache.reserve_batch(seqs, ones, step, copies);
    benchmark::DoNotOptimize(r);
    benchmark::ClobberMemory();
  }
  state.counters["out_bytes"] = double(streams) * 4;
  state.counters["streams"] = streams;
}

// One stream per sequence holds every layer and head: reserve_batch of 256 x 1.
void BM_bare_decode_step_256(benchmark::State& state) { bare_decode_step(state, kLayers, kHeads, kSeqs, kPrefill - 3); }

// As many single-head streams as the gate's step (one per (sequence, layer,
// kv-head)), each about a gate row's length: reserve_batch of 65,536 x 1.
void BM_bare_decode_step_65536_streams(benchmark::State& state) {
  bare_decode_step(state, 1, 1, kSeqs * kLayers * kHeads, kW + kPrefill / 5 - 3);
}

// Exports per row: the head-folded CSR of one layer (2,048 head rows) and
// today's CSR over 2,048 sequences whose rows have the same block counts.
void BM_heads_csr_export_2048_rows(benchmark::State& state) {
  auto cache = make_gate_cache();
  const auto seqs = prefill(cache);
  std::vector<std::int32_t> indptr(kSeqs * kHeads + 1), indices(static_cast<std::size_t>(kSeqs * kHeads * kRowBlocks)), last(kSeqs * kHeads);
  std::int64_t nnz = 0;
  for (auto _ : state) {
    auto r = cache.export_heads_csr(seqs, 0, indptr, indices, last);
    nnz = r.value_or(0);
    benchmark::DoNotOptimize(r);
    benchmark::ClobberMemory();
  }
  state.counters["out_bytes"] = double(4 * (2 * kSeqs * kHeads + 1 + nnz));
  state.counters["rows"] = kSeqs * kHeads;
}

void BM_csr_export_2048_rows(benchmark::State& state) {
  // The same rows: build the gate cache's layer-0 head rows' lengths, then as many plain sequences.
  auto gate = make_gate_cache();
  const auto gseqs = prefill(gate);
  std::vector<std::int32_t> lens(kSeqs * kHeads);
  if (!gate.export_heads_lengths(gseqs, 0, lens)) std::abort();
  kv::Cache<> cache({.geometry = *kv::Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = 128, .block_size = kB}),
                     .num_blocks = kSeqs * kHeads * kRowBlocks + 1, .max_sequences = kSeqs * kHeads,
                     .max_blocks_per_sequence = kRowBlocks});
  std::vector<kv::SeqId> seqs;
  std::vector<std::int32_t> slots(static_cast<std::size_t>(kRowBlocks * kB));
  for (const std::int32_t n : lens) {
    seqs.push_back(*cache.add_sequence());
    (void)cache.reserve(seqs.back(), n, slots);
  }
  std::vector<std::int32_t> indptr(kSeqs * kHeads + 1), indices(static_cast<std::size_t>(kSeqs * kHeads * kRowBlocks)), last(kSeqs * kHeads);
  std::int64_t nnz = 0;
  for (auto _ : state) {
    auto r = cache.export_csr(seqs, indptr, indices, last);
    nnz = r.value_or(0);
    benchmark::DoNotOptimize(r);
    benchmark::ClobberMemory();
  }
  state.counters["out_bytes"] = double(4 * (2 * kSeqs * kHeads + 1 + nnz));
  state.counters["rows"] = kSeqs * kHeads;
}
}  // namespace

BENCHMARK(BM_memcpy)->Arg(kSeqs * kLayers * kHeads * 4)->Arg(kSeqs * 4);
BENCHMARK(BM_gate_decode_step_256x32x8)->Iterations(kSteps)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_gate_decode_step_256x32x8_per_sequence)->Iterations(kSteps)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_bare_decode_step_256)->Iterations(kSteps)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_bare_decode_step_65536_streams)->Iterations(kSteps)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_heads_csr_export_2048_rows)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_csr_export_2048_rows)->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
