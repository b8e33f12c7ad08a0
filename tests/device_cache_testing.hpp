// What the tests of device-side holds and write policies share: a small
// device cache (blocks of 4 tokens), prompts of consecutive token ids, and a
// sequence reserved and published whole (its full blocks cached), a row's blocks.
#pragma once

#include <catch2/catch.hpp>

#include <kvcache/cache.hpp>

#include <numeric>
#include <vector>

namespace kvtest {

inline kvcache::CacheConfig device_config(std::int32_t blocks = 9, std::int32_t events = 0) {
  return {.geometry = *kvcache::Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = 8, .block_size = 4}),
          .num_blocks = blocks, .max_sequences = 4, .max_blocks_per_sequence = 8, .event_capacity = events};
}
inline std::vector<std::int32_t> prompt(std::int32_t n, std::int32_t base = 1) {
  std::vector<std::int32_t> p(static_cast<std::size_t>(n));
  std::iota(p.begin(), p.end(), base);
  return p;
}
inline std::vector<kvcache::BlockId> blocks_of(const kvcache::Cache<>& c, kvcache::SeqId s) {
  const auto b = *c.table().blocks(s);
  return {b.begin(), b.end()};
}
inline kvcache::SeqId add_published(kvcache::Cache<>& c, const std::vector<std::int32_t>& toks) {
  const kvcache::SeqId s = *c.add_sequence();
  std::vector<std::int32_t> slots(toks.size());
  REQUIRE(c.reserve(s, std::int32_t(toks.size()), slots).ok());
  REQUIRE(c.publish(s, toks).ok());
  return s;
}

}  // namespace kvtest
