// Block copy (and swap between pools), ring write with promotion, and
// compaction, on the host backend against plain reference semantics.
#include <catch2/catch.hpp>

#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/eviction/compaction_plan.hpp>
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/ring_write.hpp>

#include <algorithm>
#include <numeric>
#include <set>

#include "kernel_testing.hpp"

using namespace kvcache;
using namespace kvtest;

namespace {
std::mt19937_64 fresh_rng() { return std::mt19937_64(Catch::rngSeed() ^ std::random_device{}()); }
// Compares one token row (all layers, K and V, heads) of two pools.
bool same_token(const Pool& a, std::int64_t slot_a, const Pool& b, std::int64_t slot_b, int layer_from, int layers) {
  const auto& g = a.spec;
  const std::size_t row = std::size_t(g.head_dim * dtype_bytes(g.dtype));
  for (int l = layer_from; l < layer_from + layers; ++l)
    for (int kv = 0; kv < 2; ++kv)
      for (int h = 0; h < g.num_kv_heads; ++h)
        if (std::memcmp(a.at(slot_a / g.block_size, l, kv, int(slot_a % g.block_size), h, 0),
                        b.at(slot_b / g.block_size, l, kv, int(slot_b % g.block_size), h, 0), row) != 0)
          return false;
  return true;
}
}  // namespace

TEST_CASE("block copy moves whole blocks, within a pool and between pools") {
  auto rng = fresh_rng();
  for (int trial = 0; trial < 40; ++trial) {
    const GeometrySpec g = random_spec(rng);
    const std::int64_t blocks = 8;
    Pool src(g, blocks);
    src.bytes = random_elems(rng, DType::fp8_e4m3, std::int64_t(src.bytes.size()));
    src.view.base = src.bytes.data();
    const bool cross = trial % 2;  // a second pool: the device<->host swap shape
    Pool dst_pool(g, blocks);
    poison(dst_pool.bytes);
    Pool& dst = cross ? dst_pool : src;
    const Pool before = dst;
    // Disjoint sources and destinations (copy-on-write never overlaps).
    std::vector<std::int32_t> ids(static_cast<std::size_t>(blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    const int n = 1 + int(rng() % 4);
    std::vector<BlockCopy> pairs;
    for (int i = 0; i < n; ++i) pairs.push_back({ids[std::size_t(i)], ids[std::size_t(i + n)]});
    const Pool source_copy = src;
    REQUIRE(block_copy_host({src.view, dst.view, pairs.data(), n}).ok());
    std::set<std::int32_t> dsts;
    for (const auto& c : pairs) {
      dsts.insert(c.dst);
      for (int t = 0; t < g.block_size; ++t)
        REQUIRE(same_token(source_copy, std::int64_t{c.src} * g.block_size + t, dst, std::int64_t{c.dst} * g.block_size + t, 0,
                           g.num_layers));
    }
    for (std::int64_t b = 0; b < blocks; ++b) {
      if (dsts.count(std::int32_t(b))) continue;
      for (int t = 0; t < g.block_size; ++t)
        REQUIRE(same_token(before, b * g.block_size + t, dst, b * g.block_size + t, 0, g.num_layers));
    }
  }
}

TEST_CASE("block copy of a layer range copies those layers only, and a range per layer adds up to the whole copy") {
  auto rng = fresh_rng();
  for (int trial = 0; trial < 20; ++trial) {
    GeometrySpec g = random_spec(rng);
    g.num_layers = 2 + int(rng() % 3);
    Pool src(g, 4), whole(g, 4), layered(g, 4);
    src.bytes = random_elems(rng, DType::fp8_e4m3, std::int64_t(src.bytes.size()));
    src.view.base = src.bytes.data();
    poison(whole.bytes);
    layered.bytes = whole.bytes;
    const std::vector<BlockCopy> pairs{{0, 2}, {3, 1}};
    REQUIRE(block_copy_host({src.view, whole.view, pairs.data(), 2}).ok());
    const int first = int(rng() % std::uint64_t(g.num_layers));
    REQUIRE(block_copy_host({src.view, layered.view, pairs.data(), 2, first, 1}).ok());
    for (const auto& c : pairs)
      for (int t = 0; t < g.block_size; ++t) {
        const std::int64_t a = std::int64_t{c.src} * g.block_size + t, b = std::int64_t{c.dst} * g.block_size + t;
        REQUIRE(same_token(src, a, layered, b, first, 1));  // the layer arrived
        if (first > 0) REQUIRE(!same_token(src, a, layered, b, 0, first));  // the earlier ones did not (poisoned)
      }
    for (int l = 0; l < g.num_layers; ++l)
      if (l != first) REQUIRE(block_copy_host({src.view, layered.view, pairs.data(), 2, l, 1}).ok());
    CHECK(layered.bytes == whole.bytes);
  }
}

TEST_CASE("block copy rejects a layer range outside the pool, naming it, and writes nothing") {
  GeometrySpec g{.num_layers = 3, .num_kv_heads = 1, .head_dim = 8, .block_size = 4};
  Pool a(g, 4), b(g, 4);
  poison(b.bytes);
  const auto before = b.bytes;
  const std::vector<BlockCopy> pairs{{0, 1}};
  auto st = block_copy_host({a.view, b.view, pairs.data(), 1, 3, 0});
  CHECK(std::string(st.what()) == "first_layer");
  CHECK(st.value() == 3);
  CHECK(std::string(block_copy_host({a.view, b.view, pairs.data(), 1, -1, 0}).what()) == "first_layer");
  st = block_copy_host({a.view, b.view, pairs.data(), 1, 1, 3});
  CHECK(std::string(st.what()) == "layers");
  CHECK(st.value() == 3);
  CHECK(st.limit() == 2);
  CHECK(std::string(block_copy_host({a.view, b.view, pairs.data(), 1, 0, -2}).what()) == "layers");
  CHECK(b.bytes == before);
}

TEST_CASE("block copy rejects pairs outside the pool and mismatched pools") {
  GeometrySpec g{.num_layers = 1, .num_kv_heads = 1, .head_dim = 8, .block_size = 4};
  Pool a(g, 4), b(g, 2);
  poison(b.bytes);
  const auto before = b.bytes;
  std::vector<BlockCopy> pairs{{0, 1}, {3, 2}};
  auto st = block_copy_host({a.view, b.view, pairs.data(), 2});
  CHECK(std::string(st.what()) == "pairs.dst");
  CHECK(st.value() == 1);
  GeometrySpec other = g;
  other.head_dim = 16;
  Pool c(other, 4);
  CHECK(std::string(block_copy_host({a.view, c.view, pairs.data(), 1}).what()) == "dst.geometry");
  CHECK(b.bytes == before);
}

TEST_CASE("ring write copies a promoted victim before overwriting its slot") {
  auto rng = fresh_rng();
  for (int trial = 0; trial < 40; ++trial) {
    GeometrySpec g = random_spec(rng);
    const std::int64_t blocks = 6, slots_total = blocks * g.block_size;
    Pool pool(g, blocks);
    pool.bytes = random_elems(rng, DType::fp8_e4m3, std::int64_t(pool.bytes.size()));
    pool.view.base = pool.bytes.data();
    const Pool before = pool;
    // Tokens: distinct ring slots; about half promote to distinct global slots.
    std::vector<std::int32_t> ids(static_cast<std::size_t>(slots_total));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    const std::int64_t tokens = std::min<std::int64_t>(slots_total / 2, 1 + std::int64_t(rng() % 12));
    std::vector<std::int32_t> ring(ids.begin(), ids.begin() + tokens), promote(static_cast<std::size_t>(tokens), -1);
    for (std::int64_t t = 0; t < tokens; ++t)
      if (rng() % 2) promote[std::size_t(t)] = ids[std::size_t(tokens + t)];
    const DType in_dtype = g.dtype == DType::fp8_e4m3 ? DType::f32 : (rng() % 3 == 0 ? DType::f32 : g.dtype);
    const std::int64_t e = dtype_bytes(in_dtype), row = g.head_dim * e;
    std::vector<std::byte> kin = random_elems(rng, in_dtype, tokens * g.num_layers * g.num_kv_heads * g.head_dim);
    std::vector<std::byte> vin = random_elems(rng, in_dtype, std::int64_t(kin.size()) / e);
    KvSource src{kin.data(), vin.data(), in_dtype, tokens * g.num_kv_heads * row, g.num_kv_heads * row, row};
    RingWriteParams p{pool.view, src, tokens, 0, g.num_layers, ring.data(), promote.data()};
    REQUIRE(ring_write_host(p).ok());
    for (std::int64_t t = 0; t < tokens; ++t) {
      if (promote[std::size_t(t)] >= 0)
        REQUIRE(same_token(before, ring[std::size_t(t)], pool, promote[std::size_t(t)], 0, g.num_layers));
      for (int l = 0; l < g.num_layers; ++l)
        for (int kv = 0; kv < 2; ++kv)
          for (int h = 0; h < g.num_kv_heads; ++h)
            for (int d = 0; d < g.head_dim; ++d) {
              std::byte buf[4];
              store_elem(g.dtype, buf, 0, load_elem(in_dtype, src.row(kv, l, t, h), d));
              const float want = load_elem(g.dtype, buf, 0);
              const float got = pool.get(ring[std::size_t(t)] / g.block_size, l, kv, int(ring[std::size_t(t)] % g.block_size), h, d);
              REQUIRE(std::memcmp(&want, &got, 4) == 0);
            }
    }
  }
}

TEST_CASE("compaction plan: fewest moves, holes filled from the tail, order reported") {
  // 10 tokens in blocks {5, 2, 7} of 4; keep 0 2 3 6 8 9 -> new length 6.
  const std::vector<BlockId> blocks{5, 2, 7};
  const std::vector<std::int32_t> keep{0, 2, 3, 6, 8, 9};
  std::vector<SlotMove> moves(6);
  std::vector<std::int32_t> order(6);
  auto n = plan_compaction(keep, 10, blocks, 4, moves, order);
  REQUIRE(n.ok());
  // 0, 2, 3 stay; 6, 8, 9 (>= the new length) fill holes 1, 4, 5.
  REQUIRE(*n == 3);
  CHECK(moves[0] == SlotMove{2 * 4 + 2, 5 * 4 + 1});
  CHECK(moves[1] == SlotMove{7 * 4 + 0, 2 * 4 + 0});
  CHECK(moves[2] == SlotMove{7 * 4 + 1, 2 * 4 + 1});
  CHECK(order == std::vector<std::int32_t>{0, 6, 2, 3, 8, 9});
}

TEST_CASE("compaction plan validates keep and buffer sizes") {
  const std::vector<BlockId> blocks{1, 2};
  std::vector<SlotMove> moves(4);
  std::vector<std::int32_t> order(4);
  CHECK(std::string(plan_compaction(std::vector<std::int32_t>{1, 1}, 8, blocks, 4, moves, order).status().what()) == "keep");
  CHECK(std::string(plan_compaction(std::vector<std::int32_t>{0, 9}, 8, blocks, 4, moves, order).status().what()) == "keep");
  CHECK(std::string(plan_compaction(std::vector<std::int32_t>{0}, 9, blocks, 4, moves, order).status().what()) == "length");
  CHECK(plan_compaction(std::vector<std::int32_t>{5, 6, 7}, 8, blocks, 4, std::span(moves).first(2), order).status().code() ==
        Errc::buffer_too_small);
}

TEST_CASE("compaction keeps exactly the kept tokens, in place, for random keeps") {
  auto rng = fresh_rng();
  for (int trial = 0; trial < 60; ++trial) {
    const GeometrySpec g = random_spec(rng);
    const std::int32_t nblocks = 5, length = std::int32_t(rng() % std::uint64_t(nblocks * g.block_size + 1));
    std::vector<BlockId> row(static_cast<std::size_t>(nblocks));
    std::iota(row.begin(), row.end(), 1);
    std::shuffle(row.begin(), row.end(), rng);
    Pool pool(g, nblocks + 1);
    pool.bytes = random_elems(rng, DType::fp8_e4m3, std::int64_t(pool.bytes.size()));
    pool.view.base = pool.bytes.data();
    const Pool before = pool;
    std::vector<std::int32_t> keep;
    for (std::int32_t pos = 0; pos < length; ++pos)
      if (rng() % 3) keep.push_back(pos);
    std::vector<SlotMove> moves(keep.size());
    std::vector<std::int32_t> order(keep.size());
    auto n = plan_compaction(keep, length, row, g.block_size, moves, order);
    REQUIRE(n.ok());
    const auto new_len = std::int32_t(keep.size());
    REQUIRE(*n == std::count_if(keep.begin(), keep.end(), [&](std::int32_t p) { return p >= new_len; }));
    std::vector<std::int32_t> sorted_order(order.begin(), order.end());
    std::sort(sorted_order.begin(), sorted_order.end());
    REQUIRE(sorted_order == keep);  // a permutation of the kept positions
    REQUIRE(compaction_host({pool.view, moves.data(), *n, 0, g.num_layers}).ok());
    auto slot = [&](std::int32_t p) { return std::int64_t{row[std::size_t(p / g.block_size)]} * g.block_size + p % g.block_size; };
    for (std::int32_t p = 0; p < new_len; ++p)
      REQUIRE(same_token(before, slot(order[std::size_t(p)]), pool, slot(p), 0, g.num_layers));
  }
}
