// What the CUDA benchmarks share: device buffers, timing one launch per
// iteration with CUDA events (GPU time, not host time), and the counters
// report.py reads to pair a row with its device-copy reference.
#pragma once

#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <vector>

namespace kvbench {

struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(std::size_t n) {
    if (cudaMalloc(&p, n) != cudaSuccess) p = nullptr;
    else cudaMemset(p, 1, n);
  }
  template <class T, class A>
  explicit DevBuf(const std::vector<T, A>& v) : DevBuf(v.size() * sizeof(T)) {
    if (p) cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
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

// A row moving `payload` bytes, compared by bandwidth with the reference
// row of the same ref_id.
inline void finish(benchmark::State& state, std::int64_t payload, int ref_id) {
  state.SetBytesProcessed(std::int64_t(state.iterations()) * payload);
  state.counters["out_bytes"] = double(payload);
  state.counters["ref_id"] = ref_id;
  state.counters["bandwidth"] = 1;
}

// The reference: one device-to-device cudaMemcpyAsync of n bytes.
inline void device_copy(benchmark::State& state, std::int64_t n, int ref_id) {
  DevBuf src(static_cast<std::size_t>(n)), dst(static_cast<std::size_t>(n));
  run_timed(state, [&] { return cudaMemcpyAsync(dst.p, src.p, std::size_t(n), cudaMemcpyDeviceToDevice); });
  finish(state, n, ref_id);
}

// False (and a printed line) where there is no CUDA device to measure.
inline bool have_gpu(const char* who) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("%s: no CUDA device; nothing measured\n", who);
    return false;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  benchmark::AddCustomContext("gpu", prop.name);
  return true;
}

}  // namespace kvbench
