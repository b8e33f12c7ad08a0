// The host suites' reference, measured in the same run: memcpy of the bytes
// a row writes (counter out_bytes; bench/report.py matches rows to it).
#pragma once

#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <vector>

inline void BM_memcpy(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  // dst is offset by 64 bytes: equal page offsets (4K aliasing) slow glibc's
  // `rep movsb` copies several-fold at some sizes, which would flatter the ratios.
  std::vector<char> src(n, 1), dst(n + 64, 0);
  for (auto _ : state) {
    std::memcpy(dst.data() + 64, src.data(), n);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(std::int64_t(state.iterations()) * std::int64_t(n));
  state.counters["out_bytes"] = double(n);
}
