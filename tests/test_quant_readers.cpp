// Quantized pools through the kernels that read or rewrite keys in place or
// write through a ring: RoPE re-rotation (dequantize, rotate in fp32,
// requantize the rotated groups), Quest's page bounds (dequantized keys),
// ring write with promotion and Write-Gated KV's ring admission (quantized
// on write, promoted with their entries). Each against a plain reference
// built from the group codecs at Geometry's offsets, on random formats and
// layouts; bytes not written must be untouched. Then the error a rotation
// adds, against fp32.
#include <catch2/catch.hpp>

#include <kvcache/kernels/page_bounds.hpp>
#include <kvcache/kernels/ring_admit.hpp>
#include <kvcache/kernels/ring_write.hpp>
#include <kvcache/kernels/rope.hpp>

#include <cfloat>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "quant_testing.hpp"

using namespace kvcache;
using kvtest::QPool;
using kvtest::random_quant_spec;
using kvtest::reference_row;
using kvtest::reference_values;

namespace {

// Keys with a few large channels (the outliers real keys have).
std::vector<float> key_row(std::mt19937_64& rng, int n, float scale = 1.0f) {
  std::normal_distribution<float> z(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) x[std::size_t(i)] = z(rng) * scale * (i % 37 == 5 ? 12.0f : 1.0f);
  return x;
}

// Writes every row of the pool from the codecs (values in the codes' units for an engine-held scale).
void fill(QPool& pool, std::mt19937_64& rng) {
  const auto& s = pool.g.spec();
  const bool element = dtype_bits(s.dtype) == 8;  // an element type with an engine-held scale, when not grouped
  for (std::int64_t b = 0; b < pool.blocks; ++b)
    for (int l = 0; l < s.num_layers; ++l)
      for (int kv = 0; kv < 2; ++kv)
        for (int t = 0; t < s.block_size; ++t)
          for (int h = 0; h < s.num_kv_heads; ++h) {
            const bool group = pool.g.side(kv).scales == Scales::group;
            const auto x = key_row(rng, s.head_dim, group ? 1.0f : (element ? 20.0f : 1.5f));
            const kvtest::RowBytes r = reference_row(pool.g, kv, x.data());
            std::copy(r.codes.begin(), r.codes.end(), reinterpret_cast<std::uint8_t*>(&pool.bytes[pool.codes_at(b, l, kv, t, h)]));
            std::copy(r.entries.begin(), r.entries.end(), reinterpret_cast<std::uint8_t*>(&pool.bytes[pool.entries_at(b, l, kv, t, h)]));
          }
}

std::vector<float> row_values(const QPool& pool, std::int64_t b, int l, int kv, int t, int h) {
  return reference_values(pool.g, kv, &pool.bytes[pool.codes_at(b, l, kv, t, h)], &pool.bytes[pool.entries_at(b, l, kv, t, h)]);
}

// Rotates x's first r dims by (cos, sin) row ad, as RoPE pairs them, with the kernel's fma.
void rotate(std::vector<float>& x, int r, RopeStyle style, const std::vector<float>& cs, const std::vector<float>& sn, int delta) {
  const int half = r / 2, ad = std::abs(delta);
  for (int i = 0; i < half; ++i) {
    const float c = cs[std::size_t(ad * half + i)], s = delta < 0 ? -sn[std::size_t(ad * half + i)] : sn[std::size_t(ad * half + i)];
    const int ix = style == RopeStyle::neox ? i : 2 * i, iy = style == RopeStyle::neox ? i + half : 2 * i + 1;
    const float a = x[std::size_t(ix)], b = x[std::size_t(iy)];
    x[std::size_t(ix)] = std::fma(a, c, -(b * s));
    x[std::size_t(iy)] = std::fma(b, c, a * s);
  }
}

}  // namespace

TEST_CASE("rope on quantized keys requantizes the rotated groups from fp32, and moves nothing else") {
  std::mt19937_64 rng(Catch::rngSeed() ^ std::random_device{}());
  for (int trial = 0; trial < 100; ++trial) {
    GeometrySpec s = random_quant_spec(rng);
    const int D = s.head_dim, r = rng() % 3 ? D : 2 * (1 + int(rng() % std::uint64_t(D / 2)));
    const RopeStyle style = rng() % 2 ? RopeStyle::neox : RopeStyle::gptj;
    INFO("trial " << trial << " dtype " << int(s.dtype) << " D " << D << " r " << r << " style " << int(style) << " k "
                  << int(s.format.k.scales) << "/" << s.format.k.group << "/" << s.format.k.minimum << " layout " << int(s.layout));
    QPool pool(s, 3);
    fill(pool, rng);
    std::vector<float> cs(std::size_t(5 * (r / 2))), sn(cs.size());
    REQUIRE(make_rope_table(10000.0, r, 4, cs, sn).ok());
    const std::int32_t blocks[] = {2, 0}, deltas[] = {3, -1 - std::int32_t(rng() % 4)};
    auto want = pool.bytes;
    const bool quantized = quantized_side(pool.view, 0);
    const int u = quantized ? pool_unit(pool.view, 0) : 1, units = (r + u - 1) / u;  // units the rotation rewrites
    for (int e = 0; e < 2; ++e)
      for (int l = 0; l < s.num_layers; ++l)
        for (int t = 0; t < s.block_size; ++t)
          for (int h = 0; h < s.num_kv_heads; ++h) {
            const std::size_t at = pool.codes_at(blocks[e], l, 0, t, h);
            if (!quantized) {  // an element type with an engine-held scale: the elements rotate as they are
              std::vector<float> x(static_cast<std::size_t>(D));
              for (int d = 0; d < D; ++d) x[std::size_t(d)] = load_elem(s.dtype, &pool.bytes[at], d);
              rotate(x, r, style, cs, sn, deltas[e]);
              for (int d = 0; d < r; ++d) store_elem(s.dtype, &want[at], d, x[std::size_t(d)]);
              continue;
            }
            auto x = row_values(pool, blocks[e], l, 0, t, h);
            rotate(x, r, style, cs, sn, deltas[e]);
            const kvtest::RowBytes rq = reference_row(pool.g, 0, x.data());
            const auto code_bytes = std::size_t(row_bytes(s.dtype, std::int64_t{units} * u));
            std::copy_n(rq.codes.begin(), code_bytes, reinterpret_cast<std::uint8_t*>(&want[at]));
            if (!rq.entries.empty()) {
              const std::size_t per_group = rq.entries.size() / std::size_t(D / u);
              std::copy_n(rq.entries.begin(), per_group * std::size_t(units),
                          reinterpret_cast<std::uint8_t*>(&want[pool.entries_at(blocks[e], l, 0, t, h)]));
            }
          }
    RopeParams p{pool.view, 0, s.num_layers, blocks, deltas, 2, cs.data(), sn.data(), 4, r, style};
    REQUIRE(rope_host(p).ok());
    REQUIRE(pool.bytes == want);
  }
}

TEST_CASE("rope on quantized keys adds about one quantization's error, against fp32") {
  // Keys quantized once, rotated by the kernel (dequantize, rotate, requantize),
  // against the same keys rotated in fp32: the error relative to each group's
  // range, over the error of quantizing the fp32-rotated keys once.
  std::mt19937_64 rng(Catch::rngSeed() ^ 0x20be);
  struct F {
    DType code;
    std::int32_t group;
    bool minimum;
    double max_ratio;  // RMS after rotation / RMS of one quantization, at most
  };
  for (const F f : {F{DType::int8, 32, false, 1.5}, F{DType::int4, 32, true, 1.5}, F{DType::fp8_e4m3, 32, false, 1.5},
                    F{DType::fp4_e2m1, 16, false, 1.5}}) {
    const int D = 128, rows = 512;
    const SideFormat side{.scales = Scales::group, .group = f.group, .minimum = f.minimum};
    QPool pool({.num_kv_heads = 1, .head_dim = D, .block_size = rows, .dtype = f.code, .format = {side, side}}, 1);
    std::vector<float> cs(std::size_t(2 * 64)), sn(cs.size());
    REQUIRE(make_rope_table(10000.0, D, 1, cs, sn).ok());
    std::vector<std::vector<float>> exact;
    for (int t = 0; t < rows; ++t) {
      exact.push_back(key_row(rng, D));
      const kvtest::RowBytes q = reference_row(pool.g, 0, exact.back().data());
      std::copy(q.codes.begin(), q.codes.end(), reinterpret_cast<std::uint8_t*>(&pool.bytes[pool.codes_at(0, 0, 0, t, 0)]));
      std::copy(q.entries.begin(), q.entries.end(), reinterpret_cast<std::uint8_t*>(&pool.bytes[pool.entries_at(0, 0, 0, t, 0)]));
    }
    const std::int32_t block = 0, delta = 1;
    REQUIRE(rope_host({pool.view, 0, 1, &block, &delta, 1, cs.data(), sn.data(), 1}).ok());
    double rotated = 0, once = 0;
    for (int t = 0; t < rows; ++t) {
      auto x = exact[std::size_t(t)];
      rotate(x, D, RopeStyle::neox, cs, sn, 1);
      const auto got = row_values(pool, 0, 0, 0, t, 0);
      const kvtest::RowBytes q = reference_row(pool.g, 0, x.data());
      const auto direct = reference_values(pool.g, 0, reinterpret_cast<const std::byte*>(q.codes.data()),
                                           reinterpret_cast<const std::byte*>(q.entries.data()));
      for (int g = 0; g < D / f.group; ++g) {
        const auto b = x.begin() + g * f.group;
        const auto [lo, hi] = std::minmax_element(b, b + f.group);
        const double range = double(*hi - *lo);
        for (int i = g * f.group; i < (g + 1) * f.group; ++i) {
          rotated += std::pow((got[std::size_t(i)] - x[std::size_t(i)]) / range, 2);
          once += std::pow((direct[std::size_t(i)] - x[std::size_t(i)]) / range, 2);
        }
      }
    }
    const double ratio = std::sqrt(rotated / once);
    INFO("code " << int(f.code) << " RMS after rotation " << std::sqrt(rotated / (rows * D)) << " once "
                 << std::sqrt(once / (rows * D)) << " ratio " << ratio);
    CHECK(ratio > 1.0);  // the rotation's requantization adds error: it is not free
    CHECK(ratio < f.max_ratio);
  }
}

TEST_CASE("rope refuses a quantized NeoX rotation it cannot split, and writes nothing") {
  // NeoX pairs d with d + 192: groups of 128 split there, and 384 dims exceed one pass.
  const SideFormat g128{.scales = Scales::group, .group = 128};
  QPool pool({.num_kv_heads = 1, .head_dim = 384, .block_size = 2, .dtype = DType::int8, .format = {g128, g128}}, 1);
  const auto before = pool.bytes;
  std::vector<float> cs(std::size_t(2 * 192), 1.0f), sn(cs.size(), 0.0f);
  const std::int32_t block = 0, delta = 1;
  RopeParams p{pool.view, 0, 1, &block, &delta, 1, cs.data(), sn.data(), 1};
  const Status st = rope_host(p);
  CHECK(st.message() == "invalid_argument: rotary_dim (quantized NeoX keys whose half splits a group: at most 256)=384 (limit 256)");
  CHECK(pool.bytes == before);
  p.style = RopeStyle::gptj;  // pairs inside a group: any length
  CHECK(rope_host(p).ok());
  p.style = RopeStyle::neox;
  p.rotary_dim = 256;  // half 128: groups pair with groups
  CHECK(rope_host(p).ok());
}

TEST_CASE("page bounds of quantized keys are the bounds of the dequantized keys") {
  std::mt19937_64 rng(Catch::rngSeed() ^ std::random_device{}());
  for (int trial = 0; trial < 60; ++trial) {
    const GeometrySpec s = random_quant_spec(rng);
    INFO("trial " << trial << " dtype " << int(s.dtype) << " D " << s.head_dim << " k " << int(s.format.k.scales) << "/"
                  << s.format.k.group << "/" << s.format.k.minimum);
    QPool pool(s, 3);
    fill(pool, rng);
    const int H = s.num_kv_heads, D = s.head_dim, B = s.block_size, layer = s.num_layers - 1;
    const bool quantized = quantized_side(pool.view, 0);
    auto key = [&](std::int64_t b, int t, int h) {
      if (quantized) return row_values(pool, b, layer, 0, t, h);
      std::vector<float> x(static_cast<std::size_t>(D));
      for (int d = 0; d < D; ++d) x[std::size_t(d)] = load_elem(s.dtype, &pool.bytes[pool.codes_at(b, layer, 0, t, h)], d);
      return x;
    };
    // Recompute: pages 2 and 0, partly filled.
    const std::int32_t pages[] = {2, 0}, fills[] = {B, 1 + std::int32_t(rng() % std::uint64_t(B))};
    std::vector<float> bounds(std::size_t(3 * H * 2 * D), 7.0f), want = bounds;
    for (int e = 0; e < 2; ++e)
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d) {
          float mx = -FLT_MAX, mn = FLT_MAX;
          for (int t = 0; t < fills[e]; ++t) {
            const float v = key(pages[e], t, h)[std::size_t(d)] + 0.0f;
            mx = std::max(mx, v), mn = std::min(mn, v);
          }
          want[std::size_t((pages[e] * H + h) * 2 * D + d)] = mx;
          want[std::size_t((pages[e] * H + h) * 2 * D + D + d)] = mn;
        }
    REQUIRE(page_bounds_host({pool.view, layer, pages, fills, 2, bounds.data()}).ok());
    REQUIRE(bounds == want);
    // Fold: every slot of block 1 in a random order, from its first slot (a fresh page).
    std::vector<std::int32_t> slots(static_cast<std::size_t>(B));
    std::iota(slots.begin(), slots.end(), B);
    std::shuffle(slots.begin(), slots.end(), rng);
    std::vector<float> folded(bounds.size(), 5.0f);
    REQUIRE(page_bounds_update_host({pool.view, layer, slots.data(), B, folded.data()}).ok());
    const std::int32_t one = 1, full = B;
    std::vector<float> recomputed = folded;
    REQUIRE(page_bounds_host({pool.view, layer, &one, &full, 1, recomputed.data()}).ok());
    REQUIRE(folded == recomputed);
  }
}

TEST_CASE("ring write quantizes into ring slots and promotes replaced rows with their entries") {
  std::mt19937_64 rng(Catch::rngSeed() ^ std::random_device{}());
  for (int trial = 0; trial < 80; ++trial) {
    const GeometrySpec s = random_quant_spec(rng);
    INFO("trial " << trial << " dtype " << int(s.dtype) << " D " << s.head_dim << " block " << s.block_size);
    QPool pool(s, 4);
    fill(pool, rng);
    const int H = s.num_kv_heads, D = s.head_dim, L = s.num_layers;
    const std::int64_t slots_in_pool = 4 * s.block_size;
    std::vector<std::int32_t> all(static_cast<std::size_t>(slots_in_pool));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    const std::int64_t n = std::min<std::int64_t>(slots_in_pool / 2, 1 + std::int64_t(rng() % 6));
    std::vector<std::int32_t> ring(all.begin(), all.begin() + n), promote(all.begin() + n, all.begin() + 2 * n);
    for (auto& x : promote)
      if (rng() % 3 == 0) x = -1;
    if (n > 1) ring[1] = -1;  // a skipped token
    std::vector<float> k(std::size_t(n * H * D)), v(k.size());
    for (auto& x : k) x = key_row(rng, 1)[0];
    for (auto& x : v) x = key_row(rng, 1)[0];
    // Engine-held scales bring values into the code's range (4-bit codes reach 6 or 7, 8-bit ones 127 or 448).
    const float held = dtype_bits(s.dtype) == 4 ? 0.5f : 0.04f;
    const float k_scale = s.format.k.scales == Scales::group ? 1.0f : held, v_scale = s.format.v.scales == Scales::group ? 2.0f : held;
    RingWriteParams p{};
    p.cache = pool.view;
    p.src = KvSource{k.data(), v.data(), DType::f32, 0, H * D * 4, D * 4};
    p.num_tokens = n;
    p.num_layers = L;
    p.ring_slots = ring.data();
    p.promote_slots = promote.data();
    p.k_scale = k_scale;
    p.v_scale = v_scale;
    auto want = pool.bytes;
    const auto B = s.block_size;
    for (std::int64_t t = 0; t < n; ++t) {
      if (ring[std::size_t(t)] < 0) continue;
      const std::int64_t rb = ring[std::size_t(t)] / B, pb = promote[std::size_t(t)] / B;
      const int rt = int(ring[std::size_t(t)] % B), pt = int(promote[std::size_t(t)] % B);
      for (int l = 0; l < L; ++l)
        for (int kv = 0; kv < 2; ++kv)
          for (int h = 0; h < H; ++h) {
            if (promote[std::size_t(t)] >= 0) {
              std::copy_n(&pool.bytes[pool.codes_at(rb, l, kv, rt, h)], pool.g.row_bytes(), &want[pool.codes_at(pb, l, kv, pt, h)]);
              std::copy_n(&pool.bytes[pool.entries_at(rb, l, kv, rt, h)], pool.g.group_bytes_per_row(kv),
                          &want[pool.entries_at(pb, l, kv, pt, h)]);
            }
            std::vector<float> x(static_cast<std::size_t>(D));
            for (int d = 0; d < D; ++d) x[std::size_t(d)] = (kv ? v : k)[std::size_t((t * H + h) * D + d)] / (kv ? v_scale : k_scale);
            const kvtest::RowBytes r = reference_row(pool.g, kv, x.data());
            std::copy(r.codes.begin(), r.codes.end(), reinterpret_cast<std::uint8_t*>(&want[pool.codes_at(rb, l, kv, rt, h)]));
            std::copy(r.entries.begin(), r.entries.end(), reinterpret_cast<std::uint8_t*>(&want[pool.entries_at(rb, l, kv, rt, h)]));
          }
    }
    REQUIRE(ring_write_host(p).ok());
    REQUIRE(pool.bytes == want);
  }
}

TEST_CASE("ring admission into a quantized pool keeps what an fp32 pool keeps, quantized") {
  // The same calls on an fp32 pool and a quantized one: every slot the fp32
  // pool wrote holds, in the quantized pool, that row quantized (a copy moves
  // codes and entries unchanged, so the bytes match exactly); unwritten slots
  // stay untouched.
  std::mt19937_64 rng(Catch::rngSeed() ^ std::random_device{}());
  for (int trial = 0; trial < 40; ++trial) {
    GeometrySpec s = random_quant_spec(rng);
    s.num_layers = 1, s.num_kv_heads = 1;
    const std::int32_t B = s.block_size, W = B * (1 + std::int32_t(rng() % 2)), limit = std::int32_t(rng() % 7), H = 1 + std::int32_t(rng() % 3);
    const std::int32_t stride = (W + limit + B - 1) / B, D = s.head_dim;
    GeometrySpec plain = s;
    plain.dtype = DType::f32;
    plain.format = {};
    INFO("trial " << trial << " dtype " << int(s.dtype) << " D " << D << " B " << B << " W " << W << " limit " << limit << " H " << H);
    QPool q(s, H * stride), f(plain, H * stride);
    const auto untouched = q.bytes;
    std::vector<std::int32_t> rows(static_cast<std::size_t>(H * stride));
    std::iota(rows.begin(), rows.end(), 0);
    std::shuffle(rows.begin(), rows.end(), rng);
    std::vector<std::int32_t> start(std::size_t(H), 0), len(std::size_t(H), 0), gl_q(std::size_t(H), 0), gl_f(std::size_t(H), 0);
    std::vector<std::uint8_t> bits_q(std::size_t(H * W), 0), bits_f(bits_q);
    for (int call = 0; call < 6; ++call) {
      const std::int32_t n = 1 + std::int32_t(rng() % std::uint64_t(2 * W));
      std::vector<float> k(std::size_t(n * H * D)), v(k.size()), gates(std::size_t(n * H));
      for (auto& x : k) x = key_row(rng, 1)[0];
      for (auto& x : v) x = key_row(rng, 1)[0];
      for (auto& g : gates) g = float(rng() % 100) / 100.0f;
      RingAdmitParams p{.cache = q.view, .src = KvSource{k.data(), v.data(), DType::f32, 0, D * 4, D * 4}, .gates = gates.data(),
                        .num_tokens = n, .num_heads = H, .window = W, .global_limit = limit, .tau = 0.5f,
                        .ring_start = start.data(), .ring_len = len.data(), .global_len = gl_q.data(), .bits = bits_q.data(),
                        .rows = rows.data(), .row_stride = stride};
      REQUIRE(ring_admit_host(p).ok());
      p.cache = f.view, p.global_len = gl_f.data(), p.bits = bits_f.data();
      REQUIRE(ring_admit_host(p).ok());
      REQUIRE(gl_q == gl_f);
      REQUIRE(bits_q == bits_f);
      for (std::int32_t h = 0; h < H; ++h) {  // the host's ring state after the call
        const std::int32_t total = len[std::size_t(h)] + n;
        start[std::size_t(h)] = (start[std::size_t(h)] + std::max(0, total - W)) % W;
        len[std::size_t(h)] = std::min(total, W);
      }
      for (std::int32_t h = 0; h < H; ++h)
        for (std::int32_t i = 0; i < W + limit; ++i) {
          const std::int64_t slot = std::int64_t{rows[std::size_t(h * stride + i / B)]} * B + i % B, b = slot / B;
          const int t = int(slot % B);
          for (int kv = 0; kv < 2; ++kv) {
            const auto* fr = reinterpret_cast<const float*>(&f.bytes[f.codes_at(b, 0, kv, t, 0)]);
            const bool written = i < W ? i < len[std::size_t(h)] : i - W < gl_f[std::size_t(h)];
            INFO("call " << call << " head " << h << " index " << i << " kv " << kv);
            if (written)
              REQUIRE(q.holds(reference_row(q.g, kv, fr), b, 0, kv, t, 0));
            else
              REQUIRE(std::equal(q.bytes.begin() + std::ptrdiff_t(q.codes_at(b, 0, kv, t, 0)),
                                 q.bytes.begin() + std::ptrdiff_t(q.codes_at(b, 0, kv, t, 0) + std::size_t(q.g.row_bytes())),
                                 untouched.begin() + std::ptrdiff_t(q.codes_at(b, 0, kv, t, 0))));
          }
        }
    }
  }
}
