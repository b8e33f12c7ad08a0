// Hybrid caches (layer groups over one pool). One decode step of 256
// sequences (advance() of each, or one advance_batch()): each advances
// (what it reserved is computed, a full block is published; its next token
// is reserved, its id given, prefix caching on),
// and every group's CSR is exported; for 1 group (full attention), 2 (full +
// a 256-token window) and 6 (full + 5 windows, Gemma's pattern as groups).
// References in the same run: the token-paged Cache<> that one full group
// compiles to (LayerGroups::as_geometry) doing the same work (one reserve per
// sequence, publishing on reserve, one CSR export), and memcpy of the bytes written.
// BM_hybrid_match_2048: a prefix lookup per group count, beside Cache<>::match.
// BM_group_tiers_lookup_2048: the same prompt looked up in host memory
// (GroupTiers::lookup, the device holding none of it), per group count.
// BM_gemma3_kv_share prints the memory table of docs/hybrid.md: Gemma 3 27B's
// KV as the library accounts it (hybrid_blocks_needed x page bytes) over the
// same model with every layer full attention, at 8K, 32K and 128K tokens.
#include <kvcache/kvcache.hpp>

#include <benchmark/benchmark.h>

#include "memcpy_reference.hpp"

#include <numeric>
#include <vector>

namespace kv = kvcache;

namespace {

constexpr std::int32_t kSeqs = 256, kContext = 512, kSteps = 512, kMaxTokens = kContext + kSteps + 16;

// `groups` groups of 4 layers each, llama-8B-shaped heads; group 0 full, the rest 256-token windows.
kv::LayerGroups layout(std::int32_t groups, std::vector<std::vector<std::int32_t>>& layers) {
  std::vector<kv::LayerGroupSpec> specs;
  layers.assign(std::size_t(groups), {});
  for (std::int32_t g = 0; g < groups; ++g) {
    for (std::int32_t l = 0; l < 4; ++l) layers[std::size_t(g)].push_back(g * 4 + l);
    specs.push_back({.kind = g == 0 ? kv::AttentionKind::full : kv::AttentionKind::sliding_window,
                     .layers = layers[std::size_t(g)], .num_kv_heads = 8, .head_dim = 128, .window = 256});
  }
  return *kv::LayerGroups::make({.groups = specs, .block_size = 16});
}

std::int64_t step_out_bytes(std::int32_t groups) {  // slots + each group's CSR (indptr, at most the full row, first_pos)
  return 4 * std::int64_t(groups) * (kSeqs + (kSeqs + 1) + kSeqs * ((kContext + kSteps / 2) / 16 + 1) + kSeqs);
}

// state.range(1): 0 advances each sequence by advance(), 1 the batch by one advance_batch().
void BM_hybrid_decode_step_256(benchmark::State& state) {
  const auto G = std::int32_t(state.range(0));
  const bool batched = state.range(1) != 0;
  std::vector<std::vector<std::int32_t>> layers;
  const auto lg = layout(G, layers);
  kv::HybridCache<> cache({.groups = lg, .num_blocks = std::int32_t(kv::hybrid_pool_blocks(lg, kSeqs, kMaxTokens, kContext)),
                           .max_sequences = kSeqs, .max_tokens = kMaxTokens, .prefill_chunk = kContext});
  std::vector<kv::SeqId> seqs;
  std::vector<std::int32_t> prompt(kContext), slots(static_cast<std::size_t>(G) * kContext), one(static_cast<std::size_t>(G));
  for (std::int32_t k = 0; k < kSeqs; ++k) {
    std::iota(prompt.begin(), prompt.end(), k * 1000);  // distinct prompts, ragged starts
    auto a = cache.admit(std::span(prompt).first(std::size_t(kContext - 3 - k % 16)), slots);
    if (!a || !cache.computed(a->seq, a->reserved).ok()) state.SkipWithError("admit failed");
    seqs.push_back(a->seq);
  }
  std::vector<std::int32_t> indptr(kSeqs + 1), indices(std::size_t(kSeqs) * (kMaxTokens / 16 + 1)), first(kSeqs);
  std::vector<std::int32_t> ones(kSeqs, 1), ids(kSeqs), batch_slots(std::size_t(G) * kSeqs);
  std::int32_t step = 0;
  for (auto _ : state) {
    if (batched) {
      for (std::int32_t k = 0; k < kSeqs; ++k) ids[std::size_t(k)] = step * 7 + k;
      benchmark::DoNotOptimize(cache.advance_batch(seqs, ones, ids, batch_slots));
    } else {
      for (std::int32_t k = 0; k < kSeqs; ++k) {
        const std::int32_t id[] = {step * 7 + k};
        benchmark::DoNotOptimize(cache.advance(seqs[std::size_t(k)], id, one));
      }
    }
    for (std::int32_t g = 0; g < G; ++g) benchmark::DoNotOptimize(cache.export_group_csr(g, seqs, indptr, indices, first));
    benchmark::ClobberMemory();
    ++step;
  }
  if (!cache.check_invariants().ok()) state.SkipWithError("invariants");
  state.counters["groups"] = G;
  state.counters["out_bytes"] = double(step_out_bytes(G));
}

// The same step on the token-paged cache that one full group compiles to
// (LayerGroups::as_geometry): 256 reserve() calls with the token ids
// (publishing full blocks), one CSR export.
void BM_cache_decode_step_256(benchmark::State& state) {
  constexpr std::int32_t per_seq = kMaxTokens / 16 + 1;
  std::vector<std::vector<std::int32_t>> layers;
  kv::Cache<> cache({.geometry = *layout(1, layers).as_geometry(),
                     .num_blocks = kSeqs * per_seq + 1, .max_sequences = kSeqs, .max_blocks_per_sequence = per_seq,
                     .publish_on_reserve = true});
  std::vector<kv::SeqId> seqs;
  std::vector<std::int32_t> prompt(kContext), slots(kContext), one(1);
  for (std::int32_t k = 0; k < kSeqs; ++k) {
    std::iota(prompt.begin(), prompt.end(), k * 1000);
    auto a = cache.admit(std::span(prompt).first(std::size_t(kContext - 3 - k % 16)), slots);
    if (!a) state.SkipWithError("admit failed");
    seqs.push_back(a->seq);
  }
  std::vector<std::int32_t> indptr(kSeqs + 1), indices(std::size_t(kSeqs) * per_seq), last(kSeqs);
  std::int32_t step = 0;
  for (auto _ : state) {
    for (std::int32_t k = 0; k < kSeqs; ++k) {
      const std::int32_t id[] = {step * 7 + k};
      benchmark::DoNotOptimize(cache.reserve(seqs[std::size_t(k)], id, one));
    }
    benchmark::DoNotOptimize(cache.export_csr(seqs, indptr, indices, last));
    benchmark::ClobberMemory();
    ++step;
  }
  state.counters["groups"] = 1;
  state.counters["out_bytes"] = double(step_out_bytes(1));
}

// A prefix lookup of a 2,048-token prompt every group holds (published by an
// earlier request): match() hashes the prompt once per block size and looks
// each block up under every group's key. Reference in the same run: the
// token-paged Cache<> that one full group compiles to, whose match() does one
// hash and one lookup per block.
constexpr std::int32_t kMatchTokens = 2048;

void BM_hybrid_match_2048(benchmark::State& state) {
  const auto G = std::int32_t(state.range(0));
  std::vector<std::vector<std::int32_t>> layers;
  const auto lg = layout(G, layers);
  kv::HybridCache<> cache({.groups = lg, .num_blocks = std::int32_t(kv::hybrid_pool_blocks(lg, 2, kMatchTokens + 16, 0)),
                           .max_sequences = 2, .max_tokens = kMatchTokens + 16});
  std::vector<std::int32_t> prompt(kMatchTokens + 1), slots(static_cast<std::size_t>(G) * prompt.size());
  std::iota(prompt.begin(), prompt.end(), 7);
  auto a = cache.admit(prompt, slots);
  if (!a || !cache.computed(a->seq, a->reserved).ok()) state.SkipWithError("admit failed");
  std::int64_t hit = 0;
  for (auto _ : state) benchmark::DoNotOptimize(hit = cache.match(prompt));
  if (hit != kMatchTokens) state.SkipWithError("not a whole hit");
  state.counters["groups"] = G;
  state.counters["per_block"] = benchmark::Counter(double(kMatchTokens / 16), benchmark::Counter::kIsIterationInvariantRate |
                                                                               benchmark::Counter::kInvert);
}

void BM_cache_match_2048(benchmark::State& state) {
  std::vector<std::vector<std::int32_t>> layers;
  constexpr std::int32_t per_seq = kMatchTokens / 16 + 2;
  kv::Cache<> cache({.geometry = *layout(1, layers).as_geometry(), .num_blocks = 2 * per_seq + 1, .max_sequences = 2,
                     .max_blocks_per_sequence = per_seq, .publish_on_reserve = true});
  std::vector<std::int32_t> prompt(kMatchTokens + 1), slots(prompt.size());
  std::iota(prompt.begin(), prompt.end(), 7);
  if (!cache.admit(prompt, slots)) state.SkipWithError("admit failed");
  std::int64_t hit = 0;
  for (auto _ : state) benchmark::DoNotOptimize(hit = cache.match(prompt));
  if (hit != kMatchTokens) state.SkipWithError("not a whole hit");
  state.counters["groups"] = 1;
  state.counters["per_block"] = benchmark::Counter(double(kMatchTokens / 16), benchmark::Counter::kIsIterationInvariantRate |
                                                                               benchmark::Counter::kInvert);
}

void BM_group_tiers_lookup_2048(benchmark::State& state) {
  const auto G = std::int32_t(state.range(0));
  std::vector<std::vector<std::int32_t>> layers;
  const auto lg = layout(G, layers);
  kv::HybridCache<> cache({.groups = lg, .num_blocks = std::int32_t(kv::hybrid_pool_blocks(lg, 2, kMatchTokens + 16, 0)),
                           .max_sequences = 2, .max_tokens = kMatchTokens + 16});
  constexpr std::int32_t blocks = kMatchTokens / 16;
  kv::GroupTiers<kv::HybridCache<>> tiers(cache, {.host_blocks = G * blocks});
  std::vector<std::int32_t> prompt(kMatchTokens + 1);
  std::iota(prompt.begin(), prompt.end(), 7);
  // Every group's blocks of the prompt in host memory under its names (as offloads left them); none on the device.
  std::vector<kv::BlockHash> names(blocks);
  std::vector<kv::Offload> stored;
  for (std::int32_t g = 0; g < G; ++g) {
    (void)cache.hash_chain(g, prompt, {}, names);
    for (std::int32_t j = 0; j < blocks; ++j) stored.push_back({j + 1, names[std::size_t(j)], {}, g});
  }
  auto job = tiers.tiers().plan_store(kv::Tier::device, kv::Tier::host, stored);
  if (!job || !tiers.tiers().complete(job->id)) state.SkipWithError("store failed");
  std::int64_t hit = 0;
  for (auto _ : state) benchmark::DoNotOptimize(hit = tiers.lookup(prompt)->tokens);
  if (hit != kMatchTokens) state.SkipWithError("not a whole hit");
  state.counters["groups"] = G;
  state.counters["per_block"] = benchmark::Counter(double(blocks), benchmark::Counter::kIsIterationInvariantRate |
                                                                     benchmark::Counter::kInvert);
}

// Gemma 3 27B: 62 layers, layer l full when l % 6 == 5 (10 of them), the
// rest a 1,024-token window; 16 kv-heads of 128, fp16, pages of 16 window tokens.
void BM_gemma3_kv_share(benchmark::State& state) {
  const std::int64_t len = state.range(0);
  std::vector<std::int32_t> full, local, all(62);
  for (std::int32_t l = 0; l < 62; ++l) (l % 6 == 5 ? full : local).push_back(l);
  std::iota(all.begin(), all.end(), 0);
  const kv::LayerGroupSpec hybrid[] = {
      {.kind = kv::AttentionKind::full, .layers = full, .num_kv_heads = 16, .head_dim = 128},
      {.kind = kv::AttentionKind::sliding_window, .layers = local, .num_kv_heads = 16, .head_dim = 128, .window = 1024}};
  const kv::LayerGroupSpec dense[] = {{.kind = kv::AttentionKind::full, .layers = all, .num_kv_heads = 16, .head_dim = 128}};
  const auto h = *kv::LayerGroups::make({.groups = hybrid, .block_size = 16, .block_multiple = 16});
  const auto d = *kv::LayerGroups::make({.groups = dense, .block_size = 16, .block_multiple = 16});
  double decode = 0, chunked = 0;
  for (auto _ : state) {
    decode = double(kv::hybrid_blocks_needed(h, len, 1) * h.page_bytes()) / double(kv::hybrid_blocks_needed(d, len, 1) * d.page_bytes());
    chunked = double(kv::hybrid_blocks_needed(h, len, 2048) * h.page_bytes()) /
              double(kv::hybrid_blocks_needed(d, len, 2048) * d.page_bytes());
    benchmark::DoNotOptimize(decode);
  }
  state.counters["share_decoding"] = decode;      // what a decoding request holds
  state.counters["share_chunk_2048"] = chunked;   // the admission bound with 2,048-token prefill chunks
  state.counters["hybrid_GiB"] = double(kv::hybrid_blocks_needed(h, len, 1) * h.page_bytes()) / double(1 << 30);
  state.counters["all_full_GiB"] = double(kv::hybrid_blocks_needed(d, len, 1) * d.page_bytes()) / double(1 << 30);
}

}  // namespace

BENCHMARK(BM_memcpy)->Arg(std::int32_t(step_out_bytes(1)))->Arg(std::int32_t(step_out_bytes(2)))->Arg(std::int32_t(step_out_bytes(6)));
BENCHMARK(BM_cache_decode_step_256)->Iterations(kSteps)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_hybrid_decode_step_256)
    ->ArgsProduct({{1, 2, 6}, {0, 1}})
    ->ArgNames({"groups", "batch"})
    ->Iterations(kSteps)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_cache_match_2048);
BENCHMARK(BM_hybrid_match_2048)->Arg(1)->Arg(2)->Arg(6);
BENCHMARK(BM_group_tiers_lookup_2048)->Arg(2)->Arg(6);
BENCHMARK(BM_gemma3_kv_share)->Arg(8192)->Arg(32768)->Arg(131072);

BENCHMARK_MAIN();
