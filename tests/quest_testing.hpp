// A Quest cache over a real host pool, driven the way an engine drives it:
// every write path runs its kernels (block copy, scatter, page_bounds_update,
// compaction, rope) and the stale pages are recomputed with page_bounds.
// The checks a test runs after any operation:
//   uncovered()  pages whose bounds miss a live key (must all be listed stale)
//   inexact()    private pages whose bounds differ from a recompute
//   reference_select()  the pages a plain top-k picks, for select() to match
#pragma once

#include <catch2/catch.hpp>

#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/page_bounds.hpp>
#include <kvcache/kernels/page_select.hpp>
#include <kvcache/kernels/rope.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kvcache.hpp>

#include <algorithm>
#include <cfloat>
#include <random>
#include <set>
#include <vector>

#include "kernel_testing.hpp"

namespace kvtest {

template <class Policy>
struct QuestRig {
  using C = kv::Cache<kv::BlockPool, kv::PageTable, kv::AdmitAll, kv::QuestSelection, Policy>;
  static constexpr std::int32_t max_seqs = 6, max_blocks = 24;

  kv::GeometrySpec spec;
  std::int32_t num_blocks;
  Pool pool;
  std::vector<float> store;
  C cache;
  std::mt19937_64& rng;
  std::vector<float> cos, sin;  // rope tables for block rotations

  QuestRig(std::mt19937_64& r, const kv::GeometrySpec& s, std::int32_t blocks, const kv::QuestConfig& q, Policy p = {})
      : spec(s),
        num_blocks(blocks),
        pool(s, blocks),
        store(std::size_t(kv::QuestSelection::bounds_floats(*kv::Geometry::make(s), blocks)), 0.0f),
        cache(kv::CacheConfig{*kv::Geometry::make(s), blocks, max_seqs, max_blocks}, {}, with_store(q), p),
        rng(r) {
    const std::int32_t max_delta = max_blocks * s.block_size, half = s.head_dim / 2;
    cos.resize(std::size_t((max_delta + 1) * half));
    sin.resize(cos.size());
    REQUIRE(kv::make_rope_table(10000.0, s.head_dim, max_delta, cos, sin).ok());
  }
  kv::QuestConfig with_store(kv::QuestConfig q) {
    q.bounds = store;
    return q;
  }
  std::span<float> bounds(std::int32_t layer) { return *cache.page_bounds(layer); }

  // reserve + copy-on-write + scatter of random K/V + the bounds' fold, as an engine runs them.
  bool write(kv::SeqId s, std::int32_t n) {
    std::vector<std::int32_t> slots(static_cast<std::size_t>(n));
    auto r = cache.reserve(s, n, slots);
    if (!r) return false;
    if (r->copy.src >= 0) REQUIRE(kv::block_copy_host({pool.view, pool.view, &r->copy, 1}).ok());
    scatter_and_fold(slots);
    return true;
  }

  // reserve_batch of one token for each of seqs (a decode step), then the same kernels.
  bool write_batch(std::span<const kv::SeqId> seqs) {
    std::vector<std::int32_t> counts(seqs.size(), 1), slots(seqs.size());
    std::vector<kv::BlockCopy> copies(seqs.size());
    auto r = cache.reserve_batch(seqs, counts, slots, copies);
    if (!r) return false;
    REQUIRE(kv::block_copy_host({pool.view, pool.view, copies.data(), r->copies}).ok());
    scatter_and_fold(slots);
    return true;
  }
  void scatter_and_fold(const std::vector<std::int32_t>& slots) {
    const auto n = std::int32_t(slots.size());
    const std::int64_t row = std::int64_t{spec.num_kv_heads} * spec.head_dim;
    std::uniform_real_distribution<float> u(-4.0f, 4.0f);
    std::vector<float> k(std::size_t(spec.num_layers * n * row)), v(k.size());
    for (auto& x : k) x = u(rng);
    for (auto& x : v) x = u(rng);
    kv::ScatterParams sp{pool.view, {k.data(), v.data(), kv::DType::f32, n * row * 4, row * 4, spec.head_dim * 4},
                         {slots.data()}, n, 0, spec.num_layers};
    REQUIRE(kv::scatter_host(sp).ok());
    for (std::int32_t l = 0; l < spec.num_layers; ++l)
      REQUIRE(kv::page_bounds_update_host({pool.view, l, slots.data(), n, bounds(l).data()}).ok());
  }

  // observe (random scores) + evict + the engine's commands for it.
  void evict(kv::SeqId s) {
    const std::int32_t held = std::int32_t(*cache.tokens_held(s));
    if constexpr (kv::ObservingEviction<Policy>) {
      std::vector<float> sc(static_cast<std::size_t>(held));
      std::uniform_real_distribution<float> u(0.0f, 1.0f);
      for (auto& x : sc) x = u(rng);
      REQUIRE(cache.observe(s, sc).ok());
    }
    std::vector<std::int32_t> blocks(max_blocks), group_moves(64);
    std::vector<kv::BlockRotation> rot(max_blocks);
    std::vector<kv::SlotMove> moves(std::size_t(max_blocks * spec.block_size * 8));
    auto r = cache.evict(s, {blocks, rot, moves, group_moves});
    REQUIRE(r.ok());
    if constexpr (kv::BlockEviction<Policy>) {
      std::vector<std::int32_t> b, d;
      for (std::int32_t i = 0; i < r->rotations; ++i) b.push_back(rot[std::size_t(i)].block), d.push_back(rot[std::size_t(i)].delta);
      kv::RopeParams rp{pool.view, 0, spec.num_layers, b.data(), d.data(), r->rotations, cos.data(), sin.data(),
                        max_blocks * spec.block_size};
      REQUIRE(kv::rope_host(rp).ok());
    }
    if constexpr (kv::TokenEviction<Policy>)
      REQUIRE(kv::compaction_host({pool.view, moves.data(), r->moves, 0, spec.num_layers, 0, 0}).ok());
  }

  // stale_pages + page_bounds on every layer; returns the pages listed.
  std::set<std::int32_t> refresh(std::span<const kv::SeqId> seqs) {
    std::vector<std::int32_t> pages(std::size_t(max_seqs * max_blocks)), fill(pages.size());
    auto n = cache.stale_pages(seqs, {pages, fill});
    REQUIRE(n.ok());
    for (std::int32_t l = 0; l < spec.num_layers; ++l)
      REQUIRE(kv::page_bounds_host({pool.view, l, pages.data(), fill.data(), *n, bounds(l).data()}).ok());
    return {pages.begin(), pages.begin() + *n};
  }

  // Tokens of row s held in its page j: slots [lo, hi) of the page.
  std::pair<std::int32_t, std::int32_t> live(kv::SeqId s, std::int32_t j) const {
    const std::int32_t B = spec.block_size, front = *cache.table().front(s);
    const std::int32_t used = front + std::int32_t(*cache.tokens_held(s));
    return {std::max(0, front - j * B), std::min(B, used - j * B)};
  }
  float key(std::int32_t page, std::int32_t l, std::int32_t t, std::int32_t h, std::int32_t d) const {
    return pool.get(page, l, 0, t, h, d) + 0.0f;
  }
  const float* entry(std::int32_t page, std::int32_t l, std::int32_t h) {
    return bounds(l).data() + (std::int64_t{page} * spec.num_kv_heads + h) * 2 * spec.head_dim;
  }

  // Pages of live rows whose bounds miss one of the row's live keys.
  std::set<std::int32_t> uncovered(std::span<const kv::SeqId> seqs) {
    std::set<std::int32_t> bad;
    for (const kv::SeqId s : seqs) {
      const auto blocks = *cache.table().blocks(s);
      for (std::int32_t j = 0; j < std::int32_t(blocks.size()); ++j) {
        const auto [lo, hi] = live(s, j);
        const std::int32_t page = blocks[std::size_t(j)];
        for (std::int32_t l = 0; l < spec.num_layers; ++l)
          for (std::int32_t h = 0; h < spec.num_kv_heads; ++h) {
            const float* e = entry(page, l, h);
            for (std::int32_t t = lo; t < hi; ++t)
              for (std::int32_t d = 0; d < spec.head_dim; ++d)
                if (!(e[d] >= key(page, l, t, h, d) && e[spec.head_dim + d] <= key(page, l, t, h, d))) bad.insert(page);
          }
      }
    }
    return bad;
  }

  // Private pages whose bounds differ from the max and min over slots [0, fill).
  std::set<std::int32_t> inexact(std::span<const kv::SeqId> seqs) {
    std::set<std::int32_t> bad;
    for (const kv::SeqId s : seqs) {
      const auto blocks = *cache.table().blocks(s);
      for (std::int32_t j = 0; j < std::int32_t(blocks.size()); ++j) {
        const std::int32_t page = blocks[std::size_t(j)], fill = live(s, j).second;
        if (cache.pool().ref_count(page) > 1) continue;
        for (std::int32_t l = 0; l < spec.num_layers; ++l)
          for (std::int32_t h = 0; h < spec.num_kv_heads; ++h)
            for (std::int32_t d = 0; d < spec.head_dim; ++d) {
              float mx = -FLT_MAX, mn = FLT_MAX;
              for (std::int32_t t = 0; t < fill; ++t) mx = std::max(mx, key(page, l, t, h, d)), mn = std::min(mn, key(page, l, t, h, d));
              if (entry(page, l, h)[d] != mx || entry(page, l, h)[spec.head_dim + d] != mn) bad.insert(page);
            }
      }
    }
    return bad;
  }

  // The pages a plain top-k picks for each (sequence, kv-head): all of them in a
  // dense layer or a row within budget; else the forced first and last pages and
  // the best bounds between, ties to the lower page, in logical order.
  std::vector<std::vector<std::int32_t>> reference_select(std::span<const kv::SeqId> seqs, std::int32_t layer,
                                                          const std::vector<float>& queries) {
    const kv::QuestConfig& q = cache.selection().config();
    const std::int32_t H = spec.num_kv_heads, budget = q.token_budget / spec.block_size;
    std::vector<std::vector<std::int32_t>> rows;
    kv::PageSelectParams p{};
    p.bounds = bounds(layer).data(), p.num_blocks = num_blocks, p.num_kv_heads = H, p.head_dim = spec.head_dim;
    p.queries = queries.data(), p.group = q.query_group;
    for (std::int32_t k = 0; k < std::int32_t(seqs.size()); ++k) {
      const auto blocks = *cache.table().blocks(seqs[std::size_t(k)]);
      const auto n = std::int32_t(blocks.size());
      for (std::int32_t h = 0; h < H; ++h) {
        std::vector<std::int32_t> pick;
        if (layer < q.dense_layers || n <= budget) {
          pick.assign(blocks.begin(), blocks.end());
        } else {
          std::vector<std::pair<float, std::int32_t>> cand;  // (-bound, logical index): sorted = best first, ties low
          for (std::int32_t j = q.first_pages; j < n - q.last_pages; ++j)
            cand.push_back({-kv::page_select_bound(p, k, h, blocks[std::size_t(j)]), j});
          std::sort(cand.begin(), cand.end());
          std::vector<std::int32_t> idx;
          for (std::int32_t j = 0; j < q.first_pages; ++j) idx.push_back(j);
          for (std::int32_t c = 0; c < budget - q.first_pages - q.last_pages; ++c) idx.push_back(cand[std::size_t(c)].second);
          for (std::int32_t j = n - q.last_pages; j < n; ++j) idx.push_back(j);
          std::sort(idx.begin(), idx.end());
          for (const std::int32_t j : idx) pick.push_back(blocks[std::size_t(j)]);
        }
        rows.push_back(pick);
      }
    }
    return rows;
  }

  std::vector<float> random_queries(std::int32_t seqs) {
    std::vector<float> q(std::size_t(seqs * spec.num_kv_heads * cache.selection().config().query_group * spec.head_dim));
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (auto& x : q) x = u(rng);
    return q;
  }

  // select() for every layer against reference_select().
  void check_select(std::span<const kv::SeqId> seqs) {
    for (std::int32_t l = 0; l < spec.num_layers; ++l) {
      const auto q = random_queries(std::int32_t(seqs.size()));
      std::vector<std::int32_t> indptr(seqs.size() * std::size_t(spec.num_kv_heads) + 1), indices(std::size_t(max_seqs * max_blocks * spec.num_kv_heads));
      auto n = cache.select(seqs, l, q, {indptr, indices});
      REQUIRE(n.ok());
      const auto want = reference_select(seqs, l, q);
      REQUIRE(indptr[want.size()] == *n);
      for (std::size_t r = 0; r < want.size(); ++r) {
        const std::vector<std::int32_t> got(indices.begin() + indptr[r], indices.begin() + indptr[r + 1]);
        REQUIRE(got == want[r]);
      }
    }
  }
};

// Random operations on a Quest cache under policy P; after each one, every
// page whose bounds miss a live key is listed stale, and after the
// recompute none is, private pages are exact (without forks), and select()
// matches the reference.
template <class P>
void quest_cache_property(std::mt19937_64& rng, P policy, bool forks, std::int32_t ops, kv::DType t = kv::DType::f32,
                          bool latent = false) {
  kv::GeometrySpec spec;  // latent: MLA's one head of K alone (v_head_dim 0), every query head reading it
  spec.num_layers = 3, spec.num_kv_heads = latent ? 1 : 2, spec.head_dim = 8, spec.block_size = 4, spec.dtype = t;
  spec.v_head_dim = latent ? 0 : -1;
  const std::int32_t pages = 2 + std::int32_t(rng() % 3);
  QuestRig<P> rig(rng, spec, 80, {.token_budget = pages * 4, .dense_layers = 1, .query_group = 2}, policy);
  std::vector<kv::SeqId> live;
  for (std::int32_t op = 0; op < ops; ++op) {
    const auto pick = [&] { return live[std::size_t(rng() % live.size())]; };
    const std::uint64_t what = live.empty() ? 0 : rng() % 10;
    if (what == 0 && live.size() < 5) {
      auto s = rig.cache.add_sequence();
      REQUIRE(s.ok());
      live.push_back(*s);
      (void)rig.write(*s, 1 + std::int32_t(rng() % 30));
    } else if (what == 4) {
      (void)rig.write_batch(live);
    } else if (what <= 3) {
      (void)rig.write(pick(), 1 + std::int32_t(rng() % (what == 1 ? 12 : 3)));
    } else if (what == 5 && forks && live.size() < 5) {
      auto c = rig.cache.fork(pick());
      if (c) live.push_back(*c);
    } else if (what == 6) {
      const kv::SeqId s = pick();
      const auto held = std::int32_t(*rig.cache.tokens_held(s));
      if (held > 0) (void)rig.cache.truncate(s, 1 + std::int32_t(rng() % std::uint64_t(std::min(held, 6))));
    } else if (what <= 8) {
      rig.evict(pick());
    } else if (live.size() > 1) {
      const auto k = std::size_t(rng() % live.size());
      REQUIRE(rig.cache.free(live[k]).ok());
      live.erase(live.begin() + std::ptrdiff_t(k));
    }
    const auto bad = rig.uncovered(live);
    const auto listed = rig.refresh(live);
    for (const std::int32_t page : bad) {
      INFO("op " << op << ": page " << page << " misses a live key and is not listed stale");
      REQUIRE(listed.count(page) == 1);
    }
    REQUIRE(rig.uncovered(live).empty());
    if (!forks) REQUIRE(rig.inexact(live).empty());
    REQUIRE(rig.cache.check_invariants().ok());
    if (op % 4 == 0 && !live.empty()) rig.check_select(live);
  }
}
}  // namespace kvtest
