// CUDA kernels: scatter, gather and block copy GB/s on the decode and prefill
// shapes against a device-to-device cudaMemcpyAsync of the same payload in
// the same run; a 32-layer decode step written in one launch against one
// launch per layer; and memory tiers' transfers between pinned host memory
// and the device against one pinned cudaMemcpyAsync of as many bytes. GPU
// time from CUDA events. Without a GPU: prints a line, exits 0.
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "cuda_timing.hpp"
#include "kernel_shapes.hpp"
#include "launchers.hpp"  // cuda/

namespace kv = kvcache;
using namespace kvbench;

namespace {

std::int64_t copy_bytes(const Shape& s) { return s.blocks() * 16 * kRowBytes * 2; }

void BM_d2d_copy(benchmark::State& state) { device_copy(state, state.range(0), int(state.range(1))); }

struct DevShape {
  Layout lay;
  DevBuf pool, k, v, slots, indptr, indices, out_indptr, pairs;
  kv::PoolView view;
  explicit DevShape(const Shape& s, int layers = 1)
      : lay(layout(s)),
        pool(std::size_t(*kv::Geometry::make(spec(layers))->pool_bytes(lay.pool_blocks))),
        k(std::size_t(s.tokens() * kRowBytes * layers)),
        v(std::size_t(s.tokens() * kRowBytes * layers)),
        slots(lay.slots),
        indptr(lay.indptr),
        indices(lay.indices),
        out_indptr(lay.out_indptr),
        pairs(lay.pairs) {
    view = *kv::make_pool_view(*kv::Geometry::make(spec(layers)), pool.p, lay.pool_blocks);
  }
};

void BM_scatter(benchmark::State& state, const Shape& s) {
  DevShape d(s);
  const kv::ScatterParams p{d.view, kv::KvSource{d.k.p, d.v.p, kv::DType::f16, 0, kRowBytes, 256},
                            kv::TokenAddress{d.slots.as<std::int32_t>()}, s.tokens()};
  run_timed(state, [&] { return kvgpu::scatter(p); });
  finish(state, s.payload(), s.seqs == kDecode.seqs ? 0 : 1);
}

void BM_gather(benchmark::State& state, const Shape& s) {
  DevShape d(s);
  const kv::GatherParams p{d.view, 0, d.indptr.as<std::int32_t>(), d.indices.as<std::int32_t>(),
                           d.out_indptr.as<std::int32_t>(), s.seqs, s.tokens(), d.k.p, d.v.p, kv::DType::f16,
                           kRowBytes, 256};
  run_timed(state, [&] { return kvgpu::gather(p); });
  finish(state, s.payload(), s.seqs == kDecode.seqs ? 0 : 1);
}

void BM_block_copy(benchmark::State& state, const Shape& s) {
  DevShape d(s);
  const kv::BlockCopyParams p{d.view, d.view, d.pairs.as<kv::BlockCopy>(), std::int32_t(d.lay.pairs.size())};
  run_timed(state, [&] { return kvgpu::block_copy(p); });
  finish(state, copy_bytes(s), s.seqs == kDecode.seqs ? 2 : 3);
}

// A decode step of a 32-layer model: 256 tokens, K/V of every layer.
void BM_decode_step_32_layers(benchmark::State& state) {
  const bool one_launch = state.range(0) != 0;
  constexpr int kLayers = 32;
  DevShape d(kDecode, kLayers);
  kv::ScatterParams p{d.view, kv::KvSource{d.k.p, d.v.p, kv::DType::f16, kDecode.tokens() * kRowBytes, kRowBytes, 256},
                      kv::TokenAddress{d.slots.as<std::int32_t>()}, kDecode.tokens(), 0, kLayers};
  run_timed(state, [&] {
    if (one_launch) return kvgpu::scatter(p);
    kv::ScatterParams one = p;
    one.num_layers = 1;
    for (int l = 0; l < kLayers; ++l) {
      one.first_layer = l;
      one.src.k = static_cast<const std::byte*>(p.src.k) + l * p.src.layer_stride;
      one.src.v = static_cast<const std::byte*>(p.src.v) + l * p.src.layer_stride;
      if (cudaError_t err = kvgpu::scatter(one); err != cudaSuccess) return err;
    }
    return cudaSuccess;
  });
  state.SetLabel(one_launch ? "one launch" : "32 launches");
}

// Memory tiers: 16 blocks of 2 MiB (Llama 3 8B: 32 layers, 8 kv-heads of
// 128, fp16, 16 tokens; every layer contiguous) between pinned host memory
// and the device, as an onboard (mode 0) or offload (mode 1) plan runs:
// one cudaMemcpyAsync per block (DMA), or one block_copy launch reading or
// writing the pinned pool through its mapped address (the SMs copy). The
// reference is one cudaMemcpyAsync of as many bytes, same direction.
constexpr std::int32_t kTierBlocks = 16;
kv::Geometry tier_geometry() {
  return *kv::Geometry::make({.num_layers = 32, .num_kv_heads = 8, .head_dim = 128, .block_size = 16, .dtype = kv::DType::f16});
}
std::int64_t tier_bytes() { return kTierBlocks * tier_geometry().block_bytes(); }

struct Pinned {
  void* p = nullptr;
  explicit Pinned(std::size_t n) {
    if (cudaHostAlloc(&p, n, cudaHostAllocMapped) != cudaSuccess) p = nullptr;
    else std::memset(p, 2, n);
  }
  Pinned(const Pinned&) = delete;
  ~Pinned() { cudaFreeHost(p); }
};

void BM_pinned_copy(benchmark::State& state) {  // the reference: one copy of all the bytes
  const bool h2d = state.range(0) == 0;
  const auto n = std::size_t(tier_bytes());
  DevBuf dev(n);
  Pinned host(n);
  run_timed(state, [&] { return h2d ? cudaMemcpyAsync(dev.p, host.p, n, cudaMemcpyHostToDevice)
                                    : cudaMemcpyAsync(host.p, dev.p, n, cudaMemcpyDeviceToHost); });
  finish(state, std::int64_t(n), h2d ? 4 : 5);
}

void BM_tier_blocks(benchmark::State& state) {
  const bool onboard = state.range(0) == 0, kernel = state.range(1) == 1;
  const kv::Geometry g = tier_geometry();
  const std::int64_t bb = g.block_bytes();
  DevBuf dev(std::size_t((kTierBlocks + 1) * bb));
  Pinned host(std::size_t(kTierBlocks * bb));
  const kv::PoolView dv = *kv::make_pool_view(g, dev.p, kTierBlocks + 1), hv = *kv::make_pool_view(g, host.p, kTierBlocks);
  std::vector<kv::BlockCopy> pairs;  // host slot i <-> device block 16 - i (shuffled order)
  for (std::int32_t i = 0; i < kTierBlocks; ++i) pairs.push_back(onboard ? kv::BlockCopy{i, kTierBlocks - i} : kv::BlockCopy{kTierBlocks - i, i});
  DevBuf dpairs(pairs);
  const kv::BlockCopyParams p{onboard ? hv : dv, onboard ? dv : hv, dpairs.as<kv::BlockCopy>(), kTierBlocks};
  run_timed(state, [&] {
    if (kernel) return kvgpu::block_copy(p);
    for (const kv::BlockCopy& c : pairs) {
      std::byte* d = static_cast<std::byte*>(onboard ? dev.p : host.p) + c.dst * bb;
      const std::byte* s = static_cast<const std::byte*>(onboard ? host.p : dev.p) + c.src * bb;
      if (cudaError_t e = cudaMemcpyAsync(d, s, std::size_t(bb), onboard ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost); e != cudaSuccess)
        return e;
    }
    return cudaSuccess;
  });
  finish(state, tier_bytes(), onboard ? 4 : 5);
  state.SetLabel(kernel ? "block_copy kernel, mapped pinned memory" : "cudaMemcpyAsync per block");
}

}  // namespace

BENCHMARK(BM_d2d_copy)
    ->Args({kDecode.payload(), 0})
    ->Args({kPrefill.payload(), 1})
    ->Args({copy_bytes(kDecode), 2})
    ->Args({copy_bytes(kPrefill), 3})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_scatter, decode_256x1, kDecode)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_scatter, prefill_8x2048, kPrefill)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_gather, decode_256x1, kDecode)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_gather, prefill_8x2048, kPrefill)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_block_copy, decode_256x1, kDecode)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_block_copy, prefill_8x2048, kPrefill)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_decode_step_32_layers)->Arg(1)->Arg(0)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_pinned_copy)->Name("BM_h2d_copy")->Arg(0)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_pinned_copy)->Name("BM_d2h_copy")->Arg(1)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_tier_blocks)->ArgNames({"offload", "kernel"})->Args({0, 0})->Args({0, 1})->Args({1, 0})->Args({1, 1})
    ->UseManualTime()->Unit(benchmark::kMicrosecond);

int main(int argc, char** argv) {
  if (!have_gpu("bench_kernels_cuda")) return 0;
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
