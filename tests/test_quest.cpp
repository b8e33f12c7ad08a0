// QuestSelection in the composed cache: every write path leaves the page
// bounds true upper bounds once the stale pages are recomputed (and every
// page that is not is listed stale), private pages exactly the recompute,
// and select() equal to a plain top-k for every layer, dense ones included.
// Then the errors: each names the value and changes nothing.
#include <catch2/catch.hpp>

#include <cstring>
#include <limits>
#include <string>

#include "quest_testing.hpp"

using namespace kvcache;
using namespace kvtest;

namespace {
std::mt19937_64 fresh_rng() { return std::mt19937_64(Catch::rngSeed() ^ std::random_device{}()); }

GeometrySpec small_spec(DType t = DType::f32) {
  GeometrySpec s;
  s.num_layers = 3, s.num_kv_heads = 2, s.head_dim = 8, s.block_size = 4, s.dtype = t;
  return s;
}
QuestConfig quest(std::int32_t budget_pages = 3) {
  return {.token_budget = budget_pages * 4, .first_pages = 1, .last_pages = 1, .dense_layers = 1, .query_group = 2};
}

}  // namespace

TEST_CASE("Quest with keep-all: appends fold into the bounds and copy-on-write pages are listed stale") {
  auto rng = fresh_rng();
  for (int run = 0; run < 6; ++run) kvtest::quest_cache_property(rng, KeepAll{}, run % 2 == 1, 60);
}

TEST_CASE("Quest with a sliding window: dropped front blocks shift the stale marks and the dead front keeps an upper bound") {
  auto rng = fresh_rng();
  for (int run = 0; run < 6; ++run) kvtest::quest_cache_property(rng, SlidingWindow(12 + std::int32_t(rng() % 12)), run % 2 == 1, 60);
}

TEST_CASE("Quest with block eviction: rotated blocks are listed stale and recomputed after rope") {
  auto rng = fresh_rng();
  for (int run = 0; run < 6; ++run)
    kvtest::quest_cache_property(rng, BlockScoreEviction({.start = 4, .recent = 8, .max = 24}), run % 2 == 1, 60);
}

TEST_CASE("Quest with token eviction: compaction targets are listed stale and recomputed") {
  auto rng = fresh_rng();
  for (int run = 0; run < 6; ++run) kvtest::quest_cache_property(rng, H2OEviction({.heavy = 6, .recent = 6, .groups = 1}), run % 2 == 1, 60);
}

TEST_CASE("Quest bounds stay upper bounds for every pool dtype") {
  auto rng = fresh_rng();
  for (const DType t : {DType::f16, DType::bf16, DType::fp8_e4m3})
    kvtest::quest_cache_property(rng, H2OEviction({.heavy = 6, .recent = 6, .groups = 1}), false, 40, t);
}

TEST_CASE("Quest rollback: the stale tail keeps a looser bound that still holds, and the recompute makes it exact") {
  auto rng = fresh_rng();
  QuestRig<KeepAll> rig(rng, small_spec(), 40, quest());
  const SeqId s = *rig.cache.add_sequence();
  REQUIRE(rig.write(s, 10));  // pages: 4 + 4 + 2
  const SeqId one[] = {s};
  REQUIRE(rig.refresh(one).empty());  // appends alone leave nothing stale
  const std::vector<float> before(rig.store);
  REQUIRE(rig.cache.truncate(s, 1).ok());
  REQUIRE(rig.store == before);  // the cache never touches the store
  REQUIRE(rig.uncovered(one).empty());  // a looser bound, still an upper bound
  const std::int32_t tail = (*rig.cache.table().blocks(s))[2];
  REQUIRE(rig.inexact(one) == std::set<std::int32_t>{tail});
  REQUIRE(rig.refresh(one) == std::set<std::int32_t>{tail});
  REQUIRE(rig.inexact(one).empty());
  // A tail another row shares is not marked: the fork may hold more of it.
  const SeqId c = *rig.cache.fork(s);
  REQUIRE(rig.cache.truncate(s, 1).ok());
  REQUIRE(rig.refresh(one).empty());
  const SeqId both[] = {s, c};
  REQUIRE(rig.uncovered(both).empty());
}

TEST_CASE("Quest rollback into a published block: not marked, since a prefix hit may adopt it whole") {
  auto rng = fresh_rng();
  QuestRig<KeepAll> rig(rng, small_spec(), 40, quest());
  const SeqId s = *rig.cache.add_sequence();
  REQUIRE(rig.write(s, 12));  // three full pages
  std::vector<std::int32_t> text(13);
  for (std::size_t i = 0; i < text.size(); ++i) text[i] = std::int32_t(i);
  REQUIRE(*rig.cache.publish(s, std::span(text).first(12)) == 3);
  const SeqId one[] = {s};
  REQUIRE(rig.cache.truncate(s, 2).ok());  // into the third page, which keeps its hash
  REQUIRE(rig.refresh(one).empty());
  auto hit = rig.cache.add_sequence(text);  // adopts all three pages, the third with all its keys
  REQUIRE(hit->cached_tokens == 12);
  const SeqId both[] = {s, hit->seq};
  REQUIRE(rig.uncovered(both).empty());
}

TEST_CASE("Quest select: dense layers read every page, sparse ones the budget with sinks and the partial page") {
  auto rng = fresh_rng();
  QuestRig<KeepAll> rig(rng, small_spec(), 40, quest(3));
  const SeqId a = *rig.cache.add_sequence(), b = *rig.cache.add_sequence();
  REQUIRE(rig.write(a, 30));  // 8 pages
  REQUIRE(rig.write(b, 5));   // 2 pages: within the budget
  const SeqId seqs[] = {a, b};
  std::vector<std::int32_t> indptr(5), indices(64);
  const auto q = rig.random_queries(2);
  REQUIRE(*rig.cache.select(seqs, 0, q, {indptr, indices}) == 2 * 8 + 2 * 2);  // layer 0 is dense
  REQUIRE(*rig.cache.select(seqs, 1, q, {indptr, indices}) == 2 * 3 + 2 * 2);
  const auto rows = *rig.cache.table().blocks(a);
  for (std::int32_t h = 0; h < 2; ++h) {
    REQUIRE(indices[std::size_t(indptr[std::size_t(h)])] == rows[0]);  // the sink page
    REQUIRE(indices[std::size_t(indptr[std::size_t(h) + 1] - 1)] == rows[7]);  // the partial last page
  }
  rig.check_select(seqs);
}

TEST_CASE("Quest select_params: a device launch's inputs give the host backend's pages") {
  auto rng = fresh_rng();
  QuestRig<KeepAll> rig(rng, small_spec(), 40, quest(3));
  const SeqId a = *rig.cache.add_sequence(), b = *rig.cache.add_sequence();
  REQUIRE(rig.write(a, 29));
  REQUIRE(rig.write(b, 17));
  const SeqId seqs[] = {a, b};
  for (std::int32_t layer = 0; layer < 3; ++layer) {
    std::vector<std::int32_t> indptr(3), rows(16), out_indptr(5);
    auto p = rig.cache.select_params(seqs, layer, {indptr, rows, out_indptr});
    REQUIRE(p.ok());
    REQUIRE(p->num_pages == 8 + 5);
    const auto q = rig.random_queries(2);
    std::vector<std::int32_t> launched(static_cast<std::size_t>(out_indptr[4]));
    std::vector<std::byte> scratch(page_select_scratch_bytes(8, 2));
    PageSelectParams launch = *p;
    launch.queries = q.data(), launch.out_indices = launched.data(), launch.scratch = scratch.data(), launch.scratch_bytes = scratch.size();
    REQUIRE(page_select_host(launch).ok());
    std::vector<std::int32_t> got_indptr(5), got(64);
    REQUIRE(rig.cache.select(seqs, layer, q, {got_indptr, got}).ok());
    REQUIRE(got_indptr == out_indptr);
    REQUIRE(std::vector<std::int32_t>(got.begin(), got.begin() + out_indptr[4]) == launched);
  }
}

TEST_CASE("Quest errors: bad queries, layers, handles and buffers name the value and change nothing") {
  auto rng = fresh_rng();
  QuestRig<KeepAll> rig(rng, small_spec(), 40, quest(3));
  const SeqId a = *rig.cache.add_sequence();
  REQUIRE(rig.write(a, 30));
  REQUIRE(rig.cache.truncate(a, 1).ok());  // a stale mark, which errors must keep
  const SeqId seqs[] = {a};
  const auto snapshot = rig.cache;
  const std::vector<float> store(rig.store);
  auto q = rig.random_queries(1);
  std::vector<std::int32_t> indptr(3, -7), indices(64, -7);
  const auto untouched = [&] {
    REQUIRE(rig.cache == snapshot);
    REQUIRE(rig.store == store);
    REQUIRE(std::count(indptr.begin(), indptr.end(), -7) == 3);
    REQUIRE(std::count(indices.begin(), indices.end(), -7) == 64);
  };
  const auto fails = [&](Result<std::int32_t> r, Errc code, const std::string& field) {
    REQUIRE(!r.ok());
    REQUIRE(r.status().code() == code);
    REQUIRE(r.status().message().find(field) != std::string::npos);
    untouched();
  };
  std::vector<float> short_q(q.begin(), q.end() - 1);
  fails(rig.cache.select(seqs, 1, short_q, {indptr, indices}), Errc::invalid_argument, "queries.size");
  q[5] = std::numeric_limits<float>::quiet_NaN();
  fails(rig.cache.select(seqs, 1, q, {indptr, indices}), Errc::invalid_argument, "queries_at");
  q[5] = std::numeric_limits<float>::infinity();
  fails(rig.cache.select(seqs, 1, q, {indptr, indices}), Errc::invalid_argument, "queries_at");
  q[5] = 0.5f;
  fails(rig.cache.select(seqs, 3, q, {indptr, indices}), Errc::invalid_argument, "layer");
  fails(rig.cache.select(seqs, -1, q, {indptr, indices}), Errc::invalid_argument, "layer");
  fails(rig.cache.select(seqs, 1, q, {std::span(indptr).first(2), indices}), Errc::buffer_too_small, "indptr");
  fails(rig.cache.select(seqs, 1, q, {indptr, std::span(indices).first(5)}), Errc::buffer_too_small, "indices");
  const SeqId stale_handle[] = {SeqId{a.index, a.generation + 1}};
  fails(rig.cache.select(stale_handle, 1, q, {indptr, indices}), Errc::unknown_sequence, "seqs_at");
  std::vector<std::int32_t> pages(1, -7), fill(1, -7);
  auto r = rig.cache.stale_pages(seqs, {pages, std::span(fill).first(0)});  // one stale page, no room for its fill
  REQUIRE(r.status().code() == Errc::buffer_too_small);
  REQUIRE(r.status().message().find("fill") != std::string::npos);
  REQUIRE(pages[0] == -7);
  untouched();
  std::vector<std::int32_t> plan_indptr(2), plan_rows(3), plan_out(3);
  auto p = rig.cache.select_params(seqs, 1, {plan_indptr, plan_rows, plan_out});
  REQUIRE(p.status().code() == Errc::buffer_too_small);
  REQUIRE(p.status().message().find("indices") != std::string::npos);
  REQUIRE(rig.cache.page_bounds(3).status().code() == Errc::invalid_argument);
  untouched();
}

TEST_CASE("Quest config errors are ConfigErrors naming the field") {
  const auto g = *Geometry::make(small_spec());
  std::vector<float> store(std::size_t(QuestSelection::bounds_floats(g, 40)));
  using C = Cache<BlockPool, PageTable, AdmitAll, QuestSelection>;
  const CacheConfig cfg{g, 40, 4, 16};
  const auto rejects = [&](QuestConfig q, const std::string& field) {
    try {
      C c(cfg, {}, q);
      FAIL("accepted");
    } catch (const ConfigError& e) {
      REQUIRE(std::string(e.what()).find(field) != std::string::npos);
    }
  };
  rejects({.token_budget = 7, .bounds = store}, "token_budget");  // below two pages of 4
  rejects({.token_budget = 16, .first_pages = 2, .last_pages = 3, .bounds = store}, "token_budget");
  rejects({.token_budget = 16, .first_pages = -1, .bounds = store}, "first_pages");
  rejects({.token_budget = 16, .dense_layers = 4, .bounds = store}, "dense_layers");
  rejects({.token_budget = 16, .query_group = 0, .bounds = store}, "query_group");
  rejects({.token_budget = 16, .bounds = std::span(store).first(store.size() - 1)}, "bounds");
  C ok(cfg, {}, {.token_budget = 16, .bounds = store});
  REQUIRE(ok.page_bounds(2)->size() == store.size() / 3);
}
