// Quantized KV on the host backend: scatter quantizing fp16 K/V as it writes,
// and gather dequantizing back to fp16, per format, on the decode and prefill
// shapes. The reference is memcpy of the pool-side bytes (codes and group
// entries) the kernel writes or reads, measured in the same run. KIVI's
// format (keys per channel over a block) is written by seal_blocks, whole
// blocks at a time: sealing a prefill's blocks, and gathering them back.
// The in_cache_1x16 rows write and read one block of 16 tokens over and
// over (64 KiB of fp16, in L2): the conversion's own cost, which bounds
// what the prefill rows can reach however the memory behaves.
#include <kvcache/kernels/gather.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kernels/seal.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <vector>

#include "memcpy_reference.hpp"
#include "quant_formats.hpp"

namespace kv = kvcache;
using namespace kvbench;

namespace {

// One block's 16 tokens, written and read in cache (the header's comment).
const Shape kInCache{"in_cache_1x16", 1, 16};

struct Bufs {
  Layout lay;
  kv::Geometry g;
  Bytes pool, k, v, k_out, v_out;
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

// KIVI: int2 keys with a scale and minimum per (block, head, channel), int2
// values in groups of 32 with a minimum. A token's pool bytes are its
// block's over the block size (the channel entries are the block's).
kv::Geometry kivi_geometry() {
  kv::GeometrySpec g = spec();
  g.dtype = kv::DType::int2;
  g.format = {{.scales = kv::Scales::channel, .minimum = true}, {.scales = kv::Scales::group, .group = 32, .minimum = true}};
  return *kv::Geometry::make(g);
}
std::int64_t kivi_bytes(const Shape& s) {
  const kv::Geometry g = kivi_geometry();
  return s.tokens() * g.block_bytes() / g.block_size();
}
struct KiviBufs {
  Layout lay;
  kv::Geometry g = kivi_geometry();
  Bytes pool, k, k_out, v_out;
  kv::PoolView view;
  kv::SealParams seal;
  // The shape's blocks, whole: a decode shape's one-token blocks are sealed from 16 tokens each.
  explicit KiviBufs(const Shape& s) : lay(layout(s)) {
    pool.assign(std::size_t(*g.pool_bytes(lay.pool_blocks)), std::byte{1});
    view = *kv::make_pool_view(g, pool.data(), lay.pool_blocks);
    k = sample_keys(std::int64_t(lay.indices.size()) * 16);
    k_out = sample_keys(s.tokens());
    v_out = k_out;
    seal = {view, kv::KvSource{k.data(), k.data(), kv::DType::f16, 0, kRowBytes, 256}, lay.indices.data(),
            std::int32_t(lay.indices.size())};
  }
};

void BM_seal_kivi(benchmark::State& state, const Shape& s) {
  KiviBufs b(s);
  for (auto _ : state) {
    if (!kv::seal_blocks_host(b.seal)) state.SkipWithError("seal failed");
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(std::int64_t(state.iterations()) * kivi_bytes(s));
  state.counters["out_bytes"] = double(kivi_bytes(s));
}

void BM_dequant_gather_kivi(benchmark::State& state, const Shape& s) {
  KiviBufs b(s);
  if (!kv::seal_blocks_host(b.seal)) state.SkipWithError("seal failed");
  const kv::GatherParams p{b.view,    0,          b.lay.indptr.data(), b.lay.indices.data(), b.lay.out_indptr.data(),
                           s.seqs,    s.tokens(), b.k_out.data(),      b.v_out.data(),       kv::DType::f16,
                           kRowBytes, 256};
  for (auto _ : state) {
    if (!kv::gather_host(p)) state.SkipWithError("gather failed");
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(std::int64_t(state.iterations()) * kivi_bytes(s));
  state.counters["out_bytes"] = double(kivi_bytes(s));
}

// One memcpy reference per distinct pool-side byte count, and the rows.
int register_all() {
  std::vector<std::int64_t> sizes;
  const auto add = [&](std::int64_t n) {
    if (std::find(sizes.begin(), sizes.end(), n) == sizes.end()) sizes.push_back(n);
  };
  for (const Shape* s : {&kInCache, &kDecode, &kPrefill})
    for (const Format& f : kFormats) add(s->tokens() * pool_bytes_per_token(geometry(f)));
  for (const Shape* s : {&kDecode, &kPrefill}) add(kivi_bytes(*s));
  auto* ref = benchmark::RegisterBenchmark("BM_memcpy", BM_memcpy);
  for (std::int64_t n : sizes) ref->Arg(n);
  for (const Shape* s : {&kInCache, &kDecode, &kPrefill})
    for (const Format& f : kFormats) {
      const std::string tail = std::string("/") + s->name + "/" + f.name;
      benchmark::RegisterBenchmark(("BM_quant_scatter" + tail).c_str(), BM_quant_scatter, *s, f)->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark(("BM_dequant_gather" + tail).c_str(), BM_dequant_gather, *s, f)->Unit(benchmark::kMicrosecond);
    }
  benchmark::RegisterBenchmark("BM_seal_kivi/prefill_8x2048/int2_kivi", BM_seal_kivi, kPrefill)->Unit(benchmark::kMicrosecond);
  for (const Shape* s : {&kDecode, &kPrefill})
    benchmark::RegisterBenchmark((std::string("BM_dequant_gather_kivi/") + s->name + "/int2_kivi").c_str(), BM_dequant_gather_kivi, *s)
        ->Unit(benchmark::kMicrosecond);
  return 0;
}
[[maybe_unused]] const int registered = register_all();

}  // namespace

BENCHMARK_MAIN();
