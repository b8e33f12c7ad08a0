// Host backend kernels: scatter (alone, and with Quest's metadata upkeep),
// gather and block copy GB/s on the decode and prefill shapes, and the write
// gate on a decode step's keys, against memcpy of the same bytes in the same run.
#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kernels/gather.hpp>
#include <kvcache/kernels/page_bounds.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kernels/write_gate.hpp>

#include <benchmark/benchmark.h>

#include <cstring>

#include "kernel_shapes.hpp"

namespace kv = kvcache;
using namespace kvbench;

namespace {

struct Bufs {
  Layout lay;
  std::vector<std::byte> pool, k, v, k_out, v_out;
  kv::PoolView view;
  explicit Bufs(const Shape& s) : lay(layout(s)) {
    auto g = *kv::Geometry::make(spec());
    pool.assign(std::size_t(*g.pool_bytes(lay.pool_blocks)), std::byte{1});
    view = *kv::make_pool_view(g, pool.data(), lay.pool_blocks);
    k.assign(std::size_t(s.tokens() * kRowBytes), std::byte{2});
    v = k;
    k_out = k;
    v_out = k;
  }
};

void finish(benchmark::State& state, std::int64_t payload, int ref_id) {
  state.SetBytesProcessed(std::int64_t(state.iterations()) * payload);
  state.counters["out_bytes"] = double(payload);
  state.counters["ref_id"] = ref_id;
  state.counters["bandwidth"] = 1;
}

// Reference: memcpy of the kernel's payload, with the scattered side (the
// destination, or the source for gather) walking a region as large as the
// kernel's pool, so both see the same cache state; the dense side stays put.
// args: payload bytes, region bytes, 1 = region is the source, reference id.
void BM_memcpy(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0)), region = static_cast<std::size_t>(state.range(1));
  const bool region_is_src = state.range(2) != 0;
  std::vector<std::byte> dense(n + 64, std::byte{1}), big(region + n, std::byte{2});
  std::size_t at = 0;
  for (auto _ : state) {
    std::byte* d = region_is_src ? dense.data() + 64 : big.data() + at;  // +64: no 4K aliasing (bench_core.cpp)
    const std::byte* s = region_is_src ? big.data() + at : dense.data() + 64;
    std::memcpy(d, s, n);
    benchmark::ClobberMemory();
    at = (at + n) % region;
  }
  finish(state, std::int64_t(n), int(state.range(3)));
}

void BM_scatter(benchmark::State& state, const Shape& s) {
  Bufs b(s);
  const kv::ScatterParams p{b.view, kv::KvSource{b.k.data(), b.v.data(), kv::DType::f16, 0, kRowBytes, 256},
                            kv::TokenAddress{b.lay.slots.data()}, s.tokens()};
  for (auto _ : state) {
    if (!kv::scatter_host(p)) state.SkipWithError("scatter failed");
    benchmark::ClobberMemory();
  }
  finish(state, s.payload(), s.seqs == kDecode.seqs ? 0 : 1);
}

// Quest's metadata upkeep: the same scatter, then page_bounds_update folding
// the written keys into their pages' max and min (fp32, 2 x 128 per head).
void BM_scatter_with_bounds(benchmark::State& state, const Shape& s) {
  Bufs b(s);
  const kv::ScatterParams p{b.view, kv::KvSource{b.k.data(), b.v.data(), kv::DType::f16, 0, kRowBytes, 256},
                            kv::TokenAddress{b.lay.slots.data()}, s.tokens()};
  std::vector<float> bounds(std::size_t(b.lay.pool_blocks) * 8 * 2 * 128);
  const kv::PageBoundsUpdateParams u{b.view, 0, b.lay.slots.data(), s.tokens(), bounds.data()};
  for (auto _ : state) {
    if (!kv::scatter_host(p) || !kv::page_bounds_update_host(u)) state.SkipWithError("scatter or bounds failed");
    benchmark::ClobberMemory();
  }
  finish(state, s.payload(), s.seqs == kDecode.seqs ? 0 : 1);
}

void BM_gather(benchmark::State& state, const Shape& s) {
  Bufs b(s);
  const kv::GatherParams p{b.view, 0, b.lay.indptr.data(), b.lay.indices.data(), b.lay.out_indptr.data(), s.seqs,
                           s.tokens(), b.k_out.data(), b.v_out.data(), kv::DType::f16, kRowBytes, 256};
  for (auto _ : state) {
    if (!kv::gather_host(p)) state.SkipWithError("gather failed");
    benchmark::ClobberMemory();
  }
  finish(state, s.payload(), s.seqs == kDecode.seqs ? 2 : 3);
}

void BM_block_copy(benchmark::State& state, const Shape& s) {
  Bufs b(s);
  const kv::BlockCopyParams p{b.view, b.view, b.lay.pairs.data(), std::int32_t(b.lay.pairs.size())};
  for (auto _ : state) {
    if (!kv::block_copy_host(p)) state.SkipWithError("copy failed");
    benchmark::ClobberMemory();
  }
  finish(state, std::int64_t(b.lay.pairs.size()) * 16 * kRowBytes * 2, s.seqs == kDecode.seqs ? 4 : 5);
}

// The write gate on one layer of a decode step: 256 tokens x 8 kv-heads,
// head_dim 128, hidden 512 (the paper's 4 x head_dim), fp16 pre- and
// post-RoPE keys. Its "bytes" are the keys it reads: the reference copies
// as many (a compute-bound MLP of 2 x 128 x 512 products per (token, head)
// cannot approach it; the ratio says by how much).
constexpr std::int64_t kGateTokens = 256, kGateBytes = kGateTokens * kRowBytes * 2;
void BM_write_gate(benchmark::State& state) {
  const std::int32_t heads = 8, hd = 128, hidden = 512;
  std::vector<float> norm(hd, 1.0f), w1(std::size_t(heads) * 2 * hd * hidden), b1(std::size_t(heads) * hidden, 0.01f),
      w2(std::size_t(heads) * hidden), b2(heads, -1.0f), gates(std::size_t(kGateTokens) * heads);
  for (std::size_t i = 0; i < w1.size(); ++i) w1[i] = float(int(i % 17) - 8) * 0.01f;
  for (std::size_t i = 0; i < w2.size(); ++i) w2[i] = float(int(i % 13) - 6) * 0.02f;
  std::vector<std::byte> keys(static_cast<std::size_t>(kGateBytes));
  for (std::size_t i = 0; i < keys.size() / 2; ++i) kv::store_elem(kv::DType::f16, keys.data(), std::int64_t(i), float(int(i % 29) - 14) * 0.1f);
  kv::WriteGateWeights w{norm.data(), norm.data(), w1.data(), b1.data(), w2.data(), b2.data(), heads, hd, hidden};
  const kv::WriteGateParams p{w, keys.data(), keys.data() + kGateBytes / 2, kv::DType::f16, kRowBytes, hd * 2,
                              kGateTokens, gates.data()};
  for (auto _ : state) {
    if (!kv::write_gate_host(p)) state.SkipWithError("write gate failed");
    benchmark::ClobberMemory();
  }
  finish(state, kGateBytes, 6);
}

}  // namespace

// Pool bytes of a shape's layout (two regions of its blocks, one layer).
std::int64_t pool_bytes(const Shape& s) { return (2 * s.blocks() + 1) * 16 * kRowBytes * 2; }
std::int64_t copy_bytes(const Shape& s) { return s.blocks() * 16 * kRowBytes * 2; }

BENCHMARK(BM_memcpy)
    ->Args({kDecode.payload(), pool_bytes(kDecode), 0, 0})
    ->Args({kPrefill.payload(), pool_bytes(kPrefill), 0, 1})
    ->Args({kDecode.payload(), pool_bytes(kDecode), 1, 2})
    ->Args({kPrefill.payload(), pool_bytes(kPrefill), 1, 3})
    ->Args({copy_bytes(kDecode), pool_bytes(kDecode), 0, 4})
    ->Args({copy_bytes(kPrefill), pool_bytes(kPrefill), 0, 5})
    ->Args({kGateBytes, kGateBytes, 1, 6})
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_scatter, decode_256x1, kDecode)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_scatter, prefill_8x2048, kPrefill)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_scatter_with_bounds, decode_256x1, kDecode)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_scatter_with_bounds, prefill_8x2048, kPrefill)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_gather, decode_256x1, kDecode)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_gather, prefill_8x2048, kPrefill)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_block_copy, decode_256x1, kDecode)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_block_copy, prefill_8x2048, kPrefill)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_write_gate)->Name("BM_write_gate/decode_256x8")->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
