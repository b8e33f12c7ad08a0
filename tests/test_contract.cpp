// One engine, written once against the sequence-cache contract
// (cache/contract.hpp), runs over each cache: token-paged (Cache<>),
// head-paged (Cache<..., WriteGate>) and layer groups (HybridCache). The
// admission ledger, frees, holds that outlive their sequence, events and
// invariants go through the contract alone, and so does growth on the two
// caches with token rows (GrowingCache: advance, computed); only a
// head-paged sequence grows by its own call (write). After every step the invariants
// hold; at the end every block and handle is back, and the contract's errors
// name their value and change nothing.
#include <catch2/catch.hpp>

#include <kvcache/admission/write_gate.hpp>
#include <kvcache/cache.hpp>
#include <kvcache/cache/contract.hpp>
#include <kvcache/cache/hybrid.hpp>

#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

using namespace kvcache;

namespace {

using GateCache = GatedCache<WriteGate>;
static_assert(std::is_same_v<GateCache, Cache<BlockPool, PageTable, WriteGate>>);  // the head-paged cache's own name
static_assert(SequenceHolds<Cache<>>);
static_assert(SequenceHolds<HybridCache<>>);
static_assert(SequenceCache<GateCache>);  // a head-paged row is per (layer, head): no whole-sequence hold yet
static_assert(PrefixCache<Cache<>> && PrefixCache<HybridCache<>>);
static_assert(!PrefixCache<GateCache>);  // its rows are per head: no prompt-level prefix cache
static_assert(ImportingCache<Cache<>> && ImportingCache<HybridCache<>>);
static_assert(GrowingCache<Cache<>> && GrowingCache<HybridCache<>>);
static_assert(!GrowingCache<GateCache>);  // a head-paged sequence grows by write(): per layer, gated

struct Outcome {
  std::int32_t finished = 0, held = 0, events = 0, peak_running = 0;
};

// The engine: admits requests while the ledger has room (its lifetime need
// beside what running requests may still take), decodes one token a step for
// each, and frees a finished request at once, every third one behind a hold
// that a transfer releases two steps later.
template <SequenceCache C, class Grow>
Outcome run_engine(C& cache, Grow grow, std::int32_t requests) {
  const std::int32_t blocks0 = cache.free_blocks(), handles0 = cache.free_sequences();
  std::mt19937 rng(7);
  struct Running {
    SeqId seq;
    std::int64_t need = 0, tokens = 0, length = 0;
  };
  std::vector<Running> running;
  std::vector<std::pair<std::uint64_t, std::int32_t>> holds;  // (hold, release at step)
  std::vector<BlockEvent> events(512);
  Outcome out;
  std::int32_t admitted = 0;
  for (std::int32_t step = 0; out.finished < requests; ++step) {
    REQUIRE(step < 10000);
    for (; admitted < requests; ++admitted) {  // admission by lifetime need
      const std::int64_t prompt = 6 + std::int64_t(rng() % 20), max_new = 2 + std::int64_t(rng() % 10);
      const auto need = cache.blocks_needed(prompt, max_new);
      REQUIRE(need.ok());
      std::int64_t owed = 0;
      for (const Running& r : running) owed += r.need - *cache.blocks_held(r.seq);
      if (!cache.can_admit(prompt, max_new) || *need + owed > cache.free_blocks()) break;
      const auto s = cache.add_sequence();
      REQUIRE(s.ok());
      REQUIRE(grow(cache, *s, 0, prompt));
      running.push_back({*s, *need, prompt, prompt + max_new});
    }
    out.peak_running = std::max(out.peak_running, std::int32_t(running.size()));
    for (auto it = running.begin(); it != running.end();) {  // a decode step, or the end
      if (it->tokens < it->length) {
        REQUIRE(grow(cache, it->seq, it->tokens, 1));
        ++it->tokens;
        ++it;
        continue;
      }
      if constexpr (SequenceHolds<C>) {
        if (out.finished % 3 == 0) {
          const auto h = cache.hold(it->seq);
          REQUIRE(h.ok());
          holds.push_back({*h, step + 2});
          ++out.held;
        }
      }
      REQUIRE(cache.free(it->seq).ok());
      it = running.erase(it);
      ++out.finished;
    }
    for (auto h = holds.begin(); h != holds.end();) {
      if (h->second > step) {
        ++h;
        continue;
      }
      REQUIRE(cache.release_hold(h->first).ok());
      h = holds.erase(h);
    }
    out.events += cache.drain_events(events);
    REQUIRE(cache.check_invariants().ok());
  }
  for (const auto& h : holds) REQUIRE(cache.release_hold(h.first).ok());
  CHECK(cache.free_blocks() == blocks0);
  CHECK(cache.free_sequences() == handles0);
  CHECK(cache.holds().size() == 0);
  CHECK(cache.promised_blocks() == 0);
  CHECK(cache.check_invariants().ok());
  return out;
}

// The contract's errors, on a cache the engine has run: typed, naming the value, changing nothing.
template <SequenceCache C>
void contract_errors(C& cache) {
  const auto s = cache.add_sequence();
  REQUIRE(s.ok());
  REQUIRE(cache.free(*s).ok());
  const C before = cache;
  // A stale handle, and one past the slots: the same words on every cache (check_handle).
  CHECK(cache.free(*s) == Status{Errc::unknown_sequence, "seq.generation", s->generation, s->generation + 1});
  CHECK(cache.blocks_held(*s).status() == Status{Errc::unknown_sequence, "seq.generation", s->generation, s->generation + 1});
  CHECK(cache.free(SeqId{1000, 0}).what() == std::string("seq.index"));
  CHECK(cache.release_hold(999999).code() == Errc::unknown_job);
  const BlockId bad[] = {cache.pool().capacity() + 3};
  CHECK(cache.hold(bad).status() == Status{Errc::invalid_argument, "block", bad[0], cache.pool().capacity() - 1});
  CHECK(cache.blocks_needed(-1, 0).status().code() == Errc::invalid_argument);
  CHECK(cache.blocks_needed(4, -1).status().code() == Errc::invalid_argument);
  CHECK(!cache.can_admit(-1, 0));
  std::vector<BlockEvent> events(1);
  std::vector<std::int32_t> ids(0);
  if (cache.pool().events().tokens_per_event() > 0)
    CHECK(cache.drain_events(events, ids).status().code() == Errc::buffer_too_small);
  CHECK(cache == before);
  if constexpr (GrowingCache<C>) {  // growth's errors: the same words on both caches with token rows
    const auto t = cache.add_sequence();
    REQUIRE(t.ok());
    std::vector<std::int32_t> one{5}, out(std::size_t(cache.groups()));
    REQUIRE(cache.advance(*t, one, out).ok());
    const C grown = cache;
    CHECK(cache.computed(*t, 2) == Status{Errc::invalid_argument, "tokens (computed)", 2, 1});
    CHECK(cache.computed(*s, 0).code() == Errc::unknown_sequence);
    CHECK(cache.advance(*s, one, out).status().code() == Errc::unknown_sequence);
    CHECK(cache.reserve(*t, one, std::span(out).first(0)).status().code() == Errc::buffer_too_small);
    // A count out of range: the same status, word and limit on both.
    CHECK(cache.truncate(*t, 2) == Status{Errc::truncate_too_many, "n_tokens", 2, 1});
    CHECK(cache.truncate(*t, -1) == Status{Errc::invalid_argument, "n_tokens", -1, 0});
    std::vector<std::int32_t> many(40, 3), room(std::size_t(cache.groups()) * 40);
    CHECK(cache.reserve(*t, many, room).status() == Status{Errc::capacity_exceeded, "n_tokens", 40, 39});
    const SeqId batch[] = {*t};
    const std::int32_t negative[] = {-1};
    CHECK(cache.advance_batch(batch, negative, {}, room).status() == Status{Errc::invalid_argument, "n_tokens", -1, 0});
    CHECK(cache == grown);
    REQUIRE(cache.free(*t).ok());
  }
  if constexpr (PrefixCache<C>) {  // the ledger: one implementation, the same checks and words on every cache
    const auto p = cache.add_sequence();
    REQUIRE(p.ok());
    const C fresh = cache;
    CHECK(cache.promise(*p, -1) == Status{Errc::invalid_argument, "blocks", -1, 0});
    const Status too_many = cache.promise(*p, std::int64_t{1} << 40);  // past what one sequence can ever hold
    CHECK(too_many.code() == Errc::invalid_argument);
    CHECK(too_many.what() == std::string("blocks"));
    CHECK(too_many.limit() > 0);
    CHECK(cache.promise(*s, 1).code() == Errc::unknown_sequence);
    CHECK(cache == fresh);
    REQUIRE(cache.promise(*p, too_many.limit()).ok());  // the most is accepted
    CHECK(cache.promised_blocks() == too_many.limit() - *cache.blocks_held(*p));
    CHECK(cache.check_invariants().ok());
    REQUIRE(cache.free(*p).ok());  // and forgotten with its sequence
    CHECK(cache.promised_blocks() == 0);
    CHECK(cache.check_invariants().ok());
  }
  // Every handle in use: a new one is refused with the same words on every cache (no_free_handle).
  std::vector<SeqId> all;
  const std::int32_t slots = cache.free_sequences();
  for (std::int32_t i = 0; i < slots; ++i) all.push_back(*cache.add_sequence());
  const auto full = cache.add_sequence();
  CHECK(full.status().code() == Errc::capacity_exceeded);
  CHECK(full.status().what() == std::string("max_sequences"));
  CHECK(full.status().limit() + 1 == full.status().value());
  for (const SeqId x : all) REQUIRE(cache.free(x).ok());
}

// A prefix-caching engine, written once against PrefixCache: requests that
// share a system prompt are admitted with AdmitOptions (a promise of their
// lifetime need); each one's hit is what match() said before, its length is
// the hit plus what admit reserved, later requests hit what earlier ones
// published, and every promise, block and handle comes back.
template <PrefixCache C, class Grow>
void run_prefix_engine(C& cache, Grow grow) {
  const std::int32_t blocks0 = cache.free_blocks();
  std::mt19937 rng(3);
  std::vector<std::int32_t> slots(512);
  std::int64_t hits = 0;
  for (std::int32_t r = 0; r < 12; ++r) {
    std::vector<std::int32_t> prompt(16);
    for (std::int32_t i = 0; i < 16; ++i) prompt[std::size_t(i)] = 100 + i;  // the shared system prompt
    for (std::int32_t i = 0, n = 1 + std::int32_t(rng() % 6); i < n; ++i) prompt.push_back(std::int32_t(rng() % 50000));
    const std::int64_t seen = cache.match(prompt, {});
    const auto a = cache.admit(prompt, slots, {.max_new = 4});
    REQUIRE(a.ok());
    CHECK(a->cached_tokens == seen);
    CHECK(*cache.tokens(a->seq) == a->cached_tokens + a->reserved);
    CHECK(a->cached_tokens + a->reserved == std::int32_t(prompt.size()));
    CHECK(a->promised == *cache.blocks_needed(std::int64_t(prompt.size()), 4));
    CHECK(a->new_blocks <= *cache.blocks_held(a->seq));
    hits += a->cached_tokens;
    REQUIRE(grow(cache, a->seq, prompt));  // the prompt computed, then 4 tokens decoded
    CHECK(*cache.tokens(a->seq) == std::int64_t(prompt.size()) + 4);
    REQUIRE(cache.check_invariants().ok());
    REQUIRE(cache.free(a->seq).ok());
  }
  CHECK(hits >= 11 * 12);  // every later request hits the system prompt's whole blocks (12 of its 16 tokens at least)
  CHECK(cache.promised_blocks() == 0);
  CHECK(cache.free_blocks() == blocks0);
  // What prefix_stats() reports, and reset_prefix_cache(): refused while a block is held, changing nothing.
  const PrefixStats st = cache.prefix_stats();
  CHECK((st.queries == 12 && st.hit_tokens == hits && st.query_tokens >= 12 * 17 && st.query_tokens <= 12 * 22));
  CHECK((st.hashes > 0 && st.used_hashed == 0 && st.used_plain == 0 && st.free_cached + st.free_plain == blocks0));
  std::vector<std::int32_t> system(17);
  for (std::int32_t i = 0; i < 17; ++i) system[std::size_t(i)] = 100 + i;
  const std::int64_t cached = cache.match(system, {});
  CHECK(cached >= 12);
  const auto a = cache.admit(system, slots, {});
  REQUIRE(a.ok());
  const C before = cache;
  const Status busy = cache.reset_prefix_cache();
  CHECK(busy.code() == Errc::blocks_in_use);
  CHECK(cache == before);
  REQUIRE(cache.free(a->seq).ok());
  REQUIRE(cache.reset_prefix_cache().ok());
  CHECK((cache.match(system, {}) == 0 && cache.prefix_stats().hashes == 0 && cache.prefix_stats().queries == 13));
  REQUIRE(cache.check_invariants().ok());
}

// A disaggregated decode engine, written once against ImportingCache: each
// request's prompt arrives from a peer. The import's blocks, group by
// group, are what it receives (their count is the plan's); a commit naming
// another prompt is refused and changes nothing; the transfer lands (the
// sequence holds the prompt, published: the next request hits it) or fails
// (the sequence holds the hit, the rest to recompute). Every promise, block
// and handle comes back.
template <ImportingCache C>
void run_import_engine(C& cache) {
  const std::int32_t blocks0 = cache.free_blocks();
  std::mt19937 rng(5);
  std::int32_t hits = 0, landed = 0;
  for (std::int32_t r = 0; r < 12; ++r) {
    std::vector<std::int32_t> prompt(16);
    for (std::int32_t i = 0; i < 16; ++i) prompt[std::size_t(i)] = 100 + i;  // the shared system prompt
    for (std::int32_t i = 0, n = 1 + std::int32_t(rng() % 6); i < n; ++i) prompt.push_back(std::int32_t(rng() % 50000));
    const std::int64_t seen = cache.match(prompt, {});
    const auto plan = cache.import(prompt, {.max_new = 4});
    REQUIRE(plan.ok());
    CHECK(plan->cached_tokens == seen);
    hits += plan->cached_tokens;
    std::int32_t receive = 0;
    for (std::int32_t g = 0; g < cache.groups(); ++g) {
      const auto gb = cache.import_blocks(plan->id, g);
      REQUIRE(gb.ok());
      CHECK(gb->group == g);
      if (g == 0) CHECK(gb->skip == plan->skip);
      receive += std::int32_t(gb->local.size());
    }
    CHECK(receive == plan->num_blocks);
    CHECK(cache.import_blocks(plan->id, cache.groups()).status().what() == std::string("group"));
    CHECK(cache.imports().size() == 1);
    const C before = cache;
    auto other = prompt;
    other.back() += 1;
    CHECK(cache.commit_import(plan->id, other).status() ==
          Status{Errc::invalid_argument, "prompt (not the tokens imported)", std::int64_t(prompt.size()), std::int64_t(prompt.size())});
    CHECK(cache == before);
    SeqId s{};
    if (r % 4 != 3) {
      const auto c = cache.commit_import(plan->id, prompt);
      REQUIRE(c.ok());
      CHECK(*cache.tokens(c->seq) == std::int64_t(prompt.size()));
      s = c->seq;
      ++landed;
    } else {
      const auto a = cache.abort_import(plan->id);
      REQUIRE(a.ok());
      CHECK(a->cached_tokens == plan->cached_tokens);
      CHECK(a->recompute == std::int32_t(prompt.size()) - plan->cached_tokens);
      CHECK(*cache.tokens(a->seq) == a->cached_tokens);
      s = a->seq;
    }
    CHECK(cache.imports().size() == 0);
    CHECK(cache.commit_import(plan->id, prompt).status().code() == Errc::unknown_job);
    REQUIRE(cache.check_invariants().ok());
    REQUIRE(cache.free(s).ok());
  }
  CHECK(landed == 9);
  CHECK(hits >= 11 * 12);  // every later request hits the system prompt's whole blocks (12 of its 16 tokens at least)
  CHECK(cache.promised_blocks() == 0);
  CHECK(cache.free_blocks() == blocks0);
}

// The hybrid sections' layout: full attention on layer 0, a window of 8 on layer 1, blocks of 4.
LayerGroups full_and_window() {
  static const std::int32_t l0[] = {0}, l1[] = {1};  // the specs' layer spans outlive the layout
  const LayerGroupSpec specs[] = {
      {.kind = AttentionKind::full, .layers = l0, .num_kv_heads = 2, .head_dim = 8},
      {.kind = AttentionKind::sliding_window, .layers = l1, .num_kv_heads = 2, .head_dim = 8, .window = 8}};
  return *LayerGroups::make({.groups = specs, .block_size = 4});
}

// Four decode steps by the contract's growth (GrowingCache), then the last token computed.
template <GrowingCache C>
bool decode_four(C& c, SeqId s, std::span<std::int32_t> slots) {
  for (std::int32_t t = 0; t < 4; ++t) {
    const std::int32_t tok[] = {7 + t};
    if (!c.advance(s, tok, slots).ok()) return false;
  }
  return c.computed(s, *c.tokens(s)).ok();
}

// The ids of positions [at, at + n): what a cache that publishes is given.
std::span<const std::int32_t> ids_at(std::vector<std::int32_t>& ids, std::int64_t at, std::int64_t n) {
  ids.resize(std::size_t(n));
  for (std::int64_t i = 0; i < n; ++i) ids[std::size_t(i)] = std::int32_t(((at + i) * 7919) % 50021);
  return ids;
}

// Growing a token-row cache by the contract: tokens [at, at + n) advanced with their ids.
template <GrowingCache C>
auto grow_by_contract(std::vector<std::int32_t>& ids, std::vector<std::int32_t>& slots) {
  return [&ids, &slots](C& c, SeqId s, std::int64_t at, std::int64_t n) { return c.advance(s, ids_at(ids, at, n), slots).ok(); };
}

}  // namespace

TEST_CASE("one engine over each cache: the contract's calls, growth included where rows are token rows") {
  const auto g = *Geometry::make({.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .block_size = 4, .dtype = DType::f32});

  SECTION("token-paged: Cache<> publishing on reserve, with events") {
    Cache<> cache({.geometry = g, .num_blocks = 40, .max_sequences = 6, .max_blocks_per_sequence = 10, .event_capacity = 512,
                   .publish_on_reserve = true});
    std::vector<std::int32_t> ids, slots(64);
    const Outcome o = run_engine(cache, grow_by_contract<Cache<>>(ids, slots), 24);
    CHECK(o.finished == 24);
    CHECK(o.held == 8);
    CHECK(o.events > 0);
    CHECK(o.peak_running > 1);
    contract_errors(cache);
  }
  SECTION("head-paged: Cache<..., WriteGate>, every token admitted") {
    const auto one = *Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = 8, .block_size = 2, .dtype = DType::f32});
    GateCache cache({.geometry = one, .num_blocks = 400, .max_sequences = 6, .max_blocks_per_sequence = 20},
                    WriteGateConfig{.num_layers = 2, .num_kv_heads = 2, .local_window = 4, .tau = 0.5f, .global_cap = 36});
    std::vector<float> gates;
    std::vector<std::int32_t> slots(256);
    std::vector<SlotMove> moves(256);
    const auto grow = [&](GateCache& c, SeqId s, std::int64_t, std::int64_t n) {
      gates.assign(std::size_t(2 * n), 1.0f);
      for (std::int32_t l = 0; l < 2; ++l)
        if (!c.write(s, l, gates, {.slots = slots, .moves = moves}).ok()) return false;
      return true;
    };
    const Outcome o = run_engine(cache, grow, 24);
    CHECK(o.finished == 24);
    CHECK(o.peak_running > 1);
    contract_errors(cache);
  }
  SECTION("layer groups: HybridCache, full attention + a sliding window, with events") {
    HybridCache<> cache({.groups = full_and_window(), .num_blocks = 60, .max_sequences = 6,
                         .max_tokens = 40, .event_capacity = 512});
    std::vector<std::int32_t> ids, slots(128);
    const Outcome o = run_engine(cache, grow_by_contract<HybridCache<>>(ids, slots), 24);
    CHECK(o.finished == 24);
    CHECK(o.held == 8);
    CHECK(o.events > 0);
    CHECK(o.peak_running > 1);
    contract_errors(cache);
  }
}

TEST_CASE("one prefix-caching engine over Cache<> and HybridCache: admit, match, tokens and growth are one vocabulary") {
  std::vector<std::int32_t> slots(8);
  SECTION("Cache<>, publishing on reserve") {
    const auto g = *Geometry::make({.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .block_size = 4, .dtype = DType::f32});
    Cache<> cache({.geometry = g, .num_blocks = 40, .max_sequences = 2, .max_blocks_per_sequence = 10, .publish_on_reserve = true});
    run_prefix_engine(cache, [&](Cache<>& c, SeqId s, const std::vector<std::int32_t>&) { return decode_four(c, s, slots); });
  }
  SECTION("HybridCache, full attention + a sliding window") {
    HybridCache<> cache({.groups = full_and_window(), .num_blocks = 40, .max_sequences = 2,
                         .max_tokens = 40});
    run_prefix_engine(cache, [&](HybridCache<>& c, SeqId s, const std::vector<std::int32_t>&) { return decode_four(c, s, slots); });
  }
}

TEST_CASE("one disaggregated decode engine over Cache<> and HybridCache: import, import_blocks, commit_import and abort_import are one vocabulary") {
  SECTION("Cache<>") {
    const auto g = *Geometry::make({.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .block_size = 4, .dtype = DType::f32});
    Cache<> cache({.geometry = g, .num_blocks = 40, .max_sequences = 2, .max_blocks_per_sequence = 10});
    run_import_engine(cache);
  }
  SECTION("HybridCache, full attention + a sliding window") {
    HybridCache<> cache({.groups = full_and_window(), .num_blocks = 40, .max_sequences = 2,
                         .max_tokens = 40});
    run_import_engine(cache);
  }
}

// Two copies of one cache run the same decode steps, one by advance() of
// each sequence, the other by one advance_batch() a step (ragged counts,
// zeros included): after every step their states are equal and so are the
// slots, laid out [groups][stride] with -1 past the batch's. Then the
// batch's refusals: each changes nothing and leaves every slot -1.
template <GrowingCache C>
void batch_is_each_in_order(C a, std::int32_t groups) {
  C b = a;
  std::mt19937 rng(11);
  std::vector<SeqId> seqs;
  std::vector<std::int32_t> ids, slots(std::size_t(groups) * 64);
  for (std::int32_t r = 0; r < 4; ++r) {
    std::vector<std::int32_t> prompt(std::size_t(5 + 3 * r));
    for (auto& t : prompt) t = std::int32_t(rng() % 1000);
    const auto x = a.admit(prompt, slots, {}), y = b.admit(prompt, slots, {});
    REQUIRE((x.ok() && y.ok() && x->seq == y->seq));
    seqs.push_back(x->seq);
  }
  constexpr std::int32_t stride = 12;  // a padded batch; got is one longer: slots.size() / groups() is still 12 a group on two
  std::vector<std::int32_t> want(std::size_t(groups) * stride), got(want.size() + 1), one(std::size_t(groups) * 3), counts(4);
  std::vector<BlockCopy> copies(4);
  for (std::int32_t step = 0; step < 24; ++step) {
    ids.clear();
    std::fill(want.begin(), want.end(), -1);
    std::int32_t at = 0;
    for (std::size_t k = 0; k < seqs.size(); ++k) {
      counts[k] = std::int32_t(rng() % 4);
      for (std::int32_t j = 0; j < counts[k]; ++j) ids.push_back(std::int32_t(rng() % 1000));
      const auto r = a.advance(seqs[k], std::span<const std::int32_t>(ids).subspan(std::size_t(at), std::size_t(counts[k])), one);
      REQUIRE(r.ok());
      for (std::int32_t g = 0; g < groups; ++g)
        for (std::int32_t j = 0; j < counts[k]; ++j) want[std::size_t(g * stride + at + j)] = one[std::size_t(g * counts[k] + j)];
      at += counts[k];
    }
    std::fill(got.begin(), got.end(), 5);
    const auto r = b.advance_batch(seqs, counts, ids, got, copies);
    REQUIRE(r.ok());
    CHECK((r->slots == at && r->copies == 0));
    CHECK(std::equal(want.begin(), want.end(), got.begin()));
    CHECK(std::all_of(got.begin() + std::ptrdiff_t(want.size()), got.end(), [](std::int32_t x) { return x == -1; }));
    CHECK(a == b);
    REQUIRE(b.check_invariants().ok());
  }
  // Refusals: another count list, a sequence twice, a freed handle, ids of another length, too few slots, too much.
  const C before = b;
  const auto refused = [&](std::span<const SeqId> s, std::span<const std::int32_t> c, std::span<const std::int32_t> i,
                           std::span<std::int32_t> out) {
    std::fill(out.begin(), out.end(), 5);
    const auto r = b.advance_batch(s, c, i, out, copies);
    CHECK(!r.ok());
    CHECK(std::all_of(out.begin(), out.end(), [](std::int32_t x) { return x == -1; }));
    CHECK(b == before);
    return r.ok() ? Errc::ok : r.status().code();
  };
  const std::int32_t two[] = {1, 1}, tok[] = {3, 4};
  const SeqId dup[] = {seqs[0], seqs[0]};
  CHECK(refused(seqs, std::span(two), tok, got) == Errc::invalid_argument);  // 4 sequences, 2 counts
  CHECK(refused(dup, std::span(two), tok, got) == Errc::duplicate_sequence);
  const SeqId gone[] = {seqs[1], SeqId{seqs[2].index, seqs[2].generation + 1}};
  CHECK(refused(gone, std::span(two), tok, got) != Errc::ok);
  CHECK(refused(std::span(seqs).first(2), std::span(two), std::span(tok).first(1), got) == Errc::invalid_argument);
  CHECK(b.advance_batch(std::span(seqs).first(2), std::span(two), std::span(tok).first(1), got, copies).status() ==
        Status{Errc::invalid_argument, "ids.size (the sum of counts)", 1, 2});  // one check, the same words on both caches
  CHECK(b == before);
  CHECK(refused(std::span(seqs).first(2), std::span(two), tok, std::span(got).first(std::size_t(groups))) == Errc::buffer_too_small);
  std::vector<std::int32_t> many(4000, 1);
  const std::int32_t lots[] = {1, 3998};
  std::vector<std::int32_t> wide(std::size_t(groups) * 4000);
  CHECK(refused(std::span(seqs).first(2), std::span(lots), std::span(many).first(3999), wide) != Errc::ok);
}

TEST_CASE("advance_batch is advance() of each entry in order, all or nothing, on Cache<> and HybridCache") {
  SECTION("Cache<>, publishing on reserve") {
    const auto g = *Geometry::make({.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .block_size = 4, .dtype = DType::f32});
    batch_is_each_in_order(Cache<>({.geometry = g, .num_blocks = 200, .max_sequences = 4, .max_blocks_per_sequence = 40,
                                    .publish_on_reserve = true}),
                           1);
  }
  SECTION("HybridCache, full attention + a sliding window") {
    batch_is_each_in_order(HybridCache<>({.groups = full_and_window(), .num_blocks = 200, .max_sequences = 4, .max_tokens = 120}), 2);
  }
}

TEST_CASE("the core every cache keeps its sequences in: FreeHandles and PromiseLedger") {
  FreeHandles free(3);
  CHECK(free.size() == 3);
  CHECK(*free.next() == 0);  // slot 0 first, then in order
  CHECK(*free.take() == 0);
  CHECK(*free.take() == 1);
  free.give(0);
  CHECK(*free.next() == 0);  // the last given back goes out next
  CHECK(*free.take() == 0);
  CHECK(*free.take() == 2);
  CHECK(free.empty());
  CHECK(free.take().status() == Status{Errc::capacity_exceeded, "max_sequences", 4, 3});  // no_free_handle's words
  CHECK(free.next().status() == free.take().status());
  FreeHandles other(3);
  CHECK_FALSE(free == other);

  PromiseLedger ledger(3);
  CHECK(ledger.promise(1, 7, 6) == Status{Errc::invalid_argument, "blocks", 7, 6});
  CHECK(ledger.promise(1, -2, 6) == Status{Errc::invalid_argument, "blocks", -2, 0});
  CHECK(ledger == PromiseLedger(3));  // refused: nothing changed
  REQUIRE(ledger.promise(1, 6, 6).ok());
  ledger.record(2, 4);
  const std::int64_t held[] = {9, 2, 5};  // slot 0 holds blocks but promised nothing: owes nothing
  CHECK(ledger.outstanding([&](std::uint32_t i) { return held[i]; }) == 4);  // 6 - 2, and slot 2 holds past its 4
  ledger.copy(1, 0);
  CHECK(ledger.promised(0) == 6);
  CHECK(ledger.outstanding([&](std::uint32_t i) { return held[i]; }) == 4);
  // A free slot that still owes is a bug the caches' check_invariants() reports.
  CHECK(ledger.check([](std::uint32_t i) { return i != 2; }) == Status{Errc::invariant_violated, "promise (a free handle)", 2, 4});
  ledger.forget(2);
  CHECK(ledger.check([](std::uint32_t i) { return i != 2; }).ok());
}

TEST_CASE("every cache refuses the configuration fields they share with the same words (check_pool_config)") {
  const auto g = *Geometry::make({.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .block_size = 4, .dtype = DType::f32});
  const auto one = *Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = 8, .block_size = 2, .dtype = DType::f32});
  const CacheConfig paged{.geometry = g, .num_blocks = 40, .max_sequences = 6, .max_blocks_per_sequence = 10};
  const HybridConfig hybrid{.groups = full_and_window(), .num_blocks = 60, .max_sequences = 6, .max_tokens = 40};
  const auto refusal = [](auto make) -> Status {
    try {
      make();
    } catch (const ConfigError& e) {
      return e.status();
    }
    return {};
  };
  const struct {
    std::int32_t num_blocks, max_sequences, event_capacity;
    Status want;
  } bad[] = {{1, 6, 0, Status{Errc::invalid_argument, "num_blocks", 1, 2}},
             {40, 0, 0, Status{Errc::invalid_argument, "max_sequences", 0, 1}},
             {40, 6, -1, Status{Errc::invalid_argument, "event_capacity", -1, 0}}};
  for (const auto& b : bad) {
    CacheConfig p = paged;
    HybridConfig h = hybrid;
    p.num_blocks = h.num_blocks = b.num_blocks;
    p.max_sequences = h.max_sequences = b.max_sequences;
    p.event_capacity = h.event_capacity = b.event_capacity;
    CHECK(refusal([&] { Cache<> c(p); }) == b.want);
    CHECK(refusal([&] { HybridCache<> c(h); }) == b.want);
    p.geometry = one;  // head-paged: one layer and kv-head a block
    CHECK(refusal([&] {
            GateCache c(p, WriteGateConfig{.num_layers = 2, .num_kv_heads = 2, .local_window = 4, .tau = 0.5f, .global_cap = 36});
          }) == b.want);
  }
}
