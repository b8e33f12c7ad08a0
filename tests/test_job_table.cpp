// JobTable: ids name their slot and are never given twice; a completed or
// unknown id is found by no lookup; a full table refuses more; equality is
// the ids in flight, their entries and the ids to come. Randomized against a
// map of the ids in flight.
#include <catch2/catch.hpp>

#include <kvcache/core/job_table.hpp>

#include <map>
#include <random>
#include <set>
#include <vector>

using kvcache::JobTable;

namespace {
struct Entry {
  int value = 0;
  std::vector<int> list;
  friend bool operator==(const Entry&, const Entry&) = default;
};
}  // namespace

TEST_CASE("job table: ids name their slot, are never given twice, and a done id is unknown") {
  JobTable<Entry> t(3);
  CHECK(t.capacity() == 3);
  CHECK(t.size() == 0);
  const std::uint32_t a = t.add(), b = t.add(), c = t.add();
  CHECK(t.full());
  CHECK(std::set<std::uint32_t>{a, b, c}.size() == 3);
  t.find(a)->value = 7;
  t.remove(a);
  CHECK(t.find(a) == nullptr);
  CHECK(t.find(0) == nullptr);
  CHECK(t.find(a + 3000) == nullptr);
  const std::uint32_t d = t.add();  // a's slot, a new id
  CHECK(d != a);
  CHECK(t.find(d) != nullptr);
  CHECK(t.find(d)->value == 7);  // the slot's entry as its last job left it: the caller resets it
  t.clear();
  CHECK(t.size() == 0);
  CHECK(t.find(b) == nullptr);
  CHECK(t.find(c) == nullptr);
  CHECK(t.find(d) == nullptr);
}

TEST_CASE("job table: randomized against a map of the ids in flight") {
  std::mt19937 rng(11);
  JobTable<Entry> t(8);
  std::map<std::uint32_t, int> live;
  std::set<std::uint32_t> given;
  for (int step = 0; step < 20000; ++step) {
    if (!t.full() && (live.empty() || rng() % 2)) {
      const std::uint32_t id = t.add();
      REQUIRE(given.insert(id).second);  // never given twice
      t.find(id)->value = step;
      live[id] = step;
    } else {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      t.remove(it->first);
      REQUIRE(t.find(it->first) == nullptr);
      live.erase(it);
    }
    REQUIRE(t.size() == std::int32_t(live.size()));
    for (const auto& [id, v] : live) REQUIRE(t.find(id)->value == v);
    std::int32_t seen = 0;
    t.for_each([&](std::uint32_t id, const Entry& e) {
      REQUIRE(live.at(id) == e.value);
      ++seen;
    });
    REQUIRE(seen == t.size());
  }
  JobTable<Entry> copy = t;
  CHECK(copy == t);
  if (!live.empty()) {
    copy.remove(live.begin()->first);
    CHECK(!(copy == t));
  }
}
