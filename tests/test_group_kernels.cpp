// The host kernels on a hybrid pool's group views: K and V with different
// head dims (one view each), MLA's K-only latent, and a plain K = V group,
// all in one pool of equal pages. Each write is checked byte for byte against
// the page layout written out by hand ([layers][K plane][V plane], NHD), and
// every page a call does not own keeps its sentinel bytes.
#include <catch2/catch.hpp>

#include <kvcache/groups/layer_groups.hpp>
#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/gather.hpp>
#include <kvcache/kernels/detail/group_view.hpp>
#include <kvcache/kernels/ring_admit.hpp>
#include <kvcache/kernels/scatter.hpp>

#include <cstring>
#include <tuple>
#include <vector>

using namespace kvcache;

namespace {

constexpr std::int32_t kPages = 8;
constexpr std::byte kSentinel{0xAB};

struct Pool {
  std::vector<std::int32_t> l0{0, 1}, l1{2, 3, 4}, l2{5};
  LayerGroupSpec specs[3];
  LayerGroups lg;
  std::vector<std::byte> mem;
  Pool() {
    // Group 0: 2 layers, 2 heads, K 8 / V 4 (f32): 96 B a token a layer. Group 1: MLA, 3 layers of a 12-value latent.
    // Group 2: one layer, K = V = 6 x 2 heads.
    specs[0] = {.kind = AttentionKind::full, .layers = l0, .num_kv_heads = 2, .head_dim = 8, .v_head_dim = 4, .dtype = DType::f32};
    specs[1] = {.kind = AttentionKind::mla, .layers = l1, .num_kv_heads = 1, .head_dim = 12, .dtype = DType::f32};
    specs[2] = {.kind = AttentionKind::sliding_window, .layers = l2, .num_kv_heads = 2, .head_dim = 6, .window = 8,
                .dtype = DType::f32};
    lg = *LayerGroups::make({.groups = specs, .block_size = 4, .max_padding_permille = 500});
    mem.assign(std::size_t(kPages * lg.page_bytes()), kSentinel);
  }
  // Byte offset of (page, layer, K|V, token, head, d) in group g, from the layout alone.
  std::int64_t at(std::int32_t g, std::int32_t page, std::int32_t layer, std::int32_t kv, std::int32_t tok,
                  std::int32_t head, std::int32_t d) const {
    const auto& s = lg.spec(g);
    const std::int64_t B = lg.block_size(g), H = s.num_kv_heads, dk = s.head_dim, dv = lg.v_head_dim(g);
    const std::int64_t k_plane = B * H * dk * 4, v_plane = B * H * dv * 4, dim = kv == 0 ? dk : dv;
    return page * lg.page_bytes() + layer * (k_plane + v_plane) + kv * k_plane + (tok * H + head) * dim * 4 + d * 4;
  }
  float read(std::int64_t off) const {
    float f;
    std::memcpy(&f, mem.data() + off, 4);
    return f;
  }
  PoolView view(std::int32_t g, GroupPlanes p) { return *make_group_view(lg, g, mem.data(), kPages, p); }
};

float value(std::int32_t tag, std::int32_t layer, std::int32_t tok, std::int32_t head, std::int32_t d) {
  return float(tag * 100000 + layer * 10000 + tok * 100 + head * 10 + d);
}

// Source [layers][tokens][heads][dim] of tag `tag`.
std::vector<float> source(std::int32_t tag, std::int32_t layers, std::int32_t tokens, std::int32_t heads, std::int32_t dim) {
  std::vector<float> v;
  for (std::int32_t l = 0; l < layers; ++l)
    for (std::int32_t t = 0; t < tokens; ++t)
      for (std::int32_t h = 0; h < heads; ++h)
        for (std::int32_t d = 0; d < dim; ++d) v.push_back(value(tag, l, t, h, d));
  return v;
}

ScatterParams scatter_into(const PoolView& view, const std::vector<float>& k, const std::vector<float>* v,
                           const std::vector<std::int32_t>& slots, std::int32_t dim) {
  const std::int64_t tok = std::int64_t{view.num_kv_heads} * dim * 4;
  return {.cache = view,
          .src = {k.data(), v ? v->data() : nullptr, DType::f32, tok * std::int64_t(slots.size()), tok, std::int64_t{dim} * 4},
          .addr = {slots.data()},
          .num_tokens = std::int64_t(slots.size()),
          .num_layers = view.num_layers};
}

}  // namespace

TEST_CASE("group views: pages of equal bytes, each group's layout") {
  Pool p;
  CHECK(p.lg.page_bytes() == 4 * 2 * 2 * (8 + 4) * 4);  // group 0 is the widest: 4 tokens a page
  CHECK(p.lg.block_size(1) == 5);                        // 3 x 12 x 4 = 144 B a token: 5 fit in 768
  CHECK(p.lg.padding(1) == 768 - 5 * 144);
  CHECK(p.lg.block_size(2) == 8);                        // 96 B a token
  CHECK(make_group_view(p.lg, 0, p.mem.data(), kPages).status() ==
        Status{Errc::invalid_argument, "planes (K and V differ: view each alone)", 4, 8});
  CHECK(make_group_view(p.lg, 1, p.mem.data(), kPages, GroupPlanes::v).status() ==
        Status{Errc::invalid_argument, "planes (MLA stores no V)", 0, 1});
  CHECK(make_group_view(p.lg, 3, p.mem.data(), kPages).status() == Status{Errc::invalid_argument, "group", 3, 2});
  CHECK(make_group_view(p.lg, 2, nullptr, kPages).status() == Status{Errc::invalid_argument, "base", 0, 1});
  CHECK(make_group_view(p.lg, 2, p.mem.data(), 0).status() == Status{Errc::invalid_argument, "num_blocks", 0, 1});
  CHECK(make_group_view(p.lg, 1, p.mem.data(), kPages, GroupPlanes::k)->kv_planes == 1);
}

TEST_CASE("one full or MLA group is a Geometry: Cache<>'s pool view is the group's view, byte for byte") {
  const std::vector<std::int32_t> layers{0, 1, 2};
  for (const auto kind : {AttentionKind::full, AttentionKind::mla}) {
    const bool mla = kind == AttentionKind::mla;
    const LayerGroupSpec one[] = {{.kind = kind, .layers = layers, .num_kv_heads = mla ? 1 : 4, .head_dim = 24, .dtype = DType::bf16}};
    const auto lg = *LayerGroups::make({.groups = one, .block_size = 8});
    const auto geo = lg.as_geometry();
    REQUIRE(geo.ok());
    CHECK(geo->block_bytes() == lg.page_bytes());
    CHECK(geo->kv_planes() == (mla ? 1 : 2));
    std::vector<std::byte> mem(std::size_t(lg.page_bytes() * 4));
    const PoolView a = *make_pool_view(*geo, mem.data(), 4);
    const PoolView b = *make_group_view(lg, 0, mem.data(), 4, mla ? GroupPlanes::k : GroupPlanes::kv);
    CHECK(a.base == b.base);
    CHECK(a.strides.block == b.strides.block);
    CHECK(a.strides.layer == b.strides.layer);
    CHECK(a.strides.token == b.strides.token);
    CHECK(a.strides.head == b.strides.head);
    CHECK((mla || a.strides.kv == b.strides.kv));  // one plane: no V to step to
    CHECK(std::tie(a.num_layers, a.num_kv_heads, a.head_dim, a.block_size, a.kv_planes) ==
          std::tie(b.num_layers, b.num_kv_heads, b.head_dim, b.block_size, b.kv_planes));
  }
  Pool p;  // three groups, one with K and V of different dims
  CHECK(p.lg.as_geometry().status() == Status{Errc::invalid_argument, "groups (only one runs on Cache<>)", 3, 1});
  const std::vector<std::int32_t> l0{0};
  const LayerGroupSpec window[] = {{.kind = AttentionKind::sliding_window, .layers = l0, .num_kv_heads = 1, .head_dim = 8, .window = 4}};
  CHECK(LayerGroups::make({.groups = window})->as_geometry().status() ==
        Status{Errc::invalid_argument, "kind (only full and MLA run on Cache<>)", 1, 0});
  const LayerGroupSpec asym[] = {{.kind = AttentionKind::full, .layers = l0, .num_kv_heads = 1, .head_dim = 8, .v_head_dim = 4}};
  CHECK(LayerGroups::make({.groups = asym})->as_geometry().status() ==
        Status{Errc::invalid_argument, "v_head_dim (K and V differ)", 4, 8});
}

TEST_CASE("scatter, gather, block copy and compaction on asymmetric K/V, MLA and K = V groups of one pool") {
  Pool p;
  // Group 0 owns pages 1, 2; group 1 pages 3, 4; group 2 page 5. Pages 0, 6, 7 stay untouched.
  const std::vector<std::int32_t> s0{4, 5, 6, 9}, s1{15, 16, 17, 21, 23}, s2{40, 41, 47};
  const auto k0 = source(1, 2, 4, 2, 8), v0 = source(2, 2, 4, 2, 4), k1 = source(3, 3, 5, 1, 12), k2 = source(4, 1, 3, 2, 6),
             v2 = source(5, 1, 3, 2, 6);
  REQUIRE(scatter_host(scatter_into(p.view(0, GroupPlanes::k), k0, nullptr, s0, 8)).ok());
  REQUIRE(scatter_host(scatter_into(p.view(0, GroupPlanes::v), v0, nullptr, s0, 4)).ok());  // V through the view's K side
  REQUIRE(scatter_host(scatter_into(p.view(1, GroupPlanes::k), k1, nullptr, s1, 12)).ok());
  REQUIRE(scatter_host(scatter_into(p.view(2, GroupPlanes::kv), k2, &v2, s2, 6)).ok());
  std::vector<char> written(p.mem.size(), 0);
  const auto expect = [&](std::int32_t g, std::int32_t slot, std::int32_t layer, std::int32_t kv, std::int32_t head,
                          std::int32_t d, float want) {
    const std::int32_t B = p.lg.block_size(g);
    const std::int64_t off = p.at(g, slot / B, layer, kv, slot % B, head, d);
    REQUIRE(p.read(off) == want);
    std::fill(written.begin() + off, written.begin() + off + 4, 1);
  };
  for (std::int32_t t = 0; t < 4; ++t)
    for (std::int32_t l = 0; l < 2; ++l)
      for (std::int32_t h = 0; h < 2; ++h) {
        for (std::int32_t d = 0; d < 8; ++d) expect(0, s0[std::size_t(t)], l, 0, h, d, value(1, l, t, h, d));
        for (std::int32_t d = 0; d < 4; ++d) expect(0, s0[std::size_t(t)], l, 1, h, d, value(2, l, t, h, d));
      }
  for (std::int32_t t = 0; t < 5; ++t)
    for (std::int32_t l = 0; l < 3; ++l)
      for (std::int32_t d = 0; d < 12; ++d) expect(1, s1[std::size_t(t)], l, 0, 0, d, value(3, l, t, 0, d));
  for (std::int32_t t = 0; t < 3; ++t)
    for (std::int32_t h = 0; h < 2; ++h)
      for (std::int32_t d = 0; d < 6; ++d) {
        expect(2, s2[std::size_t(t)], 0, 0, h, d, value(4, 0, t, h, d));
        expect(2, s2[std::size_t(t)], 0, 1, h, d, value(5, 0, t, h, d));
      }
  for (std::size_t i = 0; i < p.mem.size(); ++i)  // nothing else was written: no plane spilled into another
    if (!written[i]) REQUIRE(p.mem[i] == kSentinel);

  SECTION("gather reads each view back") {
    const std::int32_t indptr[] = {0, 2}, pages1[] = {3, 4}, out_indptr[] = {0, 9};  // slots 15 .. 23 of group 1
    std::vector<float> out(9 * 12, -1.0f);
    GatherParams g{.cache = p.view(1, GroupPlanes::k), .layer = 2, .indptr = indptr, .indices = pages1, .out_indptr = out_indptr,
                   .num_seqs = 1, .num_rows = 9, .k_out = out.data(), .out_dtype = DType::f32, .token_stride = 48, .head_stride = 48};
    REQUIRE(gather_host(g).ok());
    for (std::int32_t t = 0; t < 5; ++t) {
      const std::int32_t row = s1[std::size_t(t)] - 15;
      for (std::int32_t d = 0; d < 12; ++d) CHECK(out[std::size_t(row * 12 + d)] == value(3, 2, t, 0, d));
    }
    const std::int32_t pages0[] = {1, 2}, rows0[] = {0, 6};
    std::vector<float> vout(6 * 2 * 4, -1.0f);
    GatherParams gv{.cache = p.view(0, GroupPlanes::v), .layer = 1, .indptr = indptr, .indices = pages0, .out_indptr = rows0,
                    .num_seqs = 1, .num_rows = 6, .k_out = vout.data(), .out_dtype = DType::f32, .token_stride = 32, .head_stride = 16};
    REQUIRE(gather_host(gv).ok());
    for (std::int32_t h = 0; h < 2; ++h)
      for (std::int32_t d = 0; d < 4; ++d) {
        CHECK(vout[std::size_t(1 * 8 + h * 4 + d)] == value(2, 1, 1, h, d));  // row 1 = slot 5: token 1
        CHECK(vout[std::size_t(5 * 8 + h * 4 + d)] == value(2, 1, 3, h, d));  // row 5 = slot 9: token 3
      }
  }
  SECTION("block copy and compaction move one plane of a one-plane view, and both of a two-plane one") {
    const BlockCopy c1[] = {{3, 6}};
    REQUIRE(block_copy_host({p.view(1, GroupPlanes::k), p.view(1, GroupPlanes::k), c1, 1}).ok());
    const std::int64_t latent = 3 * 5 * 12 * 4;  // the group's bytes of a page: its padding is not copied
    CHECK(std::memcmp(p.mem.data() + 6 * p.lg.page_bytes(), p.mem.data() + 3 * p.lg.page_bytes(), std::size_t(latent)) == 0);
    CHECK(p.mem[std::size_t(6 * p.lg.page_bytes() + latent)] == kSentinel);
    const BlockCopy c2[] = {{5, 7}};
    REQUIRE(block_copy_host({p.view(2, GroupPlanes::kv), p.view(2, GroupPlanes::kv), c2, 1}).ok());
    CHECK(std::memcmp(p.mem.data() + 7 * p.lg.page_bytes(), p.mem.data() + 5 * p.lg.page_bytes(), 2 * 8 * 2 * 6 * 4) == 0);
    const SlotMove m[] = {{.src = 23, .dst = 18}};
    REQUIRE(compaction_host({.cache = p.view(1, GroupPlanes::k), .moves = m, .num_moves = 1, .num_layers = 3}).ok());
    for (std::int32_t l = 0; l < 3; ++l)
      for (std::int32_t d = 0; d < 12; ++d) CHECK(p.read(p.at(1, 3, l, 0, 3, 0, d)) == value(3, l, 4, 0, d));
    const SlotMove mv[] = {{.src = 9, .dst = 7}};
    REQUIRE(compaction_host({.cache = p.view(0, GroupPlanes::v), .moves = mv, .num_moves = 1, .num_layers = 2}).ok());
    for (std::int32_t h = 0; h < 2; ++h)
      for (std::int32_t d = 0; d < 4; ++d) CHECK(p.read(p.at(0, 1, 1, 1, 3, h, d)) == value(2, 1, 3, h, d));
    CHECK(p.read(p.at(0, 1, 1, 0, 3, 0, 0)) != value(1, 1, 3, 0, 0));  // K of slot 7 was not moved by the V view
  }
  SECTION("a view's planes outside {1, 2} and a one-plane view where K and V are both needed are refused") {
    const auto before = p.mem;
    auto bad = p.view(2, GroupPlanes::kv);
    bad.kv_planes = 3;
    CHECK(scatter_host(scatter_into(bad, k2, &v2, s2, 6)) == Status{Errc::invalid_argument, "cache.kv_planes", 3, 2});
    CHECK(compaction_host({.cache = bad}) == Status{Errc::invalid_argument, "cache.kv_planes", 3, 2});
    const BlockCopy c[] = {{5, 7}};
    CHECK(block_copy_host({p.view(2, GroupPlanes::kv), p.view(1, GroupPlanes::k), c, 1}) ==
          Status{Errc::invalid_argument, "dst.geometry", 0, 0});
    CHECK(scatter_host(scatter_into(p.view(2, GroupPlanes::kv), k2, nullptr, s2, 6)) ==
          Status{Errc::invalid_argument, "src.k/src.v", 0, 1});
    RingAdmitParams ra{};
    ra.cache = p.view(1, GroupPlanes::k);
    ra.cache.num_layers = 1;
    CHECK(check_ring_admit_shape(ra) == Status{Errc::invalid_argument, "cache.kv_planes (K and V)", 1, 2});
    CHECK(p.mem == before);
  }
}
