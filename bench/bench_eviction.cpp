// Eviction costs on the host. Reference, same run: memcpy of the scores the
// step reads (one float per held token).
#include <kvcache/kvcache.hpp>

#include <benchmark/benchmark.h>

#include <cstring>
#include <random>
#include <vector>

namespace kv = kvcache;

namespace {

using EvictCache = kv::Cache<kv::BlockPool, kv::PageTable, kv::AdmitAll, kv::SelectAll, kv::BlockScoreEviction>;

kv::Geometry geometry() {
  return *kv::Geometry::make({.num_layers = 1, .num_kv_heads = 8, .head_dim = 128, .block_size = 16});
}
std::vector<float> random_scores(std::size_t n) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> s(n);
  for (auto& x : s) x = u(rng);
  return s;
}

void BM_memcpy(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  std::vector<char> src(n, 1), dst(n + 64);
  for (auto _ : state) {
    std::memcpy(dst.data() + 64, src.data(), n);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(std::int64_t(state.iterations()) * std::int64_t(n));
  state.counters["out_bytes"] = double(n);
}

// The decision for one 32k-token stream: score every block of the evictable
// area, pick the lowest (defaults: start 32, recent 128, max 672).
void BM_plan_32k(benchmark::State& state) {
  const auto agg = state.range(0) ? kv::Aggregation::norm_sum : kv::Aggregation::sum;
  kv::BlockScoreEviction p({.aggregation = agg});
  p.bind(1, 32768);
  const auto sc = random_scores(32768);
  (void)p.observe(0, sc);
  std::vector<std::int32_t> out(2048);
  for (auto _ : state) {
    auto n = p.plan(0, 32768, 0, out);
    benchmark::DoNotOptimize(n);
  }
  state.counters["out_bytes"] = 32768 * 4;
  state.SetLabel(state.range(0) ? "NORM_SUM" : "SUM");
}

void BM_observe_32k(benchmark::State& state) {
  kv::BlockScoreEviction p({});
  p.bind(1, 32768);
  const auto sc = random_scores(32768);
  for (auto _ : state) {
    auto st = p.observe(0, sc);
    benchmark::DoNotOptimize(st);
  }
  state.counters["out_bytes"] = 32768 * 4;
}

// A decode step of 256 sequences at the policy's steady state (~680 tokens):
// batched reserve + CSR export, and with eviction also one observe + evict per
// sequence. Arg 0: without, 1: with.
void BM_decode_step_256(benchmark::State& state) {
  const bool evict = state.range(0) != 0;
  constexpr std::int32_t kSeqs = 256, kPerSeq = 64;
  EvictCache cache({.geometry = geometry(), .num_blocks = kSeqs * kPerSeq + 1, .max_sequences = kSeqs,
                    .max_blocks_per_sequence = kPerSeq},
                   {}, {}, kv::BlockScoreEviction({}));
  std::vector<kv::SeqId> seqs(kSeqs);
  std::vector<std::int32_t> slots(1024), ones(kSeqs, 1), step(kSeqs), indptr(kSeqs + 1), indices(kSeqs * kPerSeq),
      last(kSeqs), evicted(64);
  std::vector<kv::BlockCopy> copies(kSeqs);
  std::vector<kv::BlockRotation> rot(64);
  const auto sc = random_scores(1024);
  for (auto& s : seqs) {
    s = *cache.add_sequence();
    (void)cache.reserve(s, 672 + 15 - 8, slots);  // just under the trigger; ragged tails
  }
  for (auto _ : state) {
    auto r = cache.reserve_batch(seqs, ones, step, copies);
    if (evict)
      for (const auto s : seqs) {
        const auto held = static_cast<std::size_t>(cache.table().tokens_unchecked(s));
        (void)cache.observe(s, std::span(sc).first(held));
        (void)cache.evict(s, evicted, rot);
      }
    else
      for (const auto s : seqs) (void)cache.truncate(s, 1);  // hold the length still, like eviction does
    auto nnz = cache.export_csr(seqs, indptr, indices, last);
    benchmark::DoNotOptimize(r);
    benchmark::DoNotOptimize(nnz);
  }
  state.SetLabel(evict ? "observe + evict" : "no eviction (truncate 1)");
  state.counters["out_bytes"] = 256.0 * 680 * 4;  // the scores one step reads
}

}  // namespace

BENCHMARK(BM_memcpy)->Arg(32768 * 4)->Arg(256 * 680 * 4);
BENCHMARK(BM_plan_32k)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_observe_32k)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_decode_step_256)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
