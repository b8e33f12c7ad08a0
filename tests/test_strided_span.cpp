// StridedSpan: every H-th element of a store, as WriteGate's head positions.
#include <catch2/catch.hpp>

#include <kvcache/core/strided_span.hpp>

#include <algorithm>
#include <numeric>
#include <vector>

using namespace kvcache;

TEST_CASE("a strided span reads and writes every stride-th element and iterates like a span") {
  std::vector<int> store(12);
  std::iota(store.begin(), store.end(), 0);
  const StridedSpan<int> odd(store.data() + 1, 6, 2);  // 1 3 5 7 9 11
  CHECK(odd.size() == 6);
  CHECK_FALSE(odd.empty());
  CHECK(odd.stride() == 2);
  CHECK(odd[0] == 1);
  CHECK(odd[5u] == 11);
  CHECK(odd.front() == 1);
  CHECK(odd.back() == 11);
  CHECK(std::vector<int>(odd.begin(), odd.end()) == std::vector<int>{1, 3, 5, 7, 9, 11});
  CHECK(odd.end() - odd.begin() == 6);
  CHECK(std::vector<int>(odd.first(2).begin(), odd.first(2).end()) == std::vector<int>{1, 3});
  odd[2] = -5;  // writes through to the store
  CHECK(store[5] == -5);
  std::sort(odd.begin(), odd.end());  // random access: the algorithms work on the view alone
  CHECK(std::vector<int>(odd.begin(), odd.end()) == std::vector<int>{-5, 1, 3, 7, 9, 11});
  CHECK(store[0] == 0);  // the other elements are untouched
  CHECK(store[4] == 4);
  auto it = odd.begin() + 3;
  CHECK(*it == 7);
  CHECK(it[1] == 9);
  CHECK(*(it - 2) == 1);
  CHECK(odd.begin() < it);
  CHECK(StridedSpan<const int>().empty());
  CHECK(StridedSpan<const int>().begin() == StridedSpan<const int>().end());
}
