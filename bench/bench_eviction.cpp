// Eviction costs on the host. Reference, same run: memcpy of the scores the
// step reads (one float per held token).
//   plan_32k / observe_32k   score-based block eviction on one 32k-token stream
//   decide_32k<Policy>       every policy's decision on one 32k-token stream
//                            at its trigger (Cache::evict, page-table edit and
//                            compaction plan included; SnapKV: its one-shot choice)
//   decode_step_256          256 sequences, batched reserve + CSR export, with
//                            and without each policy's observe + evict
#include <kvcache/kvcache.hpp>

#include <benchmark/benchmark.h>

#include "memcpy_reference.hpp"

#include <cstring>
#include <type_traits>
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

// The decision for one 32k-token stream: score every block of the evictable
// area, pick the lowest (defaults: start 32, recent 128, max 672).
void BM_plan_32k(benchmark::State& state) {
  const auto agg = state.range(0) ? kv::Aggregation::norm_sum : kv::Aggregation::sum;
  kv::BlockScoreEviction p({.aggregation = agg});
  p.bind({.streams = 1, .max_tokens = 32768, .block_size = 16});
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
  p.bind({.streams = 1, .max_tokens = 32768, .block_size = 16});
  const auto sc = random_scores(32768);
  for (auto _ : state) {
    auto st = p.observe(0, sc);
    benchmark::DoNotOptimize(st);
  }
  state.counters["out_bytes"] = 32768 * 4;
}

template <class E>
using CacheOf = kv::Cache<kv::BlockPool, kv::PageTable, kv::AdmitAll, kv::SelectAll, E>;
constexpr std::int32_t k32k = 32768;

// One stream at its policy's trigger: each iteration appends one token and
// evicts (token policies drop one token, average attention drops `step`
// every `step` appends, block policies a block every B appends).
template <class E>
void decide_32k(benchmark::State& state, E policy, kv::ScoreKind kind) {
  CacheOf<E> cache({.geometry = geometry(), .num_blocks = 2 * k32k / 16 + 64, .max_sequences = 1,
                    .max_blocks_per_sequence = k32k / 16 + 64},
                   {}, {}, policy);
  const auto s = *cache.add_sequence();
  std::vector<std::int32_t> slots(k32k + 64), blocks(2048), offsets(2);
  std::vector<kv::BlockRotation> rot(4096);
  std::vector<kv::SlotMove> moves(4096);
  (void)cache.reserve(s, k32k, slots);
  const auto sc = random_scores(k32k);
  if constexpr (kv::ObservingEviction<E>) (void)cache.observe(s, kv::Scores{kind, sc, 1});
  (void)cache.evict(s, kv::EvictionSpans{blocks, rot, moves, offsets});  // settle at the bound
  std::int64_t evicted = 0;
  for (auto _ : state) {
    (void)cache.reserve(s, 1, slots);
    auto r = cache.evict(s, kv::EvictionSpans{blocks, rot, moves, offsets});
    evicted += r->tokens;
  }
  state.counters["tokens_per_call"] = double(evicted) / double(state.iterations());
  state.counters["out_bytes"] = k32k * 4;
}
void BM_decide_32k_sliding_window(benchmark::State& st) { decide_32k(st, kv::SlidingWindow(k32k), {}); }
void BM_decide_32k_sink_window(benchmark::State& st) {
  decide_32k(st, kv::SinkWindowEviction({.sinks = 4, .window = k32k - 64}), {});
}
void BM_decide_32k_block_scores(benchmark::State& st) {
  decide_32k(st, kv::BlockScoreEviction({.start = 32, .recent = 128, .max = k32k - 16}), kv::ScoreKind::attention_sums);
}
void BM_decide_32k_h2o(benchmark::State& st) {
  decide_32k(st, kv::H2OEviction({.heavy = k32k - 128, .recent = 128}), kv::ScoreKind::attention_sums);
}
void BM_decide_32k_tova(benchmark::State& st) {
  decide_32k(st, kv::TovaEviction({.budget = k32k}), kv::ScoreKind::last_query_attention);
}
void BM_decide_32k_average_attention(benchmark::State& st) {
  decide_32k(st, kv::AverageAttentionEviction({.budget = k32k, .step = 64}), kv::ScoreKind::attention_sums);
}
// SnapKV runs once per stream: its choice (pooling + top-C) over a 32k prompt.
void BM_decide_32k_snapkv(benchmark::State& state) {
  kv::SnapKVEviction p({.capacity = 4096, .window = 32, .kernel = 7});
  p.bind({.streams = 1, .max_tokens = k32k, .block_size = 16});
  const auto sc = random_scores(k32k);
  const kv::StreamView v{k32k, k32k, 0};
  (void)p.observe(0, kv::Scores{kv::ScoreKind::attention_sums, sc, 1}, v);
  std::vector<std::int32_t> out(std::size_t(p.evict_count(0, v)));
  for (auto _ : state) {
    p.choose(0, v, 0, out);
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["tokens_per_call"] = double(out.size());
  state.counters["out_bytes"] = k32k * 4;
}

// A decode step of 256 sequences at the policy's steady state (~680 tokens):
// batched reserve + CSR export, and with eviction also one observe + evict per
// sequence. Arg 0: without, 1: with.
template <class E>
void decode_step_256(benchmark::State& state, E policy, kv::ScoreKind kind, const char* label) {
  constexpr std::int32_t kSeqs = 256, kPerSeq = 64;
  CacheOf<E> cache({.geometry = geometry(), .num_blocks = kSeqs * kPerSeq + 1, .max_sequences = kSeqs,
                    .max_blocks_per_sequence = kPerSeq},
                   {}, {}, policy);
  std::vector<kv::SeqId> seqs(kSeqs);
  std::vector<std::int32_t> slots(1024), ones(kSeqs, 1), step(kSeqs), indptr(kSeqs + 1), indices(kSeqs * kPerSeq),
      last(kSeqs), evicted(64), offsets(2);
  std::vector<kv::BlockCopy> copies(kSeqs);
  std::vector<kv::BlockRotation> rot(64);
  std::vector<kv::SlotMove> moves(1024);
  const auto sc = random_scores(1024);
  for (auto& s : seqs) {
    s = *cache.add_sequence();
    (void)cache.reserve(s, 672 + 15 - 8, slots);  // just under the trigger; ragged tails
  }
  for (auto _ : state) {
    auto r = cache.reserve_batch(seqs, ones, step, copies);
    if constexpr (std::is_same_v<E, kv::KeepAll>) {
      for (const auto s : seqs) (void)cache.truncate(s, 1);  // hold the length still, like eviction does
    } else {
      for (const auto s : seqs) {
        if constexpr (kv::ObservingEviction<E>) {
          const auto held = static_cast<std::size_t>(cache.table().tokens_unchecked(s));
          (void)cache.observe(s, kv::Scores{kind, std::span(sc).first(held), 1});
        }
        (void)cache.evict(s, kv::EvictionSpans{evicted, rot, moves, offsets});
      }
    }
    auto nnz = cache.export_csr(seqs, indptr, indices, last);
    benchmark::DoNotOptimize(r);
    benchmark::DoNotOptimize(nnz);
  }
  state.SetLabel(label);
  state.counters["out_bytes"] = 256.0 * 680 * 4;  // the scores one step reads
}
void BM_decode_step_256(benchmark::State& st) {  // arg 0: no eviction, 1: score-based blocks
  if (st.range(0) == 0) decode_step_256(st, kv::KeepAll{}, {}, "no eviction (truncate 1)");
  else decode_step_256(st, kv::BlockScoreEviction({}), kv::ScoreKind::attention_sums, "block scores: observe + evict");
}
void BM_decode_step_256_sliding_window(benchmark::State& st) {
  decode_step_256(st, kv::SlidingWindow(672), {}, "sliding window: evict");
}
void BM_decode_step_256_h2o(benchmark::State& st) {
  decode_step_256(st, kv::H2OEviction({.heavy = 544, .recent = 128}), kv::ScoreKind::attention_sums, "H2O: observe + evict");
}
void BM_decode_step_256_tova(benchmark::State& st) {
  decode_step_256(st, kv::TovaEviction({.budget = 672}), kv::ScoreKind::last_query_attention, "TOVA: observe + evict");
}
void BM_decode_step_256_average_attention(benchmark::State& st) {
  decode_step_256(st, kv::AverageAttentionEviction({.budget = 672, .step = 64}), kv::ScoreKind::attention_sums,
                  "average attention: observe + evict");
}

}  // namespace

BENCHMARK(BM_memcpy)->Arg(32768 * 4)->Arg(256 * 680 * 4);
BENCHMARK(BM_plan_32k)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_observe_32k)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_decide_32k_sliding_window)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_decide_32k_sink_window)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_decide_32k_block_scores)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_decide_32k_h2o)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_decide_32k_tova)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_decide_32k_average_attention)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_decide_32k_snapkv)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_decode_step_256)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_decode_step_256_sliding_window)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_decode_step_256_h2o)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_decode_step_256_tova)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_decode_step_256_average_attention)->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
