// Cache<BlockPool, PageTable, WriteGate>: Write-Gated KV through the composed
// cache. Random writes (prefill chunks, decode), rollbacks, forks and frees
// against the per-head list reference; after every step the K/V read back
// through each head-folded export (all layers, and each layer) are the
// reference's tokens, slot for slot, and accounting matches. Then the errors.
#include <catch2/catch.hpp>

#include <kvcache/admission/write_gate.hpp>
#include <kvcache/cache.hpp>

#include "write_gate_testing.hpp"

#include <algorithm>
#include <string>
#include <vector>

using namespace kvcache;
using namespace gate_testing;

namespace {
using GateCache = Cache<BlockPool, PageTable, WriteGate>;

// Head-paged: no reserve, no prefix sharing, no per-sequence export; writes go through write().
template <class C>
concept Reserves = requires(C& c, SeqId s, std::span<std::int32_t> slots) { c.reserve(s, 1, slots); };
template <class C>
concept SharesPrefixes = requires(C& c, std::span<const std::int32_t> p) { c.add_sequence(p); };
template <class C>
concept WritesGated = requires(C& c, SeqId s, std::span<const float> g, const GateWriteSpans& o) { c.write(s, 0, g, o); };
static_assert(!Reserves<GateCache> && !SharesPrefixes<GateCache> && WritesGated<GateCache>);
static_assert(Reserves<Cache<>> && SharesPrefixes<Cache<>> && !WritesGated<Cache<>>);

std::vector<std::int32_t> ints(std::int64_t n) { return std::vector<std::int32_t>(std::size_t(n)); }

Geometry single_head(std::int32_t block) {
  return *Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = kDim, .block_size = block, .dtype = DType::f32});
}

struct Live {
  SeqId id;
  std::vector<RefHead> ref;       // [layer * H + head]
  std::vector<std::int32_t> tag;  // [position]: key_of tag of its K/V
  std::int32_t own = 0;
};

// Every export of every live sequence against the reference.
void require_exports(const GateCache& c, const KvMemory& mem, const std::vector<Live>& live, std::int32_t L,
                     std::int32_t H, std::int32_t row_blocks) {
  std::vector<SeqId> seqs;
  for (const Live& x : live) seqs.push_back(x.id);
  const auto S = std::int32_t(seqs.size()), rows = L * S * H, B = c.block_size();
  auto indptr = ints(rows + 1), indices = ints(rows * row_blocks), last = ints(rows);
  REQUIRE(c.export_heads_csr(seqs, -1, indptr, indices, last).ok());
  auto cptr = ints(rows + 1), cols = ints(rows * row_blocks * B), lens = ints(rows);
  REQUIRE(c.export_head_columns(seqs, -1, cptr, cols).ok());
  REQUIRE(c.export_heads_lengths(seqs, -1, lens).ok());
  for (std::int32_t l = 0; l < L; ++l) {
    // One layer's export is the all-layer export's slice l.
    const auto per = std::size_t(S * H);
    auto lp = ints(std::int64_t(per) + 1), li = ints(std::int64_t(per) * row_blocks), ll = ints(std::int64_t(per)),
         table = ints(std::int64_t(per) * row_blocks);
    REQUIRE(c.export_heads_csr(seqs, l, lp, li, ll).ok());
    REQUIRE(c.export_heads_block_table(seqs, l, table, row_blocks).ok());
    for (std::size_t r = 0; r < per; ++r) {
      const std::size_t g = std::size_t(l) * per + r;
      REQUIRE(lp[r + 1] - lp[r] == indptr[g + 1] - indptr[g]);
      REQUIRE(ll[r] == last[g]);
      for (std::int32_t k = 0; k < row_blocks; ++k) {
        const std::int32_t want = k < lp[r + 1] - lp[r] ? indices[std::size_t(indptr[g] + k)] : BlockPool::null_block;
        if (k < lp[r + 1] - lp[r]) REQUIRE(li[std::size_t(lp[r] + k)] == want);
        REQUIRE(table[r * std::size_t(row_blocks) + std::size_t(k)] == want);
      }
    }
    for (std::int32_t k = 0; k < S; ++k)
      for (std::int32_t h = 0; h < H; ++h) {
        const std::size_t r = std::size_t((l * S + k) * H + h);
        const Live& x = live[std::size_t(k)];
        const auto want = x.ref[std::size_t(l * H + h)].row();
        const std::int32_t pages = indptr[r + 1] - indptr[r];
        REQUIRE((pages == 0 ? 0 : (pages - 1) * B + last[r]) == std::int32_t(want.size()));
        REQUIRE(lens[r] == std::int32_t(want.size()));
        REQUIRE(std::vector<std::int32_t>(cols.begin() + cptr[r], cols.begin() + cptr[r + 1]) == want);
        REQUIRE(c.tokens_held(x.id, l, h).value() == std::int64_t(want.size()));
        for (std::size_t j = 0; j < want.size(); ++j) {
          const std::int32_t slot = indices[std::size_t(indptr[r]) + j / std::size_t(B)] * B + std::int32_t(j % std::size_t(B));
          INFO("layer " << l << " seq " << k << " head " << h << " row index " << j << " position " << want[j]);
          REQUIRE(mem.k_at(slot) == key_of(x.tag[std::size_t(want[j])], l, h, want[j]));
          REQUIRE(mem.v_at(slot) == -key_of(x.tag[std::size_t(want[j])], l, h, want[j]));
        }
      }
  }
}
}  // namespace

TEST_CASE("a Cache with WriteGate admission matches the per-head reference through writes, rollback, fork and free") {
  auto rng = fresh_rng();
  std::int32_t forks = 0, copies_run = 0;
  for (int trial = 0; trial < 16; ++trial) {
    const std::int32_t block = trial % 2 ? 4 : 2, w = block * (1 + std::int32_t(rng() % 3));
    WriteGateConfig gcfg{.num_layers = 1 + std::int32_t(rng() % 2), .num_kv_heads = 1 + std::int32_t(rng() % 3),
                         .local_window = w, .tau = 0.5f, .at_cap = GlobalCapAction::drop};
    gcfg.global_cap = trial % 3 == 0 ? 2 + std::int32_t(rng() % 6) : 0;
    const std::int32_t L = gcfg.num_layers, H = gcfg.num_kv_heads, row_blocks = w / block + 5;
    const std::int32_t num_blocks = 4 * L * H * row_blocks + 1;
    GateCache cache({.geometry = single_head(block), .num_blocks = num_blocks, .max_sequences = 2,
                     .max_blocks_per_sequence = row_blocks},
                    gcfg);
    const std::int32_t cap = cache.admission().global_cap();
    KvMemory mem(block, num_blocks, H);
    CAPTURE(trial, block, w, L, H, cap);
    std::vector<Live> live;
    std::int32_t next_tag = 0;
    for (int step = 0; step < 60; ++step) {
      if (live.empty()) live.push_back(Live{*cache.add_sequence(), std::vector<RefHead>(std::size_t(L * H), RefHead(w)), {}, next_tag++});
      Live& q = live[rng() % live.size()];
      const auto appended = std::int32_t(q.tag.size());
      const int kind = int(rng() % 10);
      std::vector<BlockCopy> copies(std::size_t(L * H * row_blocks));
      if (kind == 0 && appended > 0) {
        const std::int32_t n = 1 + std::int32_t(rng() % std::uint64_t(std::min(appended, w)));
        std::int32_t limit = appended;
        for (const auto& h : q.ref) limit = std::min(limit, h.rollback_limit(appended));
        std::vector<SlotMove> moves(std::size_t(L * H * w));
        const GateCache before = cache;
        auto r = cache.truncate(q.id, n, {.moves = moves, .copies = copies});
        if (n > limit) {
          REQUIRE(r.status().code() == Errc::truncate_too_many);
          REQUIRE(cache == before);
          continue;
        }
        REQUIRE(r.ok());
        for (auto& h : q.ref) h.truncate(n);
        q.tag.resize(std::size_t(appended - n));
        copies_run += r->copies;
        mem.copy_blocks(std::span<const BlockCopy>(copies.data(), std::size_t(r->copies)));
        mem.move(std::span<const SlotMove>(moves.data(), std::size_t(r->moves)));
      } else if (kind == 1 && live.size() < 2) {
        auto child = cache.fork(q.id);
        REQUIRE(child.ok());
        ++forks;
        live.push_back(Live{*child, q.ref, q.tag, next_tag++});
      } else if (kind == 2 && live.size() > 1) {
        const std::size_t k = rng() % live.size();
        REQUIRE(cache.free(live[k].id).ok());
        REQUIRE(cache.tokens_held(live[k].id).status().code() == Errc::unknown_sequence);
        live.erase(live.begin() + std::ptrdiff_t(k));
      } else {
        const std::int32_t n = kind == 3 ? 1 + std::int32_t(rng() % std::uint64_t(3 * w)) : (kind == 4 ? 1 + std::int32_t(rng() % std::uint64_t(w)) : 1);
        for (std::int32_t l = 0; l < L; ++l) {
          std::vector<float> gates(std::size_t(n * H));
          for (auto& g : gates) g = float(rng() % 1000) / 1000.0f;
          std::vector<std::int32_t> slots(gates.size()), promote;
          if (n <= w && rng() % 2) promote.assign(gates.size(), -7);
          std::vector<SlotMove> moves(std::size_t(n * H + H * w));
          auto info = cache.write(q.id, l, gates, {.slots = slots, .moves = moves, .promote = promote, .copies = copies});
          REQUIRE(info.ok());
          std::int32_t at_cap = 0;
          for (std::int32_t t = 0; t < n; ++t)
            for (std::int32_t h = 0; h < H; ++h)
              REQUIRE(q.ref[std::size_t(l * H + h)].write(appended + t, gates[std::size_t(t * H + h)] >= 0.5f, cap, false, at_cap));
          copies_run += info->copies;
          mem.copy_blocks(std::span<const BlockCopy>(copies.data(), std::size_t(info->copies)));
          mem.run(std::span<const SlotMove>(moves.data(), std::size_t(info->moves)), slots, promote, q.own, l, appended, n);
        }
        q.tag.resize(std::size_t(appended + n), q.own);
      }
      REQUIRE(cache.check_invariants().ok());
      std::int64_t blocks = 0;
      for (const Live& x : live) {
        std::int64_t held = 0;
        for (const auto& h : x.ref) held += std::int64_t(h.row().size());
        REQUIRE(cache.tokens_held(x.id).value() == held);
        REQUIRE(cache.blocks_held(x.id).value() <= cache.blocks_needed(std::int64_t(x.tag.size()), 0).value());
        blocks += *cache.blocks_held(x.id);
      }
      REQUIRE(num_blocks - 1 - cache.free_blocks() <= blocks);  // shared blocks count once in the pool
      require_exports(cache, mem, live, L, H, row_blocks);
    }
  }
  REQUIRE(forks > 0);
  REQUIRE(copies_run > 0);
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
