// One engine's use of its own copy of kvcache. Compiled once per copy with
// ENGINE naming the entry point and the include path picking the copy
// (tests/packaging/CMakeLists.txt).
#include <kvcache/kvcache.hpp>

#include <array>
#include <cstdint>

#include "engine.hpp"

EngineReport ENGINE() {
  bool works = false;
  auto g = kvcache::Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = 8, .block_size = 4});
  if (g) {
    kvcache::Cache<> cache({.geometry = *g, .num_blocks = 8, .max_sequences = 2, .max_blocks_per_sequence = 4});
    auto seq = cache.add_sequence();
    std::array<std::int32_t, 6> slots{};
    // Block 0 is reserved (the null block), so six tokens land in blocks 1 and 2.
    works = seq && cache.reserve(*seq, 6, slots).ok() && slots[0] == 4 && slots[5] == 9 && cache.free(*seq).ok() &&
            cache.check_invariants().ok();
  }
  const char* (*fn)() noexcept = &kvcache::version_string;
  return {kvcache::version_string(), kvcache::version(), reinterpret_cast<const void*>(fn), works};
}
