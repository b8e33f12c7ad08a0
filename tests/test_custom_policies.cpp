// Adding a policy never edits the cache: an admission, a selection and an
// eviction policy defined in this file alone (admit every other token,
// select pages at random with a seed, evict the oldest half) compose with
// the library's unchanged Cache, alone and together, and the cache holds
// them to their contracts through a randomized sequence of operations.
#include <catch2/catch.hpp>
#include <kvcache/cache.hpp>
#include <kvcache/selection/page_bounds_selection.hpp>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <vector>

using namespace kvcache;

namespace {

// --- admission: every other position is written ----------------------------
struct EveryOther {
  static constexpr Signals required_signals = no_signals;
  static constexpr AdmissionKind kind = AdmissionKind::per_token;
  bool admits(SeqId, std::int64_t position) const noexcept { return position % 2 == 0; }
};

// --- selection: `budget` pages per (sequence, kv-head), drawn with a seed -----
struct RandomPagesConfig {
  std::uint64_t seed = 1;
  std::int32_t budget = 2;
};
class RandomPages {
 public:
  static constexpr Signals required_signals = no_signals;
  static constexpr SelectionKind kind = SelectionKind::page_bounds;
  using Config = RandomPagesConfig;
  RandomPages() = default;
  RandomPages(const Config& c) : cfg_(c) {}  // NOLINT: the cache builds it from its Config
  Status bind(const SelectionShape& shape) {
    stale_.bind(shape.streams);
    const GeometrySpec& g = shape.geometry.spec();
    layer_floats_ = std::size_t(shape.num_blocks) * std::size_t(g.num_kv_heads) * 2 * std::size_t(g.head_dim);
    bounds_.assign(layer_floats_ * std::size_t(g.num_layers), 0.0f);
    kv_heads_ = shape.kv_heads;
    return {};
  }
  StalePages& stale() noexcept { return stale_; }
  const StalePages& stale() const noexcept { return stale_; }
  std::span<float> bounds(std::int32_t layer) const noexcept {
    return {const_cast<float*>(bounds_.data()) + layer_floats_ * std::size_t(layer), layer_floats_};
  }
  Result<PageSelectParams> plan(const PageTable&, std::span<const SeqId>, std::int32_t, const SelectPlanSpans&) const noexcept {
    return Status{Errc::invalid_argument, "plan (random pages are drawn on the host)", 0, 0};
  }
  // Each (sequence, kv-head) reads min(budget, pages) distinct pages, ascending.
  Result<std::int32_t> select(const PageTable& t, std::span<const SeqId> seqs, std::int32_t layer, std::span<const float>,
                              const SelectSpans& out) noexcept {
    std::mt19937_64 rng(cfg_.seed ^ (std::uint64_t(layer) << 32) ^ calls_++);
    std::int32_t w = 0;
    if (std::int64_t(out.indptr.size()) < std::int64_t(seqs.size()) * kv_heads_ + 1)
      return Status{Errc::buffer_too_small, "indptr", std::int64_t(out.indptr.size()), std::int64_t(seqs.size()) * kv_heads_ + 1};
    out.indptr[0] = 0;
    for (std::size_t k = 0; k < seqs.size(); ++k) {
      auto blocks = t.blocks(seqs[k]);
      if (!blocks) return Status{blocks.status().code(), "seqs_at", std::int64_t(k), 0};
      for (std::int32_t h = 0; h < kv_heads_; ++h) {
        std::vector<std::int32_t> order(blocks->size());
        std::iota(order.begin(), order.end(), 0);
        std::shuffle(order.begin(), order.end(), rng);
        order.resize(std::min<std::size_t>(order.size(), std::size_t(cfg_.budget)));
        std::sort(order.begin(), order.end());
        if (std::int64_t(out.indices.size()) < w + std::int64_t(order.size()))
          return Status{Errc::buffer_too_small, "indices", std::int64_t(out.indices.size()), w + std::int64_t(order.size())};
        for (const std::int32_t j : order) out.indices[std::size_t(w++)] = (*blocks)[std::size_t(j)];
        out.indptr[k * std::size_t(kv_heads_) + std::size_t(h) + 1] = w;
      }
    }
    return w;
  }
  friend bool operator==(const RandomPages& a, const RandomPages& b) { return a.stale_ == b.stale_; }

 private:
  Config cfg_{};
  StalePages stale_;
  std::vector<float> bounds_;
  std::size_t layer_floats_ = 0;
  std::int32_t kv_heads_ = 0;
  std::uint64_t calls_ = 0;
};
static_assert(PageBoundsSelection<RandomPages>);

// --- eviction: each evict() drops the oldest half of what may leave ----------
class OldestHalf {
 public:
  static constexpr Signals required_signals = no_signals;
  static constexpr std::int32_t trigger = 8;  // streams shorter than this keep everything
  // After evict(): held <= n below the trigger, else ceil(held / 2) with held <= n.
  std::int64_t max_tokens_held(std::int64_t n) const noexcept { return n < trigger ? n : std::max<std::int64_t>(trigger - 1, (n + 1) / 2); }
  std::int64_t max_blocks_held(std::int64_t n, std::int32_t b) const noexcept { return blocks_for_tokens(max_tokens_held(n), b); }
  std::int64_t max_tokens_after_eviction() const noexcept { return INT64_MAX; }
  void bind(const EvictionShape& shape) { pos_.assign(std::size_t(shape.streams), {}); }
  void on_truncate(std::uint32_t s, std::int32_t held) noexcept { pos_[s].resize(std::size_t(held)); }
  void reset(std::uint32_t s) noexcept { pos_[s].clear(); }
  void copy_state(std::uint32_t from, std::uint32_t to) noexcept { pos_[to] = pos_[from]; }
  std::int32_t groups() const noexcept { return 1; }
  std::int32_t evict_count(std::uint32_t, const StreamView& v) const noexcept {
    return v.held < trigger ? 0 : (v.held - v.first_candidate) / 2;
  }
  void begin_eviction(std::uint32_t s, const StreamView& v) {  // the tokens appended since: the row's tail, in order
    auto& p = pos_[s];
    const std::int64_t known = std::int64_t(p.size());
    for (std::int64_t j = known; j < v.held; ++j) p.push_back(v.appended - v.held + j);
  }
  void choose(std::uint32_t s, const StreamView& v, std::int32_t, std::span<std::int32_t> out) const {
    std::vector<std::int32_t> idx(std::size_t(v.held - v.first_candidate));
    std::iota(idx.begin(), idx.end(), v.first_candidate);
    std::sort(idx.begin(), idx.end(), [&](std::int32_t a, std::int32_t b) { return pos_[s][std::size_t(a)] < pos_[s][std::size_t(b)]; });
    std::copy_n(idx.begin(), out.size(), out.begin());
    std::sort(out.begin(), out.end());
  }
  void on_compacted(std::uint32_t s, std::int32_t, std::span<const SlotMove> moves, std::int32_t kept) {
    for (const SlotMove& m : moves) pos_[s][std::size_t(m.dst)] = pos_[s][std::size_t(m.src)];
    pos_[s].resize(std::size_t(kept));
  }
  std::int64_t oldest(std::uint32_t s) const { return pos_[s].empty() ? -1 : *std::min_element(pos_[s].begin(), pos_[s].end()); }
  friend bool operator==(const OldestHalf& a, const OldestHalf& b) { return a.pos_ == b.pos_; }

 private:
  std::vector<std::vector<std::int64_t>> pos_;  // per stream: each held token's position, row order
};
static_assert(TokenEviction<OldestHalf>);

constexpr std::int32_t B = 4;
CacheConfig config() {
  return {.geometry = *Geometry::make({.num_layers = 2, .num_kv_heads = 2, .head_dim = 4, .block_size = B}),
          .num_blocks = 128, .max_sequences = 8, .max_blocks_per_sequence = 32};
}

}  // namespace

TEST_CASE("a per-token admission defined outside the library: every other token is written, positions count all") {
  Cache<BlockPool, PageTable, EveryOther> cache(config());
  auto s = *cache.add_sequence();
  std::vector<std::int32_t> slots(7);
  auto r = cache.reserve(s, 7, slots);
  REQUIRE(r.ok());
  CHECK(*cache.tokens_held(s) == 4);  // positions 0, 2, 4, 6
  CHECK(*cache.table().appended(s) == 7);
  CHECK(slots[1] == -1);
  CHECK(slots[3] == -1);
  CHECK(slots[5] == -1);
  CHECK(slots[0] == slots[2] - 1);  // the admitted tokens take consecutive slots
  // The next call continues at position 7 (not written), 8 (written).
  std::vector<std::int32_t> more(2);
  REQUIRE(cache.reserve(s, 2, more).ok());
  CHECK(more[0] == -1);
  CHECK(more[1] == slots[6] + 1);
  // A batch: each entry's slots in its own range, -1 where not admitted and past the batch.
  auto t = *cache.add_sequence();
  const SeqId seqs[] = {s, t};
  const std::int32_t counts[] = {3, 2};
  std::vector<std::int32_t> batch(8, 99);
  std::vector<BlockCopy> copies(2);
  auto b = cache.reserve_batch(seqs, counts, batch, copies);
  REQUIRE(b.ok());
  CHECK(b->slots == 5);
  // s is at position 9: 9 skipped, 10 written, 11 skipped; t at 0: written, 1 skipped.
  CHECK(batch[0] == -1);
  CHECK(batch[1] == more[1] + 1);
  CHECK(batch[2] == -1);
  CHECK(batch[3] >= 0);
  CHECK(batch[4] == -1);
  CHECK(std::all_of(batch.begin() + 5, batch.end(), [](std::int32_t x) { return x == -1; }));
  CHECK(*cache.tokens_held(s) == 6);
  CHECK(*cache.tokens_held(t) == 1);
  CHECK(cache.check_invariants().ok());
  // Rows that skip positions are not prefixes, and a rollback is refused; nothing changes.
  const auto before = cache;
  std::vector<std::int32_t> prompt(8, 1);
  CHECK(cache.publish(s, prompt).status().code() == Errc::invalid_argument);
  CHECK(cache.truncate(s, 1).code() == Errc::invalid_argument);
  std::vector<std::int32_t> small(1);
  CHECK(cache.reserve(s, 3, small).status().code() == Errc::buffer_too_small);
  CHECK(cache == before);
  auto cfg = config();
  cfg.publish_on_reserve = true;
  CHECK_THROWS_WITH((Cache<BlockPool, PageTable, EveryOther>(cfg)), Catch::Contains("publish_on_reserve"));
}

TEST_CASE("an eviction policy defined outside the library: the oldest half leaves, and the cache keeps its bound") {
  using C = Cache<BlockPool, PageTable, AdmitAll, SelectAll, OldestHalf>;
  C cache(config());
  auto s = *cache.add_sequence();
  std::vector<std::int32_t> slots(32);
  std::vector<SlotMove> moves(64);
  std::vector<std::int32_t> group_moves(2);
  REQUIRE(cache.reserve(s, 20, slots).ok());
  auto r = cache.evict(s, {.moves = moves, .group_moves = group_moves});
  REQUIRE(r.ok());
  CHECK(r->tokens == 10);
  CHECK(*cache.tokens_held(s) == 10);
  CHECK(cache.eviction().oldest(s.index) == 10);  // positions 0..9 left
  CHECK(cache.check_invariants().ok());
  CHECK(*cache.blocks_needed(20, 0) == blocks_for_tokens(20, B));  // the prompt is held whole until the policy runs
}

TEST_CASE("the three outside policies composed with the unchanged cache hold every invariant through random operations") {
  using C = Cache<BlockPool, PageTable, EveryOther, RandomPages, OldestHalf>;
  static_assert(C::selects && C::evicts && !C::head_paged);
  std::mt19937_64 rng(Catch::rngSeed() ^ 0x5eed);
  C cache(config(), {}, RandomPagesConfig{.seed = 7, .budget = 2});
  std::vector<SeqId> live;
  std::vector<std::int32_t> slots(64), group_moves(2), indptr(64), indices(256), pages(256), fill(256);
  std::vector<SlotMove> moves(128);
  std::int64_t selected = 0, evicted = 0;
  for (int op = 0; op < 2000; ++op) {
    const int kind = int(rng() % 6);
    const auto before = cache;
    if (kind == 0 || live.empty()) {
      if (auto s = cache.add_sequence()) live.push_back(*s);
    } else {
      const SeqId s = live[rng() % live.size()];
      if (kind == 1) {
        const auto n = std::int32_t(1 + rng() % 12);
        auto r = cache.reserve(s, n, slots);
        if (!r) CHECK(cache == before);  // all or nothing
      } else if (kind == 2) {
        auto r = cache.evict(s, {.moves = moves, .group_moves = group_moves});
        REQUIRE(r.ok());
        evicted += r->tokens;
        REQUIRE(*cache.tokens_held(s) <= std::max<std::int64_t>(OldestHalf::trigger - 1, (*cache.table().appended(s) + 1) / 2));
      } else if (kind == 3) {
        if (auto c = cache.fork(s)) live.push_back(*c);
      } else if (kind == 4) {
        const SeqId one[] = {s};
        std::vector<float> queries(2 * 4);
        auto n = cache.select(one, 0, queries, {indptr, indices});
        REQUIRE(n.ok());
        selected += *n;
        const auto held_blocks = *cache.blocks_held(s);
        REQUIRE(*n == 2 * std::min(held_blocks, 2));  // each kv-head: its budget, or every page
        auto stale = cache.stale_pages(one, {pages, fill});
        REQUIRE(stale.ok());
      } else {
        REQUIRE(cache.free(s).ok());
        live.erase(std::find(live.begin(), live.end(), s));
      }
    }
    REQUIRE(cache.check_invariants().ok());
  }
  CHECK(selected > 0);
  CHECK(evicted > 0);
}
