// Built against an installed kvcache: reserve, export, free, check.
#include <kvcache/kvcache.hpp>

#include <array>
#include <cstdio>

int main() {
  auto g = kvcache::Geometry::make({.num_layers = 2, .num_kv_heads = 2, .head_dim = 64, .block_size = 16});
  if (!g) return 1;
  kvcache::Cache<> cache({.geometry = *g, .num_blocks = 16, .max_sequences = 4, .max_blocks_per_sequence = 8});
  auto seq = cache.add_sequence();
  std::array<std::int32_t, 20> slots{};
  if (!seq || !cache.reserve(*seq, 20, slots)) return 2;
  if (slots[0] != 16 || slots[16] != 32) return 3;  // blocks 1 and 2, in order
  if (!cache.free(*seq) || !cache.check_invariants()) return 4;
  std::printf("consumer: kvcache %d.%d.%d works\n", KVCACHE_VERSION_MAJOR, KVCACHE_VERSION_MINOR, KVCACHE_VERSION_PATCH);
  return 0;
}
