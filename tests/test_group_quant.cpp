// Quantized layer groups (a hybrid pool whose groups have KV formats): the
// plane rule (codes, then group entries from a 16-byte boundary, a row's
// worth each of the larger of K's and V's) worked out by hand, scatter
// writing each row's codes and entries where that rule puts them (against
// the group codecs), gather reading them back, pages a call does not own
// untouched, one quantized group laid out exactly as its Geometry, the
// handshake carrying each group's format, and typed errors.
#include <catch2/catch.hpp>

#include <kvcache/groups/layer_groups.hpp>
#include <kvcache/kernels/gather.hpp>
#include <kvcache/kernels/detail/group_view.hpp>
#include <kvcache/kernels/detail/quant.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/transfer/layout_handshake.hpp>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

using namespace kvcache;

namespace {

constexpr std::int32_t kPages = 6;
constexpr std::byte kSentinel{0xAB};
const SideFormat kG16Min{.scales = Scales::group, .group = 16, .minimum = true};
const SideFormat kG32{.scales = Scales::group, .group = 32};
const SideFormat kG16{.scales = Scales::group, .group = 16};
const SideFormat kHead{.scales = Scales::head};

std::int64_t align16(std::int64_t n) { return (n + 15) / 16 * 16; }

struct Pool {
  std::vector<std::int32_t> l0{0, 1}, l1{2}, l2{3};
  LayerGroupSpec specs[3];
  LayerGroups lg;
  std::vector<std::byte> mem;
  Pool() {
    // Group 0: full, 2 layers, 2 heads of 32, int4: K in groups of 16 with a minimum, V in groups of 32.
    // Group 1: MLA, a 64-value int8 latent in groups of 32.
    // Group 2: a window, 2 heads, K 32 / V 16, fp8: K per (layer, head) engine-held, V in groups of 16.
    specs[0] = {.kind = AttentionKind::full, .layers = l0, .num_kv_heads = 2, .head_dim = 32, .dtype = DType::int4,
                .format = {kG16Min, kG32}};
    specs[1] = {.kind = AttentionKind::mla, .layers = l1, .num_kv_heads = 1, .head_dim = 64, .dtype = DType::int8,
                .format = {kG32, {}}};
    specs[2] = {.kind = AttentionKind::sliding_window, .layers = l2, .num_kv_heads = 2, .head_dim = 32, .v_head_dim = 16,
                .window = 8, .dtype = DType::fp8_e4m3, .format = {kHead, kG16}};
    lg = *LayerGroups::make({.groups = specs, .block_size = 4, .max_padding_permille = 500});
    mem.assign(std::size_t(kPages * lg.page_bytes()), kSentinel);
  }
};

// A row's codes and entries from the group codecs (or store_elem times mul for an engine-held scale).
struct Row {
  std::vector<std::uint8_t> codes, entries;
};
Row reference(DType t, const SideFormat& f, const std::vector<float>& x, float mul) {
  const auto n = std::int32_t(x.size());
  Row r{std::vector<std::uint8_t>(std::size_t(row_bytes(t, n))),
        std::vector<std::uint8_t>(f.scales == Scales::group ? std::size_t(n / f.group * group_entry_bytes(t, f)) : 0)};
  if (f.scales == Scales::group) quant::quantize_row(x.data(), n, t, f, r.codes.data(), r.entries.data());
  else
    for (std::int32_t i = 0; i < n; ++i) store_elem(t, r.codes.data(), i, x[std::size_t(i)] * mul);
  return r;
}

std::vector<float> random_rows(std::mt19937& rng, std::size_t n) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = d(rng) * (i % 16 == 3 ? 8.0f : 1.0f);  // an outlier channel
  return v;
}

}  // namespace

TEST_CASE("quantized layer groups: the plane rule, worked out by hand") {
  Pool p;
  // Group 0 at B tokens: codes B*2*16 B a plane; entries 2 x (2 x f16) = 8 B a row for K (16-groups, minimum),
  // 2 B for V; both planes take the larger (4 B) per row, from a 16-byte boundary.
  const auto plane0 = [](std::int64_t B) { return align16(B * 2 * 16) + B * 2 * 8; };
  // Group 1 (MLA): codes B*64, entries 2 x 2 B a row; no V plane.
  const auto plane1 = [](std::int64_t B) { return align16(B * 64) + B * 4; };
  // Group 2: K codes B*2*32, V codes B*2*16; entries the larger of K's (none) and V's (1 x 2 B): 2 B a row.
  const auto k2 = [](std::int64_t B) { return align16(B * 2 * 32) + B * 2 * 2; };
  const auto v2 = [](std::int64_t B) { return align16(B * 2 * 16) + B * 2 * 2; };
  const std::int64_t page = std::max({2 * 2 * plane0(4), plane1(4), k2(4) + v2(4)});
  CHECK(p.lg.page_bytes() == page);
  CHECK(p.lg.token_bytes(0) == 2 * 2 * 2 * (16 + 8));
  CHECK(p.lg.token_bytes(1) == 64 + 4);
  CHECK(p.lg.token_bytes(2) == 2 * (32 + 2 + 16 + 2));
  const auto fits = [&](auto bytes) {
    std::int64_t b = 0;
    while (bytes(b + 1) <= page) ++b;
    return b;
  };
  const std::int64_t b0 = fits([&](std::int64_t B) { return 2 * 2 * plane0(B); });
  const std::int64_t b1 = fits(plane1), b2 = fits([&](std::int64_t B) { return k2(B) + v2(B); });
  CHECK(p.lg.block_size(0) == b0);
  CHECK(p.lg.block_size(1) == b1);
  CHECK(p.lg.block_size(2) == b2);
  CHECK(p.lg.padding(1) == page - plane1(b1));
  CHECK(p.lg.planes(0).k == plane0(b0));
  CHECK(p.lg.planes(0).v == plane0(b0));
  CHECK(p.lg.planes(0).k_scales_offset == align16(b0 * 32));
  CHECK(p.lg.planes(1).v == 0);
  CHECK(p.lg.planes(2).k == k2(b2));
  CHECK(p.lg.planes(2).v == v2(b2));
  CHECK(p.lg.planes(2).v_scales_offset == align16(b2 * 32));
  // Without group scales nothing changes: the widest token times block_size.
  LayerGroupSpec plain[] = {{.kind = AttentionKind::full, .layers = p.l0, .num_kv_heads = 2, .head_dim = 32, .dtype = DType::fp8_e4m3,
                             .format = {{.scales = Scales::tensor}, {.scales = Scales::tensor}}},
                            {.kind = AttentionKind::mla, .layers = p.l1, .head_dim = 64, .dtype = DType::f16}};
  const auto lp = *LayerGroups::make({.groups = plain, .block_size = 4, .max_padding_permille = 500});
  CHECK(lp.page_bytes() == 2 * 2 * 64 * 4);
  CHECK(lp.planes(0).k == 4 * 64);
  CHECK(lp.planes(0).k_scales_offset == 4 * 64);
}

TEST_CASE("quantized layer groups: scatter writes codes and entries where the plane rule puts them, gather reads them back") {
  Pool p;
  std::mt19937 rng(Catch::rngSeed() + 5);
  const std::vector<float> held_k{0.5f, 2.0f};  // group 2, K: per (layer, head) scales (one layer)
  const float call_scale = 0.25f;
  struct Side {
    std::int32_t group;
    GroupPlanes planes;
    std::int32_t kv;  // 0 = K, 1 = V in the page
  };
  for (const Side s : {Side{0, GroupPlanes::kv, 0}, Side{1, GroupPlanes::k, 0}, Side{2, GroupPlanes::k, 0}, Side{2, GroupPlanes::v, 1}}) {
    std::fill(p.mem.begin(), p.mem.end(), kSentinel);
    const LayerGroupSpec& spec = p.lg.spec(s.group);
    const PoolView view = *make_group_view(p.lg, s.group, p.mem.data(), kPages, s.planes);
    const std::int32_t H = spec.num_kv_heads, dim = view.head_dim, L = view.num_layers, B = view.block_size;
    const bool held = s.group == 2 && s.kv == 0;
    CAPTURE(s.group, s.kv);
    // Tokens: page 3 offsets 0 and B-1, page 1 offset 1.
    const std::vector<std::int32_t> slots{3 * B, 3 * B + B - 1, B + 1};
    const auto T = std::int64_t(slots.size());
    const std::vector<float> k = random_rows(rng, std::size_t(L * T * H * dim)), v = random_rows(rng, k.size());
    const std::int64_t tok = std::int64_t{H} * dim * 4;
    ScatterParams sp{.cache = view, .src = {k.data(), v.data(), DType::f32, T * tok, tok, std::int64_t{dim} * 4},
                     .addr = {slots.data()}, .num_tokens = T, .num_layers = L,
                     .k_scale = held ? call_scale : 1.0f, .k_scales = held ? held_k.data() : nullptr};
    REQUIRE(scatter_host(sp).ok());
    const GroupPlaneBytes pb = p.lg.planes(s.group);
    std::vector<bool> touched(p.mem.size(), false);
    for (std::int32_t l = 0; l < L; ++l)
      for (std::int64_t t = 0; t < T; ++t)
        for (std::int32_t side = 0; side < view.kv_planes; ++side)
          for (std::int32_t h = 0; h < H; ++h) {
            const std::int32_t kv = s.kv + side;  // the page's plane
            const SideFormat& f = kv == 0 ? spec.format.k : spec.format.v;
            const std::vector<float>& src = side == 0 ? k : v;
            const std::vector<float> x(src.begin() + ((l * T + t) * H + h) * dim, src.begin() + ((l * T + t) * H + h + 1) * dim);
            const Row want = reference(spec.dtype, f, x, held ? 1.0f / (call_scale * held_k[std::size_t(h)]) : 1.0f);
            // By hand: page, layer, plane; the row's codes at its index, its entries after the plane's codes.
            const std::int64_t page = slots[std::size_t(t)] / B, off = slots[std::size_t(t)] % B, row = off * H + h;
            const std::int64_t plane = page * p.lg.page_bytes() + l * (pb.k + pb.v) + (kv == 1 ? pb.k : 0);
            const std::int64_t codes = plane + row * std::int64_t(want.codes.size());
            const std::int64_t entries = plane + (kv == 0 ? pb.k_scales_offset : pb.v_scales_offset) + row * std::int64_t(want.entries.size());
            REQUIRE(std::memcmp(p.mem.data() + codes, want.codes.data(), want.codes.size()) == 0);
            if (!want.entries.empty()) REQUIRE(std::memcmp(p.mem.data() + entries, want.entries.data(), want.entries.size()) == 0);
            std::fill_n(touched.begin() + codes, want.codes.size(), true);
            std::fill_n(touched.begin() + entries, want.entries.size(), true);
          }
    for (std::size_t i = 0; i < p.mem.size(); ++i)
      if (!touched[i]) REQUIRE(p.mem[i] == kSentinel);
    // Gather layer 0's rows back (a sequence of pages 3 then 1): the codecs' values, times the held scale.
    const std::vector<std::int32_t> indptr{0, 2}, indices{3, 1}, out_indptr{0, B + 2};
    std::vector<float> ko(std::size_t((B + 2) * H * dim)), vo(ko.size());
    GatherParams gp{.cache = view, .layer = 0, .indptr = indptr.data(), .indices = indices.data(), .out_indptr = out_indptr.data(),
                    .num_seqs = 1, .num_rows = B + 2, .k_out = ko.data(), .v_out = vo.data(), .out_dtype = DType::f32,
                    .token_stride = tok, .head_stride = std::int64_t{dim} * 4, .k_scale = held ? call_scale : 1.0f,
                    .k_scales = held ? held_k.data() : nullptr};
    REQUIRE(gather_host(gp).ok());
    for (std::int64_t t = 0; t < T; ++t) {
      const std::int64_t r = slots[std::size_t(t)] / B == 3 ? slots[std::size_t(t)] % B : B + slots[std::size_t(t)] % B;
      for (std::int32_t side = 0; side < view.kv_planes; ++side)
        for (std::int32_t h = 0; h < H; ++h) {
          const SideFormat& f = s.kv + side == 0 ? spec.format.k : spec.format.v;
          const std::vector<float>& src = side == 0 ? k : v;
          const std::vector<float> x(src.begin() + (t * H + h) * dim, src.begin() + (t * H + h + 1) * dim);
          const float scale = held ? call_scale * held_k[std::size_t(h)] : 1.0f;
          const Row want = reference(spec.dtype, f, x, 1.0f / scale);
          std::vector<float> back(static_cast<std::size_t>(dim));
          if (f.scales == Scales::group) quant::dequantize_row(want.codes.data(), want.entries.data(), dim, spec.dtype, f, back.data());
          else
            for (std::int32_t d = 0; d < dim; ++d) back[std::size_t(d)] = load_elem(spec.dtype, want.codes.data(), d) * scale;
          const std::vector<float>& out = side == 0 ? ko : vo;
          for (std::int32_t d = 0; d < dim; ++d) REQUIRE(out[std::size_t((r * H + h) * dim + d)] == back[std::size_t(d)]);
        }
    }
  }
}

TEST_CASE("one quantized full group is its Geometry, byte for byte") {
  std::vector<std::int32_t> layers{0, 1, 2};
  for (const KvFormat f : {KvFormat{kG32, kG16Min}, KvFormat{kG16, kG16}, KvFormat{{.scales = Scales::tensor}, kG32}}) {
    LayerGroupSpec s[] = {{.kind = AttentionKind::full, .layers = layers, .num_kv_heads = 3, .head_dim = 64, .dtype = DType::int8,
                           .format = f}};
    const auto lg = *LayerGroups::make({.groups = s, .block_size = 5});
    const Geometry g = *lg.as_geometry();
    std::vector<std::byte> mem(std::size_t(4 * lg.page_bytes()));
    const PoolView a = *make_group_view(lg, 0, mem.data(), 4), b = *make_pool_view(g, mem.data(), 4);
    CHECK(g.block_bytes() == lg.page_bytes());
    CHECK(std::memcmp(&a.strides, &b.strides, sizeof(Strides)) == 0);
    CHECK(a.scales_offset == b.scales_offset);
    CHECK(a.plane_bytes == b.plane_bytes);
    CHECK(a.format == b.format);
  }
}

TEST_CASE("the handshake carries each layer group's format and plane bytes") {
  Pool p;
  const auto h = *describe_layout(p.lg, kPages, 0x1000, LayoutIdentity{});
  REQUIRE(h.groups.size() == 3);
  for (std::int32_t g = 0; g < 3; ++g) CHECK(h.groups[std::size_t(g)].format == p.lg.spec(g).format);
  for (const auto& r : h.regions) {
    CHECK(r.k_bytes == p.lg.planes(r.group).k);
    CHECK(r.v_bytes == p.lg.planes(r.group).v);
  }
  // A peer whose group 0 keys take groups of 32: a mismatch naming the field.
  LayerGroupSpec other[3] = {p.specs[0], p.specs[1], p.specs[2]};
  other[0].format.k = {.scales = Scales::group, .group = 32, .minimum = true};
  const auto lo = *LayerGroups::make({.groups = other, .block_size = 4, .max_padding_permille = 500});
  const auto h2 = *describe_layout(lo, kPages, 0x1000, LayoutIdentity{});
  CHECK(h.compat_hash != h2.compat_hash);
  const Status st = check_compatible(h, h2);
  CHECK(st.code() == Errc::layout_mismatch);
  CHECK(std::string(st.what()) == "format.k.group");
}

TEST_CASE("quantized layer groups: bad formats are typed errors naming the field") {
  std::vector<std::int32_t> l{0};
  const auto err = [&](LayerGroupSpec s) {
    s.layers = l;
    LayerGroupSpec one[] = {s};
    return LayerGroups::make({.groups = one}).status();
  };
  const auto is = [](const Status& st, const char* what) { return st.code() == Errc::invalid_argument && std::string(st.what()) == what; };
  CHECK(is(err({.head_dim = 64, .dtype = DType::int4}), "format.k.scales (an integer code needs scales)"));
  CHECK(is(err({.head_dim = 64, .dtype = DType::int8, .format = {kG32, {}}}), "format.v.scales (an integer code needs scales)"));
  CHECK(is(err({.head_dim = 48, .dtype = DType::int8, .format = {kG32, kG32}}), "format.k.group (must divide head_dim)"));
  CHECK(is(err({.head_dim = 64, .v_head_dim = 48, .dtype = DType::int8, .format = {kG32, kG32}}), "format.v.group (must divide head_dim)"));
  CHECK(is(err({.kind = AttentionKind::mla, .head_dim = 64, .dtype = DType::int8, .format = {kG32, kG32}}),
           "format.v.scales (the group stores no V)"));
  CHECK(is(err({.head_dim = 33, .dtype = DType::int4, .format = {{.scales = Scales::tensor}, {.scales = Scales::tensor}}}),
           "head_dim (odd: a 4-bit dtype packs two values a byte)"));
  CHECK(is(err({.head_dim = 64, .dtype = DType::f16, .format = {kG32, {}}}), "format.k.scales (a float dtype is stored unscaled)"));
  CHECK(is(err({.head_dim = 64, .dtype = DType(99)}), "dtype"));
}
