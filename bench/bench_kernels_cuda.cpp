// CUDA kernels: scatter, gather and block copy GB/s on the decode and prefill
// shapes against a device-to-device cudaMemcpyAsync of the same payload in
// the same run; and a 32-layer decode step written in one launch against one
// launch per layer. GPU time from CUDA events. Without a GPU: prints a line, exits 0.
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <vector>

#include "launchers.hpp"  // cuda/
#include "kernel_shapes.hpp"

namespace kv = kvcache;
using namespace kvbench;

namespace {

struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(std::size_t n) {
    if (cudaMalloc(&p, n) != cudaSuccess) p = nullptr;
    else cudaMemset(p, 1, n);
  }
  template <class T>
  explicit DevBuf(const std::vector<T>& v) : DevBuf(v.size() * sizeof(T)) {
    if (p) cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  DevBuf(const DevBuf&) = delete;
  ~DevBuf() { cudaFree(p); }
  template <class T>
  T* as() const { return static_cast<T*>(p); }
};

// Times `launch` with events, one measurement per iteration.
template <class F>
void run_timed(benchmark::State& state, F&& launch) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < 3; ++i) launch();  // warm up
  for (auto _ : state) {
    cudaEventRecord(a);
    const cudaError_t err = launch();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    if (err != cudaSuccess) state.SkipWithError(cudaGetErrorString(err));
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    state.SetIterationTime(double(ms) / 1e3);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
}

void finish(benchmark::State& state, std::int64_t payload, int ref_id) {
  state.SetBytesProcessed(std::int64_t(state.iterations()) * payload);
  state.counters["out_bytes"] = double(payload);
  state.counters["ref_id"] = ref_id;
  state.counters["bandwidth"] = 1;
}

std::int64_t copy_bytes(const Shape& s) { return s.blocks() * 16 * kRowBytes * 2; }

void BM_d2d_copy(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  DevBuf src(n), dst(n);
  run_timed(state, [&] { return cudaMemcpyAsync(dst.p, src.p, n, cudaMemcpyDeviceToDevice); });
  finish(state, std::int64_t(n), int(state.range(1)));
}

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

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("bench_kernels_cuda: no CUDA device; nothing measured\n");
    return 0;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  benchmark::AddCustomContext("gpu", prop.name);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
