// Every CUDA kernel against the host backend on the same fresh random inputs:
// outputs must be bit-identical. Without a GPU the binary exits 77 (skipped).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdio>

#include "../gate_testing.hpp"
#include "cuda_testing.hpp"
#include <kvcache/eviction/compaction_plan.hpp>
#include <kvcache/kernels/detail/group_view.hpp>

#include "launchers.hpp"

using namespace kvcache;
using namespace kvtest;

TEST_CASE("cuda scatter == host scatter (slot mapping and CSR, all layouts, dtypes, multi-layer)") {
  auto rng = fresh_rng();
  for (int trial = 0; trial < 40; ++trial) {
    const GeometrySpec g = random_spec(rng);
    const std::int64_t blocks = 3 + std::int64_t(rng() % 8), tokens = std::min<std::int64_t>(blocks * g.block_size, 1 + std::int64_t(rng() % 70));
    Twin pool(rng, g, blocks);
    const DType in_dtype = g.dtype == DType::fp8_e4m3 ? DType::bf16 : g.dtype;
    const int layers = g.num_layers;
    const std::int64_t e = dtype_bytes(in_dtype), head = g.head_dim * e, per_token = 3 * g.num_kv_heads;
    std::vector<std::byte> in = random_elems(rng, in_dtype, layers * tokens * per_token * g.head_dim);
    Dev din(in);
    auto slots = shuffled(rng, blocks * g.block_size);
    slots.resize(static_cast<std::size_t>(tokens));
    for (auto& s : slots)
      if (rng() % 6 == 0) s = -1;
    Dev dslots(slots);
    auto src = [&](const std::byte* base) {
      return KvSource{base + g.num_kv_heads * head, base + 2 * g.num_kv_heads * head, in_dtype,
                      tokens * per_token * head, per_token * head, head};
    };
    ScatterParams hp{pool.host.view, src(in.data()), TokenAddress{slots.data()}, tokens, 0, layers, 0.5f, 1.5f};
    ScatterParams dp{pool.dview, src(din.as<std::byte>()), TokenAddress{dslots.as<std::int32_t>()}, tokens, 0, layers, 0.5f, 1.5f};
    REQUIRE(scatter_host(hp).ok());
    CUDA_OK(kvgpu::scatter(dp));
    pool.require_same();
    // CSR addressing through an identity page table of one sequence.
    std::vector<std::int32_t> indptr{0, std::int32_t(blocks)}, indices(shuffled(rng, blocks)), seq(slots.size(), 0), pos(slots);
    Dev dindptr(indptr), dindices(indices), dseq(seq), dpos(pos);
    hp.addr = TokenAddress{nullptr, seq.data(), pos.data(), indptr.data(), indices.data(), 1};
    dp.addr = TokenAddress{nullptr, dseq.as<std::int32_t>(), dpos.as<std::int32_t>(), dindptr.as<std::int32_t>(),
                           dindices.as<std::int32_t>(), 1};
    REQUIRE(scatter_host(hp).ok());
    CUDA_OK(kvgpu::scatter(dp));
    pool.require_same();
  }
}

TEST_CASE("cuda gather == host gather, ragged") {
  auto rng = fresh_rng();
  for (int trial = 0; trial < 30; ++trial) {
    const GeometrySpec g = random_spec(rng);
    const int nseq = 1 + int(rng() % 5), per_seq = 4;
    const std::int64_t blocks = nseq * per_seq + 1;
    Twin pool(rng, g, blocks);
    std::vector<std::int32_t> indptr{0}, indices, out_indptr{0};
    auto ids = shuffled(rng, blocks);
    for (int s = 0; s < nseq; ++s) {
      const int pages = int(rng() % (per_seq + 1));
      for (int i = 0; i < pages; ++i) indices.push_back(ids[indices.size()]);
      indptr.push_back(std::int32_t(indices.size()));
      out_indptr.push_back(out_indptr.back() + (pages ? int(rng() % (pages * g.block_size)) + 1 : 0));
    }
    const std::int64_t rows = out_indptr.back();
    const DType out_dtype = g.dtype == DType::fp8_e4m3 ? DType::f32 : g.dtype;
    const std::int64_t row_bytes = g.num_kv_heads * g.head_dim * dtype_bytes(out_dtype);
    std::vector<std::byte> k(static_cast<std::size_t>(rows * row_bytes + 64), std::byte{0x5a}), v(k);
    Dev dk(k), dv(v), dindptr(indptr), dindices(indices), dout(out_indptr);
    GatherParams hp{pool.host.view, int(rng() % g.num_layers), indptr.data(), indices.data(), out_indptr.data(), nseq, rows,
                    k.data(), v.data(), out_dtype, row_bytes, g.head_dim * dtype_bytes(out_dtype), 0.25f, 2.0f};
    GatherParams dp = hp;
    dp.cache = pool.dview;
    dp.indptr = dindptr.as<std::int32_t>();
    dp.indices = dindices.as<std::int32_t>();
    dp.out_indptr = dout.as<std::int32_t>();
    dp.k_out = dk.p;
    dp.v_out = dv.p;
    REQUIRE(gather_host(hp).ok());
    CUDA_OK(kvgpu::gather(dp));
    REQUIRE(dk.download<std::byte>() == k);
    REQUIRE(dv.download<std::byte>() == v);
  }
}

TEST_CASE("cuda block copy == host, and the device <-> pinned host swap") {
  auto rng = fresh_rng();
  for (int trial = 0; trial < 20; ++trial) {
    const GeometrySpec g = random_spec(rng);
    const std::int64_t blocks = 10;
    Twin pool(rng, g, blocks);
    auto ids = shuffled(rng, blocks);
    std::vector<BlockCopy> pairs;
    for (int i = 0; i < 4; ++i) pairs.push_back({ids[std::size_t(i)], ids[std::size_t(i + 4)]});
    Dev dpairs(pairs);
    REQUIRE(block_copy_host({pool.host.view, pool.host.view, pairs.data(), 4}).ok());
    CUDA_OK(kvgpu::block_copy({pool.dview, pool.dview, dpairs.as<BlockCopy>(), 4}));
    pool.require_same();
    // Layer by layer (an onboard that lets attention of layer i start early): one range a launch.
    std::vector<BlockCopy> late{{ids[5], ids[6]}};
    Dev dlate(late);
    for (std::int32_t l = 0; l < g.num_layers; ++l) {
      REQUIRE(block_copy_host({pool.host.view, pool.host.view, late.data(), 1, l, 1}).ok());
      CUDA_OK(kvgpu::block_copy({pool.dview, pool.dview, dlate.as<BlockCopy>(), 1, l, 1}));
    }
    pool.require_same();

    // Swap out to pinned, mapped host memory and back in, one launch each way.
    void* pinned = nullptr;
    CUDA_OK(cudaHostAlloc(&pinned, pool.host.bytes.size(), cudaHostAllocMapped));
    std::memset(pinned, 0x11, pool.host.bytes.size());
    void* pinned_dev = nullptr;
    CUDA_OK(cudaHostGetDevicePointer(&pinned_dev, pinned, 0));
    PoolView host_tier = pool.dview;
    host_tier.base = pinned_dev;
    std::vector<BlockCopy> out{{ids[0], 1}, {ids[1], 2}}, back{{1, ids[8]}, {2, ids[9]}};
    Dev dout(out), dback(back);
    CUDA_OK(kvgpu::block_copy({pool.dview, host_tier, dout.as<BlockCopy>(), 2}));
    CUDA_OK(kvgpu::block_copy({host_tier, pool.dview, dback.as<BlockCopy>(), 2}));
    CUDA_OK(cudaDeviceSynchronize());
    PoolView pinned_view = pool.host.view;
    pinned_view.base = pinned;
    std::vector<BlockCopy> href{{ids[0], ids[8]}, {ids[1], ids[9]}};
    REQUIRE(block_copy_host({pool.host.view, pool.host.view, href.data(), 2}).ok());
    pool.require_same();
    REQUIRE(std::memcmp(pinned_view.row(1, 0, 0, 0, 0), pool.host.view.row(ids[0], 0, 0, 0, 0),
                        std::size_t(g.block_size * g.num_kv_heads * g.head_dim * dtype_bytes(g.dtype))) == 0);
    CUDA_OK(cudaFreeHost(pinned));
  }
}

TEST_CASE("cuda ring write with promotion and compaction == host") {
  auto rng = fresh_rng();
  for (int trial = 0; trial < 30; ++trial) {
    const GeometrySpec g = random_spec(rng);
    const std::int64_t blocks = 6, slots_total = blocks * g.block_size;
    Twin pool(rng, g, blocks);
    auto ids = shuffled(rng, slots_total);
    const std::int64_t tokens = std::max<std::int64_t>(1, std::min<std::int64_t>(slots_total / 2, 20));
    std::vector<std::int32_t> ring(ids.begin(), ids.begin() + tokens), promote(static_cast<std::size_t>(tokens), -1);
    for (std::int64_t t = 0; t < tokens; ++t)
      if (rng() % 2) promote[std::size_t(t)] = ids[std::size_t(tokens + t)];
    const DType in_dtype = rng() % 2 ? DType::f32 : g.dtype;
    const std::int64_t row = g.head_dim * dtype_bytes(in_dtype);
    std::vector<std::byte> in = random_elems(rng, in_dtype, 2 * tokens * g.num_layers * g.num_kv_heads * g.head_dim);
    Dev din(in), dring(ring), dpromote(promote);
    const std::int64_t half = std::int64_t(in.size()) / 2;
    auto src = [&](const std::byte* b) {
      return KvSource{b, b + half, in_dtype, tokens * g.num_kv_heads * row, g.num_kv_heads * row, row};
    };
    REQUIRE(ring_write_host({pool.host.view, src(in.data()), tokens, 0, g.num_layers, ring.data(), promote.data()}).ok());
    CUDA_OK(kvgpu::ring_write({pool.dview, src(din.as<std::byte>()), tokens, 0, g.num_layers, dring.as<std::int32_t>(),
                               dpromote.as<std::int32_t>()}));
    pool.require_same();

    std::vector<BlockId> row_blocks(shuffled(rng, blocks));
    const std::int32_t length = std::int32_t(slots_total);
    std::vector<std::int32_t> keep;
    for (std::int32_t p = 0; p < length; ++p)
      if (rng() % 3 == 0) keep.push_back(p);
    std::vector<SlotMove> moves(keep.size());
    std::vector<std::int32_t> order(keep.size());
    auto n = plan_compaction(keep, length, row_blocks, g.block_size, moves, order);
    REQUIRE(n.ok());
    Dev dmoves(moves);
    // A head range, as token policies that choose per kv-head launch it (0 heads = every head).
    const auto first_head = std::int32_t(rng() % std::uint64_t(g.num_kv_heads));
    const auto num_heads = std::int32_t(rng() % std::uint64_t(g.num_kv_heads - first_head + 1));
    REQUIRE(compaction_host({pool.host.view, moves.data(), *n, 0, g.num_layers, first_head, num_heads}).ok());
    CUDA_OK(kvgpu::compaction({pool.dview, dmoves.as<SlotMove>(), *n, 0, g.num_layers, first_head, num_heads}));
    pool.require_same();
  }
}

TEST_CASE("cuda rope, page bounds, scores and top-k == host") {
  auto rng = fresh_rng();
  for (int trial = 0; trial < 20; ++trial) {
    GeometrySpec g = random_spec(rng);
    Twin pool(rng, g, 6);
    const std::int32_t max_delta = 40, half = g.head_dim / 2;
    std::vector<float> cs((max_delta + 1) * half), sn(cs.size());
    REQUIRE(make_rope_table(500000.0, g.head_dim, max_delta, cs, sn).ok());
    std::vector<std::int32_t> blocks{0, 3, 5}, deltas{7, -40, 16};
    Dev dcs(cs), dsn(sn), dblocks(blocks), ddeltas(deltas);
    const RopeStyle style = trial % 2 ? RopeStyle::neox : RopeStyle::gptj;
    REQUIRE(rope_host({pool.host.view, 0, g.num_layers, blocks.data(), deltas.data(), 3, cs.data(), sn.data(), max_delta, 0, style}).ok());
    CUDA_OK(kvgpu::rope({pool.dview, 0, g.num_layers, dblocks.as<std::int32_t>(), ddeltas.as<std::int32_t>(), 3,
                         dcs.as<float>(), dsn.as<float>(), max_delta, 0, style}));
    pool.require_same();

    std::vector<std::int32_t> pages{5, 2}, fill{g.block_size, int(rng() % (g.block_size + 1))};
    std::vector<float> bounds(std::size_t(6 * g.num_kv_heads * 2 * g.head_dim), 9.0f);
    Dev dpages(pages), dfill(fill), dbounds(bounds);
    REQUIRE(page_bounds_host({pool.host.view, 0, pages.data(), fill.data(), 2, bounds.data()}).ok());
    CUDA_OK(kvgpu::page_bounds({pool.dview, 0, dpages.as<std::int32_t>(), dfill.as<std::int32_t>(), 2, dbounds.as<float>()}));
    REQUIRE(dbounds.download<float>() == bounds);
  }
  for (int trial = 0; trial < 20; ++trial) {
    const int S = 1 + int(rng() % 5), H = 1 + int(rng() % 4), Q = 1 + int(rng() % 3), K = 1 + int(rng() % 3000);
    std::vector<float> attn(std::size_t(S * H * Q * K)), scores(std::size_t(S * K), 0.0f);
    for (auto& a : attn) a = float(rng() % 16) / 8.0f;  // coarse values: many ties
    std::vector<std::int32_t> lens(static_cast<std::size_t>(S));
    for (auto& l : lens) l = int(rng() % (K + 1));
    Dev dattn(attn), dlens(lens), dscores(scores);
    const ScoreReduce red = trial % 2 ? ScoreReduce::sum : ScoreReduce::mean_over_heads;
    REQUIRE(scores_host({attn.data(), lens.data(), scores.data(), S, H, Q, K, red}).ok());
    CUDA_OK(kvgpu::scores({dattn.as<float>(), dlens.as<std::int32_t>(), dscores.as<float>(), S, H, Q, K, red}));
    REQUIRE(dscores.download<float>() == scores);
    const int k = int(rng() % (K + 1));
    const bool lowest = rng() % 2;
    std::vector<std::int32_t> out(static_cast<std::size_t>(S * k) + 1, 7);
    REQUIRE(select_host(scores.data(), lens.data(), S, K, k, lowest, out.data()).ok());
    std::size_t bytes = 0;
    CUDA_OK(kvgpu::select_scratch_bytes(S, K, &bytes));
    std::vector<std::byte> scratch_host(bytes);
    Dev scratch(scratch_host), dout(std::vector<std::int32_t>(out.size(), 7));
    CUDA_OK(kvgpu::select(dscores.as<float>(), dlens.as<std::int32_t>(), S, K, k, lowest, dout.as<std::int32_t>(),
                          scratch.p, bytes));
    REQUIRE(dout.download<std::int32_t>() == out);
  }
}

TEST_CASE("cuda page bounds update == host (appends of many tokens per page in one launch, fp8 zeros of both signs)") {
  auto rng = fresh_rng();
  for (int trial = 0; trial < 20; ++trial) {
    GeometrySpec g = random_spec(rng);
    Twin pool(rng, g, 8);
    const int layer = int(rng() % g.num_layers);
    std::vector<std::int32_t> slots;
    for (std::int32_t s = 0; s < 8 * g.block_size; ++s)
      if (rng() % 3 != 0) slots.push_back(s);
    std::shuffle(slots.begin(), slots.end(), rng);  // any order: max and min are exact
    slots.push_back(-1);
    std::vector<float> bounds(std::size_t(8 * g.num_kv_heads * 2 * g.head_dim), 3.0f);
    Dev dslots(slots), dbounds(bounds);
    PageBoundsUpdateParams p{pool.host.view, layer, slots.data(), std::int64_t(slots.size()), bounds.data()};
    p.first_slot_starts_page = trial % 2 == 0;
    REQUIRE(page_bounds_update_host(p).ok());
    p.cache = pool.dview;
    p.slots = dslots.as<std::int32_t>();
    p.bounds = dbounds.as<float>();
    CUDA_OK(kvgpu::page_bounds_update(p));
    REQUIRE(dbounds.download<float>() == bounds);
  }
}

TEST_CASE("cuda page selection == host page selection (GQA, forced pages, ties, rows within the budget)") {
  auto rng = fresh_rng();
  for (int trial = 0; trial < 40; ++trial) {
    const std::int32_t S = 1 + std::int32_t(rng() % 6), H = 1 + std::int32_t(rng() % 4), D = 8 << (rng() % 4),
                       G = 1 + std::int32_t(rng() % 4), blocks = 40;
    const std::int32_t first = std::int32_t(rng() % 3), last = std::int32_t(rng() % 3);
    const std::int32_t budget = std::max(1, first + last) + std::int32_t(rng() % 40);
    std::vector<std::int32_t> indptr{0}, indices;
    for (std::int32_t s = 0; s < S; ++s) {
      const auto n = std::int32_t(rng() % 300);
      for (std::int32_t j = 0; j < n; ++j) indices.push_back(std::int32_t(rng() % blocks));  // repeats: equal bounds
      indptr.push_back(std::int32_t(indices.size()));
    }
    std::vector<float> bounds(std::size_t(blocks * H * 2 * D)), queries(std::size_t(S * H * G * D));
    for (auto& b : bounds) b = float(std::int32_t(rng() % 17) - 8) / 4.0f;  // coarse: ties between blocks too
    for (auto& q : queries) q = float(std::int32_t(rng() % 9) - 4) / 2.0f;
    std::vector<std::int32_t> out_indptr(std::size_t(S * H + 1));
    REQUIRE(page_select_indptr(indptr.data(), S, H, budget, out_indptr.data(), out_indptr.size()).ok());
    std::vector<std::int32_t> out(std::size_t(out_indptr.back()) + 1, -7);
    std::vector<std::byte> host_scratch(page_select_scratch_bytes(300, H));
    const auto params = [&](const float* b, const float* q, const std::int32_t* ip, const std::int32_t* ix, const std::int32_t* oip,
                            std::int32_t* o, void* scratch, std::size_t bytes) {
      return PageSelectParams{b, blocks, H, D, q, G, ip, ix, S, indptr.back(), budget, first, last, oip, o, scratch, bytes};
    };
    REQUIRE(page_select_host(params(bounds.data(), queries.data(), indptr.data(), indices.data(), out_indptr.data(), out.data(),
                                    host_scratch.data(), host_scratch.size())).ok());
    std::size_t bytes = 0;
    CUDA_OK(kvgpu::page_select_scratch_bytes(indptr.back(), S, H, &bytes));
    Dev dbounds(bounds), dq(queries), dindptr(indptr), dindices(indices.empty() ? std::vector<std::int32_t>(1) : indices),
        dout_indptr(out_indptr), dout(std::vector<std::int32_t>(out.size(), -7)), scratch(std::vector<std::byte>(bytes + 1));
    CUDA_OK(kvgpu::page_select(params(dbounds.as<float>(), dq.as<float>(), dindptr.as<std::int32_t>(), dindices.as<std::int32_t>(),
                                      dout_indptr.as<std::int32_t>(), dout.as<std::int32_t>(), scratch.p, bytes)));
    REQUIRE(dout.download<std::int32_t>() == out);
  }
}

TEST_CASE("cuda scatter and gather reach a block past 4 GiB (64-bit offsets)") {
  const GeometrySpec g{.num_layers = 1, .num_kv_heads = 8, .head_dim = 128, .block_size = 16};
  auto geo = *Geometry::make(g);
  const std::int64_t blocks = (std::int64_t{5} << 30) / geo.block_bytes() + 1;  // > 5 GiB
  void* base = nullptr;
  if (cudaMalloc(&base, std::size_t(*geo.pool_bytes(blocks))) != cudaSuccess) {
    cudaGetLastError();
    WARN("not enough device memory for the 5 GiB pool; case skipped");
    return;
  }
  // The gather below reads all 16 tokens of the last block, one written: the
  // rest must be defined (compute-sanitizer's initcheck reads the test too).
  REQUIRE(cudaMemset(base, 0, std::size_t(*geo.pool_bytes(blocks))) == cudaSuccess);
  const PoolView view = *make_pool_view(geo, base, blocks);
  std::mt19937_64 rng(3);
  const std::int64_t row = 8 * 128 * 2;
  std::vector<std::byte> in = random_elems(rng, DType::f16, 2 * 8 * 128), out(in.size(), std::byte{0});
  std::vector<std::int32_t> slots{std::int32_t((blocks - 1) * 16 + 15)}, indptr{0, 1}, indices{std::int32_t(blocks - 1)},
      out_indptr{0, 16};
  Dev din(in), dslots(slots), dindptr(indptr), dindices(indices), dout_indptr(out_indptr);
  std::vector<std::byte> dense(16 * row * 2);
  Dev dk(dense), dv(dense);
  CUDA_OK(kvgpu::scatter({view, KvSource{din.p, din.as<std::byte>() + row, DType::f16, 0, row, 256},
                          TokenAddress{dslots.as<std::int32_t>()}, 1}));
  CUDA_OK(kvgpu::gather({view, 0, dindptr.as<std::int32_t>(), dindices.as<std::int32_t>(), dout_indptr.as<std::int32_t>(), 1,
                         16, dk.p, dv.p, DType::f16, row, 256}));
  const auto k = dk.download<std::byte>(), v = dv.download<std::byte>();
  REQUIRE(std::memcmp(k.data() + 15 * row, in.data(), std::size_t(row)) == 0);
  REQUIRE(std::memcmp(v.data() + 15 * row, in.data() + row, std::size_t(row)) == 0);
  cudaFree(base);
}

TEST_CASE("cuda write gate == host write gate, bit for bit (f32, f16, bf16 keys; GELU and SiLU)") {
  auto rng = fresh_rng();
  const DType types[] = {DType::f32, DType::f16, DType::bf16};
  const std::int32_t dims[] = {16, 32, 64, 128};
  for (int trial = 0; trial < 9; ++trial) {
    const DType t = types[trial % 3];
    const std::int32_t hd = dims[rng() % 4], heads = 1 + std::int32_t(rng() % 8), tokens = 1 + std::int32_t(rng() % 300);
    const std::int32_t hidden = trial % 2 ? 4 * hd : 1 + std::int32_t(rng() % 100);
    CAPTURE(trial, t, hd, heads, tokens, hidden);
    GateWeights gw(rng, heads, hd, hidden);
    const auto act = trial == 8 ? GateActivation::silu : GateActivation::gelu;
    const std::int64_t e = dtype_bytes(t), n = std::int64_t{tokens} * heads * hd;
    const auto pre = random_elems(rng, t, n), post = random_elems(rng, t, n);
    std::vector<float> host(std::size_t(tokens * heads), -1.0f);
    WriteGateParams p{gw.view(act), pre.data(), post.data(), t, heads * hd * e, hd * e, tokens, host.data()};
    REQUIRE(write_gate_host(p).ok());
    Dev dpre(pre), dpost(post), dnp(gw.norm_pre), dnq(gw.norm_post), dw1(gw.w1), db1(gw.b1), dw2(gw.w2), db2(gw.b2),
        dgates(std::vector<float>(host.size(), -1.0f));
    WriteGateParams d = p;
    d.w.norm_pre = dnp.as<float>();
    d.w.norm_post = dnq.as<float>();
    d.w.w1 = dw1.as<float>();
    d.w.b1 = db1.as<float>();
    d.w.w2 = dw2.as<float>();
    d.w.b2 = db2.as<float>();
    d.k_pre = dpre.p;
    d.k_post = dpost.p;
    d.gates = dgates.as<float>();
    CUDA_OK(kvgpu::write_gate(d));
    const auto dev = dgates.download<float>();
    REQUIRE(std::memcmp(dev.data(), host.data(), host.size() * sizeof(float)) == 0);
  }
}

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("test_kernels_cuda: no CUDA device; skipped\n");
    return 77;
  }
  return Catch::Session().run(argc, argv);
}

TEST_CASE("cuda ring admission == host ring admission, state and pool bit for bit") {
  auto rng = fresh_rng();
  for (int trial = 0; trial < 24; ++trial) {
    GeometrySpec g = random_spec(rng);
    g.num_layers = 1, g.num_kv_heads = 1;  // single-head blocks
    const std::int32_t B = g.block_size, W = B * (1 + std::int32_t(rng() % 3)), cap = std::int32_t(rng() % 40);
    const std::int32_t H = 1 + std::int32_t(rng() % 4), n = 1 + std::int32_t(rng() % std::uint64_t(3 * W));
    const std::int32_t stride = (W + cap + B - 1) / B;
    const std::int64_t blocks = std::int64_t{H} * stride + 1;
    Twin pool(rng, g, blocks);
    std::vector<std::int32_t> rows(static_cast<std::size_t>(H * stride));
    const auto ids = shuffled(rng, blocks - 1);
    for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = ids[i] + 1;  // distinct blocks, never the null one
    std::vector<std::int32_t> start(static_cast<std::size_t>(H)), len(start.size()), gl(start.size());
    std::vector<std::uint8_t> bits(static_cast<std::size_t>(H * W));
    for (std::int32_t h = 0; h < H; ++h) {
      len[std::size_t(h)] = rng() % 2 ? W : std::int32_t(rng() % std::uint64_t(W));
      start[std::size_t(h)] = len[std::size_t(h)] == W ? std::int32_t(rng() % std::uint64_t(W)) : 0;
      gl[std::size_t(h)] = len[std::size_t(h)] == W ? std::int32_t(rng() % std::uint64_t(cap + 1)) : 0;
    }
    for (auto& b : bits) b = std::uint8_t(rng() % 2);
    std::vector<float> gates(static_cast<std::size_t>(n * H));
    for (auto& x : gates) x = float(rng() % 1000) / 1000.0f;
    const DType in_dtype = rng() % 2 ? DType::f32 : g.dtype;
    const std::int64_t row = g.head_dim * dtype_bytes(in_dtype);
    std::vector<std::byte> in = random_elems(rng, in_dtype, 2 * std::int64_t{n} * H * g.head_dim);
    const std::int64_t half = std::int64_t(in.size()) / 2;
    Dev din(in), dgates(gates), dstart(start), dlen(len), dgl(gl), dbits(bits), drows(rows);
    auto params = [&](const PoolView& v, const std::byte* k, const float* gt, const std::int32_t* st, const std::int32_t* ln,
                      std::int32_t* glen, std::uint8_t* bt, const std::int32_t* rw) {
      return RingAdmitParams{v, KvSource{k, k + half, in_dtype, 0, row, 0}, gt, n, H, W, cap, 0.5f, st, ln, glen, bt, rw, stride};
    };
    REQUIRE(ring_admit_host(params(pool.host.view, in.data(), gates.data(), start.data(), len.data(), gl.data(), bits.data(),
                                   rows.data())).ok());
    CUDA_OK(kvgpu::ring_admit(params(pool.dview, din.as<std::byte>(), dgates.as<float>(), dstart.as<std::int32_t>(),
                                     dlen.as<std::int32_t>(), dgl.as<std::int32_t>(), dbits.as<std::uint8_t>(),
                                     drows.as<std::int32_t>())));
    pool.require_same();
    REQUIRE(dgl.download<std::int32_t>() == gl);
    REQUIRE(dbits.download<std::uint8_t>() == bits);
  }
}

TEST_CASE("cuda scatter, gather, block copy and compaction on hybrid group views (K-only MLA, asymmetric K/V) == host") {
  auto rng = fresh_rng();
  // Group 0: 2 layers, 4 heads, K 64 / V 32, f16. Group 1: MLA, 3 layers, a 576-value latent, bf16.
  const std::vector<std::int32_t> l0{0, 1}, l1{2, 3, 4};
  const LayerGroupSpec specs[] = {
      {.kind = AttentionKind::full, .layers = l0, .num_kv_heads = 4, .head_dim = 64, .v_head_dim = 32, .dtype = DType::f16},
      {.kind = AttentionKind::mla, .layers = l1, .num_kv_heads = 1, .head_dim = 576, .dtype = DType::bf16}};
  const auto lg = *LayerGroups::make({.groups = specs, .block_size = 16, .max_padding_permille = 999});
  constexpr std::int64_t pages = 12;
  auto host = random_elems(rng, DType::f16, pages * lg.page_bytes() / 2);
  Dev dev(host);
  struct Case {
    std::int32_t g;
    GroupPlanes planes;
    std::int32_t dim;
  };
  for (const Case c : {Case{0, GroupPlanes::k, 64}, Case{0, GroupPlanes::v, 32}, Case{1, GroupPlanes::k, 576}}) {
    const PoolView hv = *make_group_view(lg, c.g, host.data(), pages, c.planes);
    const PoolView dv = *make_group_view(lg, c.g, dev.p, pages, c.planes);
    const std::int32_t B = hv.block_size, H = hv.num_kv_heads, L = hv.num_layers;
    // Group 0 owns pages 1 .. 5, group 1 pages 6 .. 11: 20 tokens at shuffled slots of its pages.
    const std::int32_t first = c.g == 0 ? 1 : 6, owned = c.g == 0 ? 5 : 6;
    auto order = shuffled(rng, std::int64_t{owned} * B);
    std::vector<std::int32_t> slots;
    for (std::int32_t t = 0; t < 20; ++t) slots.push_back(first * B + order[std::size_t(t)]);
    const auto src = random_elems(rng, DType::f32, std::int64_t{L} * 20 * H * c.dim);
    Dev dsrc(src), dslots(slots);
    const std::int64_t tok = std::int64_t{H} * c.dim * 4;
    ScatterParams sp{.cache = hv, .src = {src.data(), nullptr, DType::f32, tok * 20, tok, std::int64_t{c.dim} * 4},
                     .addr = {slots.data()}, .num_tokens = 20, .num_layers = L};
    REQUIRE(scatter_host(sp).ok());
    sp.cache = dv, sp.src.k = dsrc.p, sp.addr.slots = dslots.as<std::int32_t>();
    CUDA_OK(kvgpu::scatter(sp));
    REQUIRE(dev.download<std::byte>() == host);
    // Gather the owned pages of the last layer.
    std::vector<std::int32_t> indptr{0, owned}, indices(static_cast<std::size_t>(owned)), out_indptr{0, owned * B};
    std::iota(indices.begin(), indices.end(), first);
    std::vector<std::byte> out(std::size_t(owned * B * H * c.dim) * 4);  // bytes: the pool's random bits may be NaN
    Dev dindptr(indptr), dindices(indices), dout_indptr(out_indptr), dout(out);
    GatherParams gp{.cache = hv, .layer = L - 1, .indptr = indptr.data(), .indices = indices.data(), .out_indptr = out_indptr.data(),
                    .num_seqs = 1, .num_rows = owned * B, .k_out = out.data(), .out_dtype = DType::f32, .token_stride = tok,
                    .head_stride = std::int64_t{c.dim} * 4};
    REQUIRE(gather_host(gp).ok());
    gp.cache = dv, gp.indptr = dindptr.as<std::int32_t>(), gp.indices = dindices.as<std::int32_t>();
    gp.out_indptr = dout_indptr.as<std::int32_t>(), gp.k_out = dout.p;
    CUDA_OK(kvgpu::gather(gp));
    REQUIRE(dout.download<std::byte>() == out);
    // Copy a page, then move slots.
    const std::vector<BlockCopy> pairs{{first, first + 1}};
    const std::vector<SlotMove> moves{{.src = slots[0], .dst = slots[1]}, {.src = slots[2], .dst = slots[3]}};
    Dev dpairs(pairs), dmoves(moves);
    REQUIRE(block_copy_host({hv, hv, pairs.data(), 1}).ok());
    CUDA_OK(kvgpu::block_copy({dv, dv, dpairs.as<BlockCopy>(), 1}));
    REQUIRE(compaction_host({.cache = hv, .moves = moves.data(), .num_moves = 2, .num_layers = L}).ok());
    CUDA_OK(kvgpu::compaction({.cache = dv, .moves = dmoves.as<SlotMove>(), .num_moves = 2, .num_layers = L}));
    REQUIRE(dev.download<std::byte>() == host);
  }
}
