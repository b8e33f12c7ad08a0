// Layer groups over one pool: the layout (page bytes, block sizes, padding,
// layer map), each kind's hit rule, freeing out of the window on computed
// tokens only, the two-phase retain, the admission bound, the exports, and
// every error path leaving the cache unchanged.
#include <catch2/catch.hpp>

#include <kvcache/cache/hybrid.hpp>

#include <numeric>
#include <random>
#include <vector>

using namespace kvcache;

namespace {

std::vector<std::int32_t> range(std::int32_t from, std::int32_t to, std::int32_t step = 1) {
  std::vector<std::int32_t> v;
  for (std::int32_t i = from; i < to; i += step) v.push_back(i);
  return v;
}
std::vector<std::int32_t> tokens(std::int32_t n, std::int32_t seed = 0) {
  std::vector<std::int32_t> v(static_cast<std::size_t>(n));
  for (std::int32_t i = 0; i < n; ++i) v[std::size_t(i)] = (i * 7919 + seed * 104729) % 50021;
  return v;
}

// A small hybrid: full (B 4) + sliding window W (B 4), one layer each, same bytes per token.
struct Small {
  std::vector<std::int32_t> l0{0}, l1{1};
  LayerGroupSpec specs[2];
  LayerGroups lg;
  Small(std::int32_t window, AttentionKind second = AttentionKind::sliding_window) {
    specs[0] = {.kind = AttentionKind::full, .layers = l0, .num_kv_heads = 2, .head_dim = 8};
    specs[1] = {.kind = second, .layers = l1, .num_kv_heads = 2, .head_dim = 8, .window = window, .chunk = window};
    lg = *LayerGroups::make({.groups = specs, .block_size = 4});
  }
  HybridConfig config(std::int32_t blocks, std::int32_t chunk = 0) const {
    return {.groups = lg, .num_blocks = blocks, .max_sequences = 4, .max_tokens = 64, .prefill_chunk = chunk};
  }
};

// Admits a whole prompt and computes it: the new sequence and its hit.
AdmitResult prefill(HybridCache<>& c, const std::vector<std::int32_t>& prompt) {
  std::vector<std::int32_t> slots(std::size_t(c.groups()) * prompt.size());
  auto a = c.admit(prompt, slots);
  REQUIRE(a.ok());
  REQUIRE(a->cached_tokens + a->reserved == std::int32_t(prompt.size()));
  REQUIRE(c.computed(a->seq, std::int64_t(prompt.size())).ok());
  REQUIRE(c.check_invariants().ok());
  return *a;
}

}  // namespace

TEST_CASE("layer groups: one page size, each group's block size, padding and the layer map") {
  SECTION("Gemma 3 27B: 10 full layers and 52 sliding-window layers (W 1024) in one pool") {
    const auto global = range(5, 62, 6), local = [] {
      std::vector<std::int32_t> v;
      for (std::int32_t l = 0; l < 62; ++l)
        if (l % 6 != 5) v.push_back(l);
      return v;
    }();
    REQUIRE(global.size() == 10);
    const LayerGroupSpec g[] = {
        {.kind = AttentionKind::full, .layers = global, .num_kv_heads = 16, .head_dim = 128},
        {.kind = AttentionKind::sliding_window, .layers = local, .num_kv_heads = 16, .head_dim = 128, .window = 1024}};
    auto lg = LayerGroups::make({.groups = g, .block_size = 16, .block_multiple = 16});
    REQUIRE(lg.ok());
    CHECK(lg->num_layers() == 62);
    CHECK(lg->page_bytes() == 52LL * 16 * 256 * 2 * 16);  // 52 layers x 16 tokens of (K + V) x 16 heads x 128 x fp16
    CHECK(lg->block_size(1) == 16);
    CHECK(lg->block_size(0) == 80);  // 83.2 tokens of 10 layers fit; a multiple of 16
    CHECK(lg->padding(0) == lg->page_bytes() - 80 * lg->token_bytes(0));
    CHECK(lg->layer_slot(5) == LayerSlot{0, 0});
    CHECK(lg->layer_slot(11) == LayerSlot{0, 1});
    CHECK(lg->layer_slot(6) == LayerSlot{1, 5});
    CHECK(lg->layer_slot(62) == LayerSlot{});
    CHECK(lg->hit_alignment() == 80);
  }
  SECTION("DeepSeek V3: 61 MLA layers, one 576-value latent per token, pages of 64") {
    const auto layers = range(0, 61);
    const LayerGroupSpec g[] = {{.kind = AttentionKind::mla, .layers = layers, .num_kv_heads = 1, .head_dim = 576}};
    auto lg = LayerGroups::make({.groups = g, .block_size = 64, .block_multiple = 64});
    REQUIRE(lg.ok());
    CHECK(lg->v_head_dim(0) == 0);
    CHECK(lg->token_bytes(0) == 61 * 576 * 2);  // no V
    CHECK(lg->page_bytes() == 64 * 61 * 576 * 2);
    CHECK(lg->padding(0) == 0);
  }
  SECTION("typed errors name the field") {
    const auto a = range(0, 2), b = range(2, 3), twice = range(1, 3);
    auto err = [](const LayerGroupsSpec& s) { return LayerGroups::make(s).status(); };
    LayerGroupSpec g[2] = {{.layers = a, .head_dim = 64}, {.kind = AttentionKind::sliding_window, .layers = b, .head_dim = 64, .window = 0}};
    CHECK(err({.groups = g}).what() == std::string("window"));
    g[1].window = 8;
    CHECK(err({.groups = g}).ok());
    g[1].layers = twice;
    CHECK(err({.groups = g}) == Status{Errc::invalid_argument, "layers (listed twice)", 1, 0});
    g[1].layers = b;
    g[1].kind = AttentionKind::mla;
    g[1].v_head_dim = 64;
    CHECK(err({.groups = g}).what() == std::string("v_head_dim (MLA stores no V, one latent head)"));
    g[1] = {.kind = AttentionKind::full, .layers = b, .head_dim = 64, .v_head_dim = 0};
    CHECK(err({.groups = g}).what() == std::string("v_head_dim (only MLA stores no V)"));
    g[1] = {.kind = static_cast<AttentionKind>(9), .layers = b, .head_dim = 64};
    CHECK(err({.groups = g}) == Status{Errc::invalid_argument, "kind", 9, 4});
    // A page of one token of 3 layers holds one token of 2 layers (same shape): 1/3 of it is padding.
    const auto three = range(2, 5);
    g[1] = {.layers = three, .head_dim = 64};
    CHECK(err({.groups = g, .block_size = 1, .max_padding_permille = 250}) ==
          Status{Errc::invalid_argument, "padding_permille", 333, 250});
    CHECK(err({.groups = g, .block_size = 1, .max_padding_permille = 400}).ok());
    g[1] = {.layers = range(3, 4).empty() ? b : b, .head_dim = 64};
    const auto gap = range(3, 4);
    g[1].layers = gap;  // layer 2 in no group
    CHECK(err({.groups = g}) == Status{Errc::invalid_argument, "layers", 3, 2});
    CHECK(err({.groups = std::span<const LayerGroupSpec>{}}).what() == std::string("groups"));
  }
}

TEST_CASE("a sliding-window group frees what left the window, on computed tokens only, into null entries") {
  Small m(8);  // W 8, blocks of 4: a query at p reads p-7 .. p
  HybridCache<> c(m.config(64, 24));  // up to 24 tokens reserved ahead of those computed
  std::vector<std::int32_t> slots(64);
  const auto t = tokens(40);
  const auto a = c.admit(std::span(t).first(16), slots);
  REQUIRE(a->reserved == 16);
  const SeqId s = a->seq;
  // Chunked prefill: the next chunk is reserved before the first is computed: nothing is freed.
  REQUIRE(c.reserve(s, std::span(t).subspan(16, 8), slots).ok());
  CHECK(*c.blocks_held(s, 1) == 6);
  CHECK(c.check_invariants().ok());
  REQUIRE(c.computed(s, 16).ok());  // the next query is at 16: it reads 9 .. 16
  REQUIRE(c.reserve(s, std::span(t).subspan(24, 4), slots).ok());
  CHECK(*c.blocks_held(s, 1) == 5);  // 7 blocks, of which 0, 1 are freed: block 2 (8 .. 11) is still read
  CHECK(*c.blocks_held(s, 0) == 7);  // the full group keeps everything
  std::vector<std::int32_t> table(8);
  const SeqId one[] = {s};
  REQUIRE(c.export_block_table(1, one, table, 8).ok());
  CHECK(table[0] == BlockPool::null_block);
  CHECK(table[1] == BlockPool::null_block);
  CHECK(table[2] != BlockPool::null_block);
  std::vector<std::int32_t> indptr(2), indices(8), first(1);
  REQUIRE(*c.export_group_csr(1, one, indptr, indices, first) == 5);
  CHECK(first[0] == 8);  // the first live token's position
  CHECK(std::vector(indices.begin(), indices.begin() + 5) == std::vector(table.begin() + 2, table.begin() + 7));
  CHECK(*c.tokens_held(s, 1) == 28 - 8);
  std::vector<std::int32_t> out(4);
  CHECK(c.slot_mapping(1, s, 4, 8, out) == Status{Errc::invalid_argument, "begin (a freed or later position)", 4, 8});
  REQUIRE(c.slot_mapping(1, s, 8, 12, out).ok());
  CHECK(out[0] == table[2] * 4);
  CHECK(c.check_invariants().ok());
}

TEST_CASE("advance is computed up to what is reserved, then reserve, and when the reserve fails neither happens") {
  Small m(8);  // full + a window of 8, blocks of 4
  HybridCache<> a(m.config(12, 12)), b(m.config(12, 12));  // up to 12 tokens ahead of those computed
  std::vector<std::int32_t> sa(64), sb(64);
  const auto t = tokens(40);
  const SeqId s = a.admit(std::span(t).first(10), sa)->seq;
  REQUIRE(b.admit(std::span(t).first(10), sb)->seq == s);
  for (std::int32_t p = 10; p < 24; ++p) {  // decode: b in two calls, a in one
    REQUIRE(b.computed(s, p).ok());
    REQUIRE(b.reserve(s, std::span(t).subspan(std::size_t(p), 1), sb).ok());
    const auto r = a.advance(s, std::span(t).subspan(std::size_t(p), 1), sa);
    REQUIRE(r.ok());
    CHECK(r->new_blocks == (p % 4 == 0 ? 2 : 0));  // a block in each group where one begins; never a copy
    CHECK(r->copy.src == -1);
    REQUIRE(a == b);  // same tables, published blocks, freed window blocks
    REQUIRE(std::equal(sa.begin(), sa.begin() + 2, sb.begin()));
    REQUIRE(*a.computed_tokens(s) == p);
  }
  CHECK(*a.blocks_held(s, 1) == 2);  // 24 reserved, 23 computed: the next query reads 16 .. 23, blocks 4 and 5
  CHECK(*a.blocks_held(s, 0) == 6);
  // 11 usable blocks, 8 held: 12 more tokens need 3 in each group, and only 3
  // are free (the window frees nothing more at 24 computed): refused, and nothing was marked computed.
  const auto before = a;
  CHECK(a.advance(s, std::span(t).subspan(24, 12), sa).status() == Status{Errc::out_of_blocks, "n_blocks", 6, 3});
  CHECK(a == before);
  CHECK(*a.computed_tokens(s) == 23);
  CHECK(a.advance(s, 4, sa).status() == Status{Errc::invalid_argument, "n_tokens (prefix caching is on: pass the token ids)", 4, 0});
  CHECK(a.check_invariants().ok());
}

TEST_CASE("prefix hits: full, window and chunked-local rules, and cross-attention never cached") {
  SECTION("a window hit needs only the blocks the next query reads") {
    Small m(8);
    HybridCache<> c(m.config(64));
    const auto p = tokens(33, 1);
    const SeqId a = prefill(c, p).seq;
    REQUIRE(c.free(a).ok());
    CHECK(c.match(p) == 32);  // every block up to the last token
    const auto longer = tokens(200, 1);  // past max_tokens (64): looked up as its first 64, no further
    CHECK(c.match(longer) == 32);
    const auto b = prefill(c, p);
    CHECK(b.cached_tokens == 32);
    CHECK(*c.blocks_held(b.seq, 1) == 3);  // blocks 6, 7 (positions 25 .. 31) and the new one; 0 .. 5 null
    CHECK(*c.blocks_held(b.seq, 0) == 9);
  }
  SECTION("a window whose blocks were recycled limits a hit the full group could serve") {
    Small m(8);
    HybridCache<> c(m.config(40));
    const auto p = tokens(33, 2);
    const SeqId a = prefill(c, p).seq;
    std::vector<std::int32_t> slots(8);
    for (std::int32_t at = 33; at < 48; ++at) {  // a decodes on: its window frees blocks 0 .. 8, cached; its full blocks stay held
      const std::int32_t t[] = {at};
      REQUIRE(c.reserve(a, t, slots).ok());
      REQUIRE(c.computed(a, at + 1).ok());
    }
    CHECK(c.usage(1).cached == 10);  // the last reserve saw 47 computed: it reads 40 on
    CHECK(c.match(p) == 32);  // the full group's blocks and the window's 6, 7 are all there
    // Another request takes every free block: the cached window blocks are recycled.
    const auto q = tokens(64, 7);
    const std::int32_t room = c.free_blocks();
    const auto z = std::span(q).first(std::size_t(room / 2 * 4));
    CHECK(c.admit(z, std::span(slots.data(), 0)).status().code() == Errc::buffer_too_small);
    std::vector<std::int32_t> zs(z.size() * 2);
    REQUIRE(c.admit(z, zs).ok());
    CHECK(c.usage(1).cached == room % 2);  // the most recently freed one, when room is odd
    CHECK(c.usage(0).held == 12 + room / 2);
    CHECK(c.match(p) == 0);  // full alone would serve 32: the window has none of the blocks a hit needs
    CHECK(c.check_invariants().ok());
  }
  SECTION("a chunked-local hit needs the current chunk's blocks") {
    Small m(16, AttentionKind::chunked_local);  // C 16
    HybridCache<> c(m.config(64));
    const auto p = tokens(37, 3);
    REQUIRE(c.free(prefill(c, p).seq).ok());
    const auto b = prefill(c, p);
    CHECK(b.cached_tokens == 36);  // chunk 2 starts at 32: blocks 8 (32 .. 35) needed, 0 .. 7 null
    CHECK(*c.blocks_held(b.seq, 1) == 2);
  }
  SECTION("cross-attention holds its encoder's blocks and does not limit hits") {
    std::vector<std::int32_t> l0{0}, l1{1};
    const LayerGroupSpec g[] = {{.layers = l0, .head_dim = 8},
                                {.kind = AttentionKind::cross, .layers = l1, .head_dim = 8, .encoder_len = 10}};
    HybridCache<> c({.groups = *LayerGroups::make({.groups = g, .block_size = 4}), .num_blocks = 32, .max_sequences = 2, .max_tokens = 32});
    const auto p = tokens(13, 4);
    const SeqId a = prefill(c, p).seq;
    CHECK(*c.blocks_held(a, 1) == 3);
    CHECK(*c.tokens_held(a, 1) == 10);
    std::vector<std::int32_t> enc(10);
    REQUIRE(c.slot_mapping(1, a, 0, 10, enc).ok());
    REQUIRE(c.free(a).ok());
    CHECK(prefill(c, p).cached_tokens == 12);
    CHECK(c.usage(1).cached == 0);  // never published
    CHECK(c.usage(1).held == 3);
    // Rolled back to no decoder tokens, a sequence keeps its encoder's blocks: reserving again needs the decoder's only.
    HybridCache<> tight({.groups = c.layer_groups(), .num_blocks = 1 + 1 + 3, .max_sequences = 1, .max_tokens = 32});
    const auto four = tokens(4, 5);
    std::vector<std::int32_t> s4(2 * 4);
    const SeqId x = tight.admit(four, s4)->seq;  // the full group's block and the encoder's 3: the whole pool
    REQUIRE(tight.free_blocks() == 0);
    REQUIRE(tight.truncate(x, 4).ok());
    CHECK(tight.free_blocks() == 1);
    CHECK(tight.reserve(x, four, s4).ok());
    CHECK(*tight.blocks_held(x, 1) == 3);
    CHECK(tight.check_invariants().ok());
  }
}

TEST_CASE("two-phase admit: a hit of one group is retained before another group allocates") {
  Small m(8);
  const auto p = tokens(17, 5);
  HybridCache<> c(m.config(1 + 10));
  REQUIRE(c.free(prefill(c, p).seq).ok());  // 5 blocks per group; none freed (no reserve after computed)
  CHECK(c.pool().num_cached() == 8);  // 4 full blocks per group published; the partial ones go back plain
  prefill(c, tokens(4, 11));  // takes the 2 plain blocks: free blocks are now exactly the next need
  REQUIRE(c.free_blocks() == 8);
  std::vector<std::int32_t> slots(2 * 17);
  // Hit 16: full retains its 4 cached blocks, the window its blocks 2, 3 (positions 9 .. 15 are read);
  // each group allocates 1: need 8 of 8. The cached blocks least recently freed are the full group's:
  // were the window's block allocated before the full group retained, it would recycle a hit block.
  const auto before = c;
  auto r = c.admit(p, slots);
  REQUIRE(r.ok());
  CHECK(r->cached_tokens == 16);
  CHECK(c.check_invariants().ok());
  CHECK(c.free_blocks() == 0);
  const SeqId one[] = {r->seq};
  std::vector<std::int32_t> table(5);
  REQUIRE(c.export_block_table(0, one, table, 5).ok());
  for (std::int32_t j = 0; j < 4; ++j) CHECK(c.pool().has_hash(table[std::size_t(j)]));  // still the cached content
  // Short of blocks: the same hit and 4 more tokens need 10 of 8; refused, nothing changed.
  HybridCache<> short_of = before;
  auto longer = p;
  longer.insert(longer.end(), {1, 2, 3, 4});
  std::vector<std::int32_t> more(2 * 21);
  CHECK(short_of.match(longer) == 16);
  CHECK(short_of.admit(longer, more).status() == Status{Errc::out_of_blocks, "n_blocks", 10, 8});
  CHECK(short_of == before);
}

TEST_CASE("the window's admission bound sizes the pool and admits the longest request") {
  Small m(8);
  for (const std::int32_t chunk : {0, 4, 5, 16}) {
    const std::int64_t blocks = hybrid_pool_blocks(m.lg, 1, 64, chunk);
    HybridCache<> c(m.config(std::int32_t(blocks), chunk));
    CHECK(c.can_admit(64, 0));  // a prompt of the model's length fits the pool sized for it
    CHECK(c.max_concurrency(64) == 1);
    CHECK(*c.blocks_needed(64, 0) == blocks - 1);
    CHECK(*c.blocks_needed(48, 16) <= blocks - 1);
    // Prefill 48 in chunks, then decode 16, computing each step before the next reserve: never short.
    const auto t = tokens(64, 6);
    std::vector<std::int32_t> slots(2 * 64);
    const std::int32_t step = chunk > 0 ? chunk : 48;
    auto a = c.admit(std::span(t).first(48), slots, {.reserve = step});
    REQUIRE(a.ok());
    const SeqId s = a->seq;
    std::int64_t at = a->reserved;
    std::int32_t peak = *c.blocks_held(s);
    REQUIRE(c.computed(s, at).ok());
    while (at < 64) {
      const auto n = std::int32_t(std::min<std::int64_t>(at < 48 ? step : 1, (at < 48 ? 48 : 64) - at));
      auto r = c.reserve(s, std::span(t).subspan(std::size_t(at), std::size_t(n)), slots);
      REQUIRE(r.ok());
      peak = std::max(peak, *c.blocks_held(s));
      at += n;
      REQUIRE(c.computed(s, at).ok());
      REQUIRE(c.check_invariants().ok());
    }
    CHECK(peak <= *c.blocks_needed(48, 16));  // what the scheduler was told bounds what the rows held
    INFO("chunk " << chunk);
    HybridCache<> less(m.config(std::int32_t(blocks - 1), chunk));
    CHECK_FALSE(less.can_admit(64, 0));
    // The ledger: a promise of the lifetime need leaves no room for a second request.
    HybridCache<> two(m.config(std::int32_t(2 * blocks - 1), chunk));
    std::vector<std::int32_t> first(2 * 8);
    const auto r = two.admit(std::span(t).first(8), first).value();
    REQUIRE(two.can_admit(64, 0));
    REQUIRE(two.promise(r.seq, *two.blocks_needed(64, 0)).ok());
    CHECK(two.promised_blocks() == *two.blocks_needed(64, 0) - *two.blocks_held(r.seq));
    CHECK(two.can_admit(64, 0));  // two requests' worth of pages: the second still fits
    const auto r2 = two.admit(std::span(t).first(8), first).value();
    REQUIRE(two.promise(r2.seq, *two.blocks_needed(64, 0)).ok());
    CHECK_FALSE(two.can_admit(1, 0));  // everything left is promised
    CHECK(two.promise(r2.seq, -1) == Status{Errc::invalid_argument, "blocks", -1, 0});
    REQUIRE(two.free(r.seq).ok());
    CHECK(two.can_admit(64, 0));
  }
}

TEST_CASE("prefill_chunk is enforced: no reserve holds more ahead of the computed tokens than the pool was sized for (issue 62)") {
  // Before the fix: window 8, blocks of 4, chunk 8: admit 8, then reserve 40
  // more before anything is computed: accepted, the window group held 12
  // blocks against its bound of 5.
  Small m(8);
  const std::int64_t bound = GroupRule::of(m.lg, 1).max_blocks(64, 8);
  CHECK(bound == 5);  // W - 1 + 8 = 15 tokens, starting anywhere in a block: 4 blocks, and one for the offset
  HybridCache<> c(m.config(64, 8));
  std::vector<std::int32_t> slots(2 * 48);
  const auto t = tokens(48);
  const auto a = c.admit(t, slots);  // the default reserve stops at the chunk
  REQUIRE(a.ok());
  CHECK(a->reserved == 8);
  CHECK(std::count(slots.begin() + 8, slots.begin() + 48, -1) == 40);  // [groups][48]: the rest of each group's row is -1
  const SeqId s = a->seq;
  const HybridCache<> before = c;
  CHECK(c.reserve(s, std::span(t).subspan(8, 40), slots).status() ==
        Status{Errc::invalid_argument, "n_tokens (past prefill_chunk: reserved, not computed)", 40, 0});
  CHECK(c.reserve(s, std::span(t).subspan(8, 1), slots).status().limit() == 0);
  CHECK(c == before);
  REQUIRE(c.computed(s, 5).ok());
  CHECK(c.reserve(s, std::span(t).subspan(8, 6), slots).status() ==
        Status{Errc::invalid_argument, "n_tokens (past prefill_chunk: reserved, not computed)", 6, 5});
  REQUIRE(c.reserve(s, std::span(t).subspan(8, 5), slots).ok());
  // advance counts every reserved token as computed: a whole chunk again.
  REQUIRE(c.advance(s, std::span(t).subspan(13, 8), slots).ok());
  CHECK(c.advance(s, std::span(t).subspan(21, 9), slots).status().what() == std::string("n_tokens (past prefill_chunk: reserved, not computed)"));
  CHECK(*c.blocks_held(s, 1) <= bound);
  CHECK(c.check_invariants().ok());
  // An explicit admission reserve past the chunk is refused; within it, or the prompt's rest within it, is fine.
  const HybridCache<> two = c;
  CHECK(c.admit(tokens(40, 3), slots, {.reserve = 9}).status() == Status{Errc::invalid_argument, "reserve (past prefill_chunk)", 9, 8});
  CHECK(c == two);
  CHECK(c.admit(tokens(6, 4), slots, {.reserve = 20}).ok());
  // Chunk 0: a whole prompt at once, so at most the prompt's length in flight.
  HybridCache<> whole(m.config(64));
  const auto w = whole.admit(std::span(t).first(16), slots);
  REQUIRE(w.ok());
  CHECK(w->reserved == 16);
  CHECK(whole.reserve(w->seq, std::span(t).subspan(16, 8), slots).status() ==
        Status{Errc::invalid_argument, "n_tokens (past prefill_chunk: reserved, not computed)", 8, 0});
  REQUIRE(whole.computed(w->seq, 16).ok());
  CHECK(whole.reserve(w->seq, std::span(t).subspan(16, 8), slots).ok());
  // A sequence from add_sequence() has no prompt to bound it by.
  const SeqId e = *whole.add_sequence();
  CHECK(whole.reserve(e, std::span(t).first(40), slots).ok());
  CHECK(whole.check_invariants().ok());
}

TEST_CASE("a chunked-local group's bound: C - 1 + chunk tokens from a block boundary (vLLM's), one block more when C is not a multiple") {
  const std::vector<std::int32_t> l0{0}, l1{1};
  for (const std::int32_t chunk_size : {8192, 8200}) {
    const LayerGroupSpec g[] = {{.kind = AttentionKind::full, .layers = l0, .num_kv_heads = 1, .head_dim = 8},
                                {.kind = AttentionKind::chunked_local, .layers = l1, .num_kv_heads = 1, .head_dim = 8, .chunk = chunk_size}};
    const LayerGroups lg = *LayerGroups::make({.groups = g, .block_size = 16});
    const GroupRule r = GroupRule::of(lg, 1);
    CAPTURE(chunk_size);
    // vLLM's ChunkedLocalAttentionSpec: cdiv(min(C + max_num_batched_tokens, max_model_len), block_size) = 576.
    CHECK(r.max_blocks(131072, 1024) == (chunk_size == 8192 ? 576 : 578));
    CHECK(r.max_blocks(100, 1024) == 7);  // never more than the request's own blocks
  }
  // Exact on a small one, checked against what a row holds at its worst: C 8, blocks of 4, chunk 3.
  Small m(8, AttentionKind::chunked_local);
  HybridCache<> c(m.config(64, 3));
  std::int32_t peak = 0;
  std::vector<std::int32_t> slots(2 * 3);
  const auto t = tokens(64);
  const SeqId s = *c.add_sequence();
  for (std::int64_t at = 0; at < 60; at += 3) {
    REQUIRE(c.reserve(s, std::span(t).subspan(std::size_t(at), 3), slots).ok());
    peak = std::max(peak, *c.blocks_held(s, 1));
    REQUIRE(c.computed(s, at + 3).ok());
  }
  CHECK(peak == GroupRule::of(m.lg, 1).max_blocks(64, 3));  // C - 1 + 3 = 10 tokens from a chunk's start: 3 blocks
  CHECK(peak == 3);
}

TEST_CASE("max_concurrency counts the blocks a request can hold: the null block is not one of them (unlike vLLM's estimate)") {
  // vLLM's get_max_concurrency_for_kv_cache_config divides num_blocks, null
  // block included, by a request's blocks: 387 / 129 = 3. Three requests of
  // 129 blocks need 387 usable blocks; this pool has 386, so kvcache says 2.
  Small m(8);
  const std::int64_t per = *HybridCache<>(m.config(400)).blocks_needed(64, 0);
  HybridCache<> c(m.config(std::int32_t(3 * per)));
  CHECK(c.max_concurrency(64) == 2);
  HybridCache<> d(m.config(std::int32_t(3 * per + 1)));
  CHECK(d.max_concurrency(64) == 3);
}

TEST_CASE("hybrid cache errors name the value and change nothing") {
  Small m(8);
  HybridCache<> c(m.config(16));
  std::vector<std::int32_t> slots(64);
  const auto t = tokens(60);
  const SeqId s = c.admit(std::span(t).first(12), slots, {.reserve = 8})->seq;
  const auto before = c;
  CHECK(c.admit(std::span(t).first(12), slots, {.reserve = 0}).status() == Status{Errc::invalid_argument, "reserve", 0, 1});
  CHECK(c.admit({}, slots).status() == Status{Errc::invalid_argument, "prompt.size", 0, 1});  // Cache<>'s words
  CHECK(c.admit(tokens(65), slots).status() == Status{Errc::capacity_exceeded, "n_tokens", 65, 64});
  CHECK(c.admit(std::span(t).first(12), std::span(slots).first(23)).status() == Status{Errc::buffer_too_small, "slots", 23, 24});
  CHECK(c.reserve(s, std::span(t).first(4), std::span(slots).first(7)).status() == Status{Errc::buffer_too_small, "slots", 7, 8});
  CHECK(c.reserve(s, 4, slots).status() == Status{Errc::invalid_argument, "n_tokens (prefix caching is on: pass the token ids)", 4, 0});
  CHECK(c.reserve(s, std::span(t).first(57), slots).status() == Status{Errc::capacity_exceeded, "n_tokens", 57, 56});
  CHECK(c.computed(s, 9) == Status{Errc::invalid_argument, "tokens (computed)", 9, 8});
  CHECK(c.truncate(s, 9) == Status{Errc::truncate_too_many, "n_tokens", 9, 8});
  CHECK(c.tokens_held(s, 2).status() == Status{Errc::invalid_argument, "group", 2, 1});
  std::vector<std::int32_t> table(4);
  const SeqId one[] = {s};
  CHECK(c.export_block_table(0, one, table, 1) == Status{Errc::buffer_too_small, "row_stride", 1, 2});
  CHECK(c.export_block_table(-1, one, table, 2) == Status{Errc::invalid_argument, "group", -1, 1});
  const SeqId stale{s.index, s.generation + 1};
  CHECK(c.free(stale).code() == Errc::unknown_sequence);
  CHECK(c.blocks_needed(-1, 0).status() == Status{Errc::invalid_argument, "prompt_len", -1, 0});
  CHECK(c.blocks_needed(60, 8).status() == Status{Errc::invalid_argument, "max_new", 8, 4});
  // The options every cache takes: what a hybrid cache cannot do is refused, naming it.
  const ExtraKey image[] = {{.begin = 0, .end = 4, .key = 7}};
  CHECK(c.admit(std::span(t).first(12), slots, {.extras = image}).status() ==
        Status{Errc::invalid_argument, "extras (a hybrid cache hashes no multimodal inputs)", 1, 0});
  CHECK(c.admit(std::span(t).first(12), slots, {.prefill_chunk = 4}).status() ==
        Status{Errc::invalid_argument, "prefill_chunk (HybridConfig::prefill_chunk is the bound)", 4, 0});
  CHECK(c.admit(std::span(t).first(12), slots, {.max_new = 60}).status().code() == Errc::invalid_argument);  // past max_tokens
  CHECK(c == before);
  // The rollback it allows: uncomputed tokens only.
  REQUIRE(c.truncate(s, 5).ok());
  CHECK(*c.tokens(s) == 3);
  CHECK(c.check_invariants().ok());
  CHECK_THROWS_AS(HybridCache<>(m.config(1)), ConfigError);
}

TEST_CASE("hybrid admit takes AdmitOptions: max_new promises the lifetime need, new_blocks counts what it allocated") {
  Small m(8);
  HybridCache<> c(m.config(24));
  std::vector<std::int32_t> slots(128);
  const auto t = tokens(60);
  const std::int64_t life = *c.blocks_needed(12, 20);
  const AdmitResult a = *c.admit(std::span(t).first(12), slots, {.max_new = 20});
  CHECK(a.cached_tokens == 0);
  CHECK(a.reserved == 12);
  CHECK(a.new_blocks == *c.blocks_held(a.seq));
  CHECK(a.promised == life);
  CHECK(c.promised_blocks() == life - a.new_blocks);
  // A promise that does not fit the free pool less the promises made is refused, naming max_new; nothing changes.
  const auto before = c;
  const std::int64_t room = c.free_blocks() - c.promised_blocks();
  std::int64_t too_many = 0;
  while (c.blocks_needed(8, too_many).ok() && *c.blocks_needed(8, too_many) <= room) ++too_many;
  REQUIRE(c.blocks_needed(8, too_many).ok());  // the pool runs out before max_tokens does
  const auto r = c.admit(std::span(t).first(8), slots, {.max_new = too_many});
  INFO(r.status().message() << " room " << room << " too_many " << too_many);
  CHECK(r.status() == Status{Errc::out_of_blocks, "max_new (the lifetime need past the free pool less promises)",
                             *c.blocks_needed(8, too_many), room});
  CHECK(c == before);
  const auto ok = c.admit(std::span(t).first(8), slots, {.max_new = too_many - 1});
  INFO(ok.status().message());
  CHECK(ok.ok());
  CHECK(c.check_invariants().ok());
}

TEST_CASE("match is the longest hit every group serves: a brute force over random pools agrees") {
  for (const AttentionKind second : {AttentionKind::sliding_window, AttentionKind::chunked_local}) {
    Small m(8, second);
    HybridCache<> c(m.config(24));
    std::mt19937 rng(second == AttentionKind::sliding_window ? 1 : 2);
    std::vector<std::vector<std::int32_t>> stems(3, std::vector<std::int32_t>(64));
    for (auto& s : stems)
      for (auto& t : s) t = std::int32_t(rng() % 7);  // few token values: stems share blocks now and then
    std::vector<SeqId> live;
    std::vector<std::int32_t> slots(2 * 64);
    std::int64_t hits = 0;
    for (std::int32_t step = 0; step < 400; ++step) {
      const auto& stem = stems[rng() % stems.size()];
      const auto prompt = std::span(stem).first(2 + rng() % 60);
      // The brute force: the longest h (a multiple of the alignment, below the length) whose every needed block is cached.
      std::int64_t want = 0;
      for (std::int64_t h = std::int64_t(prompt.size() - 1) / 4 * 4; h > 0 && want == 0; h -= 4) {
        bool all = true;
        for (std::int32_t g = 0; g < 2 && all; ++g) {
          std::vector<BlockHash> keys(16);
          const auto n = *c.hash_chain(g, prompt.first(std::size_t(h)), {}, keys);
          const GroupRule r = GroupRule::of(m.lg, g);
          for (std::int64_t j = r.hit_first_block(h); j < n && all; ++j) all = c.pool().lookup(keys[std::size_t(j)]) >= 0;
        }
        if (all) want = h;
      }
      REQUIRE(c.match(prompt) == want);
      hits += want > 0;
      if (live.size() < 3 && rng() % 2 == 0) {
        auto a = c.admit(prompt, slots);
        if (a) {
          REQUIRE(a->cached_tokens == want);
          REQUIRE(c.computed(a->seq, std::int64_t(prompt.size())).ok());
          live.push_back(a->seq);
        }
      } else if (!live.empty()) {
        const auto k = rng() % live.size();
        REQUIRE(c.free(live[k]).ok());
        live.erase(live.begin() + std::ptrdiff_t(k));
      }
      REQUIRE(c.check_invariants().ok());
    }
    CHECK(hits > 50);
  }
}
