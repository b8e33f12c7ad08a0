// The token-paged KV backend of the example engine (scheduler.hpp runs it):
// one cache row per request, or one per (request, layer) with
// EngineConfig::layer_streams, over Cache<BlockPool, PageTable, AdmitAll,
// Selection, Policy>. The forward pass reads and writes it through PagedKv
// (kv_store.hpp). After a chunk the policy is fed the scores it reads from
// the attention trace and evicts, and the host compaction kernel moves what
// it keeps; token positions live beside the pool and move with it; with
// Quest, the pages a compaction rewrote get their bounds recomputed.
#pragma once

#include <algorithm>
#include <cstdint>
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/page_bounds.hpp>
#include <kvcache/kvcache.hpp>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "channel_kv.hpp"
#include "engine_types.hpp"
#include "forward.hpp"
#include "kv_scales.hpp"
#include "kv_store.hpp"
#include "model.hpp"

namespace engine {

template <class Policy, class Selection = kvcache::SelectAll>
class PagedBackend {
 public:
  using Cache = kvcache::Cache<kvcache::BlockPool, kvcache::PageTable, kvcache::AdmitAll, Selection, Policy>;
  static constexpr bool traces = true;                   // policies read the attention trace
  static constexpr bool decode_selects = Cache::selects;  // Quest serves decode queries

  PagedBackend(const Model& m, const EngineConfig& cfg, Policy policy)
      : m_(m),
        cfg_(cfg),
        streams_(cfg.layer_streams ? m.config().layers : 1),
        geometry_(*kvcache::Geometry::make({.num_layers = cfg.layer_streams ? 1 : m.config().layers,
                                            .num_kv_heads = m.config().kv_heads,
                                            .head_dim = m.config().head_dim(),
                                            .block_size = cfg.block_size,
                                            .dtype = cfg.kv_dtype,
                                            .format = cfg.kv_format})),
        blocks_((cfg.max_kv_tokens / cfg.block_size + 1) * streams_),
        memory_(std::size_t(*geometry_.pool_bytes(blocks_))),
        pool_(*kvcache::make_pool_view(geometry_, memory_.data(), blocks_)),
        scales_(cfg.kv_scales, cfg.kv_format, m.config()),
        bounds_(Cache::selects ? std::size_t(kvcache::QuestSelection::bounds_floats(geometry_, blocks_)) : 0),
        cache_({.geometry = geometry_,
                .num_blocks = blocks_,
                .max_sequences = cfg.max_batch * streams_,
                .max_blocks_per_sequence = m.config().context / cfg.block_size + 2},
               {}, selection_arg<typename kvcache::SelectionArg<Selection>::type>(cfg.quest, bounds_), policy),
        positions_(std::size_t(groups()) * std::size_t(blocks_) * std::size_t(cfg.block_size), -1),
        residual_(pool_) {
    if (Cache::selects && ChannelResidual::needed(pool_))
      throw std::invalid_argument("kv_format: channel scales (KIVI) with page selection: open blocks have no bounds");
    if (kvcache::TokenEviction<Policy> && cfg.layer_streams)
      throw std::invalid_argument("layer_streams: token policies choose per layer through their groups");
    if (Cache::selects && cfg.layer_streams) throw std::invalid_argument("layer_streams: not with page selection");
  }

  const Cache& cache() const { return cache_; }
  std::int32_t handles() const { return streams_; }
  bool ragged_trace() const { return streams_ > 1; }  // one stream per layer: each layer's rows

  // What r holds, read back through the page table as the forward pass
  // reads it: view(r).read(layer, kv_head) gives each held token's K/V and
  // the position its group's table names (they move with each group's
  // compaction), for tests to check against the policy's bookkeeping.
  PagedKv<Cache> view(const Request& r) {
    return {cache_, pool_, r.seqs, {}, 0, positions_, groups(), layout(), nullptr, &scales_, residual()};
  }
  // The store the forward pass writes r's tokens at `at` into (slots from reserve).
  PagedKv<Cache> store(const Request& r, std::int64_t at, std::span<const std::int32_t> slots, KeyCounts* keys) {
    return {cache_, pool_, r.seqs, slots, at, positions_, groups(), layout(), keys, &scales_, residual()};
  }
  // Tokens r holds: with one stream per layer, their mean over the layers
  // (rounded up), so figures compare with one stream's.
  std::int64_t held(const Request& r) const {
    std::int64_t sum = 0;
    for (const auto s : r.seqs) sum += *cache_.tokens_held(s);
    return (sum + streams_ - 1) / streams_;
  }
  // The position table a (layer, kv-head) reads (token policies' groups).
  std::int32_t group_of(std::int32_t layer, std::int32_t head) const { return layout().of(layer, head); }

  // Blocks a request of `tokens` (then `new_tokens` more) needs for its whole
  // life under the policy, over all its streams.
  kvcache::Result<std::int64_t> blocks_needed(std::int64_t tokens, std::int64_t new_tokens, std::int64_t chunk) const {
    auto need = cache_.blocks_needed(tokens, new_tokens, chunk);
    if (!need) return need.status();
    return *need * streams_;
  }
  // Free blocks less what the cache's ledger has promised running requests.
  std::int64_t room() const { return cache_.free_blocks() - cache_.promised_blocks(); }
  std::int32_t free_handles() const { return cache_.free_sequences(); }

  void open(Request& r) {
    r.seqs.clear();
    for (std::int32_t s = 0; s < streams_; ++s) r.seqs.push_back(*cache_.add_sequence());
  }
  void close(Request& r) {
    for (const auto s : r.seqs) {
      for (const std::int32_t b : *cache_.table().blocks(s)) residual_.drop(b);
      (void)cache_.free(s);
    }
    r.seqs.clear();
  }
  // Each stream's share of the need goes on the cache's ledger (Cache::promise).
  void promise(const Request& r, std::int64_t need) {
    for (const kvcache::SeqId s : r.seqs)
      if (auto st = cache_.promise(s, std::min<std::int64_t>(need / streams_, cache_.table().max_blocks_per_stream())); !st)
        throw std::runtime_error(st.message());
  }

  // n new slots in each of r's streams, [streams][n]; all or nothing.
  kvcache::Status reserve(const Request& r, std::int32_t n, std::vector<std::int32_t>& slots) {
    slots.resize(std::size_t(n) * r.seqs.size());
    std::int32_t copies = 0;
    if (r.seqs.size() == 1) {
      auto res = cache_.reserve(r.seqs[0], n, slots);
      if (!res) return res.status();
      copies = res->copy.src >= 0;
    } else {
      counts_.assign(r.seqs.size(), n);
      copies_.resize(r.seqs.size());
      auto res = cache_.reserve_batch(r.seqs, counts_, slots, copies_);
      if (!res) return res.status();
      copies = res->copies;
    }
    if (copies) throw std::runtime_error("unexpected copy-on-write: nothing is shared here");
    return {};
  }
  // The policy observes the chunk's attention and evicts; the kept tokens are compacted.
  void after_forward(Request& r, const AttentionTrace& trace) {
    if (streams_ > 1) return evict_layer_streams(r, trace);
    const kvcache::SeqId seq = r.seqs[0];
    const auto held = std::size_t(*cache_.tokens_held(seq));
    if constexpr (kvcache::ObservingEviction<Policy>) {
      using kvcache::Signals;
      const auto& c = m_.config();
      kvcache::Scores sc{};
      const Grouping grouping = this->grouping();
      if constexpr (Policy::required_signals.covers(Signals{Signals::last_query_attention})) {
        if (grouping == Grouping::layers)
          sc = {kvcache::ScoreKind::last_query_attention, trace.layer_last_query, c.layers * c.q_heads};
        else
          sc = {kvcache::ScoreKind::last_query_attention, trace.last_query, c.q_heads};
      } else if (grouping == Grouping::layer_heads) {
        sc = {kvcache::ScoreKind::head_attention_sums, trace.layer_head_sums, c.layers * c.kv_heads};
      } else if (grouping == Grouping::heads) {
        sc = {kvcache::ScoreKind::head_attention_sums, trace.head_sums, c.kv_heads};
      } else {
        reduced_.assign(held, 0.0f);
        for (std::int32_t g = 0; g < c.kv_heads; ++g)
          for (std::size_t t = 0; t < held; ++t) reduced_[t] += trace.head_sums[std::size_t(g) * held + t];
        sc = {kvcache::ScoreKind::attention_sums, reduced_, 1};
      }
      if (auto st = cache_.observe(seq, sc); !st) throw std::runtime_error("observe: " + st.message());
    }
    evicted_.resize(std::size_t(m_.config().context));
    rotations_.resize(evicted_.size());
    moves_.resize(std::size_t(groups()) * held);
    group_moves_.resize(std::size_t(groups() + 1));
    const bool channel = residual() != nullptr;
    if (channel) {  // what the sequence held, for the residual's compaction
      const auto b = *cache_.table().blocks(seq);
      before_.assign(b.begin(), b.end());
    }
    auto e = cache_.evict(seq, kvcache::EvictionSpans{evicted_, rotations_, moves_, group_moves_});
    if (!e) throw std::runtime_error("evict: " + e.status().message());
    if constexpr (kvcache::TokenEviction<Policy>) {
      channel_moves_.clear();
      const std::int32_t G = groups();
      const Grouping grouping = this->grouping();
      const bool by_layer = grouping == Grouping::layers || grouping == Grouping::layer_heads,
                 by_head = grouping == Grouping::heads || grouping == Grouping::layer_heads;
      const std::int32_t per_layer = grouping == Grouping::layer_heads ? m_.config().kv_heads : 1;
      for (std::int32_t g = 0; g < G && e->moves > 0; ++g) {
        const std::int32_t lo = group_moves_[std::size_t(g)], hi = group_moves_[std::size_t(g + 1)];
        // Group g's heads: all layers or one, all kv-heads or one.
        const auto [lo_layer, layers] = by_layer ? std::pair{g / per_layer, 1} : std::pair{0, m_.config().layers};
        const auto [head, heads] = by_head ? std::pair{g % m_.config().kv_heads, 1} : std::pair{0, 0};
        kvcache::CompactionParams p{.cache = pool_,
                                    .moves = moves_.data() + lo,
                                    .num_moves = hi - lo,
                                    .first_layer = lo_layer,
                                    .num_layers = layers,
                                    .first_head = head,
                                    .num_heads = heads};
        if (channel)  // codes depend on their block's tokens: moved as the residual's compaction, below
          channel_moves_.push_back({{p.moves, std::size_t(p.num_moves)}, p.first_layer, p.num_layers, p.first_head, p.num_heads});
        else if (auto st = kvcache::compaction_host(p); !st)
          throw std::runtime_error("compaction: " + st.message());
        std::int64_t* pos = pos_table(g);
        for (std::int32_t k = lo; k < hi; ++k) pos[moves_[std::size_t(k)].dst] = pos[moves_[std::size_t(k)].src];
      }
      const auto after = *cache_.table().blocks(seq);
      const auto rows = std::int32_t(*cache_.tokens_held(seq));
      if (channel && (e->moves > 0 || rows != std::int32_t(held)))  // blocks rewritten, or a new partial last block
        residual_.compact(before_, std::int32_t(held), after, rows, channel_moves_);
    }
    refresh_bounds(r);  // after the compaction: the pages it rewrote
  }

 private:
  // Pages a compaction or rotation left stale get their bounds recomputed (every layer).
  void refresh_bounds(const Request& r) {
    if constexpr (Cache::selects) {
      stale_pages_.resize(std::size_t(m_.config().context / cfg_.block_size + 2) * r.seqs.size());
      stale_fill_.resize(stale_pages_.size());
      auto n = cache_.stale_pages(r.seqs, {stale_pages_, stale_fill_});
      if (!n) throw std::runtime_error("stale_pages: " + n.status().message());
      for (std::int32_t l = 0; l < geometry_.spec().num_layers && *n > 0; ++l) {
        kvcache::PageBoundsParams p{pool_, l, stale_pages_.data(), stale_fill_.data(), *n, cache_.page_bounds(l)->data()};
        if (auto st = kvcache::page_bounds_host(p); !st) throw std::runtime_error("page_bounds: " + st.message());
      }
    } else {
      (void)r;
    }
  }
  std::int32_t groups() const {
    if constexpr (kvcache::TokenEviction<Policy>)
      return cache_.eviction().groups();
    else
      return 1;
  }
  Grouping grouping() const { return groups() == 1 ? Grouping::all : cfg_.grouping; }
  GroupLayout layout() const {
    const auto& c = m_.config();
    switch (grouping()) {
      case Grouping::all: return {0, 0, 1};
      case Grouping::heads: return {0, 1, c.kv_heads};
      case Grouping::layers: return {1, 0, c.layers};
      case Grouping::layer_heads: return {c.kv_heads, 1, c.layers * c.kv_heads};
    }
    return {};
  }
  ChannelResidual* residual() { return ChannelResidual::needed(pool_) ? &residual_ : nullptr; }
  std::int64_t* pos_table(std::int32_t g) {
    return positions_.data() + std::size_t(g) * std::size_t(blocks_) * std::size_t(cfg_.block_size);
  }
  // One stream per layer: each layer's stream is scored by that layer's
  // attention and evicts on its own.
  void evict_layer_streams(Request& r, const AttentionTrace& trace) {
    for (std::int32_t l = 0; l < streams_; ++l) {
      const kvcache::SeqId seq = r.seqs[std::size_t(l)];
      if constexpr (kvcache::ObservingEviction<Policy>) {
        const kvcache::Scores sc{kvcache::ScoreKind::attention_sums, trace.layer_sums[std::size_t(l)], 1};
        if (auto st = cache_.observe(seq, sc); !st) throw std::runtime_error("observe: " + st.message());
      }
      evicted_.resize(std::size_t(m_.config().context));
      rotations_.resize(evicted_.size());
      group_moves_.resize(2);
      auto e = cache_.evict(seq, kvcache::EvictionSpans{evicted_, rotations_, moves_, group_moves_});
      if (!e) throw std::runtime_error("evict: " + e.status().message());
    }
  }


  const Model& m_;
  EngineConfig cfg_;
  std::int32_t streams_;  // per request: 1, or one per layer
  kvcache::Geometry geometry_;
  std::int32_t blocks_;
  std::vector<std::byte> memory_;
  kvcache::PoolView pool_;
  HeldScales scales_;  // EngineConfig::kv_scales, checked
  std::vector<float> bounds_;  // page selection's store: [layers][blocks][kv_heads][2][head_dim]
  Cache cache_;
  std::vector<std::int64_t> positions_;  // [groups][pool slot]: token position, moves with compaction
  std::vector<float> reduced_;
  std::vector<std::int32_t> evicted_, group_moves_;
  std::vector<kvcache::BlockRotation> rotations_;
  std::vector<kvcache::SlotMove> moves_;
  std::vector<std::int32_t> counts_;
  std::vector<kvcache::BlockCopy> copies_;
  std::vector<std::int32_t> stale_pages_, stale_fill_;
  ChannelResidual residual_;  // a channel-scaled pool's open blocks (KIVI's residual)
  std::vector<std::int32_t> before_;
  std::vector<ChannelResidual::Moves> channel_moves_;
};

}  // namespace engine
