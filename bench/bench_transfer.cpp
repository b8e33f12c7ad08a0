// Disaggregated transfers. Plan construction for a 1,000-block prompt of a
// Llama-8B-like layout (32 layers, 8 kv-heads of 128, fp16, blocks of 16
// tokens): 64 plane regions with separate planes on both sides (vLLM's
// per-layer K and V tensors), and interleaved pools (one region per layer,
// K and V adjacent); blocks in runs of 16 consecutive ids on both sides, as
// a pool that is not fragmented hands them out. Each row reports the
// descriptors it made with and without coalescing; its reference is memcpy of
// the descriptor list. Then the bytes: 32 blocks (64 MiB) read through a
// plan by a memcpy executor, from a separate-planes pool into an interleaved
// one, against one memcpy of as many bytes. A NIXL transfer over loopback is
// measured by python/bench_nixl.py (the wheel has no C++ headers).
#include <kvcache/transfer/transfer_plan.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "memcpy_reference.hpp"

namespace kv = kvcache;

namespace {

kv::Geometry llama(kv::KvPlanes planes) {
  return *kv::Geometry::make({.num_layers = 32, .num_kv_heads = 8, .head_dim = 128, .block_size = 16,
                              .dtype = kv::DType::f16, .planes = planes});
}

// 1,000 block ids in runs of 16 consecutive ones, the runs shuffled.
std::vector<std::int32_t> runs_of_16(std::uint32_t seed) {
  std::vector<std::int32_t> starts(63);
  for (std::size_t r = 0; r < starts.size(); ++r) starts[r] = 1 + std::int32_t(r) * 16;
  std::shuffle(starts.begin(), starts.end(), std::mt19937(seed));
  std::vector<std::int32_t> ids;
  for (const std::int32_t s : starts)
    for (std::int32_t i = 0; i < 16 && ids.size() < 1000; ++i) ids.push_back(s + i);
  return ids;
}

void plan_bench(benchmark::State& state, kv::KvPlanes planes) {
  const bool coalesce = state.range(0) != 0;
  const kv::Geometry g = llama(planes);
  // The planner never touches the pools: any nonzero addresses do.
  const auto local = *kv::describe_layout(g, 1024, 0x10000000000ULL, {});
  const auto remote = *kv::describe_layout(g, 1024, 0x20000000000ULL, {});
  const kv::TransferPlanner planner(local, remote);
  const auto lb = runs_of_16(1), rb = runs_of_16(2);
  const kv::GroupBlocks gb{0, rb, lb};
  std::vector<kv::TransferDesc> out;
  out.reserve(1000 * 64);
  for (auto _ : state) {
    auto bytes = planner.plan(std::span(&gb, 1), {.coalesce = coalesce}, out);
    benchmark::DoNotOptimize(bytes);
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["descriptors"] = double(out.size());
  state.counters["regions"] = double(planner.num_plane_regions());
  state.counters["out_bytes"] = double(out.size() * sizeof(kv::TransferDesc));
}
void BM_plan_1000_blocks_64_regions_separate(benchmark::State& state) { plan_bench(state, kv::KvPlanes::separate); }
void BM_plan_1000_blocks_interleaved(benchmark::State& state) { plan_bench(state, kv::KvPlanes::interleaved); }

void BM_plan_ids_1000_blocks_64_regions(benchmark::State& state) {
  const kv::Geometry g = llama(kv::KvPlanes::separate);
  const auto local = *kv::describe_layout(g, 1024, 0x10000000000ULL, {});
  const auto remote = *kv::describe_layout(g, 1024, 0x20000000000ULL, {});
  const kv::TransferPlanner planner(local, remote);
  const auto lb = runs_of_16(1), rb = runs_of_16(2);
  const kv::GroupBlocks gb{0, rb, lb};
  std::vector<std::int64_t> lids, rids;
  lids.reserve(64000), rids.reserve(64000);
  for (auto _ : state) {
    auto st = planner.plan_ids(std::span(&gb, 1), {}, lids, rids);
    benchmark::DoNotOptimize(st);
    benchmark::DoNotOptimize(lids.data());
  }
  state.counters["descriptors"] = double(lids.size());
  state.counters["out_bytes"] = double(2 * lids.size() * sizeof(std::int64_t));
}

constexpr std::int64_t kCopyBlocks = 32;
std::int64_t copy_bytes() { return kCopyBlocks * llama(kv::KvPlanes::separate).block_bytes(); }

void BM_transfer_memcpy_executor_32_blocks(benchmark::State& state) {
  const kv::Geometry gr = llama(kv::KvPlanes::separate), gl = llama(kv::KvPlanes::interleaved);
  std::vector<std::uint8_t> rpool(std::size_t(*gr.pool_bytes(kCopyBlocks + 1)), 1),
      lpool(std::size_t(*gl.pool_bytes(kCopyBlocks + 1)) + 64, 0);
  const auto remote = *kv::describe_layout(gr, kCopyBlocks + 1, reinterpret_cast<std::uint64_t>(rpool.data()), {});
  const auto local = *kv::describe_layout(gl, kCopyBlocks + 1, reinterpret_cast<std::uint64_t>(lpool.data() + 64), {});
  const kv::TransferPlanner planner(local, remote);
  std::vector<std::int32_t> ids(kCopyBlocks);
  std::iota(ids.begin(), ids.end(), 1);
  const kv::GroupBlocks gb{0, ids, ids};
  std::vector<kv::TransferDesc> plan;
  (void)planner.plan(std::span(&gb, 1), {}, plan);
  for (auto _ : state) {
    for (const kv::TransferDesc& d : plan)
      std::memcpy(reinterpret_cast<void*>(d.local), reinterpret_cast<const void*>(d.remote), std::size_t(d.bytes));
    benchmark::DoNotOptimize(lpool.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(std::int64_t(state.iterations()) * copy_bytes());
  state.counters["descriptors"] = double(plan.size());
  state.counters["out_bytes"] = double(copy_bytes());
  state.counters["bandwidth"] = 1;
}

}  // namespace

BENCHMARK(BM_plan_1000_blocks_64_regions_separate)->Arg(1)->Arg(0)->ArgName("coalesce");
BENCHMARK(BM_plan_1000_blocks_interleaved)->Arg(1)->Arg(0)->ArgName("coalesce");
BENCHMARK(BM_plan_ids_1000_blocks_64_regions);
BENCHMARK(BM_transfer_memcpy_executor_32_blocks)->UseRealTime();
// The references: memcpy of each row's output (the descriptor lists: 64 planes × 1,000 blocks, 64 planes × 63
// runs, 63 runs; the two id lists) and of the bytes the executor moves.
constexpr std::int64_t kDesc = sizeof(kv::TransferDesc);
BENCHMARK(BM_memcpy)->Arg(64 * 1000 * kDesc)->Arg(64 * 63 * kDesc)->Arg(63 * kDesc)->Arg(2 * 64000 * 8)->Arg(copy_bytes())->UseRealTime();

BENCHMARK_MAIN();
