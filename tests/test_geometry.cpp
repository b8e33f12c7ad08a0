#include <catch2/catch.hpp>

#include <kvcache/core/geometry.hpp>

#include <vector>

using namespace kvcache;

TEST_CASE("geometry rejects each bad field and names it") {
  struct Bad {
    GeometrySpec spec;
    const char* what;
    std::int64_t value;
  };
  const Bad cases[] = {
      {{.num_layers = 0}, "num_layers", 0},
      {{.num_kv_heads = -2}, "num_kv_heads", -2},
      {{.head_dim = 0}, "head_dim", 0},
      {{.block_size = 0}, "block_size", 0},
      {{.dtype = static_cast<DType>(9)}, "dtype", 9},
      {{.layout = static_cast<Layout>(7)}, "layout", 7},
      {{.planes = static_cast<KvPlanes>(5)}, "planes", 5},
  };
  for (const auto& c : cases) {
    auto g = Geometry::make(c.spec);
    REQUIRE_FALSE(g.ok());
    CHECK(g.status().code() == Errc::invalid_argument);
    CHECK(std::string(g.status().what()) == c.what);
    CHECK(g.status().value() == c.value);
    CHECK_THAT(g.status().message(), Catch::Contains(c.what));
  }
}

TEST_CASE("geometry sizes: Llama-3-8B-like block") {
  auto g = Geometry::make({.num_layers = 32, .num_kv_heads = 8, .head_dim = 128, .block_size = 16});
  REQUIRE(g.ok());
  CHECK(g->plane_bytes() == 16 * 8 * 128 * 2);
  CHECK(g->block_bytes() == 32 * 2 * 16 * 8 * 128 * 2);  // 2 MiB
  CHECK(*g->pool_bytes(1000) == 1000LL * g->block_bytes());
  auto f8 = Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = 64, .block_size = 32, .dtype = DType::fp8_e4m3});
  CHECK(f8->block_bytes() == 2 * 32 * 64);
}

TEST_CASE("geometry overflow is a typed error, offsets are 64-bit") {
  auto huge = Geometry::make({.num_layers = 1 << 30, .num_kv_heads = 1 << 20, .head_dim = 1 << 20, .block_size = 1 << 10,
                              .dtype = DType::f32});
  REQUIRE_FALSE(huge.ok());
  CHECK(huge.status().code() == Errc::geometry_overflow);
  // The error names the factor that overflowed and the largest value it could have had.
  CHECK(huge.status().message() == "geometry_overflow: num_layers (block bytes past int64)=1073741824 (limit 1023)");
  auto wide = Geometry::make({.num_layers = 1, .num_kv_heads = 1 << 20, .head_dim = 1 << 30, .block_size = 1 << 12,
                              .dtype = DType::f32});
  CHECK(wide.status().message() == "geometry_overflow: block_size (block bytes past int64)=4096 (limit 2047)");

  auto g = Geometry::make({.num_layers = 32, .num_kv_heads = 8, .head_dim = 128, .block_size = 16});
  auto big = g->pool_bytes(std::int64_t{1} << 50);
  CHECK(big.status().code() == Errc::geometry_overflow);
  CHECK(g->pool_bytes(0).status().code() == Errc::invalid_argument);
  // A million-block pool: the last block sits past 2^32 bytes and is reached exactly.
  const std::int64_t n = 1 << 20;
  auto s = g->strides(n);
  REQUIRE(s.ok());
  CHECK(s->offset(n - 1, 0, 0, 0, 0) == (n - 1) * g->block_bytes());
  CHECK(s->offset(n - 1, 0, 0, 0, 0) > (std::int64_t{1} << 32));
}

// Every (block, layer, kv, token, head) owns head_dim elements; together they
// tile the pool exactly once, for every layout, plane order and dtype.
TEST_CASE("geometry offsets tile the pool exactly") {
  for (auto layout : {Layout::NHD, Layout::HND})
    for (auto planes : {KvPlanes::interleaved, KvPlanes::separate})
      for (auto dtype : {DType::f32, DType::f16, DType::bf16, DType::fp8_e4m3}) {
        GeometrySpec spec{.num_layers = 3, .num_kv_heads = 2, .head_dim = 8, .block_size = 4, .dtype = dtype,
                          .layout = layout, .planes = planes};
        auto g = Geometry::make(spec);
        REQUIRE(g.ok());
        const std::int64_t nblocks = 5, head_bytes = spec.head_dim * dtype_bytes(dtype);
        std::vector<int> covered(static_cast<std::size_t>(*g->pool_bytes(nblocks)), 0);
        auto s = *g->strides(nblocks);
        for (std::int64_t b = 0; b < nblocks; ++b)
          for (int l = 0; l < spec.num_layers; ++l)
            for (int kv = 0; kv < 2; ++kv)
              for (int t = 0; t < spec.block_size; ++t)
                for (int h = 0; h < spec.num_kv_heads; ++h) {
                  const std::int64_t off = s.offset(b, l, kv, t, h);
                  REQUIRE(off >= 0);
                  REQUIRE(off + head_bytes <= std::int64_t(covered.size()));
                  for (std::int64_t x = 0; x < head_bytes; ++x) ++covered[std::size_t(off + x)];
                  if (planes == KvPlanes::interleaved) {  // a block is one contiguous run
                    REQUIRE(off >= b * g->block_bytes());
                    REQUIRE(off + head_bytes <= (b + 1) * g->block_bytes());
                  }
                }
        for (int c : covered) REQUIRE(c == 1);
        if (layout == Layout::NHD) CHECK(s.token == spec.num_kv_heads * head_bytes);
        else CHECK(s.head == spec.block_size * head_bytes);
      }
}
