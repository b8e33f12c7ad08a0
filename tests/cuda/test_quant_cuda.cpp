// The quantized pools on CUDA against the host backend, bit for bit: every
// kernel on random quantized geometries, then scatter and gather in bulk
// (the chunked path, several items a thread), from unaligned rows (its
// generic loop) and with more rows than a CTA holds. Part of
// test_kernels_cuda (its main skips without a GPU).
#include "cuda_testing.hpp"
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/page_bounds.hpp>
#include <kvcache/kernels/ring_write.hpp>
#include <kvcache/kernels/rope.hpp>

#include "launchers.hpp"

using namespace kvcache;
using namespace kvtest;

namespace {

// Engine-held scales, one per layer or per (layer, head), on the host and
// on the device; each side's pointers are null unless its format holds
// such scales.
struct HeldScales {
  std::vector<float> host;
  Dev dev;
  const float *k, *v, *dk, *dv;
  static std::vector<float> values(const GeometrySpec& g) {
    std::vector<float> h(static_cast<std::size_t>(g.num_layers * g.num_kv_heads));
    for (std::size_t i = 0; i < h.size(); ++i) h[i] = 0.25f + 0.125f * float(i % 7);
    return h;
  }
  static const float* of(const SideFormat& f, const float* at) {
    return f.scales == Scales::tensor || f.scales == Scales::head ? at : nullptr;
  }
  explicit HeldScales(const GeometrySpec& g)
      : host(values(g)),
        dev(host),
        k(of(g.format.k, host.data())),
        v(of(g.format.v, host.data())),
        dk(of(g.format.k, dev.as<float>())),
        dv(of(g.format.v, dev.as<float>())) {}
};


// A pool of random bytes on the host, its copy on the device, and a view of each.
struct TwinPools {
  std::vector<std::byte> host;
  Dev dev;
  PoolView hv, dv;
  static std::vector<std::byte> random_bytes(std::mt19937_64& rng, std::int64_t n) {
    std::vector<std::byte> b(static_cast<std::size_t>(n));
    for (auto& x : b) x = std::byte(rng() & 0x3f);
    return b;
  }
  TwinPools(std::mt19937_64& rng, const Geometry& geo, std::int64_t blocks)
      : host(random_bytes(rng, *geo.pool_bytes(blocks))), dev(host), hv(*make_pool_view(geo, host.data(), blocks)), dv(hv) {
    dv.base = dev.p;
  }
};

// Scatter on both backends from the same inputs (the call's scales 0.5 and
// 1.5, the held ones where the format takes them); the pools must match.
void scatter_both(const PoolView& hv, const PoolView& dv, const KvSource& hsrc, const KvSource& dsrc,
                  const std::vector<std::int32_t>& slots, const Dev& dslots, std::int64_t tokens, std::int32_t layers,
                  const HeldScales& held, const Dev& dev, const std::vector<std::byte>& host) {
  REQUIRE(scatter_host({hv, hsrc, TokenAddress{slots.data()}, tokens, 0, layers, 0.5f, 1.5f, held.k, held.v}).ok());
  CUDA_OK(kvgpu::scatter({dv, dsrc, TokenAddress{dslots.as<std::int32_t>()}, tokens, 0, layers, 0.5f, 1.5f, held.dk, held.dv}));
  REQUIRE(dev.download<std::byte>() == host);
}

// Gather on both backends: hp as the host runs it (outputs `shift` bytes
// into k and v); on the device the same tables, pool dv, and copies of k
// and v. The outputs must match byte for byte, untouched bytes included.
void gather_both(const GatherParams& hp, const PoolView& dv, const HeldScales& held, std::vector<std::byte>& k,
                 std::vector<std::byte>& v, std::int64_t shift) {
  const std::vector<std::int32_t> indptr(hp.indptr, hp.indptr + hp.num_seqs + 1);
  const std::vector<std::int32_t> indices(hp.indices, hp.indices + indptr.back());
  const std::vector<std::int32_t> out_indptr(hp.out_indptr, hp.out_indptr + hp.num_seqs + 1);
  Dev dk(k), dvv(v), dindptr(indptr), dindices(indices), dout(out_indptr);
  GatherParams dp = hp;
  dp.cache = dv;
  dp.k_scales = held.dk;
  dp.v_scales = held.dv;
  dp.indptr = dindptr.as<std::int32_t>();
  dp.indices = dindices.as<std::int32_t>();
  dp.out_indptr = dout.as<std::int32_t>();
  dp.k_out = dk.as<std::byte>() + shift;
  dp.v_out = dvv.as<std::byte>() + shift;
  REQUIRE(gather_host(hp).ok());
  CUDA_OK(kvgpu::gather(dp));
  REQUIRE(dk.download<std::byte>() == k);
  REQUIRE(dvv.download<std::byte>() == v);
}

}  // namespace

TEST_CASE("cuda quantized scatter, gather, compaction, rope, page bounds and ring write == host, bit for bit (group scales, 4-bit codes)") {
  auto rng = fresh_rng();
  for (int trial = 0; trial < 40; ++trial) {
    const GeometrySpec g = random_quant_spec(rng);
    const Geometry geo = *Geometry::make(g);
    const std::int64_t blocks = 4, pool_slots = blocks * g.block_size;
    std::vector<std::byte> host(static_cast<std::size_t>(*geo.pool_bytes(blocks)));
    for (auto& b : host) b = std::byte(rng() & 0x3f);  // codes and finite entries
    Dev dev(host);
    const PoolView hv = *make_pool_view(geo, host.data(), blocks);
    PoolView dv = hv;
    dv.base = dev.p;
    const std::int64_t tokens = std::min<std::int64_t>(pool_slots, 1 + std::int64_t(rng() % 30));
    const std::int64_t head = g.head_dim * 2, per_token = 2 * g.num_kv_heads;
    std::vector<std::byte> in = random_elems(rng, DType::bf16, g.num_layers * tokens * per_token * g.head_dim);
    Dev din(in);
    auto slots = shuffled(rng, pool_slots);
    slots.resize(static_cast<std::size_t>(tokens));
    for (auto& s : slots)
      if (rng() % 6 == 0) s = -1;
    Dev dslots(slots);
    auto src = [&](const std::byte* base) {
      return KvSource{base, base + g.num_kv_heads * head, DType::bf16, tokens * per_token * head, per_token * head, head};
    };
    const HeldScales held(g);
    scatter_both(hv, dv, src(in.data()), src(din.as<std::byte>()), slots, dslots, tokens, g.num_layers, held, dev, host);

    // Every slot of one layer, as one sequence, into f16.
    std::vector<std::int32_t> indptr{0, std::int32_t(blocks)}, indices(shuffled(rng, blocks)), out_indptr{0, std::int32_t(pool_slots)};
    const std::int64_t row = g.num_kv_heads * g.head_dim * 2;
    std::vector<std::byte> k(static_cast<std::size_t>(pool_slots * row), std::byte{0x5a}), v(k);
    gather_both({hv, int(rng() % g.num_layers), indptr.data(), indices.data(), out_indptr.data(), 1, pool_slots, k.data(),
                 v.data(), DType::f16, row, g.head_dim * 2, 0.25f, 2.0f, held.k, held.v},
                dv, held, k, v, 0);

    auto ids = shuffled(rng, pool_slots);
    std::vector<SlotMove> moves;
    for (std::int64_t i = 0; i + 1 < pool_slots && i < 8; i += 2) moves.push_back({ids[std::size_t(i)], ids[std::size_t(i + 1)]});
    Dev dmoves(moves);
    const auto n = std::int32_t(moves.size());
    REQUIRE(compaction_host({hv, moves.data(), n, 0, g.num_layers}).ok());
    CUDA_OK(kvgpu::compaction({dv, dmoves.as<SlotMove>(), n, 0, g.num_layers}));
    REQUIRE(dev.download<std::byte>() == host);

    // RoPE: dequantize, rotate, requantize (lanes split the row's pieces).
    const std::int32_t max_delta = 8;
    std::vector<float> cs(std::size_t((max_delta + 1) * g.head_dim / 2)), sn(cs.size());
    REQUIRE(make_rope_table(10000.0, g.head_dim, max_delta, cs, sn).ok());
    std::vector<std::int32_t> rblocks{0, 3}, deltas{5, -8};
    Dev dcs(cs), dsn(sn), drblocks(rblocks), ddeltas(deltas);
    const RopeStyle style = trial % 2 ? RopeStyle::neox : RopeStyle::gptj;
    REQUIRE(rope_host({hv, 0, g.num_layers, rblocks.data(), deltas.data(), 2, cs.data(), sn.data(), max_delta, 0, style}).ok());
    CUDA_OK(kvgpu::rope({dv, 0, g.num_layers, drblocks.as<std::int32_t>(), ddeltas.as<std::int32_t>(), 2, dcs.as<float>(),
                         dsn.as<float>(), max_delta, 0, style}));
    REQUIRE(dev.download<std::byte>() == host);

    // Page bounds read the keys dequantized: recompute, and fold every slot of block 1.
    std::vector<std::int32_t> pages{3, 1}, fill{g.block_size, 1};
    std::vector<float> bounds(std::size_t(blocks * g.num_kv_heads * 2 * g.head_dim), 9.0f);
    Dev dpages(pages), dfill(fill), dbounds(bounds);
    REQUIRE(page_bounds_host({hv, 0, pages.data(), fill.data(), 2, bounds.data()}).ok());
    CUDA_OK(kvgpu::page_bounds({dv, 0, dpages.as<std::int32_t>(), dfill.as<std::int32_t>(), 2, dbounds.as<float>()}));
    REQUIRE(dbounds.download<float>() == bounds);
    std::vector<std::int32_t> fold(shuffled(rng, g.block_size));
    for (auto& x : fold) x += g.block_size;
    Dev dfold(fold), dfolded(bounds);
    REQUIRE(page_bounds_update_host({hv, 0, fold.data(), g.block_size, bounds.data()}).ok());
    CUDA_OK(kvgpu::page_bounds_update({dv, 0, dfold.as<std::int32_t>(), g.block_size, dfolded.as<float>()}));
    REQUIRE(dfolded.download<float>() == bounds);

    // Ring write: quantized into ring slots, the replaced rows promoted with their entries.
    auto rids = shuffled(rng, pool_slots);
    // At most `tokens`: the source holds that many tokens' rows.
    const std::int64_t rn = std::min<std::int64_t>({pool_slots / 2, 6, tokens});
    std::vector<std::int32_t> ring(rids.begin(), rids.begin() + rn), promote(rids.begin() + rn, rids.begin() + 2 * rn);
    promote[0] = -1;
    Dev dring(ring), dpromote(promote);
    REQUIRE(ring_write_host({hv, src(in.data()), rn, 0, g.num_layers, ring.data(), promote.data(), 0.5f, 1.5f}).ok());
    CUDA_OK(kvgpu::ring_write({dv, src(din.as<std::byte>()), rn, 0, g.num_layers, dring.as<std::int32_t>(),
                               dpromote.as<std::int32_t>(), 0.5f, 1.5f}));
    REQUIRE(dev.download<std::byte>() == host);
  }
}

// f16 inputs that take the conversions' special cases: subnormals and
// signed zeros, then NaNs (quiet and signalling) or infinities. Not both:
// a group holding both computes inf * 0, and a NaN made by arithmetic has
// the x86 default NaN's sign on the host but a GPU's canonical positive
// one. Likewise a NaN gathered into f32 or bf16 keeps its payload on the
// host (the backends agree for f16 out: both write sign | 0x7e00).
static void special_f16(std::mt19937_64& rng, std::vector<std::byte>& in, bool nans) {
  const std::uint16_t specials[] = {0x0001, 0x83ff, 0x0000, 0x8000, 0x7e01, 0x7c01, 0x7c00, 0xfc00};
  auto* h = reinterpret_cast<std::uint16_t*>(in.data());
  for (std::size_t n = in.size() / 2, i = 0; i < n / 97 + 1; ++i) {
    const std::size_t j = rng() % 6;  // the four finite ones, then NaNs (4, 5) or infinities (6, 7)
    h[rng() % n] = specials[nans || j < 4 ? j : j + 2];
  }
}

TEST_CASE("cuda quantized scatter and gather in bulk (several items a thread), from unaligned rows and past a CTA == host") {
  auto rng = fresh_rng();
  const DType floats[] = {DType::f16, DType::bf16, DType::f32};
  for (int trial = 0; trial < 9; ++trial) {
    const int kind = trial % 3;  // 0: aligned bulk, 1: unaligned bulk (generic loop), 2: 40 heads (more than a CTA)
    GeometrySpec g = random_quant_spec(rng);
    g.head_dim = 32 << (rng() % 3);  // whole chunks of 8
    g.format = {random_side(rng, g.dtype, g.head_dim), random_side(rng, g.dtype, g.head_dim)};
    if (kind == 2) g.num_kv_heads = 40, g.head_dim = 128, g.num_layers = 1;
    const Geometry geo = *Geometry::make(g);
    const std::int64_t tokens = kind == 2 ? 100 + std::int64_t(rng() % 50) : 4096 + std::int64_t(rng() % 300);
    const std::int64_t blocks = tokens / g.block_size + 2, pool_slots = blocks * g.block_size;
    TwinPools pools(rng, geo, blocks);
    auto& [host, dev, hv, dv] = pools;
    INFO("trial " << trial << " dtype " << int(g.dtype) << " heads " << g.num_kv_heads << " head_dim " << g.head_dim
                  << " block " << g.block_size << " layers " << g.num_layers);

    // Scatter: every layer's tokens, some skipped; the rows `shift` bytes
    // past a 16-byte boundary for kind 1.
    const DType st = floats[rng() % 3], ot = floats[rng() % 3];
    const std::int64_t e = dtype_bytes(st), head = g.head_dim * e, per_token = 2 * g.num_kv_heads;
    const std::int64_t shift = kind == 1 ? e : 0;
    std::vector<std::byte> in = random_elems(rng, st, g.num_layers * tokens * per_token * g.head_dim + 16);
    if (st == DType::f16) special_f16(rng, in, ot == DType::f16);
    Dev din(in);
    auto slots = shuffled(rng, pool_slots);
    slots.resize(static_cast<std::size_t>(tokens));
    for (auto& s : slots)
      if (rng() % 9 == 0) s = -1;
    Dev dslots(slots);
    auto src = [&](const std::byte* base) {
      base += shift;
      return KvSource{base, base + g.num_kv_heads * head, st, tokens * per_token * head, per_token * head, head};
    };
    const HeldScales held(g);
    scatter_both(hv, dv, src(in.data()), src(din.as<std::byte>()), slots, dslots, tokens, g.num_layers, held, dev, host);

    // Gather: three sequences over shuffled pages, the last one's last page
    // partly read.
    const auto pages = shuffled(rng, blocks);
    const auto third = std::int32_t(blocks / 3);
    std::vector<std::int32_t> indptr{0, third, 2 * third, std::int32_t(blocks)};
    std::vector<std::int32_t> out_indptr{0};
    for (int s = 0; s < 3; ++s)
      out_indptr.push_back(out_indptr.back() + (indptr[std::size_t(s) + 1] - indptr[std::size_t(s)]) * g.block_size + (s == 2 ? -1 : 0));
    const std::int64_t rows = out_indptr.back(), oe = dtype_bytes(ot), orow = g.num_kv_heads * g.head_dim * oe;
    const std::int64_t oshift = kind == 1 ? oe : 0;
    std::vector<std::byte> k(static_cast<std::size_t>(rows * orow + 16), std::byte{0x5a}), v(k);
    gather_both({hv, int(rng() % g.num_layers), indptr.data(), pages.data(), out_indptr.data(), 3, rows, k.data() + oshift,
                 v.data() + oshift, ot, orow, g.head_dim * oe, 0.25f, 2.0f, held.k, held.v},
                dv, held, k, v, oshift);
  }
}

TEST_CASE("cuda seal_blocks and gather of channel-scaled keys == host, bit for bit") {
  auto rng = fresh_rng();
  const DType codes[] = {DType::int2, DType::int4, DType::int8};
  const DType floats[] = {DType::f16, DType::bf16, DType::f32};
  for (int trial = 0; trial < 12; ++trial) {
    GeometrySpec g{.num_layers = 2, .num_kv_heads = 1 + int(rng() % 4), .head_dim = 32 << (rng() % 3),
                   .block_size = 4 << (rng() % 4), .dtype = codes[trial % 3],
                   .layout = rng() % 2 ? Layout::NHD : Layout::HND, .planes = rng() % 2 ? KvPlanes::interleaved : KvPlanes::separate};
    g.format.k = {.scales = Scales::channel, .minimum = rng() % 2 == 0};
    g.format.v = rng() % 2 ? SideFormat{.scales = Scales::channel, .minimum = true} : random_side(rng, g.dtype, g.head_dim);
    if (g.format.v.scales == Scales::tensor || g.format.v.scales == Scales::head) g.format.v = {.scales = Scales::group, .group = 16};
    const Geometry geo = *Geometry::make(g);
    TwinPools pools(rng, geo, 9);
    auto& [host, dev, hv, dv] = pools;
    INFO("trial " << trial << " dtype " << int(g.dtype) << " heads " << g.num_kv_heads << " head_dim " << g.head_dim
                  << " block " << g.block_size << " v scales " << int(g.format.v.scales));
    // Seal blocks 7, 2 and 4 of layer 1 from random inputs.
    const DType st = floats[rng() % 3];
    const std::int64_t e = dtype_bytes(st), head = g.head_dim * e, per_token = 2 * g.num_kv_heads, tokens = 3 * g.block_size;
    std::vector<std::byte> in = random_elems(rng, st, tokens * per_token * g.head_dim);
    Dev din(in);
    const std::vector<std::int32_t> sealed{7, 2, 4};
    Dev dsealed(sealed);
    auto src = [&](const std::byte* base) {
      return KvSource{base, base + g.num_kv_heads * head, st, 0, per_token * head, head};
    };
    REQUIRE(seal_blocks_host({hv, src(in.data()), sealed.data(), 3, 1, 1, 0.5f, 1.5f}).ok());
    CUDA_OK(kvgpu::seal_blocks({dv, src(din.as<std::byte>()), dsealed.as<std::int32_t>(), 3, 1, 1, 0.5f, 1.5f}));
    REQUIRE(dev.download<std::byte>() == host);
    // Gather them back as one sequence, the last page partly read.
    const DType ot = floats[rng() % 3];
    const std::vector<std::int32_t> indptr{0, 3}, out_indptr{0, std::int32_t(tokens - 1)};
    const std::int64_t rows = tokens - 1, oe = dtype_bytes(ot), orow = g.num_kv_heads * g.head_dim * oe;
    std::vector<std::byte> k(static_cast<std::size_t>(rows * orow), std::byte{0x5a}), v(k);
    const HeldScales held(g);
    gather_both({hv, 1, indptr.data(), sealed.data(), out_indptr.data(), 1, rows, k.data(), v.data(), ot, orow, g.head_dim * oe,
                 0.25f, 2.0f, held.k, held.v},
                dv, held, k, v, 0);
  }
}
