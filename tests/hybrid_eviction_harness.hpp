// A randomized harness for a HybridCache with a block eviction policy on its
// global layers, shared by test_hybrid_eviction (a seeded generator, Catch's
// REQUIRE) and fuzz_hybrid (its bytes, abort). Prompts share a stem, so
// prefix hits are common. Every slot a reserve hands out is "written" with
// the prefix hash of its position, or, once its sequence evicted, with a
// different value (its K/V read another context); after every operation the
// invariants hold, a failed call changed nothing, and every group's rows as
// kernels read them (CSR and dense table) give back, in order, what was
// written at the positions the row holds. A block published after an
// eviction and served as a hit would read back the wrong value.
// pick(n) gives a value in [0, n); need(ok, what) fails the run when ok is false.
#pragma once

#include <kvcache/cache/hybrid.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <span>
#include <utility>
#include <vector>

namespace kvtest {

/// The pool's bytes as written, and what each sequence wrote at each position.
template <class Cache, class Need>
struct EvictionModel {
  Cache& cache;
  Need need;
  std::map<std::int64_t, std::uint64_t> content{};  // (group, slot) -> what was written there
  struct Seq {
    std::vector<std::int32_t> tokens{};
    std::vector<std::uint64_t> prefix{};  // [p]: hash of tokens 0 .. p
    std::vector<std::uint64_t> wrote{};   // [p]: what its K/V at p is
    std::int64_t reserved = 0, computed = 0;
    bool evicted = false;
    std::int64_t exact = 0;  // computed tokens at the first eviction
    void hit(std::int64_t n) { std::copy(prefix.begin(), prefix.begin() + n, wrote.begin()); }  // a hit holds the prefix
  };

  static std::uint64_t extend(std::uint64_t h, std::int32_t t) { return (h ^ std::uint64_t(t + 1)) * 0x100000001b3ULL + 7; }
  static Seq make(std::vector<std::int32_t> tokens) {
    Seq s;
    s.tokens = std::move(tokens);
    for (const auto t : s.tokens) s.prefix.push_back(extend(s.prefix.empty() ? 1 : s.prefix.back(), t));
    s.wrote.assign(s.tokens.size(), 0);
    return s;
  }
  static std::int64_t key(std::int32_t g, std::int32_t slot) { return std::int64_t(g) << 32 | std::uint32_t(slot); }
  // The forward pass writes positions [from, from + n) at slots[g * stride + t]: the prompt's prefix, or
  // (after an eviction) K/V of another context.
  void write(Seq& s, std::int64_t from, std::int32_t n, std::span<const std::int32_t> slots, std::int32_t stride) {
    for (std::int32_t t = 0; t < n; ++t) s.wrote[std::size_t(from + t)] = s.prefix[std::size_t(from + t)] ^ (s.evicted ? 0x5555 : 0);
    for (std::int32_t g = 0; g < cache.groups(); ++g)
      if (cache.layer_groups().spec(g).kind != kvcache::AttentionKind::cross)
        for (std::int32_t t = 0; t < n; ++t) content[key(g, slots[std::size_t(g * stride + t)])] = s.wrote[std::size_t(from + t)];
  }
  // The positions row g of s holds, in order: each live block's.
  std::vector<std::int64_t> held_positions(kvcache::SeqId id, const Seq& s, std::int32_t g) const {
    const auto row = *cache.blocks(id, g);
    const std::int32_t b = cache.layer_groups().block_size(g);
    std::vector<std::int64_t> out;
    for (std::int64_t p = 0; p < s.reserved; ++p)
      if (row[std::size_t(p / b)] != kvcache::BlockPool::null_block) out.push_back(p);
    return out;
  }
  // The kernels' view (CSR and dense table) reads back, in order, what was written at each held position.
  void read_back(kvcache::SeqId id, const Seq& s) {
    for (std::int32_t g = 0; g < cache.groups(); ++g) {
      const auto kind = cache.layer_groups().spec(g).kind;
      if (kind == kvcache::AttentionKind::cross) continue;
      const std::int32_t b = cache.layer_groups().block_size(g);
      const auto pos = held_positions(id, s, g);
      need(std::int64_t(pos.size()) == *cache.tokens_held(id, g), "tokens_held is not the positions the row holds");
      const kvcache::SeqId one[] = {id};
      const auto row_len = std::size_t((s.reserved + b - 1) / b);
      std::vector<std::int32_t> indptr(2), indices(row_len + 1), first(1), table(row_len + 1);
      need(cache.export_group_csr(g, one, indptr, indices, first).ok(), "export_group_csr");
      need(s.reserved - first[0] == std::int64_t(pos.size()), "first_pos is not the positions not held");
      need(cache.export_block_table(g, one, table, std::int32_t(table.size())).ok(), "export_block_table");
      const bool global = kvcache::global_kind(kind);
      for (std::size_t k = 0; k < pos.size(); ++k) {
        // CSR: the k-th held token. Table: a window or chunk row keeps its positions (null ids before its
        // first live block); a global row is its live blocks one after another, from index 0.
        const auto csr = std::int64_t(k);
        const std::int32_t slot = indices[std::size_t(csr / b)] * b + std::int32_t(csr % b);
        const std::int64_t t = global ? csr : first[0] + csr;
        const auto it = content.find(key(g, slot));
        need(it != content.end() && it->second == s.wrote[std::size_t(pos[k])], "a held position reads another K/V");
        need(table[std::size_t(t / b)] * b + std::int32_t(t % b) == slot, "the dense table and the CSR differ");
      }
      need(indptr[1] == *cache.blocks_held(id, g), "the CSR lists other than the live blocks");
    }
  }
};

/// Random admits (with hits), chunked prefill and decode, evictions (scores
/// first for a scored policy), rollbacks and frees over one cache.
template <class Cache, class Pick, class Need>
class HybridEvictionHarness {
 public:
  HybridEvictionHarness(Cache& cache, Pick pick, Need need)
      : m_{cache, need}, pick_(pick), need_(need), max_(cache.config().max_tokens) {
    stem_.resize(std::size_t(max_));
    for (auto& t : stem_) t = pick_(50);
  }
  std::int64_t evictions = 0, hits = 0, ops = 0;

  void step() {
    Cache& cache = m_.cache;
    ++ops;
    const auto before = cache;
    bool failed = false;
    auto it = seqs_.begin();
    if (!seqs_.empty()) std::advance(it, pick_(std::int32_t(seqs_.size())));
    switch (pick_(6)) {
      case 0: failed = admit(); break;
      case 1: case 2: if (it != seqs_.end()) failed = advance(it->second); break;
      case 3: if (it != seqs_.end()) evict(it->second); break;  // checks its own failure: observe changed the cache
      case 4: if (it != seqs_.end()) settle(it->second); break;
      default:
        if (it == seqs_.end() || pick_(2)) break;
        need_(cache.free(it->second.first).ok(), "free");
        seqs_.erase(it);
    }
    if (failed) need_(cache == before, "a failed call changed the cache");
    need_(cache.check_invariants().ok(), "check_invariants");
    for (const auto& [index, e] : seqs_) m_.read_back(e.first, e.second);
  }

 private:
  using Seq = typename EvictionModel<Cache, Need>::Seq;
  bool admit() {
    Cache& cache = m_.cache;
    const std::int32_t len = 1 + pick_(max_ * 2 / 3);
    std::vector<std::int32_t> tokens(stem_.begin(), stem_.begin() + len);
    if (pick_(2)) tokens.back() = 50 + pick_(50);
    for (std::int32_t t = len; t < max_; ++t) tokens.push_back(pick_(50));
    Seq s = EvictionModel<Cache, Need>::make(std::move(tokens));
    std::vector<std::int32_t> slots(std::size_t(cache.groups()) * std::size_t(len));
    auto r = cache.admit(std::span(s.tokens).first(std::size_t(len)), slots);
    if (!r) return true;
    hits += r->cached_tokens > 0;
    s.reserved = r->cached_tokens + r->reserved;
    s.computed = r->cached_tokens;
    s.hit(r->cached_tokens);
    m_.write(s, r->cached_tokens, r->reserved, slots, len);
    seqs_[r->seq.index] = {r->seq, std::move(s)};
    return false;
  }
  bool advance(std::pair<kvcache::SeqId, Seq>& e) {  // compute what is reserved, reserve the next tokens
    auto& [id, s] = e;
    const std::int32_t n = std::min<std::int32_t>(1 + pick_(4), std::int32_t(max_ - s.reserved));
    if (n <= 0) return false;
    std::vector<std::int32_t> slots(std::size_t(m_.cache.groups()) * std::size_t(n));
    auto r = m_.cache.advance(id, std::span(s.tokens).subspan(std::size_t(s.reserved), std::size_t(n)), slots);
    if (!r) return true;
    s.computed = s.reserved;
    m_.write(s, s.reserved, n, slots, n);
    s.reserved += n;
    return false;
  }
  void evict(std::pair<kvcache::SeqId, Seq>& e) {  // the policy runs (fed scores first when it reads them)
    Cache& cache = m_.cache;
    auto& [id, s] = e;
    if constexpr (requires(Cache& c, const kvcache::Scores& sc) { c.observe(kvcache::SeqId{}, 0, sc); }) {
      for (const std::int32_t g : globals()) {
        std::vector<float> sums(std::size_t(*cache.tokens_held(id, g)));
        for (auto& x : sums) x = float(pick_(100)) / 10.0f;
        need_(cache.observe(id, g, {kvcache::ScoreKind::attention_sums, sums, 1}).ok(), "observe");
      }
    }
    std::vector<std::int32_t> out(std::size_t(*cache.blocks_held(id)));
    const auto before = cache;
    auto r = cache.evict(id, {.blocks = out});
    if (!r) {  // a plan that takes a block still being computed
      need_(r.status().code() == kvcache::Errc::invalid_argument, "evict failed otherwise");
      need_(cache == before, "a failed evict changed the cache");
      return;
    }
    if (r->evicted > 0 && !s.evicted) s.exact = s.computed;  // the prompt's own K/V end here
    if (r->evicted > 0) s.evicted = true, ++evictions;
    need_(*cache.evicted(id) == s.evicted, "evicted(seq)");
    need_(*cache.computed_before_eviction(id) == (s.evicted ? s.exact : s.computed),
          "computed_before_eviction(seq)");
    for (const std::int32_t g : globals())
      need_(*cache.tokens_held(id, g) <= (*cache.eviction(g))->max_tokens_held(s.reserved) + (s.reserved - s.computed),
            "a global row holds past its policy's bound");
  }
  void settle(std::pair<kvcache::SeqId, Seq>& e) {  // a rejected draft, or computed up to here
    auto& [id, s] = e;
    if (pick_(2) && s.reserved > s.computed) {
      const auto n = std::int32_t(1 + pick_(std::int32_t(s.reserved - s.computed)));
      need_(m_.cache.truncate(id, n).ok(), "truncate");
      s.reserved -= n;
    } else {
      need_(m_.cache.computed(id, s.reserved).ok(), "computed");
      s.computed = s.reserved;
    }
  }
  std::vector<std::int32_t> globals() const {
    std::vector<std::int32_t> out;
    for (std::int32_t g = 0; g < m_.cache.groups(); ++g)
      if (kvcache::global_kind(m_.cache.layer_groups().spec(g).kind))
        out.push_back(g);
    return out;
  }

  EvictionModel<Cache, Need> m_;
  Pick pick_;
  Need need_;
  std::int32_t max_;
  std::vector<std::int32_t> stem_;
  std::map<std::uint32_t, std::pair<kvcache::SeqId, Seq>> seqs_;
};

}  // namespace kvtest
