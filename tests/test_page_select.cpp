// Quest page selection on the host backend: page bounds are true upper bounds
// on q·k for every dtype, and the chosen pages equal a plain reference's
// (bounds from the keys themselves, every candidate ranked, ties to the lower
// page). Then the errors, each leaving the output untouched.
#include <catch2/catch.hpp>

#include <kvcache/kernels/page_bounds.hpp>
#include <kvcache/kernels/page_select.hpp>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <string>
#include <vector>

#include "kernel_testing.hpp"

using namespace kvcache;
using namespace kvtest;

namespace {
std::mt19937_64 fresh_rng() { return std::mt19937_64(Catch::rngSeed() ^ std::random_device{}()); }

// A batch: random keys in a pool, sequences of random page lists, random queries.
struct Batch {
  GeometrySpec g;
  std::int32_t layer = 0, group = 1, blocks = 0;
  Pool pool;
  std::vector<std::int32_t> indptr{0}, indices, last;  // last: tokens in each sequence's last page
  std::vector<float> bounds, queries;

  Batch(std::mt19937_64& rng, const GeometrySpec& spec, std::int32_t num_blocks, std::int32_t seqs, std::int32_t max_pages)
      : g(spec), layer(std::int32_t(rng() % std::uint64_t(spec.num_layers))), group(rng() % 4 == 0 ? 9 + std::int32_t(rng() % 3) : 1 + std::int32_t(rng() % 3)),
        blocks(num_blocks), pool(spec, num_blocks) {
    pool.bytes = random_elems(rng, g.dtype, std::int64_t(pool.bytes.size()) / dtype_bytes(g.dtype));
    pool.view.base = pool.bytes.data();
    if (rng() % 3 == 0)  // blocks with the same keys: equal bounds, so the tie rule decides
      for (std::int32_t b = seqs + 2; b < num_blocks; b += 2)
        for (std::int32_t t = 0; t < g.block_size; ++t)
          for (std::int32_t h = 0; h < g.num_kv_heads; ++h)
            std::memcpy(pool.bytes.data() + ref_offset(g, num_blocks, b, layer, 0, t, h, 0),
                        pool.at(seqs + 1, layer, 0, t, h, 0), std::size_t(g.head_dim * dtype_bytes(g.dtype)));
    // Block 1 + s is only ever sequence s's last page (its fill is its own);
    // the full pages before it come from the rest, repeats allowed.
    for (std::int32_t s = 0; s < seqs; ++s) {
      const auto n = std::int32_t(rng() % std::uint64_t(max_pages + 1));
      for (std::int32_t j = 0; j + 1 < n; ++j) indices.push_back(1 + seqs + std::int32_t(rng() % std::uint64_t(num_blocks - 1 - seqs)));
      if (n > 0) indices.push_back(1 + s);
      indptr.push_back(std::int32_t(indices.size()));
      last.push_back(n == 0 ? 0 : 1 + std::int32_t(rng() % std::uint64_t(g.block_size)));
    }
    // Bounds from page_bounds over every page with its fill (a partial last page counts only its tokens).
    bounds.assign(std::size_t(num_blocks) * std::size_t(g.num_kv_heads * 2 * g.head_dim), 0.0f);
    std::vector<std::int32_t> pages, fill;
    for (std::int32_t s = 0; s < seqs; ++s)
      for (std::int32_t j = indptr[std::size_t(s)]; j < indptr[std::size_t(s) + 1]; ++j) {
        pages.push_back(indices[std::size_t(j)]);
        fill.push_back(j + 1 == indptr[std::size_t(s) + 1] ? last[std::size_t(s)] : g.block_size);
      }
    REQUIRE(page_bounds_host({pool.view, layer, pages.data(), fill.data(), std::int32_t(pages.size()), bounds.data()}).ok());
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    queries.resize(std::size_t(seqs * g.num_kv_heads * group * g.head_dim));
    for (auto& x : queries) x = u(rng);
  }
  std::int32_t seqs() const { return std::int32_t(indptr.size()) - 1; }
  std::int32_t fill(std::int32_t s, std::int32_t j) const {
    return j + 1 == indptr[std::size_t(s) + 1] - indptr[std::size_t(s)] ? last[std::size_t(s)] : g.block_size;
  }
  const float* q(std::int32_t s, std::int32_t h, std::int32_t k) const {
    return queries.data() + ((std::size_t(s) * std::size_t(g.num_kv_heads) + std::size_t(h)) * std::size_t(group) + std::size_t(k)) *
                                std::size_t(g.head_dim);
  }
  PageSelectParams params(std::int32_t budget, std::int32_t first, std::int32_t lastp, const std::vector<std::int32_t>& out_indptr,
                          std::vector<std::int32_t>& out, std::vector<std::byte>& scratch) const {
    return {bounds.data(), blocks, g.num_kv_heads, g.head_dim, queries.data(), group, indptr.data(), indices.data(), seqs(),
            indptr.back(), budget, first, lastp, out_indptr.data(), out.data(), scratch.data(), scratch.size()};
  }
};

// The bound's summation order (page_select_bound): lane k sums terms d = k,
// k + 4, ... in order (the last D % 4 terms go to lanes 0..), then (s0 + s1) + (s2 + s3).
float lane_sum(const std::vector<float>& terms) {
  float lane[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const std::size_t whole = terms.size() / 4 * 4;
  for (std::size_t d = 0; d < terms.size(); ++d) lane[d < whole ? d % 4 : d - whole] += terms[d];
  return (lane[0] + lane[1]) + (lane[2] + lane[3]);
}

// The reference: each page's bound from its keys directly, every candidate ranked.
std::vector<std::int32_t> reference(const Batch& b, std::int32_t budget, std::int32_t first, std::int32_t lastp) {
  std::vector<std::int32_t> out;
  const std::int32_t H = b.g.num_kv_heads, D = b.g.head_dim;
  for (std::int32_t s = 0; s < b.seqs(); ++s)
    for (std::int32_t h = 0; h < H; ++h) {
      const std::int32_t* pages = b.indices.data() + b.indptr[std::size_t(s)];
      const std::int32_t n = b.indptr[std::size_t(s) + 1] - b.indptr[std::size_t(s)];
      if (n <= budget) {
        out.insert(out.end(), pages, pages + n);
        continue;
      }
      std::vector<std::pair<float, std::int32_t>> ranked;
      for (std::int32_t j = first; j < n - lastp; ++j) {
        float best = -INFINITY;
        for (std::int32_t k = 0; k < b.group; ++k) {
          std::vector<float> terms;
          for (std::int32_t d = 0; d < D; ++d) {
            float mx = -FLT_MAX, mn = FLT_MAX;
            for (std::int32_t t = 0; t < b.fill(s, j); ++t) {
              mx = std::max(mx, b.pool.get(pages[j], b.layer, 0, t, h, d));
              mn = std::min(mn, b.pool.get(pages[j], b.layer, 0, t, h, d));
            }
            terms.push_back(std::max(b.q(s, h, k)[d] * mx, b.q(s, h, k)[d] * mn));
          }
          best = std::max(best, lane_sum(terms));
        }
        ranked.emplace_back(best, j);
      }
      std::stable_sort(ranked.begin(), ranked.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
      std::vector<std::int32_t> chosen;
      for (std::int32_t j = 0; j < first; ++j) chosen.push_back(j);
      for (std::int32_t k = 0; k < budget - first - lastp; ++k) chosen.push_back(ranked[std::size_t(k)].second);
      for (std::int32_t j = n - lastp; j < n; ++j) chosen.push_back(j);
      std::sort(chosen.begin(), chosen.end());
      for (const std::int32_t j : chosen) out.push_back(pages[j]);
    }
  return out;
}
}  // namespace

TEST_CASE("page bounds bound q·k from above for every key, every dtype") {
  auto rng = fresh_rng();
  for (int trial = 0; trial < 30; ++trial) {
    GeometrySpec g = random_spec(rng);
    Batch b(rng, g, 6, 3, 5);
    CAPTURE(trial, int(g.dtype), g.head_dim, g.block_size, b.group);
    for (std::int32_t s = 0; s < b.seqs(); ++s)
      for (std::int32_t j = 0; j < b.indptr[std::size_t(s) + 1] - b.indptr[std::size_t(s)]; ++j)
        for (std::int32_t h = 0; h < g.num_kv_heads; ++h) {
          const std::int32_t block = b.indices[std::size_t(b.indptr[std::size_t(s)] + j)];
          PageSelectParams q{};
          q.bounds = b.bounds.data();
          q.num_kv_heads = g.num_kv_heads;
          q.head_dim = g.head_dim;
          q.queries = b.queries.data();
          q.group = b.group;
          const float bound = page_select_bound(q, s, h, block);
          for (std::int32_t t = 0; t < b.fill(s, j); ++t)
            for (std::int32_t k = 0; k < b.group; ++k) {
              // Summed in the bound's order: each term is no larger and rounding is
              // monotone, so neither is the sum. Exact, not within a tolerance.
              std::vector<float> terms;
              for (std::int32_t d = 0; d < g.head_dim; ++d) terms.push_back(b.q(s, h, k)[d] * b.pool.get(block, b.layer, 0, t, h, d));
              REQUIRE(lane_sum(terms) <= bound);
            }
        }
  }
}

TEST_CASE("page selection picks the reference's pages: forced first and last pages, the best bounds between, ties to the lower page") {
  auto rng = fresh_rng();
  std::int64_t estimated = 0, ties = 0;
  for (int trial = 0; trial < 60; ++trial) {
    GeometrySpec g = random_spec(rng);
    g.block_size = trial % 2 ? 4 : 16;
    Batch b(rng, g, 24, 1 + std::int32_t(rng() % 4), 20);
    const std::int32_t first = std::int32_t(rng() % 3), lastp = std::int32_t(rng() % 3);
    const std::int32_t budget = std::max(1, first + lastp) + std::int32_t(rng() % 6);
    CAPTURE(trial, int(g.dtype), g.num_kv_heads, g.head_dim, b.group, budget, first, lastp);
    std::vector<std::int32_t> out_indptr(std::size_t(b.seqs() * g.num_kv_heads + 1));
    REQUIRE(page_select_indptr(b.indptr.data(), b.seqs(), g.num_kv_heads, budget, out_indptr.data(), out_indptr.size()).ok());
    std::vector<std::int32_t> out(std::size_t(out_indptr.back()), -9);
    std::vector<std::byte> scratch(page_select_scratch_bytes(20, g.num_kv_heads));
    REQUIRE(page_select_host(b.params(budget, first, lastp, out_indptr, out, scratch)).ok());
    REQUIRE(out == reference(b, budget, first, lastp));
    for (std::int32_t s = 0; s < b.seqs(); ++s) {
      const std::int32_t n = b.indptr[std::size_t(s) + 1] - b.indptr[std::size_t(s)];
      estimated += n > budget ? 1 : 0;
      std::vector<std::int32_t> seen(b.indices.begin() + b.indptr[std::size_t(s)], b.indices.begin() + b.indptr[std::size_t(s) + 1]);
      std::sort(seen.begin(), seen.end());
      ties += std::adjacent_find(seen.begin(), seen.end()) != seen.end() ? 1 : 0;
    }
  }
  REQUIRE(estimated > 20);  // most rows were longer than the budget: the ranking ran
  REQUIRE(ties > 0);        // a page listed twice in a row has equal bounds
}

TEST_CASE("page selection: bad queries, offsets, pages and buffers are typed errors that name the value, and nothing is written") {
  auto rng = fresh_rng();
  GeometrySpec g{.num_layers = 1, .num_kv_heads = 2, .head_dim = 8, .block_size = 4, .dtype = DType::f32};
  Batch b(rng, g, 16, 3, 10);
  b.indptr = {0, 10, 10, 16};
  b.indices.assign(16, 3);
  b.last = {4, 0, 2};
  std::vector<std::int32_t> out_indptr(7);
  REQUIRE(page_select_indptr(b.indptr.data(), 3, 2, 4, out_indptr.data(), out_indptr.size()).ok());
  CHECK(out_indptr == std::vector<std::int32_t>{0, 4, 8, 8, 8, 12, 16});
  std::vector<std::int32_t> out(16, -9);
  std::vector<std::byte> scratch(page_select_scratch_bytes(10, 2));
  const auto fails = [&](PageSelectParams p, Errc code, const std::string& what) {
    const Status st = page_select_host(p);
    CHECK(st.code() == code);
    CHECK(std::string(st.what()) == what);
    CHECK(std::all_of(out.begin(), out.end(), [](std::int32_t x) { return x == -9; }));
  };
  const PageSelectParams good = b.params(4, 1, 1, out_indptr, out, scratch);
  auto p = good;
  p.budget = 1;
  fails(p, Errc::invalid_argument, "budget (at least first_pages + last_pages, and 1)");
  p = good;
  p.group = 0;
  fails(p, Errc::invalid_argument, "group");
  p = good;
  p.num_pages = 15;
  fails(p, Errc::invalid_argument, "num_pages (indptr[num_seqs])");
  b.queries[13] = std::nanf("");
  fails(good, Errc::invalid_argument, "queries_at");
  CHECK(page_select_host(good).value() == 13);
  b.queries[13] = INFINITY;
  fails(good, Errc::invalid_argument, "queries_at");
  b.queries[13] = 0.5f;
  b.indices[7] = 16;  // past the pool
  fails(good, Errc::invalid_argument, "indices_at");
  CHECK(page_select_host(good).value() == 7);
  b.indices[7] = 3;
  std::vector<std::int32_t> wrong = out_indptr;
  wrong[2] = 5;
  fails(b.params(4, 1, 1, wrong, out, scratch), Errc::invalid_argument, "out_indptr_at (page_select_indptr)");
  std::vector<std::byte> small(page_select_scratch_bytes(9, 2));
  fails(b.params(4, 1, 1, out_indptr, out, small), Errc::buffer_too_small, "scratch_bytes");
  std::vector<std::int32_t> bad_csr{0, 10, 9, 16};
  std::swap(b.indptr, bad_csr);
  fails(b.params(4, 1, 1, out_indptr, out, scratch), Errc::invalid_argument, "indptr_at");
  std::swap(b.indptr, bad_csr);
  CHECK(page_select_indptr(b.indptr.data(), 3, 2, 4, out_indptr.data(), 6).code() == Errc::buffer_too_small);
  CHECK(page_select_indptr(b.indptr.data(), 3, 2, 0, out_indptr.data(), 7).code() == Errc::invalid_argument);
  REQUIRE(page_select_host(good).ok());  // and the good call still works: 4 of 10 pages, the 6 of the last sequence -> 4
  CHECK(std::count(out.begin(), out.end(), 3) == 16);
}
