// Randomized property test: a million random operations (add, prefix add,
// reserve, batch reserve, fork, truncate, free, publish, reset, invalid calls)
// against a reference model. The cache's slots are "written" into a simulated
// KV memory holding token ids, copy-on-write commands are executed, and after
// every operation every live sequence must read back exactly its model tokens
// through its page table. Failed calls must leave the cache bit-for-bit as it
// was. Replay a failure with KVCACHE_SEED=<seed>; KVCACHE_PROPERTY_OPS sets the count.
#include <catch2/catch.hpp>

#include <kvcache/cache.hpp>

#include "gate_cache_property.hpp"
#include "quest_testing.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <set>
#include <tuple>
#include <vector>

using namespace kvcache;

namespace {

constexpr std::int32_t kBlocks = 40, kSeqs = 8, kPerSeq = 10;

struct Seq {
  SeqId id;
  std::vector<std::int32_t> tokens;   // what the cache must hold
  std::vector<std::int32_t> pending;  // rest of the prompt, appended by later reserves
  PrefixKey key;
};

std::uint64_t env_u64(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  return v ? std::strtoull(v, nullptr, 10) : fallback;
}

using Hash3 = std::tuple<std::uint64_t, std::uint64_t>;

// B: the block size. A power of two and not take different paths (masks, and
// specialized batch passes).
template <std::int32_t B>
class Harness {
  static constexpr std::int32_t kMaxTokens = B * kPerSeq;

 public:
  explicit Harness(std::uint64_t seed)
      : rng_(seed),
        cache_({.geometry = *Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = 8, .block_size = B}),
                .num_blocks = kBlocks,
                .max_sequences = kSeqs,
                .max_blocks_per_sequence = kPerSeq,
                .event_capacity = 256}),
        mem_(std::size_t(kBlocks) * B, -1) {
    for (auto& t : templates_) {
      t.resize(kMaxTokens);
      for (auto& x : t) x = std::int32_t(rng_() % 1000);
    }
  }

  void step() {
    before_ = cache_;
    const auto pick = rng_() % 100;
    if (pick < 12) op_add();
    else if (pick < 40) op_reserve();
    else if (pick < 52) op_batch();
    else if (pick < 60) op_truncate();
    else if (pick < 67) op_fork();
    else if (pick < 76) op_free();
    else if (pick < 88) op_publish();
    else if (pick < 90) op_reset();
    else op_invalid();
    verify();
  }

  std::int64_t prefix_hits = 0, cows = 0, failures = 0, successes = 0;

 private:
  // --- helpers ---------------------------------------------------------------
  std::int32_t rand_int(std::int32_t n) { return std::int32_t(rng_() % std::uint64_t(n)); }
  Seq* random_live() { return live_.empty() ? nullptr : &live_[std::size_t(rand_int(std::int32_t(live_.size())))]; }
  std::int32_t tail_ref(const Seq& s) const {
    const auto blocks = *cache_.table().blocks(s.id);
    return blocks.empty() ? 0 : cache_.pool().ref_count(blocks.back());
  }
  // Blocks a reserve of n tokens takes from the pool (copy-on-write included).
  std::int32_t blocks_for_reserve(const Seq& s, std::int32_t n) const {
    const auto t = std::int32_t(s.tokens.size());
    const std::int32_t fresh = (t + n + B - 1) / B - (t + B - 1) / B;
    const bool cow = n > 0 && t % B != 0 && tail_ref(s) > 1;
    return fresh + (cow ? 1 : 0);
  }
  std::int32_t next_token(Seq& s) {
    if (!s.pending.empty()) {
      const std::int32_t t = s.pending.front();
      s.pending.erase(s.pending.begin());
      return t;
    }
    return std::int32_t(rng_() % 1000);
  }
  void expect_failure(const Status& st, Errc want) {
    ++failures;
    INFO(op_ << ": expected " << to_string(want) << ", got " << st.message());
    REQUIRE(st.code() == want);
    REQUIRE(cache_ == before_);
  }
  void expect_ok(const Status& st) {
    ++successes;
    INFO(op_ << ": " << st.message());
    REQUIRE(st.ok());
  }
  void apply_copy(const BlockCopy& c) {
    ++cows;
    std::copy_n(mem_.begin() + std::ptrdiff_t(c.src) * B, B, mem_.begin() + std::ptrdiff_t(c.dst) * B);
  }
  void write(Seq& s, std::span<const std::int32_t> slots) {
    for (const std::int32_t slot : slots) {
      const std::int32_t tok = next_token(s);
      mem_[std::size_t(slot)] = tok;
      s.tokens.push_back(tok);
    }
  }
  std::vector<std::int32_t> random_prompt() {
    const auto& t = templates_[std::size_t(rand_int(3))];
    std::vector<std::int32_t> p(t.begin(), t.begin() + rand_int(kMaxTokens) + 1);
    for (std::int32_t k = rand_int(3); k > 0 && !p.empty(); --k) p[std::size_t(rand_int(std::int32_t(p.size())))] = 7;
    return p;
  }

  // --- operations ------------------------------------------------------------
  void op_add() {
    op_ = "add";
    const PrefixKey key{.salt = std::uint64_t(rand_int(2)), .extra = 0};
    const bool full = std::int32_t(live_.size()) == kSeqs;
    if (rand_int(2) == 0) {
      auto r = cache_.add_sequence(key);
      if (full) return expect_failure(r.status(), Errc::capacity_exceeded);
      expect_ok(r.status());
      live_.push_back(Seq{*r, {}, random_prompt(), key});
      return;
    }
    auto prompt = random_prompt();
    auto r = cache_.add_sequence(prompt, key);
    if (full) return expect_failure(r.status(), Errc::capacity_exceeded);
    expect_ok(r.status());
    const std::int32_t cached = r->cached_tokens;
    REQUIRE(cached % B == 0);
    REQUIRE(cached <= std::int32_t(prompt.size()) - 1);
    prefix_hits += cached > 0;
    Seq s{r->seq, {prompt.begin(), prompt.begin() + cached}, {prompt.begin() + cached, prompt.end()}, key};
    live_.push_back(std::move(s));
  }

  void op_reserve() {
    op_ = "reserve";
    Seq* s = random_live();
    if (!s) return;
    std::int32_t n = rand_int(10);
    if (rand_int(50) == 0) n = -1 - rand_int(3);
    if (rand_int(50) == 0) n = kMaxTokens;
    std::vector<std::int32_t> slots(std::size_t(std::max(n, 0)));
    const bool short_of_blocks = n >= 0 && blocks_for_reserve(*s, n) > cache_.free_blocks();
    auto r = cache_.reserve(s->id, n, slots);
    if (n < 0) return expect_failure(r.status(), Errc::invalid_argument);
    if (std::int32_t(s->tokens.size()) + n > kMaxTokens) return expect_failure(r.status(), Errc::capacity_exceeded);
    if (short_of_blocks) return expect_failure(r.status(), Errc::out_of_blocks);
    expect_ok(r.status());
    if (r->copy.src >= 0) apply_copy(r->copy);
    write(*s, slots);
  }

  void op_batch() {
    op_ = "batch";
    if (live_.empty()) return;
    std::vector<std::size_t> idx(live_.size());
    for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = i;
    std::shuffle(idx.begin(), idx.end(), rng_);
    idx.resize(std::size_t(rand_int(std::int32_t(idx.size())) + 1));
    const bool dup = rand_int(20) == 0;
    const bool decode = rand_int(3) == 0;  // every count 1: the decode step's own pass
    if (dup) idx.push_back(idx.front());
    std::vector<SeqId> ids;
    std::vector<std::int32_t> counts;
    std::int32_t total = 0, blocks = 0, copies = 0;
    Errc want = Errc::ok;
    for (std::size_t k = 0; k < idx.size(); ++k) {
      const Seq& s = live_[idx[k]];
      ids.push_back(s.id);
      counts.push_back(decode ? 1 : rand_int(3));
      total += counts.back();
      if (dup && k + 1 == idx.size()) break;  // the duplicate is rejected before it is planned
      const auto t = std::int32_t(s.tokens.size());
      if (want == Errc::ok && t + counts.back() > kMaxTokens) want = Errc::capacity_exceeded;
      blocks += blocks_for_reserve(s, counts.back());
      copies += (counts.back() > 0 && t % B != 0 && tail_ref(s) > 1) ? 1 : 0;
    }
    if (dup && want == Errc::ok) want = Errc::duplicate_sequence;
    const std::int32_t pad = rand_int(3) - (rand_int(30) == 0 ? 3 : 0);
    std::vector<std::int32_t> slots(std::size_t(std::max(total + pad, 0)), 12345);
    std::vector<BlockCopy> cbuf(static_cast<std::size_t>(copies));
    const std::int32_t free_before = cache_.free_blocks();
    auto r = cache_.reserve_batch(ids, counts, slots, cbuf);
    if (want != Errc::ok) return expect_failure(r.status(), want);
    if (std::int32_t(slots.size()) < total) return expect_failure(r.status(), Errc::buffer_too_small);
    if (blocks > free_before) return expect_failure(r.status(), Errc::out_of_blocks);
    expect_ok(r.status());
    REQUIRE(r->slots == total);
    // The engine runs every copy first, then the scatter.
    for (std::int32_t c = 0; c < r->copies; ++c) apply_copy(cbuf[std::size_t(c)]);
    std::size_t at = 0;
    for (std::size_t k = 0; k < idx.size(); ++k) {
      write(live_[idx[k]], std::span(slots).subspan(at, std::size_t(counts[k])));
      at += std::size_t(counts[k]);
    }
    for (; at < slots.size(); ++at) REQUIRE(slots[at] == -1);
  }

  void op_truncate() {
    op_ = "truncate";
    Seq* s = random_live();
    if (!s) return;
    const auto t = std::int32_t(s->tokens.size());
    const std::int32_t k = rand_int(t + 3);
    auto st = cache_.truncate(s->id, k);
    if (k > t) return expect_failure(st, Errc::truncate_too_many);
    expect_ok(st);
    s->tokens.resize(std::size_t(t - k));
    s->pending.clear();
  }

  void op_fork() {
    op_ = "fork";
    Seq* s = random_live();
    if (!s) return;
    auto r = cache_.fork(s->id);
    if (std::int32_t(live_.size()) == kSeqs) return expect_failure(r.status(), Errc::capacity_exceeded);
    expect_ok(r.status());
    Seq child = *s;
    child.id = *r;
    live_.push_back(std::move(child));
  }

  void op_free() {
    op_ = "free";
    if (live_.empty()) return;
    const auto i = std::size_t(rand_int(std::int32_t(live_.size())));
    expect_ok(cache_.free(live_[i].id));
    dead_.push_back(live_[i].id);
    live_.erase(live_.begin() + std::ptrdiff_t(i));
  }

  void op_publish() {
    op_ = "publish";
    Seq* s = random_live();
    if (!s) return;
    const auto t = std::int32_t(s->tokens.size());
    const std::int32_t len = rand_int(t + 3);
    std::vector<std::int32_t> tokens(s->tokens.begin(), s->tokens.begin() + std::min(len, t));
    tokens.resize(std::size_t(len), 1);
    auto r = cache_.publish(s->id, tokens);
    if (len > t) return expect_failure(r.status(), Errc::prefix_too_long);
    expect_ok(r.status());
  }

  void op_reset() {
    op_ = "reset";
    if (rand_int(4) == 0)  // sometimes empty the cache first, so the reset can succeed
      while (!live_.empty()) {
        expect_ok(cache_.free(live_.back().id));
        dead_.push_back(live_.back().id);
        live_.pop_back();
      }
    before_ = cache_;
    const bool busy = cache_.pool().num_used() > 0;
    auto st = cache_.reset_prefix_cache();
    if (busy) return expect_failure(st, Errc::blocks_in_use);
    expect_ok(st);
  }

  void op_invalid() {
    op_ = "invalid";
    std::vector<std::int32_t> slots(4);
    if (!dead_.empty()) {
      const SeqId d = dead_[std::size_t(rand_int(std::int32_t(dead_.size())))];
      switch (rand_int(5)) {
        case 0: return expect_failure(cache_.reserve(d, 1, slots).status(), Errc::unknown_sequence);
        case 1: return expect_failure(cache_.fork(d).status(), Errc::unknown_sequence);
        case 2: return expect_failure(cache_.truncate(d, 0), Errc::unknown_sequence);
        case 3: return expect_failure(cache_.free(d), Errc::unknown_sequence);
        default: return expect_failure(cache_.publish(d, {}).status(), Errc::unknown_sequence);
      }
    }
    expect_failure(cache_.reserve(SeqId{kSeqs + 3, 0}, 1, slots).status(), Errc::unknown_sequence);
  }

  // --- the checks after every operation ---------------------------------------
  void verify() {
    {
      const Status st = cache_.check_invariants();
      INFO(st.message());
      REQUIRE(st.ok());
    }
    REQUIRE(cache_.table().num_streams() == std::int32_t(live_.size()));
    for (const Seq& s : live_) {
      const auto blocks = *cache_.table().blocks(s.id);
      REQUIRE(*cache_.tokens_held(s.id) == std::int64_t(s.tokens.size()));
      REQUIRE(std::int64_t(blocks.size()) <= *cache_.blocks_needed(std::int64_t(s.tokens.size()), 0));
      for (std::size_t p = 0; p < s.tokens.size(); ++p)
        if (mem_[std::size_t(blocks[p / B]) * B + p % B] != s.tokens[p]) {
          FAIL("after " << op_ << ": sequence " << s.id.index << " reads " << mem_[std::size_t(blocks[p / B]) * B + p % B]
                           << " at position " << p << ", model has " << s.tokens[p]);
        }
    }
    // Events replay to exactly the set of published hashes.
    BlockEvent ev[64];
    for (std::int32_t n; (n = cache_.drain_events(ev)) > 0;)
      for (std::int32_t i = 0; i < n; ++i) {
        const Hash3 h{ev[i].hash.lo, ev[i].hash.hi};
        if (ev[i].kind == EventKind::stored) REQUIRE(published_.insert(h).second);
        else if (ev[i].kind == EventKind::removed) REQUIRE(published_.erase(h) == 1);
        else published_.clear();
      }
    REQUIRE(cache_.pool().events().dropped() == 0);
    REQUIRE(std::int32_t(published_.size()) == cache_.pool().num_published());
    for (const auto& [lo, hi] : published_) REQUIRE(cache_.pool().lookup(BlockHash{lo, hi}) >= 0);
  }

  const char* op_ = "";
  std::mt19937_64 rng_;
  Cache<> cache_;
  Cache<> before_{cache_};
  std::vector<std::int32_t> mem_;
  std::vector<Seq> live_;
  std::vector<SeqId> dead_;
  std::vector<std::int32_t> templates_[3];
  std::set<Hash3> published_;
};

}  // namespace

template <std::int32_t B>
void run_property(std::uint64_t seed, std::uint64_t ops) {
  std::printf("test_property: block_size=%d KVCACHE_SEED=%llu KVCACHE_PROPERTY_OPS=%llu\n", B,
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(ops));
  std::fflush(stdout);
  INFO("replay with KVCACHE_SEED=" << seed << " (block size " << B << ")");
  Harness<B> h(seed);
  for (std::uint64_t i = 0; i < ops; ++i) h.step();
  std::printf("test_property: %lld ok, %lld rejected, %lld prefix hits, %lld copy-on-write\n",
              static_cast<long long>(h.successes), static_cast<long long>(h.failures),
              static_cast<long long>(h.prefix_hits), static_cast<long long>(h.cows));
  // The run must have exercised the interesting paths, not only trivial ones.
  if (ops >= 100'000) {
    CHECK(h.prefix_hits > 100);
    CHECK(h.cows > 100);
    CHECK(h.failures > 1000);
  }
}

TEST_CASE("a million random operations keep every invariant and every token") {
  const std::uint64_t seed = env_u64("KVCACHE_SEED", std::random_device{}());
  const std::uint64_t ops = env_u64("KVCACHE_PROPERTY_OPS", 1'000'000);
  SECTION("block size 4 (a power of two)") { run_property<4>(seed, ops); }
  SECTION("block size 3") { run_property<3>(seed, ops); }
}

TEST_CASE("random operations through a Write-Gated KV cache keep every head row and its K/V") {
  const std::uint64_t seed = env_u64("KVCACHE_SEED", std::random_device{}());
  const std::uint64_t ops = env_u64("KVCACHE_PROPERTY_OPS", 1'000'000);
  INFO("KVCACHE_SEED=" << seed);
  std::mt19937_64 rng(seed);
  // A fiftieth of the plain cache's operations: each one here writes every layer and checks every export.
  const int steps = 400, trials = int(std::max<std::uint64_t>(1, ops / 50 / std::uint64_t(steps)));
  gate_testing::gate_cache_property(rng, trials, steps);
}


TEST_CASE("random operations through a Quest cache keep every page's bounds and every selection") {
  const std::uint64_t seed = env_u64("KVCACHE_SEED", std::random_device{}());
  const std::uint64_t ops = env_u64("KVCACHE_PROPERTY_OPS", 1'000'000);
  INFO("KVCACHE_SEED=" << seed);
  std::mt19937_64 rng(seed);
  // A 25th of the plain cache's operations: each one here checks every key of every layer.
  const int steps = 200, trials = int(std::max<std::uint64_t>(1, ops / 25 / 4 / std::uint64_t(steps)));
  for (int t = 0; t < trials; ++t) {
    const bool forks = t % 2 == 1;
    kvtest::quest_cache_property(rng, kvcache::KeepAll{}, forks, steps);
    kvtest::quest_cache_property(rng, kvcache::SlidingWindow(8 + std::int32_t(rng() % 16)), forks, steps);
    kvtest::quest_cache_property(rng, kvcache::BlockScoreEviction({.start = 4, .recent = 8, .max = 24, .block_size = 4}), forks, steps);
    kvtest::quest_cache_property(rng, kvcache::H2OEviction({.heavy = 6, .recent = 6, .groups = 1}), forks, steps);
  }
}
