// Sliding window and sinks + window against plain references: the tokens a
// stream holds (read back from memory through its row), the exact accounting,
// the ring of blocks, the dead front slots in the exports, and rotations.
#include <catch2/catch.hpp>

#include <kvcache/cache.hpp>
#include <kvcache/eviction/sink_window.hpp>
#include <kvcache/eviction/sliding_window.hpp>

#include <algorithm>
#include <random>
#include <vector>

using namespace kvcache;

namespace {
constexpr std::int32_t B = 4;
CacheConfig config(std::int32_t blocks = 64, std::int32_t per_seq = 16) {
  return {.geometry = *Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = 8, .block_size = B}),
          .num_blocks = blocks, .max_sequences = 4, .max_blocks_per_sequence = per_seq};
}

// Simulated KV memory: slot -> position of the token written there.
template <class C>
struct Stream {
  C& cache;
  SeqId s;
  std::vector<std::int64_t>& mem;
  std::int64_t appended = 0;
  void append(std::int32_t n) {
    std::vector<std::int32_t> slots(static_cast<std::size_t>(n));
    auto r = cache.reserve(s, n, slots);
    REQUIRE(r.ok());
    if (r->copy.src >= 0)  // copy-on-write of a shared tail block: the engine's copy
      std::copy_n(mem.begin() + r->copy.src * B, B, mem.begin() + r->copy.dst * B);
    for (std::int32_t i = 0; i < n; ++i) mem[std::size_t(slots[std::size_t(i)])] = appended + i;
    appended += n;
  }
  // Live tokens in row order: slots [front, front + held) of the row.
  std::vector<std::int64_t> held() const {
    const auto blocks = *cache.table().blocks(s);
    const std::int32_t front = *cache.table().front(s), n = std::int32_t(*cache.tokens_held(s));
    std::vector<std::int64_t> out;
    for (std::int32_t j = front; j < front + n; ++j) out.push_back(mem[std::size_t(blocks[std::size_t(j / B)] * B + j % B)]);
    return out;
  }
};
std::vector<std::int64_t> iota(std::int64_t from, std::int64_t to) {
  std::vector<std::int64_t> v;
  for (std::int64_t p = from; p < to; ++p) v.push_back(p);
  return v;
}
}  // namespace

TEST_CASE("sliding window holds exactly the last W tokens in a ring of ceil(W/B)+1 blocks") {
  for (std::int32_t W : {1, 4, 6, 9, 16}) {
    using C = Cache<BlockPool, PageTable, AdmitAll, SelectAll, SlidingWindow>;
    C cache(config(), {}, {}, SlidingWindow(W));
    std::vector<std::int64_t> mem(64 * B, -1);
    Stream<C> st{cache, *cache.add_sequence(), mem};
    std::mt19937 rng(W);
    for (int step = 0; step < 200; ++step) {
      st.append(step % 7 == 0 ? 1 + std::int32_t(rng() % 9) : 1);  // chunks and decode steps
      auto r = cache.evict(st.s, EvictionSpans{});
      REQUIRE(r.ok());
      INFO("W=" << W << " appended=" << st.appended);
      REQUIRE(*cache.tokens_held(st.s) == std::min<std::int64_t>(st.appended, W));
      REQUIRE(*cache.tokens(st.s) == st.appended);  // the length: what it was given, evicted or not
      REQUIRE(st.held() == iota(std::max<std::int64_t>(0, st.appended - W), st.appended));
      REQUIRE(*cache.blocks_held(st.s) <= (W + B - 1) / B + 1);
      REQUIRE(*cache.blocks_held(st.s) <= *cache.blocks_needed(st.appended, 0, 9));  // chunks of at most 9
      REQUIRE(cache.check_invariants().ok());
      // Exports describe front + held slots; the window mask hides the front.
      std::vector<std::int32_t> indptr(2), indices(16), last(1), len(1);
      REQUIRE(cache.export_csr(std::array{st.s}, indptr, indices, last).ok());
      REQUIRE(cache.export_lengths(std::array{st.s}, len).ok());
      const std::int32_t slots = *cache.table().front(st.s) + W * (st.appended >= W) + std::int32_t(st.appended) * (st.appended < W);
      REQUIRE(len[0] == slots);
      REQUIRE((indptr[1] - 1) * B + last[0] == slots);
    }
    CHECK(cache.free_blocks() == 63 - *cache.blocks_held(st.s));  // blocks that left the window went back
  }
}

TEST_CASE("sliding window: blocks_needed covers the ring, shared front blocks only lose a holder") {
  using C = Cache<BlockPool, PageTable, AdmitAll, SelectAll, SlidingWindow>;
  C cache(config(), {}, {}, SlidingWindow(8));
  CHECK(*cache.blocks_needed(4, 0) == 1);
  CHECK(*cache.blocks_needed(100, 1000) == 100 / B);          // the prompt sits whole before the first trim
  // window + chunk + dead front (B - 1) + what evicting before attention keeps for the last chunk (chunk - 1)
  CHECK(*cache.blocks_needed(100, 1000, 4) == (8 + 4 + (B - 1) + (4 - 1) + B - 1) / B);  // trimmed after every 4-token chunk
  CHECK(*cache.blocks_needed(10, 1000, 4) == 3);
  std::vector<std::int64_t> mem(64 * B, -1);
  Stream<C> a{cache, *cache.add_sequence(), mem};
  a.append(10);
  const SeqId b = *cache.fork(a.s);
  a.append(3);
  REQUIRE(cache.evict(a.s, EvictionSpans{})->tokens == 5);
  CHECK(a.held() == iota(5, 13));
  CHECK(*cache.tokens_held(b) == 10);  // the fork still holds its blocks until its own trim
  REQUIRE(cache.evict(b, EvictionSpans{})->tokens == 2);
  CHECK(cache.check_invariants().ok());
  std::vector<std::int32_t> tokens(8, 1);
  CHECK(cache.publish(a.s, tokens).status().code() == Errc::invalid_argument);  // no longer the written prefix
  REQUIRE(cache.truncate(a.s, 8).ok());  // rolling back every live token leaves an empty row
  CHECK(*cache.blocks_held(a.s) == 0);
  CHECK(cache.check_invariants().ok());
}

TEST_CASE("sinks + window keeps the pinned blocks and the last W tokens, and reports rotations") {
  for (std::int32_t sinks : {0, 3, 4}) {
    using C = Cache<BlockPool, PageTable, AdmitAll, SelectAll, SinkWindowEviction>;
    C cache(config(), {}, {}, SinkWindowEviction({.sinks = sinks, .window = 6}));
    const SinkWindowEviction& policy = cache.eviction();  // bound: it counts in the geometry's blocks
    const std::int32_t pinned = policy.pinned();
    std::vector<std::int64_t> mem(64 * B, -1);
    Stream<C> st{cache, *cache.add_sequence(), mem};
    std::vector<std::int32_t> evicted(16);
    std::vector<BlockRotation> rot(16);
    for (int step = 0; step < 100; ++step) {
      st.append(1 + step % 3);
      const auto blocks_before = std::vector<BlockId>(cache.table().blocks(st.s)->begin(), cache.table().blocks(st.s)->end());
      auto r = cache.evict(st.s, evicted, rot);
      REQUIRE(r.ok());
      const auto held = st.held();
      INFO("sinks=" << sinks << " appended=" << st.appended);
      REQUIRE(std::int64_t(held.size()) <= policy.max_tokens_held(st.appended));
      REQUIRE(*cache.blocks_held(st.s) <= *cache.blocks_needed(st.appended, 0, 3));
      REQUIRE(cache.check_invariants().ok());
      // Reference: positions [0, pinned) and a contiguous run that ends at appended and spans at least W.
      for (std::int32_t p = 0; p < std::min<std::int32_t>(pinned, std::int32_t(held.size())); ++p) REQUIRE(held[std::size_t(p)] == p);
      const auto tail = std::vector<std::int64_t>(held.begin() + std::min<std::ptrdiff_t>(pinned, std::ptrdiff_t(held.size())), held.end());
      if (!tail.empty()) REQUIRE(tail == iota(st.appended - std::int64_t(tail.size()), st.appended));
      REQUIRE(std::int64_t(tail.size()) >= std::min<std::int64_t>(st.appended - pinned, 6));
      for (std::int32_t k = 0; k < r->rotations; ++k) {  // new index * B - old index * B == delta
        const auto& x = rot[std::size_t(k)];
        const auto old = std::find(blocks_before.begin(), blocks_before.end(), x.block) - blocks_before.begin();
        REQUIRE(x.delta == (x.new_index - old) * B);
        REQUIRE(x.delta == -r->evicted * B);
      }
    }
  }
}

// Every query of a chunk sees, through the window mask (window_left = W − 1,
// causal), exactly the keys max(0, q − W + 1) .. q: read back from memory.
TEST_CASE("sliding window with chunks: every query finds its whole window, evicting before or after attention") {
  using C = Cache<BlockPool, PageTable, AdmitAll, SelectAll, SlidingWindow>;
  constexpr std::int32_t W = 10;
  for (const bool before_attention : {true, false})
    for (std::int32_t chunk : {1, B, W, W + 3, 3 * W}) {
      C cache(config(64, 32), {}, {}, SlidingWindow(W));
      std::vector<std::int64_t> mem(64 * B, -1);
      Stream<C> st{cache, *cache.add_sequence(), mem};
      std::int64_t peak_blocks = 0, queries = 0;
      const std::int64_t prompt = 5 * W + 3;
      while (st.appended < prompt + 20) {
        const auto n = std::int32_t(st.appended < prompt ? std::min<std::int64_t>(chunk, prompt - st.appended) : 1);
        st.append(n);
        peak_blocks = std::max<std::int64_t>(peak_blocks, *cache.blocks_held(st.s));
        if (before_attention) REQUIRE(cache.evict(st.s, {}, n).ok());  // n queries pending
        REQUIRE(cache.check_invariants().ok());
        const auto held = st.held();  // attention: the chunk's n queries
        for (std::int64_t q = st.appended - n; q < st.appended; ++q, ++queries) {
          std::vector<std::int64_t> seen;
          for (const std::int64_t k : held)
            if (k <= q && k >= q - W + 1) seen.push_back(k);
          INFO("chunk " << chunk << " query " << q << (before_attention ? " (evict before)" : " (evict after)"));
          REQUIRE(seen == iota(std::max<std::int64_t>(0, q - W + 1), q + 1));
        }
        if (!before_attention) REQUIRE(cache.evict(st.s, {}).ok());
        REQUIRE(cache.check_invariants().ok());
      }
      CHECK(queries == prompt + 20);
      CHECK(peak_blocks <= *cache.blocks_needed(prompt, 20, chunk));
      if (before_attention) CHECK(*cache.tokens_held(st.s) == W);  // decode: one pending query keeps exactly W
    }
  // pending_queries is checked: at most the tokens held, and only window policies take it.
  C cache(config(), {}, {}, SlidingWindow(4));
  const SeqId s = *cache.add_sequence();
  std::vector<std::int32_t> slots(3);
  REQUIRE(cache.reserve(s, 3, slots).ok());
  CHECK(cache.evict(s, {}, 4).status().message() == "invalid_argument: pending_queries=4 (limit 3)");
  CHECK(cache.evict(s, {}, -1).status().code() == Errc::invalid_argument);
  Cache<> keep(config());
  const SeqId k = *keep.add_sequence();
  CHECK(keep.evict(k, {}, 1).status().message() == "invalid_argument: pending_queries=1 (limit 0)");
}
