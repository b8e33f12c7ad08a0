// The example engine over a hybrid cache (scheduler.hpp runs it): the
// model's even layers full attention, its odd layers a sliding window of
// `window` tokens (Gemma's interleave, on a model trained with full
// attention everywhere: where the window covers the context it generates
// exactly what the full model does). Both groups draw pages from one pool;
// the window group frees what its next query no longer reads. The forward
// pass writes each layer through its group's view of the pool and reads it
// back through the group's CSR, a window layer masking what is W or more
// behind the query (HeldKv's window, nothing admitted past it).
// HybridEngine<QuestSelection> runs Quest on the full layers (the hybrid's
// global layers): every write folds its keys into the page bounds, and a
// decode query of a full layer reads only the pages the cache selects.
// HybridEngine<Selection, Eviction> runs a block policy (sinks and a window,
// or block scores fed the full layers' attention sums) on the full layers
// after every chunk and decoded token: its blocks leave as holes, and the
// full layers read what their rows still hold.
#pragma once

#include <array>
#include <cstdint>
#include <kvcache/cache/hybrid.hpp>
#include <kvcache/kernels/gather.hpp>
#include <kvcache/kernels/detail/group_view.hpp>
#include <kvcache/kernels/page_bounds.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/eviction/block_scores.hpp>
#include <kvcache/eviction/sink_window.hpp>
#include <kvcache/selection/quest.hpp>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine_types.hpp"
#include "forward.hpp"
#include "model.hpp"
#include "scheduler.hpp"

namespace engine {

// The hybrid layout of the shipped model: even layers full attention, odd
// layers a sliding window of `window` tokens (layers[0] and layers[1] hold
// the lists the groups point at), f32 pages of block_size tokens.
inline kvcache::LayerGroups interleaved_groups(const Model& m, std::int32_t block_size, std::int32_t window,
                                               std::array<std::vector<std::int32_t>, 2>& layers) {
  const auto& c = m.config();
  if (c.layers % 2 != 0) throw std::invalid_argument("hybrid: an even number of layers (full, window, ...)");
  for (std::int32_t l = 0; l < c.layers; ++l) layers[std::size_t(l % 2)].push_back(l);
  const kvcache::LayerGroupSpec g[] = {
      {.kind = kvcache::AttentionKind::full, .layers = layers[0], .num_kv_heads = c.kv_heads, .head_dim = c.head_dim(),
       .dtype = kvcache::DType::f32},
      {.kind = kvcache::AttentionKind::sliding_window, .layers = layers[1], .num_kv_heads = c.kv_heads,
       .head_dim = c.head_dim(), .window = window, .dtype = kvcache::DType::f32}};
  auto lg = kvcache::LayerGroups::make({.groups = g, .block_size = block_size});
  if (!lg) throw std::invalid_argument("hybrid layout: " + lg.status().message());
  return *lg;
}

// One request's view for one forward call: the chunk's slots, [groups][n].
template <class Cache>
class HybridKv {
 public:
  HybridKv(Cache& cache, std::span<const kvcache::PoolView> views, kvcache::SeqId seq, std::span<const std::int32_t> slots,
           std::int32_t window, std::vector<std::uint8_t>& none, KeyCounts* counts)
      : cache_(cache), views_(views), seq_(seq), slots_(slots), window_(window), none_(none), counts_(counts),
        decode_(slots.size() == std::size_t(cache.groups())) {}

  void write(std::int32_t l, const float* k, const float* v, std::int32_t n) {
    const auto at = cache_.layer_groups().layer_slot(l);
    const kvcache::PoolView& pool = views_[std::size_t(at.group)];
    const std::int64_t hd = pool.head_dim, row = std::int64_t{pool.num_kv_heads} * hd;
    const auto slots = slots_.subspan(std::size_t(at.group) * std::size_t(n), std::size_t(n));
    kvcache::ScatterParams p{pool, {k, v, kvcache::DType::f32, 0, row * 4, hd * 4}, {slots.data()}, n, at.index, 1};
    if (auto st = kvcache::scatter_host(p); !st) throw std::runtime_error("scatter: " + st.message());
    if constexpr (Cache::selects) {
      if (at.group == 0) {  // a full layer's keys enter their pages' bounds
        kvcache::PageBoundsUpdateParams u{pool, at.index, slots.data(), n, cache_.page_bounds(l)->data()};
        if (auto st = kvcache::page_bounds_update_host(u); !st) throw std::runtime_error("page_bounds_update: " + st.message());
      }
    }
    gathered_ = -1;
  }
  // A decode query (n == 1) of a full layer: the pages each kv-head reads,
  // as a mask over the gathered rows (q: [q_heads][head_dim]).
  void select(std::int32_t l, const float* q, std::int32_t n) {
    if constexpr (Cache::selects) {
      selected_ = -1;
      const auto at = cache_.layer_groups().layer_slot(l);
      if (n != 1 || at.group != 0) return;  // prefill reads densely; window layers read their window
      const kvcache::PoolView& pool = views_[std::size_t(at.group)];
      if (gathered_ != l) gather(l, at, pool);
      const std::int32_t H = pool.num_kv_heads, B = pool.block_size, rows = std::int32_t(pos_.size());
      const auto blocks = *cache_.blocks(seq_, 0);
      indptr_sel_.resize(std::size_t(H) + 1);
      chosen_.resize(std::size_t(H) * blocks.size());
      const kvcache::SeqId one[] = {seq_};
      const std::span<const float> queries(q, std::size_t(H) * std::size_t(cache_.selection().config().query_group) * std::size_t(pool.head_dim));
      if (auto r = cache_.select(one, l, queries, {indptr_sel_, chosen_}); !r) throw std::runtime_error("select: " + r.status().message());
      mask_.assign(std::size_t(H) * std::size_t(rows), 0);
      ones_.assign(std::size_t(H), 0);
      for (std::int32_t h = 0; h < H; ++h) {
        std::size_t j = 0;  // both lists in logical order: one walk maps chosen blocks to rows
        for (std::int32_t c = indptr_sel_[std::size_t(h)]; c < indptr_sel_[std::size_t(h) + 1]; ++c) {
          while (blocks[j] != chosen_[std::size_t(c)]) ++j;
          const std::int32_t lo = std::int32_t(j) * B, hi = std::min(rows, (std::int32_t(j) + 1) * B);
          for (std::int32_t t = lo; t < hi; ++t) mask_[std::size_t(h) * std::size_t(rows) + std::size_t(t)] = 1;
          ones_[std::size_t(h)] += hi - lo;
        }
      }
      selected_ = l;
    } else {
      (void)l, (void)q, (void)n;
    }
  }
  HeldKv read(std::int32_t l, std::int32_t head) {
    const auto at = cache_.layer_groups().layer_slot(l);
    const kvcache::PoolView& pool = views_[std::size_t(at.group)];
    if (gathered_ != l) gather(l, at, pool);
    const std::int32_t row = pool.num_kv_heads * pool.head_dim, rows = std::int32_t(pos_.size());
    HeldKv h{k_.data() + std::ptrdiff_t(head) * pool.head_dim, v_.data() + std::ptrdiff_t(head) * pool.head_dim, pos_.data(),
             rows, row};
    if (at.group == 1) {  // the window: nothing is admitted past it
      none_.assign(pos_.size(), 0);
      h.admitted = none_.data();
      h.window = window_;
    }
    const bool picked = selected_ == l;
    if (picked) h.selected = mask_.data() + std::ptrdiff_t(head) * rows;
    if (counts_ && at.group == 0 && decode_) {  // what a full layer's decode query reads
      const std::int64_t read = picked ? ones_[std::size_t(head)] : rows;
      counts_->read += read, counts_->dense += rows, ++counts_->reads;
      if (picked) counts_->sparse_read += read, ++counts_->sparse_reads;
    }
    return h;
  }

 private:
  // The group's live blocks for this layer, every token up to the chunk's end, in position order.
  void gather(std::int32_t l, kvcache::LayerSlot at, const kvcache::PoolView& pool) {
    const kvcache::SeqId one[] = {seq_};
    indices_.resize(std::size_t(*cache_.blocks_held(seq_, at.group)));
    if (auto r = cache_.export_group_csr(at.group, one, indptr_, indices_, first_); !r)
      throw std::runtime_error("export_csr: " + r.status().message());
    const auto rows = std::int32_t(*cache_.tokens(seq_) - first_[0]), row = pool.num_kv_heads * pool.head_dim;
    k_.resize(std::size_t(rows) * std::size_t(row));
    v_.resize(k_.size());
    pos_.resize(std::size_t(rows));
    for (std::int32_t t = 0; t < rows; ++t) pos_[std::size_t(t)] = first_[0] + t;
    const std::array<std::int32_t, 2> out_indptr{0, rows};
    kvcache::GatherParams p{pool, at.index, indptr_.data(), indices_.data(), out_indptr.data(), 1, rows, k_.data(), v_.data(),
                            kvcache::DType::f32, row * 4, pool.head_dim * 4};
    if (auto st = kvcache::gather_host(p); !st) throw std::runtime_error("gather: " + st.message());
    gathered_ = l;
  }

  Cache& cache_;
  std::span<const kvcache::PoolView> views_;
  kvcache::SeqId seq_;
  std::span<const std::int32_t> slots_;
  std::int32_t window_;
  std::vector<std::uint8_t>& none_;
  KeyCounts* counts_;
  bool decode_;  // one token: a decode query
  std::int32_t gathered_ = -1, selected_ = -1;
  std::array<std::int32_t, 2> indptr_{};
  std::array<std::int32_t, 1> first_{};
  std::vector<std::int32_t> indices_, indptr_sel_, chosen_, ones_;
  std::vector<std::uint8_t> mask_;
  std::vector<float> k_, v_;
  std::vector<std::int64_t> pos_;
};

// Pages hold block_size tokens of one group's layers (half the model's), so
// the pool has the bytes of EngineConfig::max_kv_tokens tokens of every layer:
// twice as many pages as the full-attention engine's blocks. With
// QuestSelection, EngineConfig::quest configures it (its bounds are the
// backend's store, [full layers][pages][kv-heads][2][head dim]).
template <class Selection = kvcache::SelectAll, class Eviction = kvcache::KeepAll>
class HybridBackend {
 public:
  using Cache = kvcache::HybridCache<kvcache::FastBlockHasher, Selection, Eviction>;
  static constexpr bool traces = kvcache::ObservingEviction<Eviction>;  // block scores read the full layers' sums
  static constexpr bool decode_selects = Cache::selects;  // Quest serves the full layers' decode queries

  HybridBackend(const Model& m, const EngineConfig& cfg, std::int32_t window, Eviction eviction = {})
      : window_(window),
        groups_(interleaved_groups(m, cfg.block_size, window, layers_)),
        pages_(2 * (cfg.max_kv_tokens / cfg.block_size) + 1),
        memory_(std::size_t(pages_) * std::size_t(groups_.page_bytes())),
        bounds_(Cache::selects ? std::size_t(kvcache::QuestSelection::bounds_floats(*kvcache::global_geometry(groups_), pages_)) : 0),
        cache_({.groups = groups_, .num_blocks = pages_, .max_sequences = cfg.max_batch, .max_tokens = m.config().context + 256,
                .prefill_chunk = cfg.chunk, .prefix_caching = false},
               selection_arg<typename kvcache::GroupSelection<Selection>::Arg>(cfg.quest, bounds_), eviction),
        evicted_(Cache::evicts ? std::size_t(pages_) : 0) {
    if (cfg.optimistic) throw std::invalid_argument("optimistic: the hybrid backend admits by the lifetime bound");
    if (cfg.layer_streams) throw std::invalid_argument("layer_streams: not with layer groups");
    if (!cfg.evict_in_prefill) throw std::invalid_argument("evict_in_prefill: every chunk is marked computed (the window's bound)");
    for (std::int32_t g = 0; g < 2; ++g) views_[std::size_t(g)] = *kvcache::make_group_view(groups_, g, memory_.data(), pages_);
  }

  const Cache& cache() const { return cache_; }
  std::int32_t handles() const { return 1; }
  bool ragged_trace() const { return traces; }  // each layer's sums over the rows it holds (full and window differ)
  kvcache::Result<std::int64_t> blocks_needed(std::int64_t tokens, std::int64_t new_tokens, std::int64_t) const {
    return cache_.blocks_needed(tokens, new_tokens);  // the configured chunk: the bound the pool is sized with
  }
  // Free pages less what running requests were promised and do not hold yet (the cache's ledger).
  std::int64_t room() const { return cache_.free_blocks() - cache_.promised_blocks(); }
  std::int32_t free_handles() const { return cache_.free_sequences(); }
  void open(Request& r) { r.seqs = {*cache_.add_sequence()}; }
  void close(Request& r) {
    for (const auto s : r.seqs) (void)cache_.free(s);
    r.seqs.clear();
  }
  void promise(const Request& r, std::int64_t need) {
    if (auto st = cache_.promise(r.seqs[0], need); !st) throw std::runtime_error(st.message());
  }
  kvcache::Status reserve(const Request& r, std::int32_t n, std::vector<std::int32_t>& slots) {
    slots.resize(2 * std::size_t(n));
    auto res = cache_.reserve(r.seqs[0], n, slots);
    return res ? kvcache::Status{} : res.status();
  }
  HybridKv<Cache> store(const Request& r, std::int64_t, std::span<const std::int32_t> slots, KeyCounts* keys) {
    return {cache_, views_, r.seqs[0], slots, window_, none_, keys};
  }
  // The chunk is computed: a later reserve may free what left the window.
  // Then the policy on the full layers (block scores fed the sum of their
  // attention over the rows they hold). With Quest, pages whose bounds went
  // stale (none in this engine's calls: it imports nothing and rolls nothing
  // back, and an eviction rewrites no page) are recomputed first.
  void after_forward(Request& r, const AttentionTrace& trace) {
    if (auto st = cache_.computed(r.seqs[0], *cache_.tokens(r.seqs[0])); !st) throw std::runtime_error(st.message());
    if constexpr (Cache::evicts) {
      if constexpr (traces) {
        sums_.assign(trace.layer_sums[std::size_t(layers_[0][0])].size(), 0.0f);
        for (const std::int32_t l : layers_[0])
          for (std::size_t t = 0; t < sums_.size(); ++t) sums_[t] += trace.layer_sums[std::size_t(l)][t];
        if (auto st = cache_.observe(r.seqs[0], 0, {kvcache::ScoreKind::attention_sums, sums_, 1}); !st)
          throw std::runtime_error("observe: " + st.message());
      } else {
        (void)trace;
      }
      if (auto e = cache_.evict(r.seqs[0], {.blocks = evicted_}); !e) throw std::runtime_error("evict: " + e.status().message());
    } else {
      (void)trace;
    }
    if constexpr (Cache::selects) {
      stale_.resize(std::size_t(*cache_.blocks_held(r.seqs[0], 0)) + 1);
      fill_.resize(stale_.size());
      auto n = cache_.stale_pages(r.seqs, {stale_, fill_});
      if (!n) throw std::runtime_error("stale_pages: " + n.status().message());
      for (std::size_t i = 0; i < layers_[0].size() && *n > 0; ++i) {
        kvcache::PageBoundsParams p{views_[0], std::int32_t(i), stale_.data(), fill_.data(), *n,
                                    cache_.page_bounds(layers_[0][i])->data()};
        if (auto st = kvcache::page_bounds_host(p); !st) throw std::runtime_error("page_bounds: " + st.message());
      }
    }
  }
  // Tokens held per layer, the mean of the two groups' (each has half the layers).
  std::int64_t held(const Request& r) const {
    return (*cache_.tokens_held(r.seqs[0], 0) + *cache_.tokens_held(r.seqs[0], 1) + 1) / 2;
  }

 private:
  std::int32_t window_;
  std::array<std::vector<std::int32_t>, 2> layers_;
  kvcache::LayerGroups groups_;
  std::int32_t pages_;
  std::vector<std::byte> memory_;
  std::vector<float> bounds_;  // Quest's store: [full layers][pages][kv_heads][2][head_dim]
  Cache cache_;
  std::array<kvcache::PoolView, 2> views_{};
  std::vector<std::uint8_t> none_;  // a window layer's "admitted" flags: none
  std::vector<std::int32_t> stale_, fill_;
  std::vector<std::int32_t> evicted_;  // evict()'s block indices (the pool's size bounds every plan)
  std::vector<float> sums_;            // the full layers' attention sums, one per row they hold
};

// The scheduler over the hybrid backend: Gemma-style interleaved layers on the
// shipped model (HybridEngine<QuestSelection>: Quest on the full layers; a
// block policy as Eviction: on the full layers).
template <class Selection = kvcache::SelectAll, class Eviction = kvcache::KeepAll>
class HybridEngine : public Scheduler<HybridBackend<Selection, Eviction>> {
 public:
  HybridEngine(const Model& m, const EngineConfig& cfg, std::int32_t window, Eviction eviction = {})
      : Scheduler<HybridBackend<Selection, Eviction>>(m, cfg, window, eviction) {}
  const typename HybridBackend<Selection, Eviction>::Cache& cache() const { return this->backend().cache(); }
};

}  // namespace engine
