#include <catch2/catch.hpp>

#include <kvcache/prefix/prefix_sharing.hpp>

#include <numeric>
#include <vector>

using namespace kvcache;

namespace {
constexpr std::int32_t B = 4;
struct Fixture {
  BlockPool pool{32, 64};
  PageTable table{pool, 8, 8, B};
  FastBlockHasher hasher{};
  void require_ok() const {
    auto a = pool.check(), b = table.check(pool);
    INFO(a.message() << " / " << b.message());
    REQUIRE(a.ok());
    REQUIRE(b.ok());
  }
  // A sequence that holds `tokens` and has published them.
  SeqId prefill(const std::vector<std::int32_t>& tokens, const PrefixKey& key = {}) {
    auto s = *table.add(key);
    std::vector<std::int32_t> slots(tokens.size());
    REQUIRE(table.reserve(pool, s, std::int32_t(tokens.size()), slots).ok());
    REQUIRE(publish_prefix(table, pool, s, tokens, hasher).ok());
    return s;
  }
};
std::vector<std::int32_t> iota(std::int32_t n, std::int32_t from = 100) {
  std::vector<std::int32_t> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), from);
  return v;
}
}  // namespace

TEST_CASE("a published prefix is shared by the next sequence, full blocks only, last token recomputed") {
  Fixture f;
  const auto prompt = iota(14);  // 3 full blocks + 2 tokens
  auto a = f.prefill(prompt);
  CHECK(f.pool.num_published() == 3);

  auto hit = add_with_prefix(f.table, f.pool, prompt, {}, f.hasher);
  REQUIRE(hit.ok());
  CHECK(hit->cached_tokens == 12);
  const auto ab = *f.table.blocks(a), bb = *f.table.blocks(hit->seq);
  REQUIRE(bb.size() == 3);
  for (int i = 0; i < 3; ++i) CHECK(bb[std::size_t(i)] == ab[std::size_t(i)]);
  CHECK(f.pool.ref_count(ab[0]) == 2);
  f.require_ok();

  // Exactly 12 tokens: at most 11 may be reused, so only 2 blocks.
  auto exact = add_with_prefix(f.table, f.pool, iota(12), {}, f.hasher);
  CHECK(exact->cached_tokens == 8);
  // A different first token: nothing shared.
  auto other = iota(14);
  other[0] = 7;
  CHECK(add_with_prefix(f.table, f.pool, other, {}, f.hasher)->cached_tokens == 0);
  f.require_ok();
}

TEST_CASE("salt and extra keys isolate chains") {
  Fixture f;
  const auto prompt = iota(9);
  f.prefill(prompt, {.salt = 1, .extra = 0});
  std::vector<BlockId> out(8);
  CHECK(match_prefix(f.table, f.pool, prompt, {.salt = 1}, f.hasher, out) == 2);
  CHECK(match_prefix(f.table, f.pool, prompt, {.salt = 2}, f.hasher, out) == 0);
  CHECK(match_prefix(f.table, f.pool, prompt, {.salt = 1, .extra = 5}, f.hasher, out) == 0);
  CHECK(match_prefix(f.table, f.pool, prompt, {.salt = 1}, f.hasher, std::span(out).first(1)) == 1);
}

TEST_CASE("publish validates the prefix length and is incremental") {
  Fixture f;
  auto s = *f.table.add();
  std::vector<std::int32_t> slots(8);
  REQUIRE(f.table.reserve(f.pool, s, 6, slots).ok());
  const auto tokens = iota(10);
  const BlockPool p0 = f.pool;
  const PageTable t0 = f.table;
  auto bad = publish_prefix(f.table, f.pool, s, tokens, f.hasher);
  CHECK(bad.status().code() == Errc::prefix_too_long);
  CHECK(bad.status().value() == 10);
  CHECK(bad.status().limit() == 6);
  CHECK(f.pool == p0);
  CHECK(f.table == t0);

  CHECK(*publish_prefix(f.table, f.pool, s, std::span(tokens).first(6), f.hasher) == 1);
  REQUIRE(f.table.reserve(f.pool, s, 2, slots).ok());
  CHECK(*publish_prefix(f.table, f.pool, s, std::span(tokens).first(8), f.hasher) == 1);
  CHECK(*publish_prefix(f.table, f.pool, s, std::span(tokens).first(8), f.hasher) == 0);  // nothing new
  // The incremental chain equals a one-shot chain from another sequence.
  std::vector<BlockId> out(4);
  CHECK(match_prefix(f.table, f.pool, iota(9), {}, f.hasher, out) == 2);
  f.require_ok();
}

TEST_CASE("freed prefixes stay cached, are hit from the free queue, and recycle tail first") {
  Fixture f;
  const auto prompt = iota(16);  // 4 full blocks
  auto a = f.prefill(prompt);
  const std::vector<BlockId> chain(f.table.blocks(a)->begin(), f.table.blocks(a)->end());
  REQUIRE(f.table.release(f.pool, a).ok());
  CHECK(f.pool.num_cached() == 4);
  CHECK(f.pool.num_used() == 0);

  auto hit = add_with_prefix(f.table, f.pool, iota(17), {}, f.hasher);
  CHECK(hit->cached_tokens == 16);
  CHECK(f.pool.num_cached() == 0);
  CHECK(f.pool.num_used() == 4);
  REQUIRE(f.table.release(f.pool, hit->seq).ok());
  f.require_ok();

  // Pressure: take every plain free block, then one more: the chain's tail goes first.
  auto hog = *f.table.add();
  std::vector<std::int32_t> slots(32 * B);
  const std::int32_t plain = f.pool.num_free() - f.pool.num_cached();
  REQUIRE(plain <= 8 * B);
  auto hog2 = *f.table.add();
  auto hog3 = *f.table.add();
  auto hog4 = *f.table.add();
  std::int32_t left = plain;
  for (SeqId h : {hog, hog2, hog3, hog4}) {
    const std::int32_t take = std::min(left, 8);
    REQUIRE(f.table.reserve(f.pool, h, take * B, slots).ok());
    left -= take;
  }
  REQUIRE(left == 0);
  CHECK(f.pool.num_cached() == 4);
  auto last = *f.table.add();
  REQUIRE(f.table.reserve(f.pool, last, 1, slots).ok());
  CHECK((*f.table.blocks(last))[0] == chain[3]);  // the tail block was recycled
  std::vector<BlockId> out(4);
  CHECK(match_prefix(f.table, f.pool, iota(17), {}, f.hasher, out) == 3);  // prefix still intact
  f.require_ok();

  std::vector<BlockEvent> ev(64);
  const auto n = f.pool.drain_events(ev);
  REQUIRE(n == 5);
  for (int i = 0; i < 4; ++i) {
    CHECK(ev[std::size_t(i)].kind == EventKind::stored);
    CHECK(ev[std::size_t(i)].block == chain[std::size_t(i)]);
    if (i > 0) CHECK(ev[std::size_t(i)].parent == ev[std::size_t(i - 1)].hash);  // chained
  }
  CHECK(ev[4] == BlockEvent{EventKind::removed, chain[3], ev[3].hash, {}});
}

TEST_CASE("rolling back into a published block: the hash lives until a write, then copy or unpublish") {
  Fixture f;
  const auto prompt = iota(8);
  auto a = f.prefill(prompt);
  const BlockId second = (*f.table.blocks(a))[1];
  REQUIRE(f.table.truncate(f.pool, a, 1).ok());
  CHECK(f.pool.has_hash(second));  // content of positions 4..6 still valid
  std::vector<std::int32_t> slots(1);
  auto w = f.table.reserve(f.pool, a, 1, slots);
  REQUIRE(w.ok());
  CHECK(w->copy.src == -1);  // unshared: written in place...
  CHECK_FALSE(f.pool.has_hash(second));  // ...after its hash was dropped
  CHECK(f.pool.num_published() == 1);
  f.require_ok();

  // Both holders of a shared published block roll back into it: the first
  // writer copies, the second (now sole holder) must unpublish before writing.
  auto b = f.prefill(prompt);
  auto c = *f.table.fork(f.pool, b);
  const BlockId shared = (*f.table.blocks(b))[1];
  REQUIRE(f.table.truncate(f.pool, c, 2).ok());
  REQUIRE(f.table.truncate(f.pool, b, 1).ok());
  CHECK(f.pool.has_hash(shared));
  auto r = f.table.reserve(f.pool, c, 1, slots);
  REQUIRE(r.ok());
  CHECK(r->copy.src == shared);
  CHECK(slots[0] == r->copy.dst * B + 2);
  auto rb = f.table.reserve(f.pool, b, 1, slots);
  REQUIRE(rb.ok());
  CHECK(rb->copy.src == -1);
  CHECK_FALSE(f.pool.has_hash(shared));
  std::vector<BlockId> out(4);
  CHECK(match_prefix(f.table, f.pool, iota(9), {}, f.hasher, out) == 1);
  f.require_ok();
}
