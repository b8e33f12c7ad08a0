// MLA (one latent vector per token, no V) in the single-geometry caches:
// GeometrySpec::v_head_dim 0 gives one plane per layer, the pool views
// carry it, and the policies run on such a pool as on any other: Quest with
// H2O, block scores and a sliding window keep exact page bounds over the
// latent after every compaction and rotation (quest_cache_property), and
// Write-Gated KV's head rows read back, through the head-folded export and
// gather, exactly the latents of the positions each row holds.
#include <catch2/catch.hpp>

#include <kvcache/admission/write_gate.hpp>
#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/gather.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kvcache.hpp>

#include <random>
#include <vector>

#include "quest_testing.hpp"

using namespace kvcache;

namespace {
std::mt19937_64 fresh_rng() { return std::mt19937_64(Catch::rngSeed() ^ std::random_device{}()); }
}  // namespace

TEST_CASE("an MLA geometry: one plane per layer, half the bytes, views that say so") {
  const GeometrySpec kv_spec{.num_layers = 61, .num_kv_heads = 1, .head_dim = 576, .block_size = 64, .dtype = DType::bf16};
  GeometrySpec mla_spec = kv_spec;
  mla_spec.v_head_dim = 0;
  const auto both = *Geometry::make(kv_spec), mla = *Geometry::make(mla_spec);
  CHECK(mla.kv_planes() == 1);
  CHECK(both.kv_planes() == 2);
  CHECK(mla.block_bytes() == 61LL * 64 * 576 * 2);
  CHECK(both.block_bytes() == 2 * mla.block_bytes());
  CHECK_FALSE(mla == both);
  CHECK(mla.strides(8)->layer == mla.plane_bytes());
  mla_spec.planes = KvPlanes::separate;  // vLLM registers one region per layer for MLA
  CHECK(Geometry::make(mla_spec)->strides(8)->layer == 8 * mla.plane_bytes());
  std::vector<std::byte> memory(std::size_t(*mla.pool_bytes(2)));
  CHECK(make_pool_view(mla, memory.data(), 2)->kv_planes == 1);
  // DeepSeek V3 described as layer groups (one MLA group) compiles to this geometry: Cache<> and its policies run it.
  std::vector<std::int32_t> layers(61);
  for (std::int32_t l = 0; l < 61; ++l) layers[std::size_t(l)] = l;
  const LayerGroupSpec deepseek[] = {
      {.kind = AttentionKind::mla, .layers = layers, .num_kv_heads = 1, .head_dim = 576, .dtype = DType::bf16}};
  CHECK(*LayerGroups::make({.groups = deepseek, .block_size = 64})->as_geometry() == mla);
  GeometrySpec bad = kv_spec;
  bad.v_head_dim = 512;
  CHECK(Geometry::make(bad).status() ==
        Status{Errc::invalid_argument, "v_head_dim (head_dim, or 0 for no V; other dims: layer groups)", 512, 576});
}

TEST_CASE("Quest with H2O, block scores and a sliding window on an MLA pool keeps exact bounds over the latent") {
  auto rng = fresh_rng();
  for (int run = 0; run < 4; ++run) {
    kvtest::quest_cache_property(rng, H2OEviction({.heavy = 6, .recent = 6, .groups = 1}), run % 2 == 1, 60, DType::f32, true);
    kvtest::quest_cache_property(rng, BlockScoreEviction({.start = 4, .recent = 8, .max = 24}), false, 60, DType::f32, true);
    kvtest::quest_cache_property(rng, SlidingWindow(12 + std::int32_t(rng() % 12)), false, 60, DType::bf16, true);
  }
}

TEST_CASE("Write-Gated KV on an MLA pool: every head row reads back the latents of the positions it holds") {
  auto rng = fresh_rng();
  constexpr std::int32_t L = 2, H = 1, W = 8, B = 4, D = 6, kBlocks = 64;
  const auto geometry = *Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = D, .block_size = B,
                                         .dtype = DType::f32, .v_head_dim = 0});
  GatedCache<WriteGate> cache({.geometry = geometry, .num_blocks = kBlocks, .max_sequences = 2,
                                                .max_blocks_per_sequence = 16},
                                               WriteGateConfig{.num_layers = L, .num_kv_heads = H, .local_window = W, .tau = 0.5f,
                                                               .global_cap = 12, .at_cap = GlobalCapAction::drop});
  std::vector<std::byte> memory(std::size_t(*geometry.pool_bytes(kBlocks)));
  const PoolView pool = *make_pool_view(geometry, memory.data(), kBlocks);
  REQUIRE(pool.kv_planes == 1);
  const SeqId s = *cache.add_sequence();
  const auto latent = [](std::int32_t layer, std::int32_t pos, std::int32_t d) { return float(layer * 100000 + pos * 10 + d); };
  std::int32_t written = 0;
  for (int step = 0; step < 12; ++step) {
    const std::int32_t n = 1 + std::int32_t(rng() % 5);
    for (std::int32_t l = 0; l < L; ++l) {
      std::vector<float> gates(std::size_t(n * H)), src;
      for (auto& g : gates) g = float(rng() % 100) / 100.0f;
      for (std::int32_t t = 0; t < n; ++t)
        for (std::int32_t d = 0; d < D; ++d) src.push_back(latent(l, written + t, d));
      std::vector<std::int32_t> slots(std::size_t(n * H));
      std::vector<SlotMove> moves(std::size_t(H * W));
      std::vector<BlockCopy> copies(8);
      auto r = cache.write(s, l, gates, {.slots = slots, .moves = moves, .copies = copies});
      INFO(r.status().message());
      REQUIRE(r.ok());
      REQUIRE(block_copy_host({pool, pool, copies.data(), r->copies}).ok());
      REQUIRE(compaction_host({pool, moves.data(), r->moves}).ok());
      REQUIRE(scatter_host({pool, {src.data(), nullptr, DType::f32, 0, D * 4, D * 4}, {slots.data()}, n * H}).ok());
    }
    written += n;
    for (std::int32_t l = 0; l < L; ++l) {  // each head row, through the export and gather, against its positions
      const SeqId one[] = {s};
      std::vector<std::int32_t> indptr(2), indices(16), last(1);
      REQUIRE(cache.export_heads_csr(one, l, indptr, indices, last).ok());
      const auto positions = *cache.admission().positions(s, l, 0);
      const auto rows = std::int32_t(positions.size());
      const std::int32_t out_indptr[] = {0, rows};
      std::vector<float> out(std::size_t(rows * D));
      REQUIRE(gather_host({.cache = pool, .indptr = indptr.data(), .indices = indices.data(), .out_indptr = out_indptr,
                           .num_seqs = 1, .num_rows = rows, .k_out = out.data(), .out_dtype = DType::f32,
                           .token_stride = D * 4, .head_stride = D * 4})
                  .ok());
      for (std::int32_t j = 0; j < rows; ++j)
        for (std::int32_t d = 0; d < D; ++d) REQUIRE(out[std::size_t(j * D + d)] == latent(l, positions[std::size_t(j)], d));
    }
  }
  CHECK(*cache.tokens_held(s) > 0);
  CHECK(cache.check_invariants().ok());
}
