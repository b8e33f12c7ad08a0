// Quantized pools through the row kernels on the host backend: scatter
// quantizes on write, gather dequantizes on read, compaction moves codes and
// group entries together. Each against a plain reference built from the
// group codecs and Geometry's own entry offsets, on random formats, layouts,
// plane orders and shapes; bytes not written must be untouched.
#include <catch2/catch.hpp>

#include <kvcache/core/geometry.hpp>
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/gather.hpp>
#include <kvcache/kernels/detail/quant.hpp>
#include <kvcache/kernels/scatter.hpp>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "quant_testing.hpp"

using namespace kvcache;
using kvtest::random_quant_spec;

using kvtest::QPool;
using kvtest::reference_row;
using kvtest::RowBytes;

TEST_CASE("quantized scatter, gather and compaction against the group codecs, every format and layout") {
  std::mt19937_64 rng(Catch::rngSeed() ^ std::random_device{}());
  std::normal_distribution<float> z(0.0f, 1.0f);
  for (int trial = 0; trial < 120; ++trial) {
    const GeometrySpec s = random_quant_spec(rng);
    INFO("trial " << trial << " dtype " << int(s.dtype) << " head_dim " << s.head_dim << " k " << int(s.format.k.scales)
                  << "/" << s.format.k.group << "/" << s.format.k.minimum << " v " << int(s.format.v.scales) << "/"
                  << s.format.v.group << "/" << s.format.v.minimum << " layout " << int(s.layout) << " planes "
                  << int(s.planes) << " block " << s.block_size);
    REQUIRE(Geometry::make(s).ok());
    const std::int64_t blocks = 2 + std::int64_t(rng() % 4), pool_slots = blocks * s.block_size;
    QPool pool(s, blocks);
    const auto before = pool.bytes;
    const std::int64_t tokens = std::min<std::int64_t>(pool_slots, 1 + std::int64_t(rng() % 20));
    const int H = s.num_kv_heads, D = s.head_dim, L = s.num_layers;
    const DType in = rng() % 2 ? DType::f32 : DType::bf16;
    const std::int64_t e = dtype_bytes(in);
    // Input [layer][token][K|V][head][dim], keys with an outlier channel.
    std::vector<std::byte> input(std::size_t(L * tokens * 2 * H * D * e));
    for (std::int64_t i = 0; i < L * tokens * 2 * H * D; ++i) store_elem(in, input.data(), i, z(rng) * (i % D == 3 ? 12.0f : 1.0f));
    KvSource src{input.data(), input.data() + H * D * e, in, tokens * 2 * H * D * e, 2 * H * D * e, D * e};
    std::vector<std::int32_t> all(static_cast<std::size_t>(pool_slots));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<std::int32_t> slots(all.begin(), all.begin() + tokens);
    for (auto& x : slots)
      if (rng() % 6 == 0) x = -1;
    const float k_scale = s.format.k.scales == Scales::group ? 1.0f : 0.05f, v_scale = s.format.v.scales == Scales::group ? 0.5f : 0.03f;
    ScatterParams p{pool.view, src, TokenAddress{slots.data()}, tokens, 0, L, k_scale, v_scale};
    REQUIRE(scatter_host(p).ok());

    std::vector<char> written(pool.bytes.size(), 0);
    std::vector<float> x(static_cast<std::size_t>(D));
    for (std::int64_t t = 0; t < tokens; ++t) {
      if (slots[std::size_t(t)] < 0) continue;
      const std::int64_t b = slots[std::size_t(t)] / s.block_size;
      const int off = int(slots[std::size_t(t)] % s.block_size);
      for (int l = 0; l < L; ++l)
        for (int kv = 0; kv < 2; ++kv)
          for (int h = 0; h < H; ++h) {
            const float div = kv ? v_scale : k_scale;  // a write divides by its scale (vLLM's fp8(x / scale))
            for (int d = 0; d < D; ++d) x[std::size_t(d)] = load_elem(in, src.row(kv, l, t, h), d) / div;
            const RowBytes want = reference_row(pool.g, kv, x.data());
            INFO("token " << t << " layer " << l << " kv " << kv << " head " << h);
            REQUIRE(std::memcmp(&pool.bytes[pool.codes_at(b, l, kv, off, h)], want.codes.data(), want.codes.size()) == 0);
            if (!want.entries.empty())  // engine-held scales: no entries (and memcmp takes no null pointer)
              REQUIRE(std::memcmp(&pool.bytes[pool.entries_at(b, l, kv, off, h)], want.entries.data(), want.entries.size()) == 0);
            pool.mark(written, b, l, kv, off, h);
          }
    }
    for (std::size_t i = 0; i < written.size(); ++i)
      if (!written[i]) REQUIRE(pool.bytes[i] == before[i]);

    // Gather every written position of layer L-1 as one sequence over all blocks.
    std::vector<std::int32_t> indptr{0, std::int32_t(blocks)}, indices(static_cast<std::size_t>(blocks)), out_indptr{0, std::int32_t(pool_slots)};
    std::iota(indices.begin(), indices.end(), 0);
    std::vector<float> ko(std::size_t(pool_slots * H * D)), vo(ko.size());
    GatherParams gp{pool.view, L - 1, indptr.data(), indices.data(), out_indptr.data(), 1, pool_slots, ko.data(), vo.data(),
                    DType::f32, H * D * 4, D * 4, k_scale, v_scale};
    REQUIRE(gather_host(gp).ok());
    for (std::int64_t t = 0; t < tokens; ++t) {
      if (slots[std::size_t(t)] < 0) continue;
      const std::int64_t slot = slots[std::size_t(t)], b = slot / s.block_size;
      const int off = int(slot % s.block_size);
      for (int kv = 0; kv < 2; ++kv)
        for (int h = 0; h < H; ++h) {
          const std::vector<float> want = kvtest::reference_values(pool.g, kv, &pool.bytes[pool.codes_at(b, L - 1, kv, off, h)],
                                                                   &pool.bytes[pool.entries_at(b, L - 1, kv, off, h)]);
          const float* got = (kv ? vo : ko).data() + slot * H * D + h * D;
          for (int d = 0; d < D; ++d) REQUIRE(got[d] == want[std::size_t(d)] * (kv ? v_scale : k_scale));
        }
    }

    // Compaction: distinct source slots to distinct destination slots, all layers and heads.
    std::shuffle(all.begin(), all.end(), rng);
    const std::int32_t n_moves = std::int32_t(std::min<std::int64_t>(pool_slots / 2, 5));
    std::vector<SlotMove> moves;
    for (std::int32_t i = 0; i < n_moves; ++i) moves.push_back({all[std::size_t(i)], all[std::size_t(i + n_moves)]});
    const auto pre = pool.bytes;
    CompactionParams cp{pool.view, moves.data(), n_moves, 0, L};
    REQUIRE(compaction_host(cp).ok());
    std::vector<char> moved(pool.bytes.size(), 0);
    for (const SlotMove& m : moves)
      for (int l = 0; l < L; ++l)
        for (int kv = 0; kv < 2; ++kv)
          for (int h = 0; h < H; ++h) {
            const int so = int(m.src % s.block_size), dof = int(m.dst % s.block_size);
            const std::int64_t sb = m.src / s.block_size, db = m.dst / s.block_size;
            REQUIRE(std::memcmp(&pool.bytes[pool.codes_at(db, l, kv, dof, h)], &pre[pool.codes_at(sb, l, kv, so, h)],
                                std::size_t(pool.g.row_bytes())) == 0);
            REQUIRE(std::memcmp(&pool.bytes[pool.entries_at(db, l, kv, dof, h)], &pre[pool.entries_at(sb, l, kv, so, h)],
                                std::size_t(pool.g.group_bytes_per_row(kv))) == 0);
            pool.mark(moved, db, l, kv, dof, h);
          }
    for (std::size_t i = 0; i < moved.size(); ++i)
      if (!moved[i]) REQUIRE(pool.bytes[i] == pre[i]);
  }
}

TEST_CASE("quantized scatter reports a bad slot before writing anything") {
  auto g = Geometry::make({.head_dim = 32, .block_size = 4, .dtype = DType::int4,
                           .format = {{.scales = Scales::group, .group = 32, .minimum = true}, {.scales = Scales::group, .group = 16}}});
  REQUIRE(g.ok());
  std::vector<std::byte> pool(std::size_t(*g->pool_bytes(2)), std::byte{0x33});
  const auto before = pool;
  std::vector<float> kvs(2 * 2 * 32, 1.5f);
  const std::int32_t slots[] = {1, 8};  // 8 is past the pool's 8 slots
  ScatterParams p{*make_pool_view(*g, pool.data(), 2), KvSource{kvs.data(), kvs.data() + 32, DType::f32, 0, 64 * 4, 32 * 4},
                  TokenAddress{slots}, 2};
  const Status st = scatter_host(p);
  CHECK(st.message() == "invalid_argument: slot (past the pool)=8 (limit 8)");
  CHECK(pool == before);
}
