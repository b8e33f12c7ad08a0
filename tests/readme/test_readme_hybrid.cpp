// The hybrid-model page's snippets (docs/hybrid.md), each run in a fixture
// that supplies the engine's names, then checked against what it promises.
#include <catch2/catch.hpp>

#include <kvcache/kernels/detail/group_view.hpp>
#include <kvcache/kernels/page_bounds.hpp>
#include <kvcache/kernels/page_select.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kvcache.hpp>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <span>
#include <vector>

namespace kv = kvcache;
using std::int32_t;
using std::int64_t;

namespace {
std::vector<int32_t> text(std::size_t n, int32_t from) {
  std::vector<int32_t> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = from + int32_t(i);
  return t;
}
}  // namespace

namespace {
struct Hybrid {
  std::vector<int32_t> prompt = text(5000, 1);
};
}  // namespace

TEST_CASE_METHOD(Hybrid, "docs hybrid: a Gemma-3-shaped and a DeepSeek-shaped cache, one request through the first") {
#include "snippets/hybrid.inc"
  CHECK(groups.num_layers() == 62);
  CHECK(groups.block_size(0) == 80);
  CHECK(groups.block_size(1) == 16);
  CHECK(groups.layer_slot(11) == kv::LayerSlot{0, 1});
  CHECK(a.cached_tokens == 0);
  CHECK(a.reserved == 2048);
  CHECK(*cache.tokens(a.seq) == 2050);
  CHECK(*cache.computed_tokens(a.seq) == 2049);
  // The next query is at 2049: it reads 1026 on, so window blocks 0 .. 63 were freed to the null id.
  CHECK(table[63] == kv::BlockPool::null_block);
  CHECK(table[64] != kv::BlockPool::null_block);
  CHECK(*cache.blocks_held(a.seq, 1) == 129 - 64);
  CHECK(*cache.blocks_held(a.seq, 0) == 26);  // ceil(2050 / 80)
  CHECK(cache.max_concurrency(32768) == 4);
  CHECK(cache.check_invariants().ok());
  // A second request with the same prompt finds the computed prefix in both groups.
  std::vector<int32_t> more(std::size_t(cache.groups()) * 2048);
  auto b = cache.admit(prompt, more, {.reserve = 2048}).value();
  CHECK(b.cached_tokens == 2000);  // 2049 computed: 25 full pages of 80; the window blocks 61 on are cached
  CHECK(mla.v_head_dim(0) == 0);
  CHECK(mla.page_bytes() == 64 * 61 * 576 * 2);
  CHECK(latent.can_admit(12288, 4096));
  CHECK(latent.check_invariants().ok());
}

TEST_CASE("docs hybrid_events: a hybrid cache's block events name their group, and reach vLLM's wire") {
#include "snippets/hybrid_events.inc"
  REQUIRE(n == 4);
  REQUIRE(batch.ok());
  CHECK(*batch == 3);  // the full group's chain merges; the window's two blocks are roots
  CHECK(events[0].group == 0);
  CHECK(events[2].group == 1);
  CHECK(events[0].block_size == 16);
  CHECK(ids[0] == 1000);
  CHECK(ids[std::size_t(cache.tokens_per_event())] == 1016);
  kv::MsgpackReader r(wire);
  CHECK(*r.array("batch") == 3);
}

TEST_CASE("docs unitary: one full group compiles to Cache<> over the same pages") {
#include "snippets/unitary.inc"
  CHECK(dense.geometry().block_bytes() == one.page_bytes());
  std::vector<std::byte> pool(std::size_t(one.page_bytes() * 2));
  const kv::PoolView a = kv::make_pool_view(dense.geometry(), pool.data(), 2).value();
  const kv::PoolView b = kv::make_group_view(one, 0, pool.data(), 2).value();
  CHECK(a.strides.block == b.strides.block);
  CHECK(a.strides.layer == b.strides.layer);
  CHECK(a.strides.kv == b.strides.kv);
  CHECK(a.strides.token == b.strides.token);
  CHECK(a.num_layers == 32);
  std::vector<int32_t> slots(20);
  CHECK(dense.admit(text(20, 7), slots).ok());
}

namespace {
// Group 0: 2 layers, 4 heads, K 64 / V 32; group 1: MLA, 3 layers, a 576-value latent; f32.
struct GroupView {
  std::vector<int32_t> l0{0, 1}, l1{2, 3, 4};
  kv::LayerGroupSpec specs[2] = {
      {.kind = kv::AttentionKind::full, .layers = l0, .num_kv_heads = 4, .head_dim = 64, .v_head_dim = 32, .dtype = kv::DType::f32},
      {.kind = kv::AttentionKind::mla, .layers = l1, .num_kv_heads = 1, .head_dim = 576, .dtype = kv::DType::f32}};
  kv::LayerGroups groups = kv::LayerGroups::make({.groups = specs, .block_size = 16, .max_padding_permille = 999}).value();
  int64_t pages = 4;
  std::vector<std::byte> pool = std::vector<std::byte>(std::size_t(pages * groups.page_bytes()));
  void* base = pool.data();
  int64_t n = 3;
  std::vector<float> kbuf = seq(2 * 3 * 4 * 64, 1.0f), vbuf = seq(2 * 3 * 4 * 32, 100000.0f), cbuf = seq(3 * 3 * 576, 200000.0f);
  const float* k = kbuf.data();
  const float* v = vbuf.data();
  const float* c_kv = cbuf.data();
  int32_t s0[3] = {36, 37, 50}, s1[3] = {0, 1, 2};  // group 0 (36 tokens a page) in page 1, group 1 (16) in page 0
  const int32_t* slots_g0 = s0;
  const int32_t* slots_g1 = s1;
  static std::vector<float> seq(std::size_t n, float from) {
    std::vector<float> x(n);
    std::iota(x.begin(), x.end(), from);
    return x;
  }
  float at(std::int64_t off) const {
    float f;
    std::memcpy(&f, pool.data() + off, 4);
    return f;
  }
};
}  // namespace

TEST_CASE_METHOD(GroupView, "docs group_view: asymmetric K/V one side at a time, and the MLA latent") {
#include "snippets/group_view.inc"
  REQUIRE(st.ok());
  const int64_t B0 = groups.block_size(0), B1 = groups.block_size(1), P = groups.page_bytes();
  REQUIRE(B0 == 36);  // the latent's 3 x 576 floats a token set the page: 16 of them
  REQUIRE(B1 == 16);
  const int64_t k_plane = B0 * 4 * 64 * 4, v_plane = B0 * 4 * 32 * 4;
  // Token 2 (slot 50: page 1, row 14) of layer 1, head 3, element 5: K, then V after K's plane.
  CHECK(at(1 * P + (k_plane + v_plane) + (14 * 4 + 3) * 64 * 4 + 5 * 4) == kbuf[std::size_t(((1 * 3 + 2) * 4 + 3) * 64 + 5)]);
  CHECK(at(1 * P + (k_plane + v_plane) + k_plane + (14 * 4 + 3) * 32 * 4 + 5 * 4) == vbuf[std::size_t(((1 * 3 + 2) * 4 + 3) * 32 + 5)]);
  // The latent of token 1 (slot 1: page 0, row 1), layer 2, element 500: no V plane after it.
  CHECK(at(0 * P + 2 * (B1 * 576 * 4) + (1 * 576 + 500) * 4) == cbuf[std::size_t((2 * 3 + 1) * 576 + 500)]);
}

namespace {
// One token of both full layers: 4 heads x 64, an outlier channel per head.
struct GroupFormat {
  int64_t pages = 3;
  int32_t slot = 16 + 5;  // page 1, row 5
  std::vector<float> kbuf = values(0.0f), vbuf = values(1.0f);
  const float* k = kbuf.data();
  const float* v = vbuf.data();
  static std::vector<float> values(float phase) {
    std::vector<float> x(2 * 4 * 64);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(float(i) * 0.7f + phase) * (i % 64 == 9 ? 12.0f : 1.0f);
    return x;
  }
};
}  // namespace

TEST_CASE_METHOD(GroupFormat, "docs group_format: an int8 full group and an fp8 window group, one token written") {
#include "snippets/group_format.inc"
  REQUIRE(st.ok());
  // The full group's planes: 16 x 4 rows of 64 codes (4,096 B, aligned), then 64 rows of 2 x 2 B.
  CHECK(planes.k == 4096 + 64 * 4);
  CHECK(planes.v == planes.k);
  CHECK(planes.k_scales_offset == 4096);
  CHECK(groups.page_bytes() == 2 * 2 * planes.k);
  CHECK(groups.block_size(0) == 16);
  CHECK(groups.block_size(1) == 16 * (64 + 4) / 64);  // fp8 with held scales: no entries, so more tokens a page
  // Layer 1, V, head 2 of the token: its 64 codes and 2 scales where the rule puts them, within half a step of the input.
  const int64_t plane = 1 * groups.page_bytes() + 1 * (planes.k + planes.v) + planes.k, row = 5 * 4 + 2;
  const float* x = vbuf.data() + (1 * 4 + 2) * 64;
  for (int grp = 0; grp < 2; ++grp) {
    std::uint16_t h;
    std::memcpy(&h, pool.data() + plane + planes.v_scales_offset + row * 4 + grp * 2, 2);
    const float scale = kv::cvt::f16_to_f32(h);
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[grp * 32 + i]));
    CHECK(std::fabs(scale - amax / 127.0f) <= amax / 127.0f * 1e-3f);
    for (int i = 0; i < 32; ++i) {
      const auto code = static_cast<std::int8_t>(pool[std::size_t(plane + row * 64 + grp * 32 + i)]);
      CHECK(std::fabs(float(code) * scale - x[grp * 32 + i]) <= 0.51f * scale);
    }
  }
}

namespace {
// A Gemma-3-shaped layout: layers 2 and 5 full (group 0), the rest a window
// of 128 (group 1); 2 kv-heads of 32 fp32 elements. The engine's names: the
// pool, the K/V it writes (kept here by layer and position), its queries.
struct HybridQuest {
  static constexpr int32_t H = 2, Dh = 32;
  std::vector<int32_t> full_layers{2, 5}, window_layers{0, 1, 3, 4};
  std::vector<kv::LayerGroupSpec> specs{
      {.kind = kv::AttentionKind::full, .layers = full_layers, .num_kv_heads = H, .head_dim = Dh, .dtype = kv::DType::f32},
      {.kind = kv::AttentionKind::sliding_window, .layers = window_layers, .num_kv_heads = H, .head_dim = Dh, .window = 128,
       .dtype = kv::DType::f32}};
  kv::LayerGroups groups = kv::LayerGroups::make({.groups = specs, .block_size = 16}).value();
  int32_t pages = 160;
  std::vector<std::byte> pool = std::vector<std::byte>(std::size_t(pages * groups.page_bytes()));
  void* base = pool.data();
  std::vector<int32_t> prompt = text(1000, 7);
  std::vector<std::vector<float>> keys = std::vector<std::vector<float>>(6);  // [layer][position][head][dim]
  std::vector<std::vector<float>> asked = std::vector<std::vector<float>>(6);
  int32_t attention_calls = 0;

  void write_kv(int32_t layer, const std::vector<int32_t>& slots) {
    const kv::LayerSlot at = groups.layer_slot(layer);
    const std::size_t n = prompt.size();
    std::vector<float> k(n * H * Dh), v(k.size());
    for (std::size_t i = 0; i < k.size(); ++i) k[i] = std::sin(float(i) * 0.37f + float(layer)) * (1.0f + float(i % 97) / 10.0f);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::cos(float(i) * 0.11f);
    keys[std::size_t(layer)] = k;
    const kv::PoolView view = kv::make_group_view(groups, at.group, base, pages).value();
    REQUIRE(kv::scatter_host({.cache = view, .src = {k.data(), v.data(), kv::DType::f32, 0, H * Dh * 4, Dh * 4},
                              .addr = {slots.data() + std::size_t(at.group) * n}, .num_tokens = int64_t(n), .first_layer = at.index})
                .ok());
  }
  std::span<const float> queries(int32_t layer) {
    auto& q = asked[std::size_t(layer)];
    q.resize(H * 2 * Dh);
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::cos(float(i) * 1.3f + float(layer));
    return q;
  }
  void attention(int32_t, const std::vector<int32_t>&, const std::vector<int32_t>&) { ++attention_calls; }
};
}  // namespace

TEST_CASE_METHOD(HybridQuest, "docs hybrid_quest: Quest on a hybrid's global layers reads the best-bounded pages of the full group") {
#include "snippets/hybrid_quest.inc"
  REQUIRE(attention_calls == 1);
  const int32_t B = groups.block_size(0);  // 32: the full group's two layers against the window's four
  REQUIRE(B == 32);
  const auto row = *cache.blocks(a.seq, 0);
  REQUIRE(row.size() == 32);  // ceil(1000 / 32)
  // The reference: each page's bounds from the keys written (by position), page_select's sum order.
  std::vector<float> ref(std::size_t(pages) * H * 2 * Dh);
  const auto& k5 = keys[5];
  for (std::size_t j = 0; j < row.size(); ++j)
    for (int32_t h = 0; h < H; ++h)
      for (int32_t d = 0; d < Dh; ++d) {
        float hi = -FLT_MAX, lo = FLT_MAX;
        for (std::size_t t = j * B; t < std::min<std::size_t>(prompt.size(), (j + 1) * B); ++t)
          hi = std::max(hi, k5[(t * H + std::size_t(h)) * Dh + std::size_t(d)] + 0.0f), lo = std::min(lo, k5[(t * H + std::size_t(h)) * Dh + std::size_t(d)] + 0.0f);
        float* b = ref.data() + (std::size_t(row[j]) * H + std::size_t(h)) * 2 * Dh;
        b[d] = hi, b[Dh + d] = lo;
        REQUIRE(cache.page_bounds(5)->data()[(std::size_t(row[j]) * H + std::size_t(h)) * 2 * Dh + std::size_t(d)] == hi);
      }
  kv::PageSelectParams p{};
  p.bounds = ref.data(), p.num_blocks = pages, p.num_kv_heads = H, p.head_dim = Dh, p.queries = asked[5].data(), p.group = 2;
  for (int32_t h = 0; h < H; ++h) {
    std::vector<std::pair<float, int32_t>> ranked;
    for (int32_t j = 1; j + 1 < int32_t(row.size()); ++j) ranked.push_back({-kv::page_select_bound(p, 0, h, row[std::size_t(j)]), j});
    std::sort(ranked.begin(), ranked.end());
    std::vector<int32_t> want{row.front()};
    std::vector<int32_t> mid;
    for (int32_t c = 0; c < 256 / B - 2; ++c) mid.push_back(ranked[std::size_t(c)].second);
    std::sort(mid.begin(), mid.end());
    for (const int32_t j : mid) want.push_back(row[std::size_t(j)]);
    want.push_back(row.back());
    REQUIRE(std::vector<int32_t>(indices.begin() + indptr[std::size_t(h)], indices.begin() + indptr[std::size_t(h) + 1]) == want);
  }
  // A window layer takes no selection: its window is its retention.
  REQUIRE(cache.select(seqs, 4, queries(4), {indptr, indices}).status().code() == kv::Errc::invalid_argument);
}

namespace {
// Gemma 3 27B's groups (as the hybrid snippet), a pool for four 8K requests, a 5,000-token prompt.
struct HybridEviction {
  std::vector<int32_t> full_layers, window_layers;
  kv::LayerGroups groups;
  int32_t pages = 0;
  std::vector<int32_t> prompt = text(5000, 1);
  int forwards = 0;
  HybridEviction() {
    for (int32_t l = 0; l < 62; ++l) (l % 6 == 5 ? full_layers : window_layers).push_back(l);
    const kv::LayerGroupSpec gemma[] = {
        {.kind = kv::AttentionKind::full, .layers = full_layers, .num_kv_heads = 16, .head_dim = 128},
        {.kind = kv::AttentionKind::sliding_window, .layers = window_layers, .num_kv_heads = 16, .head_dim = 128, .window = 1024}};
    groups = kv::LayerGroups::make({.groups = gemma, .block_size = 16, .block_multiple = 16}).value();
    pages = int32_t(kv::hybrid_pool_blocks(groups, 4, 8192, 0));
  }
  void forward(std::span<const int32_t>) { ++forwards; }
};
}  // namespace

TEST_CASE_METHOD(HybridEviction, "docs hybrid_eviction: sinks and a window on a Gemma-3-shaped model's full layers") {
#include "snippets/hybrid_eviction.inc"
  REQUIRE(forwards == 1);
  REQUIRE(groups.block_size(0) == 80);
  // 63 blocks of 80: block 0 holds the sinks, the last 2,048 tokens reach back into block 36; blocks 1 .. 35 leave.
  REQUIRE(r.evicted == 35);
  for (int32_t k = 0; k < 35; ++k) REQUIRE(evicted[std::size_t(k)] == k + 1);
  REQUIRE(kv_len == 5000 - 35 * 80);
  REQUIRE(first_pos[0] == 35 * 80);
  REQUIRE(indptr[1] == 63 - 35);
  const auto row = *cache.blocks(a.seq, 0);
  REQUIRE(indices[0] == row[0]);
  REQUIRE(indices[1] == row[36]);
  REQUIRE(cache.blocks_held(a.seq, 1).value() == 313);  // the window group: all 5,000 tokens until the next reserve frees
  REQUIRE(cache.evicted(a.seq).value());
  REQUIRE(cache.check_invariants().ok());
}
