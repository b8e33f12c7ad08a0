// Channel scales (KIVI's keys) and seal_blocks: the geometry of per-channel
// entries and its refusals; seal against a plain per-channel reference
// (range, f16 scale and minimum, round-to-nearest codes), gather and the
// page bounds reading it back; the row-written side of a sealed block
// equal to scatter's bytes; block_copy carrying the entries; the row
// writers refusing a channel pool; and the error per-channel keys save
// against per-token groups when a few channels carry outliers.
#include <catch2/catch.hpp>

#include <kvcache/groups/layer_groups.hpp>
#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/gather.hpp>
#include <kvcache/kernels/page_bounds.hpp>
#include <kvcache/kernels/ring_write.hpp>
#include <kvcache/kernels/rope.hpp>
#include <kvcache/kernels/seal.hpp>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "quant_testing.hpp"

using namespace kvcache;
using kvtest::QPool;

namespace {

// K with a few outlier channels, as real keys have (KIVI's observation):
// channel c of every token is drawn around its own offset, channels 3 and 17
// (mod head_dim) fifty times wider.
std::vector<float> keys_with_outliers(std::mt19937_64& rng, std::int64_t tokens, int H, int D) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> x(std::size_t(tokens * H * D));
  for (std::int64_t t = 0; t < tokens; ++t)
    for (int h = 0; h < H; ++h)
      for (int d = 0; d < D; ++d) {
        const float wide = (d == 3 % D || d == 17 % D) ? 50.0f : 1.0f;
        x[std::size_t((t * H + h) * D + d)] = wide * n(rng) + 0.1f * float(d % 5);
      }
  return x;
}

float f16(float v) { return cvt::f16_to_f32(cvt::f32_to_f16(v)); }

// The plain reference of one channel: its range over the block's tokens,
// the minimum as the largest f16 at most its lowest value, the scale (range
// above the minimum / code max, or max |x| / code max) as the smallest f16
// at least that, codes rounded to nearest even and clamped, read back with one fma.
std::vector<float> reference_channel(const std::vector<float>& col, DType code, bool minimum) {
  const float lo = *std::min_element(col.begin(), col.end()), hi = *std::max_element(col.begin(), col.end());
  float amax = 0.0f;
  for (float v : col) amax = std::max(amax, std::fabs(v));
  const float qmax = quant::code_max(code, minimum);
  const float m = minimum ? kvtest::round_down_to(DType::f16, lo) : 0.0f;
  const float scale = kvtest::round_up_to(DType::f16, std::min((minimum ? hi - m : amax) / qmax, 65504.0f));
  const float inv = scale > 0.0f ? 1.0f / scale : 0.0f, qlo = minimum ? 0.0f : -qmax;
  std::vector<float> out;
  for (float v : col) {
    const float q = std::clamp(std::nearbyint((v - m) * inv), qlo, qmax);
    out.push_back(minimum ? std::fma(q, scale, m) : q * scale);
  }
  return out;
}

// Block `b`'s layer `l` read back by gather as f32 ([token][head][dim]).
std::vector<float> read_block(const PoolView& v, std::int32_t b, std::int32_t l, int kv) {
  const int H = v.num_kv_heads, D = v.head_dim, B = v.block_size;
  std::vector<float> k(std::size_t(B * H * D)), vv(k.size());
  const std::int32_t indptr[] = {0, 1}, rows[] = {0, B};
  REQUIRE(gather_host({v, l, indptr, &b, rows, 1, B, k.data(), vv.data(), DType::f32, std::int64_t{H} * D * 4, std::int64_t{D} * 4})
              .ok());
  return kv == 0 ? k : vv;
}

GeometrySpec kivi_spec(DType code, bool minimum, Layout layout, KvPlanes planes) {
  return {.num_layers = 2, .num_kv_heads = 2, .head_dim = 32, .block_size = 8, .dtype = code, .layout = layout, .planes = planes,
          .format = {.k = {.scales = Scales::channel, .minimum = minimum}, .v = {.scales = Scales::group, .group = 16, .minimum = minimum}}};
}

}  // namespace

TEST_CASE("channel scales: a plane's entries are head_dim per kv-head after the codes, and bad specs are refused by name") {
  const GeometrySpec s{.num_layers = 1, .num_kv_heads = 2, .head_dim = 64, .block_size = 32, .dtype = DType::int2,
                       .format = {.k = {.scales = Scales::channel, .minimum = true}, .v = {.scales = Scales::group, .group = 32, .minimum = true}}};
  const Geometry g = *Geometry::make(s);
  CHECK(g.row_bytes() == 16);
  CHECK(g.scales_offset() == 32 * 2 * 16);
  CHECK(g.plane_entry_bytes(0) == 2 * 64 * 4);  // f16 scale + f16 minimum per channel
  CHECK(g.plane_entry_bytes(1) == 32 * 2 * 2 * 4);  // per row: 2 groups of (scale, minimum)
  CHECK(g.plane_bytes() == 1024 + 512);
  CHECK(g.channel_entries_offset(0, 1) == 1024 + 256);
  CHECK(g.group_bytes_per_row(0) == 0);
  // KIVI's saving: 2-bit keys with per-channel entries over a block of 32 are
  // 3 bits a value; per-token groups of 16 with a minimum are 4.
  GeometrySpec g16 = s;
  g16.format.k = {.scales = Scales::group, .group = 16, .minimum = true};
  CHECK(Geometry::make(g16)->plane_entry_bytes(0) == 2 * g.plane_entry_bytes(0));

  const auto refused = [&](GeometrySpec bad, const std::string& field, std::int64_t value) {
    const auto r = Geometry::make(bad);
    REQUIRE_FALSE(r);
    CHECK(std::string(r.status().what()) == field);
    CHECK(r.status().value() == value);
  };
  GeometrySpec bad = s;
  bad.format.k.group = 32;
  refused(bad, "format.k.group (channel: the group is the block)", 32);
  bad = s;
  bad.dtype = DType::fp8_e4m3;
  bad.format.v = {};
  refused(bad, "format.k.scales (channel scales take integer codes)", 4);
  bad.dtype = DType::f16;
  refused(bad, "format.k.scales (a float dtype is stored unscaled)", 4);
  bad = s;
  bad.head_dim = 6;
  bad.format.v = {.scales = Scales::channel};
  refused(bad, "head_dim (not whole bytes of codes)", 6);
  bad = s;
  bad.format.v.scales = static_cast<Scales>(5);
  refused(bad, "format.v.scales", 5);
  // A layer group's page holds a derived number of tokens, not one block: refused there.
  const std::int32_t layer0[] = {0};
  const LayerGroupSpec group{.layers = layer0, .num_kv_heads = 2, .head_dim = 64, .dtype = DType::int2, .format = s.format};
  const auto groups = LayerGroups::make({.groups = {&group, 1}, .block_size = 32});
  REQUIRE_FALSE(groups);
  CHECK(std::string(groups.status().what()).find("channel") != std::string::npos);
}

TEST_CASE("seal_blocks quantizes each (block, head, channel) over the block's tokens, as a plain reference does") {
  std::mt19937_64 rng(Catch::rngSeed() ^ 0x5ea1);
  for (DType code : {DType::int2, DType::int4, DType::int8})
    for (bool minimum : {true, false})
      for (Layout layout : {Layout::NHD, Layout::HND})
        for (KvPlanes planes : {KvPlanes::interleaved, KvPlanes::separate}) {
          const GeometrySpec s = kivi_spec(code, minimum, layout, planes);
          INFO("code " << int(code) << " minimum " << minimum << " layout " << int(layout) << " planes " << int(planes));
          const int H = s.num_kv_heads, D = s.head_dim, B = s.block_size;
          QPool pool(s, 6);
          // Two blocks (5, then 2) of layer 1, from f16 inputs with a k_scale of 2 on top.
          const std::vector<float> k = keys_with_outliers(rng, 2 * B, H, D), v = keys_with_outliers(rng, 2 * B, H, D);
          std::vector<std::uint16_t> k16(k.size()), v16(v.size());
          for (std::size_t i = 0; i < k.size(); ++i) k16[i] = cvt::f32_to_f16(k[i]), v16[i] = cvt::f32_to_f16(v[i]);
          const KvSource src{k16.data(), v16.data(), DType::f16, 0, std::int64_t{H} * D * 2, std::int64_t{D} * 2};
          const std::int32_t blocks[] = {5, 2};
          const std::vector<std::byte> before = pool.bytes;
          REQUIRE(seal_blocks_host({pool.view, src, blocks, 2, 1, 1, 2.0f, 1.0f}).ok());
          for (int i = 0; i < 2; ++i) {
            const std::vector<float> got = read_block(pool.view, blocks[i], 1, 0);
            for (int h = 0; h < H; ++h)
              for (int d = 0; d < D; ++d) {
                std::vector<float> col;
                for (int t = 0; t < B; ++t) col.push_back(f16(k[std::size_t(((i * B + t) * H + h) * D + d)]) / 2.0f);
                const std::vector<float> want = reference_channel(col, code, minimum);
                for (int t = 0; t < B; ++t) REQUIRE(got[std::size_t((t * H + h) * D + d)] == want[std::size_t(t)]);
              }
          }
          // V (groups of a row) holds what scatter writes from the same tokens.
          std::vector<std::int32_t> slots;
          for (int i = 0; i < 2; ++i)
            for (int t = 0; t < B; ++t) slots.push_back(blocks[i] * B + t);
          GeometrySpec vs = s;
          vs.format.k = vs.format.v;
          QPool rows(vs, 6);
          REQUIRE(scatter_host({rows.view, src, TokenAddress{slots.data()}, 2 * B, 1, 1, 2.0f, 1.0f}).ok());
          for (int i = 0; i < 2; ++i) CHECK(read_block(pool.view, blocks[i], 1, 1) == read_block(rows.view, blocks[i], 1, 1));
          // Nothing outside blocks 5 and 2 of layer 1 changed.
          for (std::int64_t b = 0; b < 6; ++b)
            for (int kv = 0; kv < 2; ++kv)
              for (int l = 0; l < 2; ++l) {
                if (l == 1 && (b == 5 || b == 2)) continue;
                const std::size_t at = std::size_t(pool.st.offset(b, l, kv, 0, 0));
                REQUIRE(std::equal(pool.bytes.begin() + std::ptrdiff_t(at), pool.bytes.begin() + std::ptrdiff_t(at + std::size_t(pool.g.plane_bytes())),
                                   before.begin() + std::ptrdiff_t(at)));
              }
          // Copy-on-write of block 5 into block 3 carries the channel entries.
          const BlockCopy pair{5, 3};
          REQUIRE(block_copy_host({pool.view, pool.view, &pair, 1}).ok());
          CHECK(read_block(pool.view, 3, 1, 0) == read_block(pool.view, 5, 1, 0));
          // Quest's page bounds read the dequantized keys.
          std::vector<float> bounds(std::size_t(6 * H * 2 * D), 0.0f);
          const std::int32_t page = 2, fill = B;
          REQUIRE(page_bounds_host({pool.view, 1, &page, &fill, 1, bounds.data()}).ok());
          const std::vector<float> keys = read_block(pool.view, 2, 1, 0);
          for (int h = 0; h < H; ++h)
            for (int d = 0; d < D; ++d) {
              float mx = -FLT_MAX, mn = FLT_MAX;
              for (int t = 0; t < B; ++t) mx = std::max(mx, keys[std::size_t((t * H + h) * D + d)] + 0.0f), mn = std::min(mn, keys[std::size_t((t * H + h) * D + d)] + 0.0f);
              REQUIRE(bounds[std::size_t((2 * H + h) * 2 * D + d)] == mx);
              REQUIRE(bounds[std::size_t((2 * H + h) * 2 * D + D + d)] == mn);
            }
        }
}

TEST_CASE("per-channel 2-bit keys err less than per-token groups when a few channels carry outliers (KIVI)") {
  std::mt19937_64 rng(Catch::rngSeed() ^ 0xc4a7);
  const int H = 2, D = 64, B = 32;
  const std::vector<float> k = keys_with_outliers(rng, B, H, D);
  const KvSource src{k.data(), k.data(), DType::f32, 0, std::int64_t{H} * D * 4, std::int64_t{D} * 4};
  const auto rms_error = [&](SideFormat f) {
    QPool pool({.num_layers = 1, .num_kv_heads = H, .head_dim = D, .block_size = B, .dtype = DType::int2, .format = {.k = f, .v = f}}, 2);
    const std::int32_t block = 1;
    REQUIRE(seal_blocks_host({pool.view, src, &block, 1}).ok());
    const std::vector<float> got = read_block(pool.view, 1, 0, 0);
    double e = 0.0;  // over the ordinary channels: per-token groups lose them to the outliers' range
    int n = 0;
    for (int t = 0; t < B; ++t)
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d)
          if (d != 3 && d != 17) e += std::pow(got[std::size_t((t * H + h) * D + d)] - k[std::size_t((t * H + h) * D + d)], 2), ++n;
    return std::sqrt(e / n);
  };
  const double channel = rms_error({.scales = Scales::channel, .minimum = true});
  const double token = rms_error({.scales = Scales::group, .group = 32, .minimum = true});
  INFO("rms error: per channel " << channel << ", per token (g32) " << token);
  CHECK(channel < 0.5 * token);
}

TEST_CASE("a channel-scaled pool refuses the row writers and bad seals by name, and changes nothing") {
  const GeometrySpec s = kivi_spec(DType::int2, true, Layout::NHD, KvPlanes::interleaved);
  QPool pool(s, 4);
  const std::vector<std::byte> before = pool.bytes;
  const int H = s.num_kv_heads, D = s.head_dim, B = s.block_size;
  std::vector<float> x(std::size_t(2 * B * H * D), 1.0f);
  const KvSource src{x.data(), x.data(), DType::f32, 0, std::int64_t{H} * D * 4, std::int64_t{D} * 4};
  const auto names_channel = [](const Status& st) {
    REQUIRE_FALSE(st.ok());
    CHECK(std::string(st.what()).rfind("cache.format", 0) == 0);
    CHECK(st.value() == 0);  // the side: K
  };
  const std::int32_t slot = B + 1, block = 1, delta = 1;
  names_channel(scatter_host({pool.view, src, TokenAddress{&slot}, 1}));
  names_channel(ring_write_host({pool.view, src, 1, 0, 1, &slot}));
  const SlotMove move{B + 1, B};
  names_channel(compaction_host({pool.view, &move, 1}));
  const float cs[] = {1.0f}, sn[] = {0.0f};
  names_channel(rope_host({pool.view, 0, 1, &block, &delta, 1, cs, sn, 1, 2}));
  // Seals: a block outside the pool, a block twice, held scales on a channel side.
  const std::int32_t outside[] = {1, 4}, twice[] = {2, 2};
  Status st = seal_blocks_host({pool.view, src, outside, 2});
  CHECK(st.code() == Errc::invalid_argument);
  CHECK(std::string(st.what()) == "blocks (outside the pool)");
  CHECK(st.value() == 4);
  st = seal_blocks_host({pool.view, src, twice, 2});
  CHECK(std::string(st.what()) == "blocks (sealed twice in one call)");
  const float held[] = {1.0f, 1.0f};
  st = seal_blocks_host({.cache = pool.view, .src = src, .blocks = &block, .num_blocks = 1, .k_scales = held});
  CHECK(std::string(st.what()) == "k_scales (format.k holds no engine-held scales)");
  st = seal_blocks_host({pool.view, src, &block, 1, 1, 2});
  CHECK(std::string(st.what()) == "first_layer+num_layers");
  CHECK(pool.bytes == before);
}

TEST_CASE("a block sealed again from its own read-back keeps its bytes (what a compaction relies on for the channels it did not move)") {
  std::mt19937_64 rng(Catch::rngSeed() ^ 0x1de);
  for (DType code : {DType::int2, DType::int4, DType::int8})
    for (bool minimum : {true, false}) {
      INFO("code " << int(code) << " minimum " << minimum);
      const GeometrySpec s = kivi_spec(code, minimum, Layout::NHD, KvPlanes::interleaved);
      const int H = s.num_kv_heads, D = s.head_dim, B = s.block_size;
      QPool pool(s, 3);
      for (int trial = 0; trial < 50; ++trial) {
        const std::vector<float> k = keys_with_outliers(rng, B, H, D), v = keys_with_outliers(rng, B, H, D);
        const KvSource src{k.data(), v.data(), DType::f32, 0, std::int64_t{H} * D * 4, std::int64_t{D} * 4};
        const std::int32_t block = 1;
        REQUIRE(seal_blocks_host({pool.view, src, &block, 1}).ok());
        const std::vector<std::byte> once = pool.bytes;
        const std::vector<float> kb = read_block(pool.view, 1, 0, 0), vb = read_block(pool.view, 1, 0, 1);
        const KvSource back{kb.data(), vb.data(), DType::f32, 0, std::int64_t{H} * D * 4, std::int64_t{D} * 4};
        REQUIRE(seal_blocks_host({pool.view, back, &block, 1}).ok());
        REQUIRE(pool.bytes == once);
      }
    }
}

TEST_CASE("the host's seal (channels across a row) writes the bytes of the one body CUDA runs (a unit of channels a thread)") {
  std::mt19937_64 rng(Catch::rngSeed() ^ 0xb0d7);
  const float specials[] = {0.0f, -0.0f, 1e-40f, -3e-39f, INFINITY, -INFINITY, NAN, 65504.0f, 7e4f, -1e30f};
  for (int trial = 0; trial < 90; ++trial) {
    const DType codes[] = {DType::int2, DType::int4, DType::int8};
    GeometrySpec s = kivi_spec(codes[trial % 3], trial % 2 == 0, trial % 4 < 2 ? Layout::NHD : Layout::HND, KvPlanes::interleaved);
    s.block_size = 1 + int(rng() % 40);
    // 8 to 64 channels: the host's vector loops take multiples of 8, the scalar body the rest (12, 20).
    const int dims[] = {8, 12, 16, 20, 24, 32, 64};
    s.head_dim = dims[rng() % std::size(dims)];
    // Channel values too: every fifth trial, and where V's groups do not divide the head.
    if (trial % 5 == 0 || (s.format.v.scales == Scales::group && s.head_dim % s.format.v.group != 0))
      s.format.v = SideFormat{.scales = Scales::channel, .minimum = trial % 2 == 0};
    INFO("trial " << trial << " code " << int(s.dtype) << " block " << s.block_size << " head_dim " << s.head_dim);
    const int H = s.num_kv_heads, D = s.head_dim, B = s.block_size;
    QPool host(s, 5), body(s, 5);
    body.bytes = host.bytes;
    const DType st = trial % 3 == 0 ? DType::f16 : DType::f32;
    std::vector<std::byte> in = kvtest::random_elems(rng, st, std::int64_t{3} * B * 2 * H * D);
    if (st == DType::f32)
      for (int j = 0; j < 20; ++j)
        std::memcpy(in.data() + 4 * (rng() % (in.size() / 4)), &specials[rng() % 10], 4);  // special values somewhere
    const std::int64_t row = std::int64_t{H} * D * dtype_bytes(st);
    const KvSource src{in.data(), in.data() + row, st, 0, 2 * row, std::int64_t{D} * dtype_bytes(st)};
    const std::int32_t blocks[] = {4, 1, 3};
    const SealParams p{host.view, src, blocks, 3, 1, 1, 0.75f, 1.25f};
    REQUIRE(seal_blocks_host(p).ok());
    SealParams q = p;
    q.cache = body.view;
    for (std::int64_t it = 0; it < seal_items(q); ++it)
      for (int kv = 0; kv < 2; ++kv)
        for (int h = 0; h < H; ++h) seal_item(q, it, kv, h, 0, 1);
    REQUIRE(host.bytes == body.bytes);
  }
}
