// Quantized KV on the host backend: scatter quantizing fp16 K/V as it writes,
// and gather dequantizing back to fp16, per format, on the decode and prefill
// shapes. The reference is memcpy of the pool-side bytes (codes and group
// entries) the kernel writes or reads, measured in the same run.
#include <kvcache/kernels/gather.hpp>
#include <kvcache/kernels/scatter.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <vector>

#include "memcpy_reference.hpp"
#include "quant_formats.hpp"

namespace kv = kvcache;
using namespace kvbench;

namespace {

struct Bufs {
  Layout lay;
  kv::Geometry g;
  std::vector<std::byte> pool, k, v, k_out, v_out;
  kv::PoolView view;
  Bufs(const Shape& s, const Format& f) : lay(layout(s)), g(geometry(f)) {
    pool.assign(std::size_t(*g.pool_bytes(lay.pool_blocks)), std::byte{1});
    view = *kv::make_pool_view(g, pool.data(), lay.pool_blocks);
    k = sample_keys(s.tokens());
    v = k;
    k_out = k;
    v_out = k;
  }
};

void BM_quant_scatter(benchmark::State& state, const Shape& s, const Format& f) {
  Bufs b(s, f);
  const kv::ScatterParams p{b.view, kv::KvSource{b.k.data(), b.v.data(), kv::DType::f16, 0, kRowBytes, 256},
                            kv::TokenAddress{b.lay.slots.data()}, s.tokens(), 0, 1, scale(f), scale(f)};
  for (auto _ : state) {
    if (!kv::scatter_host(p)) state.SkipWithError("scatter failed");
    benchmark::ClobberMemory();
  }
  const std::int64_t bytes = s.tokens() * pool_bytes_per_token(b.g);
  state.SetBytesProcessed(std::int64_t(state.iterations()) * bytes);
  state.counters["out_bytes"] = double(bytes);
}

void BM_dequant_gather(benchmark::State& state, const Shape& s, const Format& f) {
  Bufs b(s, f);
  const kv::ScatterParams w{b.view, kv::KvSource{b.k.data(), b.v.data(), kv::DType::f16, 0, kRowBytes, 256},
                            kv::TokenAddress{b.lay.slots.data()}, s.tokens(), 0, 1, scale(f), scale(f)};
  if (!kv::scatter_host(w)) state.SkipWithError("scatter failed");
  const kv::GatherParams p{b.view,        0,           b.lay.indptr.data(), b.lay.indices.data(), b.lay.out_indptr.data(),
                           s.seqs,        s.tokens(),  b.k_out.data(),      b.v_out.data(),       kv::DType::f16,
                           kRowBytes,     256,         scale(f),            scale(f)};
  for (auto _ : state) {
    if (!kv::gather_host(p)) state.SkipWithError("gather failed");
    benchmark::ClobberMemory();
  }
  const std::int64_t bytes = s.tokens() * pool_bytes_per_token(b.g);
  state.SetBytesProcessed(std::int64_t(state.iterations()) * bytes);
  state.counters["out_bytes"] = double(bytes);
}

// One memcpy reference per distinct pool-side byte count, and the rows.
int register_all() {
  std::vector<std::int64_t> sizes;
  for (const Shape* s : {&kDecode, &kPrefill})
    for (const Format& f : kFormats) {
      const std::int64_t n = s->tokens() * pool_bytes_per_token(geometry(f));
      if (std::find(sizes.begin(), sizes.end(), n) == sizes.end()) sizes.push_back(n);
    }
  auto* ref = benchmark::RegisterBenchmark("BM_memcpy", BM_memcpy);
  for (std::int64_t n : sizes) ref->Arg(n);
  for (const Shape* s : {&kDecode, &kPrefill})
    for (const Format& f : kFormats) {
      const std::string tail = std::string("/") + s->name + "/" + f.name;
      benchmark::RegisterBenchmark(("BM_quant_scatter" + tail).c_str(), BM_quant_scatter, *s, f)->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark(("BM_dequant_gather" + tail).c_str(), BM_dequant_gather, *s, f)->Unit(benchmark::kMicrosecond);
    }
  return 0;
}
[[maybe_unused]] const int registered = register_all();

}  // namespace

BENCHMARK_MAIN();
