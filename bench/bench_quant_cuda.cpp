// Quantized KV on the CUDA backend: scatter quantizing fp16 K/V as it writes,
// and gather dequantizing back to fp16, per format (quant_formats.hpp), on
// the decode and prefill shapes. The reference is a device-to-device copy of
// the pool-side bytes (codes and group entries) the kernel writes or reads,
// in the same run; the ratio compares bandwidths over those bytes. GPU time
// from CUDA events. Without a GPU: prints a line, exits 0.
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cuda_timing.hpp"
#include "launchers.hpp"  // cuda/
#include "quant_formats.hpp"

namespace kv = kvcache;
using namespace kvbench;

namespace {

struct DevQuant {
  Layout lay;
  kv::Geometry g;
  DevBuf pool, k, v, k_out, v_out, slots, indptr, indices, out_indptr;
  kv::PoolView view;
  DevQuant(const Shape& s, const Format& f)
      : lay(layout(s)),
        g(geometry(f)),
        pool(std::size_t(*g.pool_bytes(lay.pool_blocks))),
        k(sample_keys(s.tokens())),
        v(sample_keys(s.tokens())),
        k_out(std::size_t(s.tokens() * kRowBytes)),
        v_out(std::size_t(s.tokens() * kRowBytes)),
        slots(lay.slots),
        indptr(lay.indptr),
        indices(lay.indices),
        out_indptr(lay.out_indptr) {
    view = *kv::make_pool_view(g, pool.p, lay.pool_blocks);
  }
  kv::ScatterParams scatter(const Shape& s, const Format& f) const {
    return {view, kv::KvSource{k.p, v.p, kv::DType::f16, 0, kRowBytes, 256}, kv::TokenAddress{slots.as<std::int32_t>()},
            s.tokens(), 0, 1, scale(f), scale(f)};
  }
};

int ref_of(std::int64_t bytes);

void BM_quant_scatter(benchmark::State& state, const Shape& s, const Format& f) {
  DevQuant d(s, f);
  const kv::ScatterParams p = d.scatter(s, f);
  run_timed(state, [&] { return kvgpu::scatter(p); });
  const std::int64_t bytes = s.tokens() * pool_bytes_per_token(d.g);
  finish(state, bytes, ref_of(bytes));
}

void BM_dequant_gather(benchmark::State& state, const Shape& s, const Format& f) {
  DevQuant d(s, f);
  if (kvgpu::scatter(d.scatter(s, f)) != cudaSuccess) state.SkipWithError("scatter failed");
  const kv::GatherParams p{d.view,
                           0,
                           d.indptr.as<std::int32_t>(),
                           d.indices.as<std::int32_t>(),
                           d.out_indptr.as<std::int32_t>(),
                           s.seqs,
                           s.tokens(),
                           d.k_out.p,
                           d.v_out.p,
                           kv::DType::f16,
                           kRowBytes,
                           256,
                           scale(f),
                           scale(f)};
  run_timed(state, [&] { return kvgpu::gather(p); });
  const std::int64_t bytes = s.tokens() * pool_bytes_per_token(d.g);
  finish(state, bytes, ref_of(bytes));
}

// One device-copy reference per distinct pool-side byte count; its index is
// the ref_id that pairs a row with it.
std::vector<std::int64_t> reference_sizes() {
  std::vector<std::int64_t> sizes;
  for (const Shape* s : {&kDecode, &kPrefill})
    for (const Format& f : kFormats) {
      const std::int64_t n = s->tokens() * pool_bytes_per_token(geometry(f));
      if (std::find(sizes.begin(), sizes.end(), n) == sizes.end()) sizes.push_back(n);
    }
  return sizes;
}
int ref_of(std::int64_t bytes) {
  static const std::vector<std::int64_t> sizes = reference_sizes();
  return int(std::find(sizes.begin(), sizes.end(), bytes) - sizes.begin());
}

void BM_d2d_copy(benchmark::State& state) { device_copy(state, state.range(0), ref_of(state.range(0))); }

void register_all() {
  auto* ref = benchmark::RegisterBenchmark("BM_d2d_copy", BM_d2d_copy);
  for (std::int64_t n : reference_sizes()) ref->Arg(n);
  ref->UseManualTime()->Unit(benchmark::kMicrosecond);
  for (const Shape* s : {&kDecode, &kPrefill})
    for (const Format& f : kFormats) {
      const std::string tail = std::string("/") + s->name + "/" + f.name;
      benchmark::RegisterBenchmark(("BM_quant_scatter" + tail).c_str(), BM_quant_scatter, *s, f)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark(("BM_dequant_gather" + tail).c_str(), BM_dequant_gather, *s, f)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
    }
}

}  // namespace

int main(int argc, char** argv) {
  if (!have_gpu("bench_quant_cuda")) return 0;
  register_all();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
