// Eviction on a hybrid model's global layers: a block policy on the full and
// MLA groups leaves holes in their rows while the window group keeps its own
// retention. Every slot a reserve hands out is "written" with the prefix hash
// of its position (or, once its sequence evicted, a different value: its K/V
// read another context), and the kernels' view of every row (the CSR and the
// dense table) must read back the positions the row holds, in order.
#include <catch2/catch.hpp>
#include <kvcache/cache/hybrid.hpp>
#include <kvcache/eviction/block_scores.hpp>
#include <kvcache/eviction/sink_window.hpp>
#include <kvcache/selection/quest.hpp>
#include <kvcache/tiers/group_tiers.hpp>

#include "hybrid_eviction_harness.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace kv = kvcache;
using kv::AttentionKind;

namespace {

// Full attention (4 tokens a page), a window of 8 (4), and MLA (a latent of 8: 8 tokens a page).
kv::LayerGroups layout() {
  static const std::vector<std::int32_t> l0{0}, l1{1}, l2{2};
  static const kv::LayerGroupSpec g[] = {
      {.kind = AttentionKind::full, .layers = l0, .num_kv_heads = 1, .head_dim = 8},
      {.kind = AttentionKind::sliding_window, .layers = l1, .num_kv_heads = 1, .head_dim = 8, .window = 8},
      {.kind = AttentionKind::mla, .layers = l2, .num_kv_heads = 1, .head_dim = 8}};
  return *kv::LayerGroups::make({.groups = g, .block_size = 4, .block_multiple = 2, .max_padding_permille = 999});
}

using SinkCache = kv::HybridCache<kv::FastBlockHasher, kv::SelectAll, kv::SinkWindowEviction>;
using ScoreCache = kv::HybridCache<kv::FastBlockHasher, kv::SelectAll, kv::BlockScoreEviction>;

const auto require = [](bool ok, const char* what) {
  INFO(what);
  REQUIRE(ok);
};
template <class Cache>
using Model = kvtest::EvictionModel<Cache, decltype(require)>;

}  // namespace

TEST_CASE("eviction on a hybrid's global layers: sinks and a window leave holes in the full and MLA rows, the window group keeps its own") {
  SinkCache cache({.groups = layout(), .num_blocks = 64, .max_sequences = 2, .max_tokens = 128, .event_capacity = 64}, {},
                  kv::SinkWindowEviction({.sinks = 4, .window = 8}));
  Model<SinkCache> m{cache, require};
  std::vector<std::int32_t> tokens(40);
  std::iota(tokens.begin(), tokens.end(), 100);
  auto s = Model<SinkCache>::make(tokens);
  const std::int32_t full_b = cache.layer_groups().block_size(0), mla_b = cache.layer_groups().block_size(2);
  REQUIRE(full_b == 4);
  REQUIRE(mla_b == 8);

  std::vector<std::int32_t> slots(3 * 40);
  const auto a = cache.admit(std::span(s.tokens).first(32), slots, {.reserve = 32}).value();
  s.reserved = 32;
  m.write(s, 0, 32, slots, 32);
  REQUIRE(cache.computed(a.seq, 32).ok());
  s.computed = 32;
  m.read_back(a.seq, s);

  std::vector<std::int32_t> out(32);
  const auto r = cache.evict(a.seq, {.blocks = out}).value();
  // Full (B 4): sinks [0, 4) and the last 8 tokens [24, 32) stay: blocks 1 .. 5 leave.
  // MLA (B 8): the sinks pin block 0, the window [24, 32) block 3: blocks 1 and 2 leave.
  REQUIRE(r.evicted == 5 + 2);
  REQUIRE(r.tokens == 5 * 4 + 2 * 8);
  REQUIRE(r.rotations == 0);
  REQUIRE(r.first_changed == 4);
  const std::vector<std::int32_t> want{1, 2, 3, 4, 5, 1, 2};
  REQUIRE(std::vector<std::int32_t>(out.begin(), out.begin() + r.evicted) == want);
  REQUIRE(*cache.tokens_held(a.seq, 0) == 12);
  REQUIRE(*cache.tokens_held(a.seq, 2) == 16);
  REQUIRE(*cache.tokens_held(a.seq, 1) == 32);  // the window group frees on its own rule, at the next reserve
  REQUIRE(*cache.blocks_held(a.seq, 0) == 3);
  REQUIRE((*cache.blocks(a.seq, 0))[1] == kv::BlockPool::null_block);
  REQUIRE(cache.evicted(a.seq).value());
  REQUIRE(cache.check_invariants().ok());
  m.read_back(a.seq, s);
  // A sender cannot pin it for a peer: its rows are not its prompt's K/V.
  const auto held = cache.hold(a.seq);
  REQUIRE(held.status().code() == kv::Errc::invalid_argument);
  REQUIRE(std::string(held.status().what()).find("evicted") != std::string::npos);

  // A held position's slot is there; an evicted one is refused, naming it.
  std::vector<std::int32_t> one(4);
  REQUIRE(cache.slot_mapping(0, a.seq, 0, 4, one).ok());
  const auto hole = cache.slot_mapping(0, a.seq, 2, 6, one);
  REQUIRE(hole.code() == kv::Errc::invalid_argument);
  REQUIRE(hole.value() == 4);
  REQUIRE(cache.slot_mapping(0, a.seq, 6, 6, one).ok());  // an empty range reads nothing, even inside a hole

  // Decode: each step computes the last token, reserves the next, and evicts.
  s.evicted = true;
  for (std::int32_t t = 32; t < 40; ++t) {
    const std::int32_t tok[] = {s.tokens[std::size_t(t)]};
    REQUIRE(cache.advance(a.seq, tok, slots).ok());
    s.computed = s.reserved;
    m.write(s, s.reserved, 1, slots, 1);
    ++s.reserved;
    REQUIRE(cache.evict(a.seq, {.blocks = out}).ok());
    REQUIRE(cache.check_invariants().ok());
    m.read_back(a.seq, s);
    for (const std::int32_t g : {0, 2}) {
      const auto pos = m.held_positions(a.seq, s, g);
      REQUIRE(std::vector<std::int64_t>(pos.begin(), pos.begin() + 4) == std::vector<std::int64_t>{0, 1, 2, 3});
      REQUIRE(pos.back() == s.reserved - 1);
      REQUIRE(std::int64_t(pos.size()) <= cache.eviction(g).value()->max_tokens_held(s.reserved));
      for (std::int64_t p = s.reserved - 8; p < s.reserved; ++p) REQUIRE(std::count(pos.begin(), pos.end(), p) == 1);
    }
  }
  REQUIRE(cache.free(a.seq).ok());
  REQUIRE(cache.check_invariants().ok());
}

TEST_CASE("a hybrid sequence that evicted publishes nothing more, and what it published before stays served") {
  SinkCache cache({.groups = layout(), .num_blocks = 96, .max_sequences = 3, .max_tokens = 128}, {},
                  kv::SinkWindowEviction({.sinks = 4, .window = 8}));
  std::vector<std::int32_t> prompt(48);
  std::iota(prompt.begin(), prompt.end(), 7);
  std::vector<std::int32_t> slots(3 * 48), out(64);
  const auto a = cache.admit(std::span(prompt).first(32), slots, {.reserve = 32}).value();
  REQUIRE(cache.computed(a.seq, 32).ok());
  REQUIRE(cache.evict(a.seq, {.blocks = out}).value().evicted > 0);
  // The next 16 tokens are computed after the eviction: none of them may be served.
  REQUIRE(cache.reserve(a.seq, std::span(prompt).subspan(32, 16), slots).ok());
  REQUIRE(cache.computed(a.seq, 48).ok());
  REQUIRE(cache.match(prompt) == 32);  // the 32 computed before the eviction, the evicted blocks included
  REQUIRE(cache.check_invariants().ok());
  // A second request adopts the prompt's blocks the first one let go (they stayed cached) and publishes on.
  const auto b = cache.admit(std::span(prompt).first(40), slots, {.reserve = 8}).value();
  REQUIRE(b.cached_tokens == 32);
  REQUIRE(cache.computed(b.seq, 40).ok());
  REQUIRE(cache.match(prompt) == 40);
  REQUIRE(cache.check_invariants().ok());
}

TEST_CASE("host tiers over an evicting hybrid: only blocks published before the eviction are offloaded and served") {
  SinkCache cache({.groups = layout(), .num_blocks = 64, .max_sequences = 2, .max_tokens = 128}, {},
                  kv::SinkWindowEviction({.sinks = 4, .window = 8}));
  kv::GroupTiers<SinkCache> tiers(cache, {.host_blocks = 64});
  std::vector<std::int32_t> prompt(48), slots(3 * 48);
  std::iota(prompt.begin(), prompt.end(), 300);
  const auto a = cache.admit(std::span(prompt).first(32), slots, {.reserve = 32}).value();
  REQUIRE(cache.computed(a.seq, 32).ok());
  std::vector<std::int32_t> out(32);
  REQUIRE(cache.evict(a.seq, {.blocks = out}).value().evicted == 5 + 2);
  REQUIRE(cache.reserve(a.seq, std::span(prompt).subspan(32, 16), slots).ok());
  REQUIRE(cache.computed(a.seq, 48).ok());
  // The request ends: every block it offloads is named by the first 32 tokens, in its own group.
  const auto job = tiers.plan_offload(a.seq, prompt).value();
  REQUIRE(!job.moves.empty());
  for (const kv::BlockMove& m : job.moves) {
    const std::int32_t g = cache.pool().group(m.src);
    std::vector<kv::BlockHash> names(16);
    names.resize(std::size_t(cache.hash_chain(g, std::span(prompt).first(32), {}, names).value()));
    REQUIRE(std::find(names.begin(), names.end(), cache.pool().hash(m.src)) != names.end());
  }
  // The window group's blocks that a hit at 32 reads (positions 24..31, let go by its row, still cached) go too:
  // the boundary is where the prompt's own K/V ends, not the 48 computed.
  REQUIRE(cache.computed_before_eviction(a.seq).value() == 32);
  std::vector<kv::BlockHash> window(16);
  window.resize(std::size_t(cache.hash_chain(1, std::span(prompt).first(32), {}, window).value()));
  for (const std::size_t j : {std::size_t(6), std::size_t(7)})
    REQUIRE(std::any_of(job.moves.begin(), job.moves.end(),
                        [&](const kv::BlockMove& m) { return cache.pool().hash(m.src) == window[j]; }));
  REQUIRE(tiers.tiers().complete(job.id).ok());
  REQUIRE(cache.free(a.seq).ok());
  const auto hits = tiers.lookup(prompt).value();
  REQUIRE(hits.tokens == 32);  // never the 16 tokens computed after the eviction
  REQUIRE(cache.check_invariants().ok());
}

TEST_CASE("Quest beside sinks and a window on a hybrid's global layers: it ranks the live pages, a listing skips the holes") {
  using QuestSink = kv::HybridCache<kv::FastBlockHasher, kv::QuestSelection, kv::SinkWindowEviction>;
  std::vector<float> bounds(std::size_t(kv::QuestSelection::bounds_floats(kv::global_geometry(layout()).value(), 64)), 0.0f);
  QuestSink cache({.groups = layout(), .num_blocks = 64, .max_sequences = 2, .max_tokens = 128},
                  {.token_budget = 16, .first_pages = 1, .last_pages = 1, .dense_layers = 0, .bounds = bounds},
                  kv::SinkWindowEviction({.sinks = 4, .window = 8}));
  std::vector<std::int32_t> prompt(40), slots(3 * 40), out(32);
  std::iota(prompt.begin(), prompt.end(), 1);
  const auto a = cache.admit(std::span(prompt).first(32), slots, {.reserve = 32}).value();
  REQUIRE(cache.computed(a.seq, 32).ok());
  // Every page's bounds: page b's keys are -b in every dimension, so a query of ones ranks the null page
  // (bounds 0) above every live one: a selection that saw the holes would pick it.
  for (std::int32_t b = 1; b < 64; ++b)
    for (const std::int32_t layer : {0, 2}) std::fill_n(cache.page_bounds(layer)->data() + std::size_t(b) * 16, 16, -float(b));
  const std::vector<std::int32_t> before(cache.blocks(a.seq, 0)->begin(), cache.blocks(a.seq, 0)->end());
  REQUIRE(cache.evict(a.seq, {.blocks = out}).value().evicted == 5 + 2);
  // Layer 0 (the full group): 3 live pages within a budget of 4 pages of 4: each read, never a hole's null page.
  const kv::SeqId seqs[] = {a.seq};
  std::vector<float> q(8, 1.0f);
  std::vector<std::int32_t> indptr(2), indices(16);
  const std::int32_t n = cache.select(seqs, 0, q, {indptr, indices}).value();
  std::vector<std::int32_t> picked(indices.begin(), indices.begin() + n), live{before[0], before[6], before[7]};
  std::sort(picked.begin(), picked.end());
  std::sort(live.begin(), live.end());
  REQUIRE(picked == live);
  // A rollback of a partial tail lists that page stale, and no hole.
  REQUIRE(cache.reserve(a.seq, std::span(prompt).subspan(32, 3), slots).ok());
  REQUIRE(cache.truncate(a.seq, 2).ok());
  std::vector<std::int32_t> stale(16), fill(16);
  const std::int32_t listed = cache.stale_pages(seqs, {stale, fill}).value();
  REQUIRE(listed >= 1);
  for (std::int32_t k = 0; k < listed; ++k) REQUIRE(stale[std::size_t(k)] != kv::BlockPool::null_block);
  // A peer's prefill lands (its pages stale until bounded), and the policy runs before any listing: the
  // listing is the pages the rows still hold, never a hole's null page.
  std::vector<std::int32_t> other(32);
  std::iota(other.begin(), other.end(), 500);
  const auto plan = cache.import(other).value();
  const kv::SeqId imported = cache.commit_import(plan.id, other).value().seq;
  const auto r = cache.evict(imported, {.blocks = out}).value();
  REQUIRE(r.evicted > 0);
  const kv::SeqId both[] = {imported};
  const std::int32_t again = cache.stale_pages(both, {stale, fill}).value();
  REQUIRE(again == cache.blocks_held(imported, 0).value() + cache.blocks_held(imported, 2).value());
  for (std::int32_t k = 0; k < again; ++k) REQUIRE(stale[std::size_t(k)] != kv::BlockPool::null_block);
  REQUIRE(cache.check_invariants().ok());
}

TEST_CASE("block scores on a hybrid's global layers: observe per group, the lowest-scored blocks leave") {
  // start 8, recent 8, max 24 tokens: each global group binds its own copy (4- and 8-token blocks).
  ScoreCache cache({.groups = layout(), .num_blocks = 64, .max_sequences = 2, .max_tokens = 64}, {},
                   kv::BlockScoreEviction({.start = 8, .recent = 8, .max = 24, .aggregation = kv::Aggregation::sum}));
  std::vector<std::int32_t> prompt(40), slots(3 * 40), out(32);
  std::iota(prompt.begin(), prompt.end(), 1);
  const auto a = cache.admit(prompt, slots, {.reserve = 40}).value();
  REQUIRE(cache.computed(a.seq, 40).ok());
  // Full: 40 held, 16 leave from the evictable blocks 2 .. 7: blocks 3, 5, 6 and 7 score lowest.
  // MLA: 40 held, 16 leave from blocks 1 .. 3: blocks 1 and 3 score lowest.
  std::vector<float> full(40, 1.0f), mla(40, 1.0f);
  for (const int blk : {3, 5, 6, 7}) std::fill_n(full.begin() + blk * 4, 4, 0.1f);
  for (const int blk : {1, 3}) std::fill_n(mla.begin() + blk * 8, 8, 0.0f);
  REQUIRE(cache.observe(a.seq, 0, {kv::ScoreKind::attention_sums, full, 1}).ok());
  REQUIRE(cache.observe(a.seq, 2, {kv::ScoreKind::attention_sums, mla, 1}).ok());
  const auto r = cache.evict(a.seq, {.blocks = out}).value();
  REQUIRE(r.evicted == 4 + 2);
  REQUIRE(std::vector<std::int32_t>(out.begin(), out.begin() + 6) == std::vector<std::int32_t>{3, 5, 6, 7, 1, 3});
  REQUIRE(*cache.tokens_held(a.seq, 0) == 24);
  REQUIRE(*cache.tokens_held(a.seq, 2) == 24);
  // The next scores have one value per held token (tokens_held), in the CSR's order.
  std::vector<float> next(24, 1.0f);
  REQUIRE(cache.observe(a.seq, 0, {kv::ScoreKind::attention_sums, next, 1}).ok());
  REQUIRE(cache.check_invariants().ok());
}

TEST_CASE("eviction on a hybrid: errors name the value and change nothing") {
  ScoreCache cache({.groups = layout(), .num_blocks = 64, .max_sequences = 2, .max_tokens = 64}, {},
                   kv::BlockScoreEviction({.start = 8, .recent = 8, .max = 24}));
  std::vector<std::int32_t> prompt(40), slots(3 * 40), out(64);
  std::iota(prompt.begin(), prompt.end(), 1);
  const auto a = cache.admit(std::span(prompt).first(32), slots, {.reserve = 32}).value();
  REQUIRE(cache.computed(a.seq, 32).ok());
  const auto before = cache;
  std::vector<float> sums(32, 1.0f);

  SECTION("a window group takes no scores") {
    const auto st = cache.observe(a.seq, 1, {kv::ScoreKind::attention_sums, sums, 1});
    REQUIRE(st.code() == kv::Errc::invalid_argument);
    REQUIRE(std::string(st.what()).find("window") != std::string::npos);
  }
  SECTION("a group past the layout") { REQUIRE(cache.observe(a.seq, 3, {kv::ScoreKind::attention_sums, sums, 1}).code() == kv::Errc::invalid_argument); }
  SECTION("scores of the wrong size name scores.size and the tokens held") {
    const auto st = cache.observe(a.seq, 0, {kv::ScoreKind::attention_sums, std::span(sums).first(31), 1});
    REQUIRE(st.code() == kv::Errc::invalid_argument);
    REQUIRE(std::string(st.what()) == "scores.size");
    REQUIRE(st.limit() == 32);
  }
  SECTION("a NaN names its index") {
    sums[5] = std::nanf("");
    const auto st = cache.observe(a.seq, 0, {kv::ScoreKind::attention_sums, sums, 1});
    REQUIRE(std::string(st.what()) == "scores_at");
    REQUIRE(st.value() == 5);
  }
  SECTION("a span too small for the blocks names blocks and the size every group needs") {
    // Full: 32 held, max 24: 2 blocks leave; MLA: 1. Room for 1, then for 2.
    for (const std::size_t room : {1u, 2u}) {
      const auto r = cache.evict(a.seq, {.blocks = std::span(out).first(room)});
      REQUIRE(r.status().code() == kv::Errc::buffer_too_small);
      REQUIRE(std::string(r.status().what()) == "blocks");
      REQUIRE(r.status().limit() == 2 + 1);
    }
  }
  SECTION("a stale handle") {
    const kv::SeqId stale{a.seq.index, a.seq.generation + 1};
    REQUIRE(cache.evict(stale, {.blocks = out}).status().code() == kv::Errc::unknown_sequence);
    REQUIRE(cache.observe(stale, 0, {kv::ScoreKind::attention_sums, sums, 1}).code() == kv::Errc::unknown_sequence);
  }
  SECTION("a plan whose blocks are all computed runs with tokens pending") {
    // 8 more reserved and not computed: 40 held, the policy's recent area (8) covers only them.
    auto c2 = cache;
    REQUIRE(c2.reserve(a.seq, std::span(prompt).subspan(32, 8), slots).ok());
    const auto mid = c2;
    REQUIRE(c2.evict(a.seq, {.blocks = out}).value().evicted == 4 + 2);
    REQUIRE(c2.check_invariants().ok());
    REQUIRE(!(c2 == mid));
  }
  REQUIRE(cache == before);
  REQUIRE(cache.check_invariants().ok());
}

TEST_CASE("eviction on a hybrid: a plan that takes a block not yet computed is refused, nothing changed") {
  SinkCache cache({.groups = layout(), .num_blocks = 64, .max_sequences = 2, .max_tokens = 64}, {},
                  kv::SinkWindowEviction({.sinks = 4, .window = 8}));
  std::vector<std::int32_t> prompt(32), slots(3 * 32), out(32);
  std::iota(prompt.begin(), prompt.end(), 1);
  const auto a = cache.admit(std::span(prompt).first(16), slots, {.reserve = 16}).value();
  REQUIRE(cache.computed(a.seq, 16).ok());
  REQUIRE(cache.reserve(a.seq, std::span(prompt).subspan(16, 16), slots).ok());
  // 32 held, 16 computed: the full group's plan (blocks 1 .. 5) reaches positions 16 .. 23.
  const auto before = cache;
  const auto r = cache.evict(a.seq, {.blocks = out});
  REQUIRE(r.status().code() == kv::Errc::invalid_argument);
  REQUIRE(r.status().value() == 20);  // block 4 ends at 20, past the 16 computed
  REQUIRE(r.status().limit() == 16);
  REQUIRE(cache == before);
  REQUIRE(cache.computed(a.seq, 32).ok());
  REQUIRE(cache.evict(a.seq, {.blocks = out}).value().evicted == 5 + 2);
  REQUIRE(cache.check_invariants().ok());
}

TEST_CASE("eviction on a hybrid: lifetime need within the policy's bound") {
  SinkCache cache({.groups = layout(), .num_blocks = 64, .max_sequences = 2, .max_tokens = 1024}, {},
                  kv::SinkWindowEviction({.sinks = 4, .window = 8}));
  kv::HybridCache<> plain({.groups = layout(), .num_blocks = 64, .max_sequences = 2, .max_tokens = 1024});
  // The window group's need is its own either way; the full (B 4) and MLA (B 8) groups' differ.
  const auto window = [&](std::int64_t prompt) { return plain.blocks_needed(prompt, 900).value() - (prompt + 900 + 3) / 4 - (prompt + 900 + 7) / 8; };
  // A 64-token prompt is held whole before the policy first runs: 16 and 8 blocks.
  REQUIRE(cache.blocks_needed(64, 900).value() == 16 + 8 + window(64));
  // An 8-token prompt: the bound for the request's length (pinned + window + B - 1, and the token it reserves).
  REQUIRE(cache.blocks_needed(8, 900).value() == kv::blocks_for_tokens(4 + 8 + 4, 4) + kv::blocks_for_tokens(8 + 8 + 8, 8) + window(8));
  REQUIRE(cache.blocks_needed(8, 900).value() < plain.blocks_needed(8, 900).value());
}

TEST_CASE("eviction on a hybrid: randomized conversations keep every invariant and read back what they hold") {
  const unsigned seed = GENERATE(1u, 2u, 3u);
  std::mt19937 rng(seed);
  const auto pick = [&](std::int32_t n) { return std::int32_t(rng() % std::uint32_t(n)); };
  const kv::HybridConfig cfg{.groups = layout(), .num_blocks = 80, .max_sequences = 4, .max_tokens = 96, .prefill_chunk = 16};
  SECTION("sinks and a window") {
    SinkCache cache(cfg, {}, kv::SinkWindowEviction({.sinks = 2, .window = 6}));
    kvtest::HybridEvictionHarness h(cache, pick, require);
    while (h.ops < 1500) h.step();
    REQUIRE(h.evictions > 20);
    REQUIRE(h.hits > 20);
  }
  SECTION("block scores, random scores before every evict") {
    ScoreCache cache(cfg, {}, kv::BlockScoreEviction({.start = 8, .recent = 8, .max = 24, .aggregation = kv::Aggregation::sum}));
    kvtest::HybridEvictionHarness h(cache, pick, require);
    while (h.ops < 1500) h.step();
    REQUIRE(h.evictions > 20);
    REQUIRE(h.hits > 20);
  }
}
