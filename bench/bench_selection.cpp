// Quest page selection on the host: one decode step's bound estimate and
// top-k for 256 sequences x 8 kv-heads at 4k tokens (block 16: 256 pages per
// sequence, head_dim 128, 4 query heads per kv-head, a 1,024-token budget),
// and for one sequence at 32k tokens. Reference: memcpy of the metadata bytes
// the step reads (out_bytes: every page's max and min per kv-head), same run.
// The cache row runs the same step through Cache<..., QuestSelection>::select
// (rows' CSR from the page table, output offsets, the host kernel): its
// overhead over the bare kernel. The hybrid row runs it through
// HybridCache<..., QuestSelection>::select on the full layer of a model
// whose other layer is a 256-token window (Quest on its global layer).
#include <kvcache/kernels/page_select.hpp>
#include <kvcache/kvcache.hpp>

#include <benchmark/benchmark.h>

#include "memcpy_reference.hpp"

#include <random>
#include <vector>

namespace kv = kvcache;

namespace {
constexpr std::int32_t kHeads = 8, kDim = 128, kGroup = 4, kBlock = 16, kBudget = 1024 / kBlock;

struct Step {
  std::int32_t seqs, pages;
  std::vector<float> bounds, queries;
  std::vector<std::int32_t> indptr, indices, out_indptr, out;
  std::vector<std::byte> scratch;
  Step(std::int32_t num_seqs, std::int32_t tokens) : seqs(num_seqs), pages(tokens / kBlock) {
    const std::int64_t blocks = std::int64_t{seqs} * pages;
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    bounds.resize(std::size_t(blocks) * kHeads * 2 * kDim);
    for (std::size_t i = 0; i < bounds.size(); i += 2 * kDim)  // a page's max, then its min (max >= min)
      for (std::int32_t d = 0; d < kDim; ++d) {
        const float a = u(rng), b = u(rng);
        bounds[i + std::size_t(d)] = a > b ? a : b;
        bounds[i + std::size_t(kDim + d)] = a > b ? b : a;
      }
    queries.resize(std::size_t(seqs) * kHeads * kGroup * kDim);
    for (auto& q : queries) q = u(rng);
    for (std::int32_t s = 0; s <= seqs; ++s) indptr.push_back(s * pages);
    indices.resize(std::size_t(blocks));
    for (std::int64_t b = 0; b < blocks; ++b) indices[std::size_t(b)] = std::int32_t(b);
    out_indptr.resize(std::size_t(seqs) * kHeads + 1);
    if (!kv::page_select_indptr(indptr.data(), seqs, kHeads, kBudget, out_indptr.data(), out_indptr.size())) std::abort();
    out.resize(std::size_t(out_indptr.back()));
    scratch.resize(kv::page_select_scratch_bytes(pages, kHeads));
  }
  kv::PageSelectParams params() {
    return {bounds.data(), std::int64_t{seqs} * pages, kHeads, kDim, queries.data(), kGroup, indptr.data(), indices.data(),
            seqs, indptr.back(), kBudget, 1, 1, out_indptr.data(), out.data(), scratch.data(), scratch.size()};
  }
  double metadata_bytes() const { return double(bounds.size()) * 4; }
};

void run(benchmark::State& state, std::int32_t seqs, std::int32_t tokens) {
  Step step(seqs, tokens);
  const auto p = step.params();
  for (auto _ : state) {
    auto st = kv::page_select_host(p);
    benchmark::DoNotOptimize(st);
    benchmark::ClobberMemory();
  }
  state.counters["out_bytes"] = step.metadata_bytes();
  state.counters["rows"] = double(seqs) * kHeads;
}

void BM_select_256x8_at_4k(benchmark::State& state) { run(state, 256, 4096); }

// A cache's select() on layer 0 of `ids`, timed; `bytes`: the metadata the step reads.
template <class Cache>
void time_select(benchmark::State& state, Cache& cache, std::span<const kv::SeqId> ids, std::span<const float> queries, double bytes) {
  std::vector<std::int32_t> indptr(ids.size() * kHeads + 1), out(ids.size() * kHeads * kBudget);
  for (auto _ : state) {
    auto r = cache.select(ids, 0, queries, {indptr, out});
    if (!r) state.SkipWithError("select failed");
    benchmark::ClobberMemory();
  }
  state.counters["out_bytes"] = bytes;
  state.counters["rows"] = double(ids.size()) * kHeads;
}

// The same step through the composed cache: 256 sequences of 4k tokens, the
// store holding the step's bounds (block 0 is the pool's null block).
void BM_cache_select_256x8_at_4k(benchmark::State& state) {
  constexpr std::int32_t seqs = 256, tokens = 4096;
  Step step(seqs, tokens);
  const double bytes = step.metadata_bytes();  // the step reads the same bytes as the bare kernel's
  const auto g = *kv::Geometry::make({.num_layers = 1, .num_kv_heads = kHeads, .head_dim = kDim, .block_size = kBlock});
  const std::int32_t blocks = seqs * (tokens / kBlock) + 1;
  step.bounds.resize(std::size_t(kv::QuestSelection::bounds_floats(g, blocks)));
  kv::Cache<kv::BlockPool, kv::PageTable, kv::AdmitAll, kv::QuestSelection> cache(
      {.geometry = g, .num_blocks = blocks, .max_sequences = seqs, .max_blocks_per_sequence = tokens / kBlock},
      {}, {.token_budget = kBudget * kBlock, .dense_layers = 0, .query_group = kGroup, .bounds = step.bounds});
  std::vector<kv::SeqId> ids;
  std::vector<std::int32_t> slots(tokens);
  for (std::int32_t s = 0; s < seqs; ++s) {
    ids.push_back(*cache.add_sequence());
    if (!cache.reserve(ids.back(), tokens, slots)) std::abort();
  }
  time_select(state, cache, ids, step.queries, bytes);
}
// The same step on a hybrid's global layer: layer 0 full (the rows Quest
// ranks), layer 1 a 256-token window, one pool; the prompts went in by
// chunks of 512, so each window row holds its last window.
void BM_hybrid_select_256x8_at_4k(benchmark::State& state) {
  constexpr std::int32_t seqs = 256, tokens = 4096, chunk = 512;
  Step step(seqs, tokens);
  const double bytes = step.metadata_bytes();
  static const std::int32_t full[] = {0}, window[] = {1};
  const kv::LayerGroupSpec specs[] = {
      {.kind = kv::AttentionKind::full, .layers = full, .num_kv_heads = kHeads, .head_dim = kDim},
      {.kind = kv::AttentionKind::sliding_window, .layers = window, .num_kv_heads = kHeads, .head_dim = kDim, .window = 256}};
  const auto lg = *kv::LayerGroups::make({.groups = specs, .block_size = kBlock});
  const auto blocks = std::int32_t(kv::hybrid_pool_blocks(lg, seqs, tokens, chunk));
  step.bounds.resize(std::size_t(kv::QuestSelection::bounds_floats(*kv::global_geometry(lg), blocks)));
  kv::HybridCache<kv::FastBlockHasher, kv::QuestSelection> cache(
      {.groups = lg, .num_blocks = blocks, .max_sequences = seqs, .max_tokens = tokens, .prefill_chunk = chunk, .prefix_caching = false},
      kv::QuestConfig{.token_budget = kBudget * kBlock, .dense_layers = 0, .query_group = kGroup, .bounds = step.bounds});
  std::vector<kv::SeqId> ids;
  std::vector<std::int32_t> slots(2 * chunk);
  for (std::int32_t s = 0; s < seqs; ++s) {
    ids.push_back(*cache.add_sequence());
    for (std::int32_t at = 0; at < tokens; at += chunk)
      if (!cache.advance(ids.back(), chunk, slots)) std::abort();
  }
  time_select(state, cache, ids, step.queries, bytes);
}
void BM_select_1x8_at_32k(benchmark::State& state) { run(state, 1, 32768); }
}  // namespace

BENCHMARK(BM_memcpy)->Arg(std::int64_t{256} * 256 * kHeads * 2 * kDim * 4)->Arg(std::int64_t{2048} * kHeads * 2 * kDim * 4)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_select_256x8_at_4k)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_cache_select_256x8_at_4k)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_hybrid_select_256x8_at_4k)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_select_1x8_at_32k)->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
