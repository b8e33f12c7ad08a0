// Memory tiers. Bookkeeping for 256 requests of 64 blocks with a host tier
// of 10,000 blocks: lookups alone, onboarding (lookup, plan host -> device,
// complete) and offloading (plan device -> host recycling least recently
// used blocks, complete), per step of 256 requests; beside them the step
// without tiers (the device prefix cache's match of the same prompts) and
// memcpy of the move lists. The bytes: 16 blocks of 2 MiB (a Llama-8B
// block of 16 tokens, 32 layers, every layer contiguous in host memory)
// copied from a separate-planes pool into the host tier, against memcpy; the
// same blocks sealed and written to a disk file and read back and verified,
// against one sequential write and read of as many bytes (page cache
// included: /tmp is where CI runs).
#include <kvcache/kvcache.hpp>
#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/tiers/disk_layout.hpp>
#include <kvcache/tiers/tiers.hpp>

#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <numeric>
#include <vector>

#include "memcpy_reference.hpp"

namespace kv = kvcache;

namespace {

constexpr std::int32_t kRequests = 256, kBlocks = 64, kHostBlocks = 10000, kTokens = 16;

// Request r's chain of kBlocks hashes, into c (the timed loops reuse one buffer).
void fill_chain(std::int32_t r, std::vector<kv::BlockHash>& c) {
  c.resize(kBlocks);
  for (std::int32_t i = 0; i < kBlocks; ++i) c[std::size_t(i)] = {std::uint64_t(r) * 1000003u + std::uint64_t(i) + 1, 5};
}
std::vector<kv::BlockHash> chain(std::int32_t r) {
  std::vector<kv::BlockHash> c;
  fill_chain(r, c);
  return c;
}
// Time per unit of work: per lookup, per block planned (Google Benchmark prints seconds with SI prefixes).
benchmark::Counter per(double units) {
  return benchmark::Counter(units, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}
std::int64_t move_list_bytes() { return std::int64_t{kRequests} * kBlocks * std::int64_t(sizeof(kv::BlockMove)); }

// A host tier holding the first 150 requests' chains (of 256): the rest miss.
struct Warm {
  kv::Tiers tiers{{.host_blocks = kHostBlocks, .block_size = kTokens, .max_jobs = 4096}};
  std::vector<std::vector<kv::BlockHash>> chains;
  std::vector<std::int32_t> device = std::vector<std::int32_t>(kBlocks);
  std::vector<kv::Tier> where = std::vector<kv::Tier>(kBlocks);
  Warm() {
    std::iota(device.begin(), device.end(), 1);
    for (std::int32_t r = 0; r < kRequests; ++r) chains.push_back(chain(r));
    for (std::int32_t r = 0; r < 150; ++r) (void)tiers.complete(tiers.plan_store(kv::Tier::device, kv::Tier::host, chains[std::size_t(r)], device)->id);
  }
};

void BM_tiers_lookup_256x64(benchmark::State& state) {
  Warm w;
  std::int64_t hits = 0;
  for (auto _ : state) {
    hits = 0;
    for (const auto& c : w.chains) hits += w.tiers.lookup(c, 0, kBlocks * kTokens + 1, w.where)->host;
    benchmark::DoNotOptimize(hits);
  }
  state.counters["host_hits"] = double(hits);
  state.counters["out_bytes"] = double(move_list_bytes());
  state.counters["per_lookup"] = per(kRequests);
}

void BM_tiers_onboard_256x64(benchmark::State& state) {
  Warm w;
  std::int64_t moved = 0;
  for (auto _ : state) {
    moved = 0;
    for (const auto& c : w.chains) {
      const auto h = *w.tiers.lookup(c, 0, kBlocks * kTokens + 1, w.where);
      const auto j = *w.tiers.plan_load(kv::Tier::host, kv::Tier::device, std::span(c).first(std::size_t(h.host)),
                                        std::span(w.device).first(std::size_t(h.host)));
      moved += std::int64_t(j.moves.size());
      benchmark::DoNotOptimize(w.tiers.complete(j.id));
    }
  }
  state.counters["moves"] = double(moved);
  state.counters["out_bytes"] = double(move_list_bytes());
  state.counters["per_block"] = per(double(moved));
}

void BM_tiers_offload_256x64(benchmark::State& state) {
  Warm w;
  std::int32_t round = 0;
  std::vector<kv::BlockHash> c;
  for (auto _ : state) {  // new chains every step: each store recycles the least recently used blocks
    ++round;
    for (std::int32_t r = 0; r < kRequests; ++r) {
      fill_chain(round * kRequests + r + 1000, c);
      const auto j = *w.tiers.plan_store(kv::Tier::device, kv::Tier::host, c, w.device);
      benchmark::DoNotOptimize(w.tiers.complete(j.id));
    }
  }
  state.counters["out_bytes"] = double(move_list_bytes());
  state.counters["per_block"] = per(double(kRequests) * kBlocks);
}

// The step without tiers: the device prefix cache matching the same 256 prompts (64 cached blocks each).
void BM_device_match_256x64(benchmark::State& state) {
  kv::Cache<> cache({.geometry = *kv::Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = 8, .block_size = kTokens}),
                     .num_blocks = kRequests * (kBlocks + 1) + 1, .max_sequences = kRequests, .max_blocks_per_sequence = kBlocks + 1});
  std::vector<std::vector<std::int32_t>> prompts;
  std::vector<std::int32_t> slots(kBlocks * kTokens + 1);
  for (std::int32_t r = 0; r < kRequests; ++r) {
    prompts.emplace_back(std::size_t(kBlocks * kTokens + 1));
    std::iota(prompts.back().begin(), prompts.back().end(), r * 100000);
    auto a = cache.admit(prompts.back(), slots);
    (void)cache.publish(a->seq, prompts.back());
  }
  std::vector<kv::BlockId> out(kBlocks);
  std::int64_t hits = 0;
  for (auto _ : state) {
    hits = 0;
    for (const auto& p : prompts) hits += cache.match_prefix(p, {}, out);
    benchmark::DoNotOptimize(hits);
  }
  state.counters["hit_blocks"] = double(hits);
  state.counters["out_bytes"] = double(move_list_bytes());
}

// 16 blocks of 2 MiB: Llama 3 8B (32 layers, 8 kv-heads of 128, fp16), 16 tokens a block.
constexpr std::int32_t kCopyBlocks = 16;
kv::GeometrySpec llama(kv::KvPlanes planes) {
  return {.num_layers = 32, .num_kv_heads = 8, .head_dim = 128, .block_size = 16, .dtype = kv::DType::f16, .planes = planes};
}
std::int64_t copy_bytes() { return kCopyBlocks * kv::Geometry::make(llama(kv::KvPlanes::interleaved))->block_bytes(); }

void BM_host_tier_copy_16x2MiB(benchmark::State& state) {
  const auto dg = *kv::Geometry::make(llama(kv::KvPlanes::separate)), hg = *kv::Geometry::make(llama(kv::KvPlanes::interleaved));
  std::vector<std::byte> device(std::size_t(*dg.pool_bytes(kCopyBlocks + 1)), std::byte{1}), host(std::size_t(*hg.pool_bytes(kCopyBlocks)));
  const auto dv = *kv::make_pool_view(dg, device.data(), kCopyBlocks + 1), hv = *kv::make_pool_view(hg, host.data(), kCopyBlocks);
  std::vector<kv::BlockCopy> pairs;
  for (std::int32_t i = 0; i < kCopyBlocks; ++i) pairs.push_back({i + 1, i});
  for (auto _ : state) {
    benchmark::DoNotOptimize(kv::block_copy_host({dv, hv, pairs.data(), kCopyBlocks}));
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(std::int64_t(state.iterations()) * copy_bytes());
  state.counters["out_bytes"] = double(copy_bytes());
  state.counters["bandwidth"] = 1;
}

struct File {
  char path[64] = "/tmp/kvcache_bench_tiers_XXXXXX";
  int fd = mkstemp(path);
  ~File() {
    close(fd);
    std::remove(path);
  }
};

// Gather each block into its slot image, seal it, pwrite it (mode 0); pread each slot, verify it (mode 1).
void BM_disk_slots_16x2MiB(benchmark::State& state) {
  const bool read = state.range(0) == 1;
  const auto g = *kv::Geometry::make(llama(kv::KvPlanes::interleaved));
  const auto d = *kv::DiskLayout::make(g.block_bytes(), kCopyBlocks, kv::layout_digest(g.spec()));
  std::vector<std::byte> host(std::size_t(*g.pool_bytes(kCopyBlocks)), std::byte{3}), image(std::size_t(d.slot_bytes()));
  File f;
  if (ftruncate(f.fd, off_t(d.file_bytes())) != 0) state.SkipWithError("ftruncate");
  const kv::BlockHash h{1, 2};
  for (std::int32_t s = 0; s < kCopyBlocks; ++s) {  // slots sealed once, so reads verify
    std::memcpy(image.data(), host.data() + std::size_t(s) * std::size_t(g.block_bytes()), std::size_t(g.block_bytes()));
    (void)d.seal(image, s, h);
    if (pwrite(f.fd, image.data(), image.size(), off_t(d.offset(s))) != ssize_t(image.size())) state.SkipWithError("pwrite");
  }
  for (auto _ : state) {
    for (std::int32_t s = 0; s < kCopyBlocks; ++s) {
      std::byte* block = host.data() + std::size_t(s) * std::size_t(g.block_bytes());
      if (read) {
        if (pread(f.fd, image.data(), image.size(), off_t(d.offset(s))) != ssize_t(image.size())) state.SkipWithError("pread");
        if (!d.verify(image, s, h).ok()) state.SkipWithError("verify");
        std::memcpy(block, image.data(), std::size_t(g.block_bytes()));
      } else {
        std::memcpy(image.data(), block, std::size_t(g.block_bytes()));
        (void)d.seal(image, s, h);
        if (pwrite(f.fd, image.data(), image.size(), off_t(d.offset(s))) != ssize_t(image.size())) state.SkipWithError("pwrite");
      }
    }
  }
  state.SetBytesProcessed(std::int64_t(state.iterations()) * copy_bytes());
  state.SetLabel(read ? "pread + verify" : "seal + pwrite");
  state.counters["out_bytes"] = double(copy_bytes());
  state.counters["bandwidth"] = 1;
}

// The file system's sequential bandwidth in the same run: one pwrite (mode 0) or pread (mode 1) of the same bytes.
void BM_file_sequential_32MiB(benchmark::State& state) {
  const bool read = state.range(0) == 1;
  std::vector<std::byte> buf(std::size_t(copy_bytes()), std::byte{5});
  File f;
  if (pwrite(f.fd, buf.data(), buf.size(), 0) != ssize_t(buf.size())) state.SkipWithError("pwrite");
  for (auto _ : state) {
    const ssize_t n = read ? pread(f.fd, buf.data(), buf.size(), 0) : pwrite(f.fd, buf.data(), buf.size(), 0);
    if (n != ssize_t(buf.size())) state.SkipWithError("io");
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(std::int64_t(state.iterations()) * copy_bytes());
  state.SetLabel(read ? "pread" : "pwrite");
  state.counters["out_bytes"] = double(copy_bytes());
  state.counters["bandwidth"] = 1;
}

}  // namespace

BENCHMARK(BM_memcpy)->Arg(move_list_bytes())->Arg(std::int32_t(copy_bytes()));
BENCHMARK(BM_device_match_256x64)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_tiers_lookup_256x64)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_tiers_onboard_256x64)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_tiers_offload_256x64)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_host_tier_copy_16x2MiB)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_disk_slots_16x2MiB)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_file_sequential_32MiB)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
