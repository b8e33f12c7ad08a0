// GatedCache<WriteGate>: Write-Gated KV through the composed
// cache. Random writes (prefill chunks, decode), rollbacks, forks and frees
// against the per-head list reference; after every step the K/V read back
// through each head-folded export (all layers, and each layer) are the
// reference's tokens, slot for slot, and accounting matches. Then the errors.
#include <catch2/catch.hpp>

#include <kvcache/admission/write_gate.hpp>
#include <kvcache/cache.hpp>

#include "gate_cache_property.hpp"

#include <algorithm>
#include <string>
#include <vector>

using namespace kvcache;
using namespace gate_testing;

namespace {

// Head-paged: no reserve, no prefix sharing, no per-sequence export; writes go through write().
template <class C>
concept Reserves = requires(C& c, SeqId s, std::span<std::int32_t> slots) { c.reserve(s, 1, slots); };
template <class C>
concept SharesPrefixes = requires(C& c, std::span<const std::int32_t> p) { c.add_sequence(p); };
template <class C>
concept WritesGated = requires(C& c, SeqId s, std::span<const float> g, const GateWriteSpans& o) { c.write(s, 0, g, o); };
static_assert(!Reserves<GateCache> && !SharesPrefixes<GateCache> && WritesGated<GateCache>);
static_assert(Reserves<Cache<>> && SharesPrefixes<Cache<>> && !WritesGated<Cache<>>);


}  // namespace

TEST_CASE("a Cache with WriteGate admission matches the per-head reference through writes, rollback, fork and free") {
  auto rng = fresh_rng();
  gate_cache_property(rng, 16, 60);
}

TEST_CASE("a Cache with WriteGate admission: bad configurations, handles, layers and buffers are typed errors, and nothing changes") {
  const WriteGateConfig gcfg{.num_layers = 2, .num_kv_heads = 2, .local_window = 4, .tau = 0.5f, .global_cap = 4};
  const CacheConfig cfg{.geometry = single_head(2), .num_blocks = 33, .max_sequences = 2, .max_blocks_per_sequence = 4};
  auto two_heads = *Geometry::make({.num_layers = 1, .num_kv_heads = 2, .head_dim = kDim, .block_size = 2, .dtype = DType::f32});
  CHECK_THROWS_AS(GateCache(CacheConfig{.geometry = two_heads, .num_blocks = 33, .max_sequences = 2, .max_blocks_per_sequence = 4}, gcfg),
                  ConfigError);
  CHECK_THROWS_AS(GateCache(cfg, WriteGateConfig{.num_layers = 2, .num_kv_heads = 2, .local_window = 3}), ConfigError);
  CHECK_THROWS_AS(GateCache(cfg, WriteGateConfig{.local_window = 4, .global_cap = 5}), ConfigError);  // row: 8 tokens

  GateCache cache(cfg, gcfg);
  // Per head: a ring of 4 and at most 4 admitted: 4 heads x 4 blocks of 2.
  CHECK(cache.blocks_needed(100, 100).value() == 16);
  CHECK(cache.blocks_needed(3, 0).value() == 8);  // 4 heads x 2 blocks for 3 tokens
  CHECK(cache.can_admit(100, 100));
  SeqId s = *cache.add_sequence();
  std::vector<float> ones(12, 1.0f);  // 6 tokens x 2 heads
  std::vector<std::int32_t> slots(64);
  std::vector<SlotMove> moves(64);
  for (std::int32_t l = 0; l < 2; ++l) REQUIRE(cache.write(s, l, ones, {.slots = slots, .moves = moves}).ok());
  CHECK(cache.tokens_held(s).value() == 4 * 6);
  CHECK(cache.blocks_held(s).value() == 4 * 3);
  const GateCache before = cache;
  std::vector<float> bad(2, 0.5f);
  bad[1] = 2.0f;
  auto r = cache.write(s, 0, bad, {.slots = slots, .moves = moves});
  CHECK(r.status().code() == Errc::invalid_argument);
  CHECK(std::string(r.status().what()) == "gates_at");
  CHECK(cache.write(s, 2, std::vector<float>(2, 0.5f), {.slots = slots, .moves = moves}).status().code() == Errc::invalid_argument);
  CHECK(cache.truncate(s, 7, {.moves = moves}).status().code() == Errc::truncate_too_many);
  CHECK(cache == before);

  // write_batch: each bad argument names itself; a head at its cap under `refuse` fails the whole batch.
  {
    const SeqId one[] = {s}, twice[] = {s, s};
    const auto fails = [&](Errc code, const char* what, auto&& call) {
      auto res = call();
      CHECK(res.status().code() == code);
      CHECK(std::string(res.status().what()) == what);
      CHECK(cache == before);
    };
    const std::vector<float> two(2, 1.0f);
    fails(Errc::invalid_argument, "layer", [&] { return cache.write_batch(one, 2, two, {.slots = slots, .moves = moves}); });
    fails(Errc::invalid_argument, "gates.size (seqs x kv_heads)",
          [&] { return cache.write_batch(one, 0, ones, {.slots = slots, .moves = moves}); });
    fails(Errc::invalid_argument, "gates_at", [&] { return cache.write_batch(one, 0, bad, {.slots = slots, .moves = moves}); });
    fails(Errc::invalid_argument, "seqs_at (a sequence twice)",
          [&] { return cache.write_batch(twice, 0, std::vector<float>(4, 1.0f), {.slots = slots, .moves = moves}); });
    fails(Errc::buffer_too_small, "slots",
          [&] { return cache.write_batch(one, 0, two, {.slots = std::span(slots).first(1), .moves = moves}); });
    fails(Errc::buffer_too_small, "promote",
          [&] { return cache.write_batch(one, 0, two, {.slots = slots, .moves = moves, .promote = std::span(slots).first(1)}); });
    fails(Errc::buffer_too_small, "moves",  // both heads promote an admitted token
          [&] { return cache.write_batch(one, 0, two, {.slots = slots, .moves = std::span(moves).first(1)}); });
    // Each head holds 2 of its 4 admitted tokens; two more steps fill the cap, the third is refused.
    for (int step = 0; step < 2; ++step) REQUIRE(cache.write_batch(one, 0, two, {.slots = slots, .moves = moves}).ok());
    const GateCache full = cache;
    auto res = cache.write_batch(one, 0, two, {.slots = slots, .moves = moves});
    CHECK(res.status().code() == Errc::capacity_exceeded);
    CHECK(std::string(res.status().what()) == "global_cap");
    CHECK(res.status().limit() == 4);
    CHECK(cache == full);
    cache = before;
  }

  const SeqId seqs[] = {s};
  std::vector<std::int32_t> indptr(9, -5), indices(64, -5), last(8, -5);
  const auto untouched = [](const std::vector<std::int32_t>& v) { return std::all_of(v.begin(), v.end(), [](std::int32_t x) { return x == -5; }); };
  auto e = cache.export_heads_csr(seqs, 2, indptr, indices, last);
  CHECK(e.status().code() == Errc::invalid_argument);
  CHECK(std::string(e.status().what()) == "layer");
  CHECK(cache.export_heads_csr(seqs, -2, indptr, indices, last).status().code() == Errc::invalid_argument);
  e = cache.export_heads_csr(seqs, -1, std::span<std::int32_t>(indptr.data(), 4), indices, last);
  CHECK(e.status().code() == Errc::buffer_too_small);
  CHECK(e.status().limit() == 5);  // 4 head rows + 1
  e = cache.export_heads_csr(seqs, 0, indptr, std::span<std::int32_t>(indices.data(), 3), last);
  CHECK(std::string(e.status().what()) == "indices");
  CHECK(e.status().limit() == 6);  // 2 heads x 3 blocks
  CHECK(cache.export_heads_block_table(seqs, 0, indices, 2).code() == Errc::buffer_too_small);  // rows of 3 blocks
  CHECK(cache.export_heads_lengths(seqs, -1, std::span<std::int32_t>(last.data(), 3)).code() == Errc::buffer_too_small);
  CHECK(std::string(cache.export_head_columns(seqs, 0, indptr, std::span<std::int32_t>(indices.data(), 11)).status().what()) == "columns");
  CHECK(untouched(indptr));
  CHECK(untouched(indices));
  CHECK(untouched(last));

  // A stale handle, everywhere.
  SeqId t = *cache.add_sequence();
  REQUIRE(cache.free(t).ok());
  const SeqId stale[] = {t};
  CHECK(cache.write(t, 0, bad, {.slots = slots}).status().code() == Errc::unknown_sequence);
  CHECK(cache.write_batch(stale, 0, std::vector<float>(2, 0.5f), {.slots = slots}).status().code() == Errc::unknown_sequence);
  CHECK(cache.fork(t).status().code() == Errc::unknown_sequence);
  CHECK(cache.free(t).code() == Errc::unknown_sequence);
  CHECK(cache.tokens_held(t, 0, 0).status().code() == Errc::unknown_sequence);
  CHECK(cache.blocks_held(t).status().code() == Errc::unknown_sequence);
  CHECK(cache.export_heads_lengths(stale, 0, last).code() == Errc::unknown_sequence);

  // The pool: 32 usable blocks, 12 held; a second sequence whose 24 tokens are all dropped holds its rings: 4 x 2.
  SeqId u = *cache.add_sequence();
  std::vector<float> gates(2 * 24, 0.0f);
  REQUIRE(cache.write(u, 0, gates, {.slots = slots, .moves = moves}).ok());
  REQUIRE(cache.write(u, 1, gates, {.slots = slots, .moves = moves}).ok());
  CHECK(cache.free_blocks() == 32 - 12 - 8);
  CHECK_FALSE(cache.can_admit(100, 100));  // and no handle is free either
  CHECK(cache.free_sequences() == 0);
  CHECK(cache.add_sequence().status().code() == Errc::capacity_exceeded);
  CHECK(cache.check_invariants().ok());
}
