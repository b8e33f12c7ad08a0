// Built against an installed kvcache: reserve, scatter through the host
// kernel, read back, free, check.
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kvcache.hpp>

#include <array>
#include <cstdio>
#include <vector>

int main() {
  auto g = kvcache::Geometry::make({.num_layers = 2, .num_kv_heads = 2, .head_dim = 64, .block_size = 16});
  if (!g) return 1;
  kvcache::Cache<> cache({.geometry = *g, .num_blocks = 16, .max_sequences = 4, .max_blocks_per_sequence = 8});
  auto seq = cache.add_sequence();
  std::array<std::int32_t, 20> slots{};
  if (!seq || !cache.reserve(*seq, 20, slots)) return 2;
  if (slots[0] != 16 || slots[16] != 32) return 3;  // blocks 1 and 2, in order
  std::vector<std::byte> pool(static_cast<std::size_t>(*g->pool_bytes(16)));
  std::vector<std::uint16_t> k(20 * 2 * 64, 0x3c00), v(k.size(), 0x4000);  // fp16 1.0 and 2.0
  const auto view = *kvcache::make_pool_view(*g, pool.data(), 16);
  kvcache::ScatterParams p{view, {k.data(), v.data(), kvcache::DType::f16, 0, 2 * 64 * 2, 64 * 2},
                           kvcache::TokenAddress{slots.data()}, 20};
  if (!kvcache::scatter_host(p) || kvcache::load_elem(kvcache::DType::f16, view.row(2, 0, 1, 3, 1), 5) != 2.0f) return 5;
  if (!cache.free(*seq) || !cache.check_invariants()) return 4;
  std::printf("consumer: kvcache %d.%d.%d works\n", KVCACHE_VERSION_MAJOR, KVCACHE_VERSION_MINOR, KVCACHE_VERSION_PATCH);
  return 0;
}
