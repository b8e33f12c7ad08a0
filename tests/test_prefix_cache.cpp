// The prefix cache through Cache: copies of a hash serving hits, atomic
// admission with the lifetime ledger, publishing on reserve, multimodal extra
// keys, and router events with counters. Each scenario is written against the
// behaviour engine authors expect from vLLM's prefix cache (or better).
#include <catch2/catch.hpp>

#include <kvcache/cache.hpp>
#include <kvcache/eviction/sliding_window.hpp>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

using namespace kvcache;

namespace {

constexpr std::int32_t B = 4;

CacheConfig config(std::int32_t blocks = 24, bool on_reserve = false) {
  return {.geometry = *Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = 8, .block_size = B}),
          .num_blocks = blocks,
          .max_sequences = 8,
          .max_blocks_per_sequence = 16,
          .event_capacity = 64,
          .publish_on_reserve = on_reserve};
}

std::vector<std::int32_t> iota(std::int32_t n, std::int32_t from = 100) {
  std::vector<std::int32_t> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), from);
  return v;
}

template <class C>
void require_ok(const C& cache) {
  const Status st = cache.check_invariants();
  INFO(st.message());
  REQUIRE(st.ok());
}

// A sequence that wrote `tokens` and published them (no prefix lookup).
template <class C>
SeqId prefill(C& cache, std::span<const std::int32_t> tokens, const PrefixKey& key = {}) {
  const SeqId s = *cache.add_sequence(key);
  std::vector<std::int32_t> slots(tokens.size());
  REQUIRE(cache.reserve(s, std::int32_t(tokens.size()), slots).ok());
  REQUIRE(cache.publish(s, tokens).ok());
  return s;
}

// Holds every plain free block, so allocation must recycle cached content.
// Returns the last holder (it has room for more).
template <class C>
SeqId hog_plain(C& cache) {
  std::vector<std::int32_t> slots(std::size_t(8 * B));
  SeqId h{};
  for (std::int32_t plain; (plain = cache.free_blocks() - cache.pool().num_cached()) > 0;) {
    h = *cache.add_sequence();
    const std::int32_t n = std::min(plain, 8);
    REQUIRE(cache.reserve(h, n * B, slots).ok());
  }
  return h;
}

}  // namespace

TEST_CASE("two identical prompts: the second copy keeps serving hits after the first is freed and recycled") {
  Cache<> cache(config());
  const auto prompt = iota(12);  // three full blocks
  const SeqId a = prefill(cache, prompt), b = prefill(cache, prompt);  // written twice: copies
  CHECK(cache.prefix_stats().pool.copies == 3);
  CHECK(cache.pool().num_published() == 3);
  const auto b_blocks = std::vector<BlockId>(cache.table().blocks(b)->begin(), cache.table().blocks(b)->end());
  REQUIRE(cache.free(a).ok());  // the first copies are redundant now: plain free
  const SeqId hog = hog_plain(cache);  // takes them
  std::vector<BlockId> hit(4);
  auto probe = iota(13);
  REQUIRE(cache.match_prefix(probe, {}, hit) == 3);
  CHECK(std::equal(b_blocks.begin(), b_blocks.end(), hit.begin()));  // served by the second copy
  // Then the second copy is freed too: cached, and hit from the free queue.
  REQUIRE(cache.free(b).ok());
  CHECK(cache.pool().num_cached() == 3);
  auto again = cache.add_sequence(probe);
  REQUIRE(again.ok());
  CHECK(again->cached_tokens == 12);
  (void)hog;
  require_ok(cache);
}

TEST_CASE("n > 1 sampling: forks that write the same generated block publish one hash, and either copy serves it") {
  Cache<> cache(config());
  const auto prompt = iota(6);
  const SeqId p = prefill(cache, prompt);
  const SeqId c = *cache.fork(p);
  std::vector<std::int32_t> slots(2), full(prompt);
  full.insert(full.end(), {7, 8});  // both samples produce the same two tokens
  for (SeqId s : {p, c}) {
    auto r = cache.reserve(s, 2, slots);
    REQUIRE(r.ok());
    REQUIRE(cache.publish(s, full).ok());
  }
  CHECK(cache.pool().num_published() == 2);
  const BlockId second_of_c = (*cache.table().blocks(c))[1];
  REQUIRE(cache.free(p).ok());  // the parent's copy goes
  std::vector<BlockId> hit(4);
  full.push_back(9);
  REQUIRE(cache.match_prefix(full, {}, hit) == 2);
  CHECK(hit[1] == second_of_c);
  require_ok(cache);
}

TEST_CASE("admit is all or nothing: a failure leaves the free queue's order, and the hit blocks, as they were") {
  Cache<> cache(config(12));
  const auto prompt = iota(8);  // two blocks, cached after the free
  REQUIRE(cache.free(prefill(cache, prompt)).ok());
  const SeqId hog = *cache.add_sequence();
  std::vector<std::int32_t> slots(64);
  REQUIRE(cache.reserve(hog, (cache.free_blocks() - 2 - 2) * B, slots).ok());  // 2 plain + 2 cached left
  auto longer = iota(8 + 3 * B);
  {  // The hit takes the 2 cached blocks; the rest needs 3 more: only 2 are left.
    const Cache<> before = cache;
    auto r = cache.admit(longer, slots);
    CHECK(r.status().message() == "out_of_blocks: n_blocks=3 (limit 2)");
    CHECK(cache == before);  // the pool's queue links included
  }
  {  // What the two-call pattern does instead: the hit moves in the LRU order.
    Cache<> twocall = cache;
    auto s = twocall.add_sequence(longer);
    REQUIRE(s->cached_tokens == 8);
    CHECK_FALSE(twocall.reserve(s->seq, 3 * B + 0, slots).ok());
    REQUIRE(twocall.free(s->seq).ok());
    CHECK_FALSE(twocall == cache);
  }
  // Every bad argument is a typed error naming the value, and changes nothing.
  const Cache<> before = cache;
  CHECK(cache.admit({}, slots).status().message() == "invalid_argument: prompt.size=0 (limit 1)");
  CHECK(cache.admit(prompt, std::span(slots).first(1)).status().message() == "buffer_too_small: slots=1 (limit 4)");
  CHECK(cache.admit(prompt, slots, {.reserve = -1}).status().code() == Errc::invalid_argument);
  CHECK(cache.admit(prompt, slots, {.max_new = -2}).status().message() == "invalid_argument: max_new=-2 (limit -1)");
  const ExtraKey bad[] = {{.begin = 4, .end = 6, .key = 1}, {.begin = 5, .end = 7, .key = 2}};
  CHECK(cache.admit(prompt, slots, {.extras = bad}).status().code() == Errc::invalid_argument);
  CHECK(cache.admit(iota(17 * B), slots).status().code() == Errc::capacity_exceeded);
  CHECK(cache == before);
  // A prompt that fits: the hit is shared, the rest reserved, in one call.
  auto ok = cache.admit(iota(8 + 2 * B), slots);
  REQUIRE(ok.ok());
  CHECK(ok->cached_tokens == 8);
  CHECK(ok->reserved == 2 * B);
  CHECK(ok->new_blocks == 2);
  CHECK(*cache.tokens_held(ok->seq) == 8 + 2 * B);
  const auto row = *cache.table().blocks(ok->seq);
  CHECK(slots[0] == row[2] * B);
  CHECK(cache.prefix_stats().hit_tokens == 8);
  require_ok(cache);
  // Sequence handles run out: capacity_exceeded, unchanged.
  std::vector<SeqId> held;
  while (cache.free_sequences() > 0) held.push_back(*cache.add_sequence());
  const Cache<> full = cache;
  CHECK(cache.admit(prompt, slots).status().code() == Errc::capacity_exceeded);
  CHECK(cache == full);
}

TEST_CASE("plan_admission counts the hit: free-but-cached hit blocks come from the free pool, held ones do not") {
  Cache<> cache(config(32));
  const auto prompt = iota(9);
  const SeqId held = prefill(cache, prompt);  // its two full blocks stay held
  REQUIRE(cache.free(prefill(cache, iota(9, 500))).ok());  // two more, cached free
  auto live = cache.plan_admission(prompt, {.max_new = 7});
  REQUIRE(live.ok());
  CHECK(live->hit.blocks == 2);
  CHECK(live->hit.free_blocks == 0);
  CHECK(live->lifetime == 4);  // ceil(16 / 4)
  CHECK(live->from_free == 2);  // the held hit blocks cost nothing
  auto cached = cache.plan_admission(iota(9, 500), {.max_new = 7});
  CHECK(cached->hit.free_blocks == 2);
  CHECK(cached->from_free == 4);  // taking a cached block uses a free one
  CHECK(cache.can_admit(prompt, {.max_new = 7}));
  (void)held;
}

namespace {
// A continuous-batching scheduler that admits by lifetime need and decodes
// one token per running sequence per step; returns its preemptions.
struct Request {
  std::int32_t prompt, max_new;
};
std::int32_t run_scheduler(bool ledger, std::uint64_t seed) {
  Cache<> cache({.geometry = *Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = 8, .block_size = B}),
                 .num_blocks = 41, .max_sequences = 16, .max_blocks_per_sequence = 32});
  std::mt19937 rng(static_cast<std::uint32_t>(seed));
  std::vector<Request> waiting(60);
  for (auto& r : waiting) r = {std::int32_t(4 + rng() % 30), std::int32_t(4 + rng() % 40)};
  struct Running {
    SeqId s;
    std::int32_t left;
  };
  std::vector<Running> running;
  std::vector<std::int32_t> slots(256), ones;
  std::vector<SeqId> seqs;
  std::vector<BlockCopy> copies(16);
  std::int32_t preemptions = 0, next = 0;
  std::vector<std::int32_t> prompt;
  for (int step = 0; step < 5000 && (next < std::int32_t(waiting.size()) || !running.empty()); ++step) {
    while (next < std::int32_t(waiting.size())) {
      const Request& q = waiting[std::size_t(next)];
      prompt.assign(std::size_t(q.prompt), 1000 + next);  // distinct prompts: no hits
      const AdmitOptions opt{.max_new = ledger ? q.max_new : -1};
      if (ledger ? !cache.can_admit(prompt, opt) : !cache.can_admit(q.prompt, q.max_new)) break;
      auto a = cache.admit(prompt, slots, opt);
      if (!a) break;
      running.push_back({a->seq, q.max_new});
      ++next;
    }
    seqs.clear();
    for (const auto& r : running) seqs.push_back(r.s);
    ones.assign(seqs.size(), 1);
    while (!seqs.empty() && !cache.reserve_batch(seqs, ones, slots, copies).ok()) {
      ++preemptions;  // out of blocks: the newest sequence goes back to waiting
      REQUIRE(cache.free(running.back().s).ok());
      running.pop_back();
      seqs.pop_back();
      ones.pop_back();
      --next;
    }
    for (std::size_t k = running.size(); k-- > 0;)
      if (--running[k].left == 0) {
        REQUIRE(cache.free(running[k].s).ok());
        running.erase(running.begin() + std::ptrdiff_t(k));
      }
  }
  REQUIRE(next == std::int32_t(waiting.size()));
  return preemptions;
}
}  // namespace

TEST_CASE("a lifetime-need scheduler with the promise ledger never preempts and without it does") {
  std::int32_t without = 0;
  for (std::uint64_t seed = 1; seed <= 5; ++seed) {
    CHECK(run_scheduler(true, seed) == 0);
    without += run_scheduler(false, seed);
  }
  std::printf("lifetime-need scheduler, 5 seeds: 0 preemptions with the ledger, %d without\n", without);
  CHECK(without > 0);  // the check can fail: promises matter
}

TEST_CASE("promise() and promised_blocks(): a promise is owed until the sequence holds it") {
  Cache<> cache(config(20));
  const SeqId s = *cache.add_sequence();
  REQUIRE(cache.promise(s, 5).ok());
  CHECK(cache.promised_blocks() == 5);
  std::vector<std::int32_t> slots(8);
  REQUIRE(cache.reserve(s, 8, slots).ok());
  CHECK(cache.promised_blocks() == 3);
  CHECK(cache.can_admit(4 * 14, 0));  // 17 free less the 3 still owed
  CHECK_FALSE(cache.can_admit(4 * 15, 0));
  const Cache<> before = cache;
  CHECK(cache.promise(s, -1).message() == "invalid_argument: blocks=-1 (limit 0)");
  CHECK(cache == before);
  REQUIRE(cache.free(s).ok());
  CHECK(cache.promised_blocks() == 0);
}

TEST_CASE("publish_on_reserve: generated tokens are cached as decode reserves them") {
  for (const bool on : {false, true}) {
    Cache<> cache(config(32, on));
    const auto prompt = iota(6);
    std::vector<std::int32_t> slots(16);
    auto a = cache.admit(prompt, slots);
    REQUIRE(a.ok());
    std::vector<std::int32_t> history(prompt);
    std::vector<BlockCopy> copies(1);
    for (std::int32_t t = 0; t < 10; ++t) {  // decode: each step reserves the token it feeds
      const std::int32_t id = 900 + t;
      REQUIRE(cache.reserve_batch(std::span(&a->seq, 1), std::vector<std::int32_t>{1}, std::span(&id, 1), slots, copies).ok());
      history.push_back(id);
    }
    require_ok(cache);
    std::vector<BlockId> hit(8);
    history.push_back(1);
    // 16 tokens written: four full blocks, all published on reserve; none without.
    CHECK(cache.match_prefix(history, {}, hit) == (on ? 4 : 0));
  }
}

TEST_CASE("publish_on_reserve: draft tokens reserved without ids are not published until publish() gives them") {
  Cache<> cache(config(32, true));
  std::vector<std::int32_t> slots(16);
  auto a = cache.admit(iota(5), slots);  // 5 prompt tokens, one block published
  REQUIRE(a.ok());
  CHECK(cache.pool().num_published() == 1);
  REQUIRE(cache.reserve(a->seq, 3, slots).ok());  // drafts: ids unknown
  CHECK(cache.pool().num_published() == 1);
  REQUIRE(cache.truncate(a->seq, 1).ok());  // one draft rejected
  const std::vector<std::int32_t> ids{7};
  REQUIRE(cache.reserve(a->seq, ids, slots).ok());  // its ids still unknown before: nothing new
  CHECK(cache.pool().num_published() == 1);
  auto tokens = iota(5);
  tokens.insert(tokens.end(), {50, 51, 7});  // the accepted drafts, then the bonus token
  REQUIRE(cache.publish(a->seq, tokens).ok());
  CHECK(cache.pool().num_published() == 2);
  const std::vector<std::int32_t> more{8, 9, 10, 11};
  REQUIRE(cache.reserve(a->seq, more, slots).ok());  // known again: the next full block publishes itself
  CHECK(cache.pool().num_published() == 3);
  tokens.insert(tokens.end(), more.begin(), more.end());
  std::vector<BlockId> hit(8);
  CHECK(cache.match_prefix(tokens, {}, hit) == 2);  // (12 - 1) / 4
  tokens.push_back(0);
  CHECK(cache.match_prefix(tokens, {}, hit) == 3);
  require_ok(cache);
}

TEST_CASE("a window engine publishes its shared system prompt before the window drops it") {
  using C = Cache<BlockPool, PageTable, AdmitAll, SelectAll, SlidingWindow>;
  C cache(config(40, true), {}, {}, SlidingWindow(8));
  const auto system = iota(16);  // four blocks, longer than the window
  auto prompt = system;
  prompt.insert(prompt.end(), {1, 2, 3});
  std::vector<std::int32_t> slots(32);
  auto a = cache.admit(prompt, slots);  // reserved with ids: published as written
  REQUIRE(a.ok());
  CHECK(cache.pool().num_published() == 4);
  REQUIRE(cache.evict(a->seq, EvictionSpans{}).ok());  // the window drops the system prompt's blocks...
  CHECK(cache.pool().num_cached() >= 2);  // ...which stay cached, free
  CHECK(cache.publish(a->seq, prompt).status().code() == Errc::invalid_argument);  // evicted_tokens: too late
  auto b = cache.admit(prompt, slots);  // the next request reuses them
  REQUIRE(b.ok());
  CHECK(b->cached_tokens == 16);
  require_ok(cache);
}

TEST_CASE("multimodal extra keys enter only the blocks their placeholders cover") {
  Cache<> cache(config(40));
  const auto prompt = iota(16);
  const ExtraKey cat[] = {{.begin = 6, .end = 10, .key = 0xca7}}, dog[] = {{.begin = 6, .end = 10, .key = 0xd06}};
  const SeqId a = *cache.add_sequence();
  std::vector<std::int32_t> slots(16);
  REQUIRE(cache.reserve(a, 16, slots).ok());
  REQUIRE(cache.publish(a, prompt, cat).ok());
  std::vector<BlockId> hit(8);
  auto probe = iota(17);
  CHECK(*cache.match_prefix(probe, {}, hit, cat) == 4);
  CHECK(*cache.match_prefix(probe, {}, hit, dog) == 1);  // the text before the image is shared
  CHECK(cache.match_prefix(probe, {}, hit) == 1);  // without the image: the same
  CHECK(*cache.match_prefix(probe, {.salt = 9}, hit, cat) == 0);  // the salt still isolates tenants
  CHECK(*cache.match_prefix(probe, {.extra = 3}, hit, cat) == 0);  // so does a LoRA id
  auto d = cache.admit(probe, slots, {.extras = dog});
  REQUIRE(d.ok());
  CHECK(d->cached_tokens == 4);
  CHECK(cache.prefix_stats().query_tokens == 17);
  const ExtraKey unsorted[] = {{.begin = 8, .end = 9, .key = 1}, {.begin = 2, .end = 3, .key = 2}};
  CHECK(cache.match_prefix(probe, {}, hit, unsorted).status().code() == Errc::invalid_argument);
  CHECK(cache.publish(a, prompt, unsorted).status().message() ==
        "invalid_argument: extras.begin (sorted, not overlapping)=2 (limit 9)");
  require_ok(cache);
}

TEST_CASE("publishing on reserve with an image across two chunks hashes as publishing it whole") {
  const auto prompt = iota(20);
  const ExtraKey img[] = {{.begin = 5, .end = 14, .key = 0x1111}};
  Cache<> whole(config(40));
  const SeqId w = *whole.add_sequence();
  std::vector<std::int32_t> slots(20);
  REQUIRE(whole.reserve(w, 20, slots).ok());
  REQUIRE(whole.publish(w, prompt, img).ok());
  Cache<> chunked(config(40, true));
  auto c = chunked.admit(prompt, slots, {.extras = img, .reserve = 9});  // the image spans the chunk boundary
  REQUIRE(c.ok());
  REQUIRE(chunked.reserve(c->seq, std::span(prompt).subspan(9), slots, img).ok());
  std::vector<BlockEvent> ew(16), ec(16);
  REQUIRE(whole.drain_events(ew) == 5);
  REQUIRE(chunked.drain_events(ec) == 5);
  for (std::size_t i = 0; i < 5; ++i) {
    CHECK(ew[i].hash == ec[i].hash);
    CHECK(ew[i].block_extra == ec[i].block_extra);
  }
  CHECK(ew[0].block_extra == 0);  // [0, 4): before the image
  CHECK(ew[1].block_extra != 0);
  CHECK(ew[4].block_extra == 0);  // [16, 20): after it
}

TEST_CASE("router events carry token ids, parent, block size, keys and medium and counters track queries and states") {
  auto cfg = config(12);
  cfg.medium = Medium::cpu;
  Cache<> cache(cfg);
  const PrefixKey key{.salt = 5, .extra = 42};
  const auto prompt = iota(9);
  std::vector<std::int32_t> slots(16);
  auto a = cache.admit(prompt, slots, {.key = key});
  REQUIRE(a.ok());
  REQUIRE(cache.publish(a->seq, prompt).ok());
  std::vector<BlockEvent> ev(1);
  std::vector<std::int32_t> ids(B);
  CHECK(cache.drain_events(ev, std::span(ids).first(2)).status().message() == "buffer_too_small: token_ids=2 (limit 4)");
  REQUIRE(*cache.drain_events(ev, ids) == 1);  // batches of one
  CHECK(ev[0].kind == EventKind::stored);
  CHECK(ev[0].first);
  CHECK(ev[0].parent == chain_root(key));
  CHECK(ev[0].key == key);
  CHECK(ev[0].block_extra == 42);
  CHECK(ev[0].block_size == B);
  CHECK(ev[0].num_tokens == B);
  CHECK(ev[0].medium == Medium::cpu);
  CHECK(ids == std::vector<std::int32_t>(prompt.begin(), prompt.begin() + 4));
  REQUIRE(*cache.drain_events(ev, ids) == 1);
  CHECK_FALSE(ev[0].first);
  CHECK(ids == std::vector<std::int32_t>(prompt.begin() + 4, prompt.begin() + 8));
  // Recycled: removed events, and the counters see it.
  REQUIRE(cache.free(a->seq).ok());
  const SeqId hog = hog_plain(cache);
  std::vector<std::int32_t> more(8);
  REQUIRE(cache.reserve(hog, 8, more).ok());  // two cached blocks recycled, tail first
  REQUIRE(cache.drain_events(ev) == 1);
  CHECK(ev[0].kind == EventKind::removed);
  const PrefixStats st = cache.prefix_stats();
  CHECK(st.queries == 1);
  CHECK(st.query_tokens == 9);
  CHECK(st.hit_tokens == 0);
  CHECK(st.pool.stored == 2);
  CHECK(st.pool.recycled == 2);
  CHECK(st.hashes == 0);
  CHECK(st.used_hashed + st.used_plain + st.free_cached + st.free_plain == cache.pool().capacity() - 1);
  CHECK(st.used_plain == cache.pool().num_used());
}

TEST_CASE("reserve and reserve_batch with ids: a wrong id count or bad extras change nothing") {
  Cache<> cache(config(32, true));
  std::vector<std::int32_t> slots(16);
  const SeqId a = cache.admit(iota(5), slots)->seq, b = cache.admit(iota(6, 300), slots)->seq;
  const SeqId seqs[] = {a, b};
  const std::int32_t counts[] = {2, 1};
  std::vector<BlockCopy> copies(2);
  const Cache<> before = cache;
  const std::vector<std::int32_t> two{1, 2};
  CHECK(cache.reserve_batch(seqs, counts, two, slots, copies).status().message() ==
        "invalid_argument: ids.size (the sum of counts)=2 (limit 3)");
  const ExtraKey empty[] = {{.begin = 3, .end = 3, .key = 1}};
  CHECK(cache.reserve(a, two, slots, empty).status().message() == "invalid_argument: extras.end=3 (limit 4)");
  const std::int32_t negative[] = {-1, 1};
  CHECK(cache.reserve_batch(seqs, negative, two, slots, copies).status().code() == Errc::invalid_argument);  // the count's error
  CHECK(cache == before);
  const std::vector<std::int32_t> three{1, 2, 3};
  REQUIRE(cache.reserve_batch(seqs, counts, three, slots, copies).ok());
  require_ok(cache);
}
