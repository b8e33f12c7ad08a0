// kvcache, one eviction policy end to end: H2O (heavy hitters + recent) with
// one choice per kv-head. The engine writes K/V, feeds each head's attention
// column sums (observe), evicts after every chunk, and runs the compaction
// each head's moves ask for; then every held token of every head is read
// back through the page table and checked against the positions H2O says the
// head kept.
#include <kvcache/eviction/h2o.hpp>
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kvcache.hpp>

#include <fmt/format.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace kv = kvcache;

namespace {
constexpr std::int32_t H = 2, D = 4, B = 4, kBlocks = 64;
// Head h's K at position p (V = -K): the read-back check.
float key(std::int32_t h, std::int64_t p) { return float(h) * 10000.0f + float(p); }
// A stand-in for attention: some positions are heavy for each head.
float attention(std::int32_t h, std::int64_t p) { return (p * (h + 3)) % 7 == 0 ? 5.0f : 0.1f; }
}  // namespace

int main() {
  const auto g = kv::Geometry::make({.num_layers = 1, .num_kv_heads = H, .head_dim = D, .block_size = B,
                                     .dtype = kv::DType::f32}).value();
  std::vector<std::byte> memory(std::size_t(g.pool_bytes(kBlocks).value()));
  const auto pool = kv::make_pool_view(g, memory.data(), kBlocks).value();
  const auto strides = g.strides(kBlocks).value();
  using Cache = kv::Cache<kv::BlockPool, kv::PageTable, kv::AdmitAll, kv::SelectAll, kv::H2OEviction>;
  Cache cache({.geometry = g, .num_blocks = kBlocks, .max_sequences = 2, .max_blocks_per_sequence = 32}, {}, {},
              kv::H2OEviction({.heavy = 8, .recent = 8, .groups = H}));  // one choice per kv-head
  const kv::SeqId seq = cache.add_sequence().value();
  std::vector<std::int32_t> slots(16), group_moves(H + 1);
  std::vector<kv::SlotMove> moves(std::size_t(H) * 128);

  std::int64_t pos = 0, evicted = 0;
  for (int chunk = 0; chunk < 12; ++chunk) {
    const std::int32_t n = chunk < 4 ? 16 : 1;  // a prefill in chunks of 16, then decode
    if (auto r = cache.reserve(seq, n, slots); !r) return fmt::print("reserve: {}\n", r.status().message()), 1;
    std::vector<float> k(std::size_t(n * H * D)), v(k.size());
    for (std::int32_t t = 0; t < n; ++t)
      for (std::int32_t h = 0; h < H; ++h)
        for (std::int32_t d = 0; d < D; ++d) {
          k[std::size_t((t * H + h) * D + d)] = key(h, pos + t);
          v[std::size_t((t * H + h) * D + d)] = -key(h, pos + t);
        }
    const kv::KvSource src{.k = k.data(), .v = v.data(), .dtype = kv::DType::f32, .token_stride = H * D * 4,
                           .head_stride = D * 4};
    if (!kv::scatter_host({.cache = pool, .src = src, .addr = {.slots = slots.data()}, .num_tokens = n})) return 1;
    pos += n;

    // Attention's per-head column sums over every held token, in slot order (the row's order).
    const std::int32_t held = std::int32_t(cache.tokens_held(seq).value());
    std::vector<float> sums(std::size_t(H * held));
    for (std::int32_t h = 0; h < H; ++h) {
      const auto p = cache.eviction().positions(seq.index, h);  // each held token's position, row order
      for (std::int32_t j = 0; j < held; ++j)
        sums[std::size_t(h * held + j)] = j < std::int32_t(p.size()) ? attention(h, p[std::size_t(j)]) : attention(h, pos - held + j);
    }
    if (auto st = cache.observe(seq, kv::Scores{kv::ScoreKind::head_attention_sums, sums, H}); !st)
      return fmt::print("observe: {}\n", st.message()), 1;

    auto r = cache.evict(seq, {.moves = moves, .group_moves = group_moves});
    if (!r) return fmt::print("evict: {}\n", r.status().message()), 1;
    evicted += r->tokens;
    for (std::int32_t h = 0; h < H; ++h) {  // each head's moves on its own head
      const std::int32_t lo = group_moves[std::size_t(h)], hi = group_moves[std::size_t(h) + 1];
      if (!kv::compaction_host({.cache = pool, .moves = moves.data() + lo, .num_moves = hi - lo, .first_head = h, .num_heads = 1}))
        return 1;
    }
  }

  // Every held token of every head holds the K of the position H2O kept there.
  const auto blocks = cache.table().blocks(seq).value();
  const std::int32_t held = std::int32_t(cache.tokens_held(seq).value());
  for (std::int32_t h = 0; h < H; ++h) {
    const auto p = cache.eviction().positions(seq.index, h);
    for (std::int32_t j = 0; j < held; ++j) {
      float got = 0;
      std::memcpy(&got, memory.data() + strides.offset(blocks[std::size_t(j / B)], 0, 0, j % B, h), sizeof got);
      if (got != key(h, p[std::size_t(j)]))
        return fmt::print("head {} token {}: K of position {} expected, read {}\n", h, j, p[std::size_t(j)], got), 1;
    }
  }
  if (auto st = cache.check_invariants(); !st) return fmt::print("invariants: {}\n", st.message()), 1;
  fmt::print("{} tokens appended, {} evicted, {} held (bound {}), every head's tokens read back\n", pos, evicted, held,
             cache.max_tokens_after_eviction());
}
