// Host bookkeeping benchmarks. Reference, measured in the same run: memcpy of
// the same number of bytes each benchmark writes (counter out_bytes), and
// memcpy bandwidth on a 64 MiB buffer. bench/report.py turns the JSON into
// the README table with medians and ratios.
#include <kvcache/kvcache.hpp>

#include <benchmark/benchmark.h>

#include "memcpy_reference.hpp"

#include <cstring>
#include <numeric>
#include <vector>

namespace kv = kvcache;

namespace {

kv::Geometry llama8b() {
  return *kv::Geometry::make({.num_layers = 32, .num_kv_heads = 8, .head_dim = 128, .block_size = 16});
}

kv::Cache<> make_cache(std::int32_t blocks, std::int32_t seqs, std::int32_t per_seq) {
  return kv::Cache<>({.geometry = llama8b(), .num_blocks = blocks, .max_sequences = seqs,
                      .max_blocks_per_sequence = per_seq});
}

void BM_allocate_free_one(benchmark::State& state) {
  kv::BlockPool pool(4096);
  for (auto _ : state) {
    const kv::BlockId b = *pool.allocate_one();
    benchmark::DoNotOptimize(b);
    (void)pool.release(b);
  }
}

void BM_allocate_free_64(benchmark::State& state) {
  kv::BlockPool pool(4096);
  std::vector<kv::BlockId> blocks(64);
  for (auto _ : state) {
    (void)pool.allocate(blocks);
    benchmark::DoNotOptimize(blocks.data());
    for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) (void)pool.release(*it);
  }
}

// One decode step of 256 sequences of ~512 tokens: reserve 1 token each (one
// batched call, slot mapping out) + CSR export. Fixed iteration count so the
// sequences never outgrow their capacity; each repetition starts fresh.
constexpr std::int32_t kDecodeSeqs = 256, kDecodeContext = 512, kDecodeSteps = 512;
std::int64_t decode_out_bytes() {
  const std::int64_t blocks = kDecodeSeqs * std::int64_t((kDecodeContext + kDecodeSteps / 2 + 15) / 16);
  return 4 * (kDecodeSeqs + (kDecodeSeqs + 1) + blocks + kDecodeSeqs);  // slots + indptr + indices + last
}

// Prefix caching in the decode step: off; on, publishing each full block as
// reserve_batch() is given the step's token ids (publish_on_reserve); and on
// with router events drained every step, token ids included.
enum class Caching { off, on_reserve, with_events };

template <Caching Mode>
void BM_decode_step_256(benchmark::State& state) {
  constexpr std::int32_t per_seq = (kDecodeContext + kDecodeSteps) / 16 + 1;
  kv::Cache<> cache({.geometry = llama8b(), .num_blocks = kDecodeSeqs * per_seq + 1, .max_sequences = kDecodeSeqs,
                     .max_blocks_per_sequence = per_seq, .event_capacity = Mode == Caching::with_events ? 4096 : 0,
                     .publish_on_reserve = Mode != Caching::off});
  std::vector<kv::SeqId> seqs(kDecodeSeqs);
  std::vector<std::int32_t> prompt(kDecodeContext), slots(kDecodeContext), ones(kDecodeSeqs, 1), step_slots(kDecodeSeqs),
      ids(kDecodeSeqs);
  std::vector<std::int32_t> indptr(kDecodeSeqs + 1), indices(std::size_t(kDecodeSeqs) * per_seq), last(kDecodeSeqs);
  std::vector<kv::BlockCopy> copies(kDecodeSeqs);
  std::vector<kv::BlockEvent> events(512);
  std::vector<std::int32_t> event_ids(512 * 16);
  for (std::size_t k = 0; k < seqs.size(); ++k) {
    for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = std::int32_t(k * 1000 + i);  // distinct prompts
    // Ragged start: boundaries spread across steps.
    auto a = cache.admit(std::span(prompt).first(kDecodeContext - 3), slots);
    if (!a) state.SkipWithError("admit failed");
    seqs[k] = a->seq;
  }
  std::int32_t step = 0;
  for (auto _ : state) {
    for (std::size_t k = 0; k < ids.size(); ++k) ids[k] = step * 7 + std::int32_t(k);  // this step's sampled tokens
    ++step;
    auto r = Mode == Caching::off ? cache.reserve_batch(seqs, ones, step_slots, copies)
                                  : cache.reserve_batch(seqs, ones, ids, step_slots, copies);
    auto nnz = cache.export_csr(seqs, indptr, indices, last);
    if constexpr (Mode == Caching::with_events) benchmark::DoNotOptimize(cache.drain_events(events, event_ids));
    benchmark::DoNotOptimize(r);
    benchmark::DoNotOptimize(nnz);
    benchmark::ClobberMemory();
  }
  if (Mode != Caching::off && cache.pool().num_published() != kDecodeSeqs * ((kDecodeContext - 3 + kDecodeSteps) / 16))
    state.SkipWithError("a full block was not published");
  state.counters["out_bytes"] = double(decode_out_bytes());
  state.counters["seqs"] = kDecodeSeqs;
}

// The export half alone: the CSR of 256 sequences of 509 tokens (32 blocks
// each; issue 64 measured it against release 0.2.0's build of this file).
void BM_export_csr_256(benchmark::State& state) {
  constexpr std::int32_t per_seq = kDecodeContext / 16 + 1;
  auto cache = make_cache(kDecodeSeqs * per_seq + 1, kDecodeSeqs, per_seq);
  std::vector<kv::SeqId> seqs(kDecodeSeqs);
  std::vector<std::int32_t> slots(kDecodeContext), indptr(kDecodeSeqs + 1), indices(std::size_t(kDecodeSeqs) * per_seq),
      last(kDecodeSeqs);
  for (auto& s : seqs) {
    s = *cache.add_sequence();
    if (!cache.reserve(s, kDecodeContext - 3, slots).ok()) state.SkipWithError("reserve failed");
  }
  for (auto _ : state) {
    auto nnz = cache.export_csr(seqs, indptr, indices, last);
    benchmark::DoNotOptimize(nnz);
    benchmark::ClobberMemory();
  }
  state.counters["out_bytes"] = double(4 * (kDecodeSeqs + (kDecodeSeqs + 1) + kDecodeSeqs * 32));
}

// The reserve half of the decode step alone, batched and as 256 single
// reserve() calls on the same state: the batch path must not be slower.
template <bool Batched>
void BM_reserve_256x1(benchmark::State& state) {
  constexpr std::int32_t per_seq = (kDecodeContext + kDecodeSteps) / 16 + 1;
  auto cache = make_cache(kDecodeSeqs * per_seq + 1, kDecodeSeqs, per_seq);
  std::vector<kv::SeqId> seqs(kDecodeSeqs);
  std::vector<std::int32_t> slots(kDecodeContext), ones(kDecodeSeqs, 1), step_slots(kDecodeSeqs);
  std::vector<kv::BlockCopy> copies(kDecodeSeqs);
  for (auto& s : seqs) {
    s = *cache.add_sequence();
    (void)cache.reserve(s, kDecodeContext - 3, slots);
  }
  for (auto _ : state) {
    if constexpr (Batched) {
      auto r = cache.reserve_batch(seqs, ones, step_slots, copies);
      benchmark::DoNotOptimize(r);
    } else {
      for (std::size_t k = 0; k < seqs.size(); ++k) {
        // The count comes from memory, as an engine's would (a literal 1
        // lets the compiler fold the per-count work away).
        auto r = cache.reserve(seqs[k], ones[k], std::span(step_slots).subspan(k, 1));
        benchmark::DoNotOptimize(r);
      }
    }
    benchmark::ClobberMemory();
  }
  state.counters["out_bytes"] = 4.0 * kDecodeSeqs;  // the slot mapping
  state.counters["seqs"] = kDecodeSeqs;
}

void BM_reserve_8k_prompt(benchmark::State& state) {
  auto cache = make_cache(1024, 4, 600);
  std::vector<std::int32_t> slots(8192);
  for (auto _ : state) {
    const kv::SeqId s = *cache.add_sequence();
    auto r = cache.reserve(s, 8192, slots);
    benchmark::DoNotOptimize(r);
    benchmark::DoNotOptimize(slots.data());
    (void)cache.free(s);
  }
  state.counters["out_bytes"] = 8192 * 4;
}

// Match a 16,001-token prompt against a published 1,000-block chain (hashes
// every block, looks each up).
template <class Hasher>
void BM_prefix_match_1000(benchmark::State& state, Hasher hasher) {
  kv::Cache<kv::BlockPool, kv::PageTable, kv::AdmitAll, kv::SelectAll, kv::KeepAll, Hasher> cache(
      {.geometry = llama8b(), .num_blocks = 1100, .max_sequences = 2, .max_blocks_per_sequence = 1050}, {}, {}, {},
      hasher);
  std::vector<std::int32_t> tokens(16001), slots(16000);
  std::iota(tokens.begin(), tokens.end(), 7);
  const kv::SeqId s = *cache.add_sequence();
  (void)cache.reserve(s, 16000, slots);
  (void)cache.publish(s, std::span(tokens).first(16000));
  std::vector<kv::BlockId> out(1000);
  for (auto _ : state) {
    const std::int32_t m = cache.match_prefix(tokens, {}, out);
    benchmark::DoNotOptimize(m);
    if (m != 1000) state.SkipWithError("prefix match missed");
  }
  state.counters["out_bytes"] = 16000 * 4;  // reference: a copy of the tokens it hashes
}

}  // namespace

BENCHMARK(BM_memcpy)->Arg(64 << 20)->Arg(decode_out_bytes())->Arg(4 * (kDecodeSeqs + (kDecodeSeqs + 1) + kDecodeSeqs * 32))->Arg(kDecodeSeqs * 4)->Arg(8192 * 4)->Arg(16000 * 4);
BENCHMARK(BM_allocate_free_one);
BENCHMARK(BM_allocate_free_64);
BENCHMARK(BM_decode_step_256<Caching::off>)->Name("BM_decode_step_256")->Iterations(kDecodeSteps)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_decode_step_256<Caching::on_reserve>)
    ->Name("BM_decode_step_256_publish_on_reserve")
    ->Iterations(kDecodeSteps)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_decode_step_256<Caching::with_events>)
    ->Name("BM_decode_step_256_publish_and_events")
    ->Iterations(kDecodeSteps)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_export_csr_256);
BENCHMARK(BM_reserve_256x1<true>)->Name("BM_reserve_batch_256x1")->Iterations(kDecodeSteps)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_reserve_256x1<false>)->Name("BM_reserve_single_256x1")->Iterations(kDecodeSteps)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_reserve_8k_prompt)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_prefix_match_1000, fast_hasher, kv::FastBlockHasher{})->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_prefix_match_1000, siphash128, kv::SipHasher128{0x1234, 0x5678})->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
