// Quest on a hybrid model's global layers (selection/group_selection.hpp,
// cache/hybrid_selection.hpp): randomized admits with prefix hits, decode
// steps, rollbacks, imports that land or fail, and frees, driven as an
// engine drives them. Keys are kept here, per (global layer, page, slot);
// every write folds its keys into the store as page_bounds_update does, an
// import's received pages are written without it, and whatever stale_pages()
// lists is recomputed. After every operation:
//   every page of every global row bounds every key it holds, and a page no
//   other row or prefix hit can read has the exact bounds of its keys;
//   select() on every global layer equals a plain top-k over the rows'
//   pages, and select_params() plans the same rows.
// The same run with sinks and a window evicting from the global rows after
// decode steps: the rows' holes are never a candidate, never listed stale.
#include <kvcache/eviction/sink_window.hpp>
#include <catch2/catch.hpp>

#include <kvcache/cache/hybrid.hpp>
#include <kvcache/cache.hpp>
#include <kvcache/selection/quest.hpp>

#include <algorithm>
#include <cfloat>
#include <random>
#include <vector>

namespace kv = kvcache;
using kv::AttentionKind;

namespace {

using Hybrid = kv::HybridCache<kv::FastBlockHasher, kv::QuestSelection>;
using Evicting = kv::HybridCache<kv::FastBlockHasher, kv::QuestSelection, kv::SinkWindowEviction>;
constexpr std::int32_t D = 4, kSeqs = 4, kTokens = 96, kBlocks = 160;

struct Layout {
  std::int32_t H = 2;  // kv-heads of the global layers
  std::vector<std::vector<std::int32_t>> layers;
  std::vector<kv::LayerGroupSpec> specs;
  kv::LayerGroups lg;
  explicit Layout(int which) {
    if (which == 0) {  // Gemma-like: full and sliding-window layers interleaved
      layers = {{0, 2}, {1, 3}};
      specs = {{.kind = AttentionKind::full, .num_kv_heads = H, .head_dim = D},
               {.kind = AttentionKind::sliding_window, .num_kv_heads = H, .head_dim = D, .window = 8}};
    } else if (which == 1) {  // two global groups of two block sizes, and a chunked group
      layers = {{0, 3}, {1, 2, 4, 5}, {6}};
      specs = {{.kind = AttentionKind::full, .num_kv_heads = H, .head_dim = D},
               {.kind = AttentionKind::chunked_local, .num_kv_heads = H, .head_dim = D, .chunk = 8},
               {.kind = AttentionKind::full, .num_kv_heads = H, .head_dim = D}};
    } else {  // MLA's one latent head beside window layers
      H = 1;
      layers = {{0, 2}, {1, 3}};
      specs = {{.kind = AttentionKind::mla, .num_kv_heads = 1, .head_dim = D, .v_head_dim = 0},
               {.kind = AttentionKind::sliding_window, .num_kv_heads = 2, .head_dim = D, .window = 12}};
    }
    for (std::size_t g = 0; g < specs.size(); ++g) specs[g].layers = layers[g];
    lg = *kv::LayerGroups::make({.groups = specs, .block_size = 4});
  }
};

// A row's live blocks (an eviction's holes left out): what Quest ranks.
std::vector<std::int32_t> live_blocks(std::span<const kv::BlockId> row) {
  std::vector<std::int32_t> out;
  for (const kv::BlockId b : row)
    if (b != kv::BlockPool::null_block) out.push_back(b);
  return out;
}

template <class Cache = Hybrid>
struct Rig {
  Layout layout;
  std::int32_t H;
  std::vector<float> store;
  Cache cache;
  std::mt19937_64& rng;
  std::vector<std::int32_t> slice_group;  // [slice]: its group
  std::int32_t slices = 0, max_bs = 0;
  std::vector<float> keys;  // [slice][block][slot][head][dim]
  std::vector<kv::SeqId> live;
  std::vector<std::vector<std::int32_t>> prompts;  // what each live sequence holds (its tokens)

  Rig(int which, std::mt19937_64& r, kv::QuestConfig q)
      : layout(which),
        H(layout.H),
        store(std::size_t(kv::QuestSelection::bounds_floats(*kv::global_geometry(layout.lg), kBlocks)), 0.0f),
        cache(make({.groups = layout.lg, .num_blocks = kBlocks, .max_sequences = kSeqs, .max_tokens = kTokens, .prefix_caching = true},
                   with(q))),
        rng(r) {
    for (std::int32_t l = 0; l < layout.lg.num_layers(); ++l) {
      const std::int32_t g = layout.lg.layer_slot(l).group;
      if (kv::global_kind(layout.lg.spec(g).kind)) slice_group.push_back(g);
    }
    slices = std::int32_t(slice_group.size());
    for (std::int32_t g = 0; g < layout.lg.num_groups(); ++g) max_bs = std::max(max_bs, layout.lg.block_size(g));
    keys.assign(std::size_t(slices) * kBlocks * std::size_t(max_bs) * H * D, 0.0f);
  }
  static Cache make(const kv::HybridConfig& cfg, const kv::QuestConfig& q) {
    if constexpr (Cache::evicts) return Cache(cfg, q, kv::SinkWindowEviction({.sinks = 2, .window = 8}));
    else return Cache(cfg, q);
  }
  kv::QuestConfig with(kv::QuestConfig q) {
    q.bounds = store;
    return q;
  }
  std::int32_t model_layer(std::int32_t slice) const {
    for (std::int32_t l = 0, k = 0; l < layout.lg.num_layers(); ++l)
      if (kv::global_kind(layout.lg.spec(layout.lg.layer_slot(l).group).kind) && k++ == slice) return l;
    return -1;
  }
  float* key(std::int32_t k, std::int32_t block, std::int32_t slot) {
    return keys.data() + ((std::size_t(k) * kBlocks + std::size_t(block)) * std::size_t(max_bs) + std::size_t(slot)) * H * D;
  }
  float* bound(std::int32_t k, std::int32_t block) { return (*cache.page_bounds(model_layer(k))).data() + std::size_t(block) * H * 2 * D; }

  // Random keys at group g's slots (one per token), folded into the bounds as page_bounds_update folds them.
  void write(std::int32_t g, std::span<const std::int32_t> slots, bool fold = true) {
    const std::int32_t B = layout.lg.block_size(g);
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (std::int32_t k = 0; k < slices; ++k) {
      if (slice_group[std::size_t(k)] != g) continue;
      for (const std::int32_t s : slots) {
        if (s < 0) continue;
        float* kk = key(k, s / B, s % B);
        for (std::int32_t i = 0; i < H * D; ++i) kk[i] = n(rng);
        if (!fold) continue;
        float* b = bound(k, s / B);
        for (std::int32_t h = 0; h < H; ++h)
          for (std::int32_t d = 0; d < D; ++d) {
            float &hi = b[(h * 2) * D + d], &lo = b[(h * 2 + 1) * D + d];
            const float x = kk[h * D + d];
            hi = s % B == 0 ? x : std::max(hi, x);  // a page's first slot starts it afresh
            lo = s % B == 0 ? x : std::min(lo, x);
          }
      }
    }
  }
  // The exact bounds of `fill` slots of a page (what page_bounds writes).
  void recompute(std::int32_t k, std::int32_t block, std::int32_t fill) {
    float* b = bound(k, block);
    for (std::int32_t h = 0; h < H; ++h)
      for (std::int32_t d = 0; d < D; ++d) {
        float hi = -FLT_MAX, lo = FLT_MAX;
        for (std::int32_t t = 0; t < fill; ++t) hi = std::max(hi, key(k, block, t)[h * D + d]), lo = std::min(lo, key(k, block, t)[h * D + d]);
        b[(h * 2) * D + d] = hi, b[(h * 2 + 1) * D + d] = lo;
      }
  }
  // What the engine runs before it selects: every stale page recomputed, every global layer.
  void refresh() {
    std::vector<std::int32_t> pages(kSeqs * 2 * (kTokens + 1)), fill(pages.size());
    auto n = cache.stale_pages(live, {pages, fill});
    REQUIRE(n.ok());
    for (std::int32_t i = 0; i < *n; ++i)
      for (std::int32_t k = 0; k < slices; ++k) recompute(k, pages[std::size_t(i)], fill[std::size_t(i)]);
  }

  void check() {
    REQUIRE(cache.check_invariants().ok());
    for (std::size_t q = 0; q < live.size(); ++q) {
      const std::int64_t used = *cache.tokens(live[q]);
      for (std::int32_t k = 0; k < slices; ++k) {
        const std::int32_t g = slice_group[std::size_t(k)], B = layout.lg.block_size(g);
        const auto row = *cache.blocks(live[q], g);
        REQUIRE(std::int64_t(row.size()) == (used + B - 1) / B);
        for (std::size_t j = 0; j < row.size(); ++j) {
          if (row[j] == kv::BlockPool::null_block) continue;  // an eviction's hole
          const auto fill = std::int32_t(std::min<std::int64_t>(B, used - std::int64_t(j) * B));
          const float* b = bound(k, row[j]);
          const bool exact = cache.pool().ref_count(row[j]) == 1 && !cache.pool().has_hash(row[j]);
          for (std::int32_t h = 0; h < H; ++h)
            for (std::int32_t d = 0; d < D; ++d) {
              float hi = -FLT_MAX, lo = FLT_MAX;
              for (std::int32_t t = 0; t < fill; ++t) hi = std::max(hi, key(k, row[j], t)[h * D + d]), lo = std::min(lo, key(k, row[j], t)[h * D + d]);
              INFO("slice " << k << " block " << row[j] << " head " << h << " dim " << d);
              REQUIRE(b[(h * 2) * D + d] >= hi);
              REQUIRE(b[(h * 2 + 1) * D + d] <= lo);
              if (exact) REQUIRE((b[(h * 2) * D + d] == hi && b[(h * 2 + 1) * D + d] == lo));
            }
        }
      }
    }
    if (!live.empty())
      for (std::int32_t k = 0; k < slices; ++k) check_select(k);
  }

  // select() on slice k's model layer against a plain top-k over the same rows.
  void check_select(std::int32_t k) {
    const kv::QuestConfig& q = cache.selection().config();
    const std::int32_t g = slice_group[std::size_t(k)], B = layout.lg.block_size(g), budget = q.token_budget / B;
    std::normal_distribution<float> n(0.0f, 1.0f);
    std::vector<float> queries(live.size() * H * std::size_t(q.query_group) * D);
    for (float& x : queries) x = n(rng);
    std::vector<std::int32_t> indptr(live.size() * H + 1), indices(live.size() * H * kTokens);
    auto got = cache.select(live, model_layer(k), queries, {indptr, indices});
    REQUIRE(got.ok());
    kv::PageSelectParams p{};
    p.bounds = (*cache.page_bounds(model_layer(k))).data(), p.num_blocks = kBlocks, p.num_kv_heads = H, p.head_dim = D;
    p.queries = queries.data(), p.group = q.query_group;
    std::int32_t total = 0;
    for (std::int32_t s = 0; s < std::int32_t(live.size()); ++s) {
      const auto blocks = live_blocks(*cache.blocks(live[std::size_t(s)], g));
      const auto nb = std::int32_t(blocks.size());
      for (std::int32_t h = 0; h < H; ++h) {
        std::vector<std::int32_t> pick;
        if (k < q.dense_layers || nb <= budget) {
          pick.assign(blocks.begin(), blocks.end());
        } else {
          std::vector<std::pair<float, std::int32_t>> cand;  // (-bound, index): sorted = best first, ties low
          for (std::int32_t j = q.first_pages; j < nb - q.last_pages; ++j) cand.push_back({-kv::page_select_bound(p, s, h, blocks[std::size_t(j)]), j});
          std::sort(cand.begin(), cand.end());
          std::vector<std::int32_t> idx;
          for (std::int32_t j = 0; j < q.first_pages; ++j) idx.push_back(j);
          for (std::int32_t c = 0; c < budget - q.first_pages - q.last_pages; ++c) idx.push_back(cand[std::size_t(c)].second);
          for (std::int32_t j = nb - q.last_pages; j < nb; ++j) idx.push_back(j);
          std::sort(idx.begin(), idx.end());
          for (const std::int32_t j : idx) pick.push_back(blocks[std::size_t(j)]);
        }
        const std::size_t r = std::size_t(s) * H + std::size_t(h);
        const std::vector<std::int32_t> row(indices.begin() + indptr[r], indices.begin() + indptr[r + 1]);
        INFO("slice " << k << " seq " << s << " head " << h);
        REQUIRE(row == pick);
        total += std::int32_t(pick.size());
      }
    }
    REQUIRE(*got == total);
    std::vector<std::int32_t> pi(live.size() + 1), px(live.size() * kTokens), po(live.size() * H + 1);
    auto plan = cache.select_params(live, model_layer(k), {pi, px, po});
    REQUIRE(plan.ok());
    REQUIRE(plan->num_seqs == std::int32_t(live.size()));
    REQUIRE(plan->budget == (k < q.dense_layers ? INT32_MAX : budget));
    for (std::size_t s = 0; s < live.size(); ++s) {
      const auto blocks = live_blocks(*cache.blocks(live[s], g));
      REQUIRE(std::vector<std::int32_t>(px.begin() + pi[s], px.begin() + pi[s + 1]) == blocks);
    }
  }

  std::vector<std::int32_t> prompt(std::int32_t len) {
    std::vector<std::int32_t> p(static_cast<std::size_t>(len));
    const std::int32_t shared = std::uniform_int_distribution<std::int32_t>(0, len)(rng) / 8 * 8;  // a prefix many share
    for (std::int32_t i = 0; i < len; ++i) p[std::size_t(i)] = i < shared ? i % 5 : std::int32_t(rng() % 1000) + 5;
    return p;
  }
  std::vector<std::int32_t> slots_of(std::span<const std::int32_t> slots, std::int32_t g, std::int32_t stride, std::int32_t n) {
    return {slots.begin() + std::size_t(g) * std::size_t(stride), slots.begin() + std::size_t(g) * std::size_t(stride) + n};
  }

  std::vector<std::vector<std::int32_t>> imported;  // the prompts of landed imports: admitted again, they hit the received pages

  void admit() {
    auto p = prompt(std::uniform_int_distribution<std::int32_t>(1, 40)(rng));
    if (!imported.empty() && rng() % 3 == 0) p = imported[rng() % imported.size()];
    std::vector<std::int32_t> slots(std::size_t(layout.lg.num_groups()) * p.size());
    auto r = cache.admit(p, slots);
    if (!r) return;
    for (std::int32_t g = 0; g < layout.lg.num_groups(); ++g) write(g, slots_of(slots, g, std::int32_t(p.size()), r->reserved));
    REQUIRE(cache.computed(r->seq, std::int64_t(p.size())).ok());
    live.push_back(r->seq);
    prompts.push_back(p);
  }
  void decode(std::size_t q) {
    const std::int32_t n = std::uniform_int_distribution<std::int32_t>(1, 6)(rng);
    std::vector<std::int32_t> tokens(static_cast<std::size_t>(n)), slots(std::size_t(layout.lg.num_groups()) * std::size_t(n));
    for (auto& t : tokens) t = std::int32_t(rng() % 1000) + 5;
    auto r = cache.reserve(live[q], tokens, slots);
    if (!r) return;
    for (std::int32_t g = 0; g < layout.lg.num_groups(); ++g) write(g, slots_of(slots, g, n, n));
    if (rng() % 3 == 0) {  // a rejected draft: rolled back before it counts
      const std::int32_t back = std::uniform_int_distribution<std::int32_t>(1, n)(rng);
      REQUIRE(cache.truncate(live[q], back).ok());
      tokens.resize(std::size_t(n - back));
    }
    REQUIRE(cache.computed(live[q], *cache.tokens(live[q])).ok());
    prompts[q].insert(prompts[q].end(), tokens.begin(), tokens.end());
    if constexpr (Cache::evicts) {  // sinks and a window on the global rows: holes, no page rewritten
      std::vector<std::int32_t> out(std::size_t(*cache.blocks_held(live[q])));
      REQUIRE(cache.evict(live[q], {.blocks = out}).ok());
    }
  }
  // A peer's K/V lands in the received pages (no bounds folded), then
  // commits, or the transfer fails; a request cancelled at once is freed
  // before any stale_pages() listing, leaving its published pages unbounded.
  enum class Import { aborts, lands, lands_then_freed };
  void import(Import how) {
    const bool lands = how != Import::aborts;
    auto p = prompt(std::uniform_int_distribution<std::int32_t>(1, 40)(rng));
    auto plan = cache.import(p);
    if (!plan) return;
    for (std::int32_t g = 0; g < layout.lg.num_groups(); ++g) {
      const auto got = *cache.import_blocks(plan->id, g);
      const std::int32_t B = layout.lg.block_size(g);
      std::vector<std::int32_t> slots;
      for (std::size_t i = 0; i < got.local.size(); ++i)
        for (std::int32_t t = 0; t < B; ++t)
          if ((std::int64_t(got.skip) + std::int64_t(i)) * B + t < std::int64_t(p.size())) slots.push_back(got.local[i] * B + t);
      write(g, slots, /*fold=*/false);
    }
    if (!lands) {
      const auto a = *cache.abort_import(plan->id);
      REQUIRE(cache.free(a.seq).ok());
      return;
    }
    const auto c = *cache.commit_import(plan->id, p);
    imported.push_back(p);
    if (how == Import::lands_then_freed) {
      REQUIRE(cache.free(c.seq).ok());
      return;
    }
    live.push_back(c.seq);
    prompts.push_back(p);
  }
  void free(std::size_t q) {
    REQUIRE(cache.free(live[q]).ok());
    live.erase(live.begin() + std::ptrdiff_t(q));
    prompts.erase(prompts.begin() + std::ptrdiff_t(q));
  }
};

}  // namespace

template <class Cache>
void randomized_quest(std::int32_t holes_wanted) {
  std::int32_t holes = 0;
  for (int which = 0; which < 3; ++which) {
    for (std::int32_t dense = 0; dense < 2; ++dense) {
      std::mt19937_64 rng(std::uint64_t(7 + which * 10 + dense));
      Rig<Cache> rig(which, rng, {.token_budget = 32, .first_pages = 1, .last_pages = 1, .dense_layers = dense});
      std::int32_t imports = 0;
      for (int step = 0; step < 300; ++step) {
        const auto op = rng() % 10;
        if (rig.live.size() < 2 || (op < 3 && rig.live.size() < std::size_t(kSeqs))) {
          rig.admit();
        } else if (op < 5 && rig.live.size() < std::size_t(kSeqs)) {
          const auto how = rng() % 4;
          using Import = typename Rig<Cache>::Import;
          rig.import(how == 0 ? Import::aborts : how == 1 ? Import::lands_then_freed : Import::lands);
          imports += 1;
        } else if (op < 6) {
          rig.free(rng() % rig.live.size());
        } else {
          rig.decode(rng() % rig.live.size());
        }
        std::vector<std::int32_t> pages(kSeqs * 2 * (kTokens + 1)), fill(pages.size());
        // Listing twice lists nothing the second time: the first call cleared the marks.
        rig.refresh();
        auto again = rig.cache.stale_pages(rig.live, {pages, fill});
        REQUIRE(again.ok());
        REQUIRE(*again == 0);
        rig.check();
        for (const kv::SeqId s : rig.live)
          for (std::int32_t g = 0; g < rig.layout.lg.num_groups(); ++g)
            if (kv::global_kind(rig.layout.lg.spec(g).kind))
              holes += std::int32_t(rig.cache.blocks(s, g)->size()) - *rig.cache.blocks_held(s, g);
      }
      REQUIRE(imports > 20);
    }
  }
  REQUIRE(holes >= holes_wanted);
}

TEST_CASE("Quest on a hybrid's global layers: stale pages are listed and select() is a top-k over the group's rows") {
  randomized_quest<Hybrid>(0);
}

TEST_CASE("Quest beside sinks and a window on a hybrid's global layers: the same run, the rows' holes never a candidate") {
  randomized_quest<Evicting>(100);
}

TEST_CASE("A hybrid's received pages are stale until page_bounds runs, and a rolled-back tail with them") {
  std::mt19937_64 rng(3);
  Rig rig(0, rng, {.token_budget = 16, .dense_layers = 0});
  std::vector<std::int32_t> p(30);
  for (std::size_t i = 0; i < p.size(); ++i) p[i] = std::int32_t(i) + 100;
  auto plan = *rig.cache.import(p);
  const auto c = *rig.cache.commit_import(plan.id, p);
  rig.live.push_back(c.seq);
  std::vector<std::int32_t> pages(64), fill(64);
  auto n = rig.cache.stale_pages(rig.live, {pages, fill});
  REQUIRE(n.ok());
  REQUIRE(*n == 8);  // 30 tokens in blocks of 4: every received page of the full group
  REQUIRE(std::vector<std::int32_t>(pages.begin(), pages.begin() + 8) ==
          std::vector<std::int32_t>(rig.cache.blocks(c.seq, 0)->begin(), rig.cache.blocks(c.seq, 0)->end()));
  REQUIRE(fill[7] == 2);
  // A draft of 3 reserved and 2 rolled back: the partial tail keeps the removed keys' extremes.
  std::vector<std::int32_t> draft{1, 2, 3}, slots(6);
  REQUIRE(rig.cache.reserve(c.seq, draft, slots).ok());
  REQUIRE(rig.cache.truncate(c.seq, 2).ok());
  n = rig.cache.stale_pages(rig.live, {pages, fill});
  REQUIRE(*n == 1);
  REQUIRE(pages[0] == (*rig.cache.blocks(c.seq, 0))[7]);
  REQUIRE(fill[0] == 3);
}

TEST_CASE("Selection on a hybrid: errors name the value and change nothing") {
  std::mt19937_64 rng(5);
  Rig rig(0, rng, {.token_budget = 16, .dense_layers = 0});
  rig.admit();
  rig.admit();
  const Hybrid before = rig.cache;
  const std::int32_t H = rig.H;
  std::vector<float> q(2 * H * D);
  std::vector<std::int32_t> indptr(2 * H + 1), indices(2 * H * kTokens), pages(1), fill(1);
  auto bad = rig.cache.select(rig.live, 1, q, {indptr, indices});  // layer 1 is a window layer
  REQUIRE(bad.status().code() == kv::Errc::invalid_argument);
  REQUIRE(std::string(bad.status().what()).find("window") != std::string::npos);
  REQUIRE(rig.cache.select(rig.live, 4, q, {indptr, indices}).status().code() == kv::Errc::invalid_argument);
  REQUIRE(rig.cache.page_bounds(3).status().code() == kv::Errc::invalid_argument);
  REQUIRE(rig.cache.select(rig.live, 0, std::span<const float>(q).first(3), {indptr, indices}).status().code() ==
          kv::Errc::invalid_argument);
  REQUIRE(rig.cache == before);
  // A stale-pages listing too small for the received pages lists nothing and keeps the marks.
  std::vector<std::int32_t> p(20, 7);
  auto plan = *rig.cache.import(p);
  const auto c = *rig.cache.commit_import(plan.id, p);
  const Hybrid committed = rig.cache;
  const std::vector<kv::SeqId> one(1, c.seq);
  auto small = rig.cache.stale_pages(one, {pages, fill});
  REQUIRE(small.status().code() == kv::Errc::buffer_too_small);
  REQUIRE(rig.cache == committed);
  REQUIRE(rig.cache.free(c.seq).ok());
  const Hybrid freed = rig.cache;
  auto gone = rig.cache.select(one, 0, std::span<const float>(q).first(H * D), {indptr, indices});
  REQUIRE(gone.status().code() == kv::Errc::unknown_sequence);
  REQUIRE(std::string(gone.status().what()).find("seqs_at") != std::string::npos);
  REQUIRE(rig.cache.stale_pages(one, {pages, fill}).status().code() == kv::Errc::unknown_sequence);
  REQUIRE(rig.cache == freed);
}

TEST_CASE("Selection on a hybrid: a layout it cannot serve is a ConfigError naming the field") {
  static const std::int32_t a[] = {0}, b[] = {1};
  std::vector<float> store(4096);
  auto make = [&](const std::vector<kv::LayerGroupSpec>& specs, kv::QuestConfig q) {
    const auto lg = *kv::LayerGroups::make({.groups = specs, .block_size = 4});
    q.bounds = store;
    return Hybrid({.groups = lg, .num_blocks = 16, .max_sequences = 2, .max_tokens = 32}, q);
  };
  const kv::QuestConfig q{.token_budget = 8, .dense_layers = 0};
  auto what = [&](const std::vector<kv::LayerGroupSpec>& specs, kv::QuestConfig cfg) {
    try {
      (void)make(specs, cfg);
    } catch (const kv::ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::vector<kv::LayerGroupSpec> windows{{.kind = AttentionKind::sliding_window, .layers = a, .num_kv_heads = 1, .head_dim = 4, .window = 4},
                                                {.kind = AttentionKind::sliding_window, .layers = b, .num_kv_heads = 1, .head_dim = 4, .window = 8}};
  REQUIRE(what(windows, q).find("no full or MLA group") != std::string::npos);
  const std::vector<kv::LayerGroupSpec> shapes{{.kind = AttentionKind::full, .layers = a, .num_kv_heads = 1, .head_dim = 4},
                                               {.kind = AttentionKind::full, .layers = b, .num_kv_heads = 2, .head_dim = 4}};
  REQUIRE(what(shapes, q).find("num_kv_heads") != std::string::npos);
  const std::vector<kv::LayerGroupSpec> fine{{.kind = AttentionKind::full, .layers = a, .num_kv_heads = 1, .head_dim = 4},
                                             {.kind = AttentionKind::sliding_window, .layers = b, .num_kv_heads = 1, .head_dim = 4, .window = 4}};
  REQUIRE(what(fine, q) == "no error");
  REQUIRE(what(fine, {.token_budget = 2, .dense_layers = 0}).find("token_budget") != std::string::npos);
  REQUIRE(what(fine, {.token_budget = 2, .dense_layers = 0}).rfind("kvcache::HybridCache (selection): ", 0) == 0);  // names the cache it binds to
  store.resize(8);
  REQUIRE(what(fine, q).find("bounds") != std::string::npos);
}

template <class C>
concept Selecting = requires(C& c, std::span<const kv::SeqId> s) { c.select(s, 0, std::span<const float>{}, kv::SelectSpans{}); };

TEST_CASE("Selection on a hybrid is compile-time: a dense cache has no selection call") {
  STATIC_REQUIRE(Hybrid::selects);
  STATIC_REQUIRE(!kv::HybridCache<>::selects);
  STATIC_REQUIRE(!Selecting<kv::HybridCache<>>);
  STATIC_REQUIRE(Selecting<Hybrid>);
  STATIC_REQUIRE(sizeof(kv::HybridCache<>) <= sizeof(Hybrid));
}

TEST_CASE("Cache<> with Quest: an import's received pages are listed stale at commit") {
  const auto g = *kv::Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = 4, .block_size = 4});
  std::vector<float> store(std::size_t(kv::QuestSelection::bounds_floats(g, 32)));
  kv::Cache<kv::BlockPool, kv::PageTable, kv::AdmitAll, kv::QuestSelection> c({g, 32, 2, 16}, {},
                                                                                 kv::QuestConfig{.token_budget = 8, .dense_layers = 0, .bounds = store});
  std::vector<std::int32_t> p(14);
  for (std::size_t i = 0; i < p.size(); ++i) p[i] = std::int32_t(i);
  std::vector<kv::BlockId> blocks(4);
  auto plan = *c.import(p, blocks);
  const auto done = *c.commit_import(plan.id, p);
  std::vector<std::int32_t> pages(8), fill(8);
  const std::vector<kv::SeqId> one(1, done.seq);
  auto n = c.stale_pages(one, {pages, fill});
  REQUIRE(n.ok());
  REQUIRE(*n == 4);  // 14 tokens in blocks of 4, every one received: no page_bounds_update saw them
  REQUIRE(fill[3] == 2);
}

TEST_CASE("Cache<> with Quest: received pages stay stale for a row that adopts them before any listing") {
  const auto g = *kv::Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = 4, .block_size = 4});
  std::vector<float> store(std::size_t(kv::QuestSelection::bounds_floats(g, 32)));
  kv::Cache<kv::BlockPool, kv::PageTable, kv::AdmitAll, kv::QuestSelection> c({g, 32, 3, 16}, {},
                                                                                 kv::QuestConfig{.token_budget = 8, .dense_layers = 0, .bounds = store});
  std::vector<std::int32_t> p(14), slots(16), pages(16), fill(16);
  for (std::size_t i = 0; i < p.size(); ++i) p[i] = std::int32_t(i);
  std::vector<kv::BlockId> blocks(4);
  auto plan = *c.import(p, blocks);
  const auto done = *c.commit_import(plan.id, p);
  const std::vector<kv::BlockId> received(blocks.begin(), blocks.begin() + 3);  // the 3 full blocks, published
  REQUIRE(c.free(done.seq).ok());  // cancelled before the engine listed anything
  // A new request hits the 3 published blocks: their bounds were never computed.
  const auto a = *c.admit(p, slots);
  REQUIRE(a.cached_tokens == 12);
  const std::vector<kv::SeqId> one(1, a.seq);
  auto n = c.stale_pages(one, {pages, fill});
  REQUIRE(n.ok());
  REQUIRE(*n == 4);  // the 3 hits and the fresh tail (listed from the first stale block on)
  REQUIRE(std::vector<std::int32_t>(pages.begin(), pages.begin() + 3) == received);
  // Listed once, bounded: the next row adopting them has nothing stale.
  const auto b = *c.admit(p, slots);
  const std::vector<kv::SeqId> other(1, b.seq);
  REQUIRE(*c.stale_pages(other, {pages, fill}) == 0);
  // And a row adopting them while the importer still lives lists them, once.
  kv::Cache<kv::BlockPool, kv::PageTable, kv::AdmitAll, kv::QuestSelection> d({g, 32, 3, 16}, {},
                                                                                 kv::QuestConfig{.token_budget = 8, .dense_layers = 0, .bounds = store});
  plan = *d.import(p, blocks);
  const auto importer = d.commit_import(plan.id, p)->seq;
  const auto adopter = d.admit(p, slots)->seq;
  const std::vector<kv::SeqId> first(1, adopter), second(1, importer);
  REQUIRE(*d.stale_pages(first, {pages, fill}) == 4);
  REQUIRE(std::vector<std::int32_t>(pages.begin(), pages.begin() + 3) == received);
  REQUIRE(*d.stale_pages(second, {pages, fill}) == 4);  // its own marks: its pages, listed again (harmless)
}

TEST_CASE("A hybrid's received pages stay stale for a row that adopts them before any listing") {
  std::mt19937_64 rng(11);
  Rig rig(0, rng, {.token_budget = 16, .dense_layers = 0});
  std::vector<std::int32_t> p(30);
  for (std::size_t i = 0; i < p.size(); ++i) p[i] = std::int32_t(i) + 100;
  auto plan = *rig.cache.import(p);
  const auto c = *rig.cache.commit_import(plan.id, p);
  const std::vector<kv::BlockId> full(rig.cache.blocks(c.seq, 0)->begin(), rig.cache.blocks(c.seq, 0)->begin() + 7);
  REQUIRE(rig.cache.free(c.seq).ok());
  std::vector<std::int32_t> slots(2 * 30), pages(64), fill(64);
  const auto a = *rig.cache.admit(p, slots);
  REQUIRE(a.cached_tokens == 28);
  const std::vector<kv::SeqId> one(1, a.seq);
  auto n = rig.cache.stale_pages(one, {pages, fill});
  REQUIRE(n.ok());
  REQUIRE(*n == 8);  // the 7 full hits of the global group and its fresh tail
  REQUIRE(std::vector<std::int32_t>(pages.begin(), pages.begin() + 7) == full);
  const auto b = *rig.cache.admit(p, slots);
  const std::vector<kv::SeqId> other(1, b.seq);
  REQUIRE(*rig.cache.stale_pages(other, {pages, fill}) == 0);
}
