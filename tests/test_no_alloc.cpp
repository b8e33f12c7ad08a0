// After construction, no cache operation touches the heap: global operator
// new is counted while a mixed workload (hits, misses, errors) runs.
#include <kvcache/cache.hpp>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <vector>

namespace {
long g_allocations = 0;
}

void* operator new(std::size_t n) {
  ++g_allocations;
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

int main() {
  using namespace kvcache;
  auto g = *Geometry::make({.num_layers = 4, .num_kv_heads = 8, .head_dim = 128, .block_size = 16});
  Cache<> cache({.geometry = g, .num_blocks = 512, .max_sequences = 32, .max_blocks_per_sequence = 64,
                 .event_capacity = 1024});
  std::vector<std::int32_t> prompt(600), slots(1024), counts(32, 1), dense(32 * 64), indptr(33), indices(32 * 64),
      last(32);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<std::int32_t>(i % 97);
  std::vector<SeqId> seqs(32);
  std::vector<BlockCopy> copies(32);
  std::vector<BlockEvent> events(1024);

  const long before = g_allocations;
  long bad = 0;
  for (int round = 0; round < 200; ++round) {
    std::size_t n = 0;
    for (; n < 8; ++n) {
      auto hit = cache.add_sequence(prompt);
      if (!hit) break;
      seqs[n] = hit->seq;
      const auto rest = static_cast<std::int32_t>(prompt.size()) - hit->cached_tokens;
      if (!cache.reserve(seqs[n], rest, slots).ok()) ++bad;
      if (!cache.publish(seqs[n], prompt).ok()) ++bad;
    }
    seqs[n] = *cache.fork(seqs[0]);
    ++n;
    for (int step = 0; step < 20; ++step) {
      if (!cache.reserve_batch(std::span(seqs).first(n), std::span(counts).first(n), slots, copies).ok()) ++bad;
      if (!cache.export_csr(std::span(seqs).first(n), indptr, indices, last).ok()) ++bad;
      if (!cache.export_block_table(std::span(seqs).first(n), dense, 64).ok()) ++bad;
    }
    if (!cache.truncate(seqs[1], 5).ok()) ++bad;
    if (cache.reserve(seqs[1], 100000, slots).ok()) ++bad;  // must fail, without allocating
    (void)cache.drain_events(events);
    for (std::size_t i = 0; i < n; ++i)
      if (!cache.free(seqs[i]).ok()) ++bad;
    if (cache.free(seqs[0]).ok()) ++bad;  // stale handle
  }
  const long during = g_allocations - before;
  std::printf("heap allocations during the workload: %ld; unexpected results: %ld\n", during, bad);
  return during == 0 && bad == 0 ? 0 : 1;
}
