// A small continuous-batching engine over kvcache: requests are admitted by
// the cache's accounting, prompts are prefilled in chunks, every step decodes
// one token per running request, and when the pool runs out the
// lowest-priority running request is preempted (its blocks freed, its prompt
// and tokens so far re-prefilled later). The eviction policy is a template
// parameter and is fed the scores it reads from the attention the forward
// pass computes. Greedy decoding: runs are reproducible.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/page_bounds.hpp>
#include <kvcache/kvcache.hpp>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine_types.hpp"
#include "forward.hpp"
#include "kv_store.hpp"
#include "model.hpp"

namespace engine {

template <class Policy, class Selection = kvcache::SelectAll>
class Engine {
 public:
  using Cache = kvcache::Cache<kvcache::BlockPool, kvcache::PageTable, kvcache::AdmitAll, Selection, Policy>;

  Engine(const Model& m, const EngineConfig& cfg, Policy policy)
      : m_(m),
        cfg_(cfg),
        fwd_(m),
        streams_(cfg.layer_streams ? m.config().layers : 1),
        geometry_(*kvcache::Geometry::make({.num_layers = cfg.layer_streams ? 1 : m.config().layers,
                                            .num_kv_heads = m.config().kv_heads,
                                            .head_dim = m.config().head_dim(),
                                            .block_size = cfg.block_size,
                                            .dtype = kvcache::DType::f32})),
        blocks_((cfg.max_kv_tokens / cfg.block_size + 1) * streams_),
        memory_(std::size_t(*geometry_.pool_bytes(blocks_))),
        pool_(*kvcache::make_pool_view(geometry_, memory_.data(), blocks_)),
        bounds_(Cache::selects ? std::size_t(kvcache::QuestSelection::bounds_floats(geometry_, blocks_)) : 0),
        cache_({.geometry = geometry_,
                .num_blocks = blocks_,
                .max_sequences = cfg.max_batch * streams_,
                .max_blocks_per_sequence = m.config().context / cfg.block_size + 2},
               {}, selection_arg(cfg), policy),
        positions_(std::size_t(groups()) * std::size_t(blocks_) * std::size_t(cfg.block_size), -1) {
    if (kvcache::TokenEviction<Policy> && cfg.layer_streams)
      throw std::invalid_argument("layer_streams: token policies choose per layer through their groups");
    if (Cache::selects && cfg.layer_streams) throw std::invalid_argument("layer_streams: not with page selection");
  }

  const Cache& cache() const { return cache_; }

  // Negative log-likelihood (nats) of text[from..] (from >= 1) given the
  // text before it, fed in chunks with the policy active: eviction after
  // every chunk, or (SnapKV: evict_in_prefill false) once, after the first
  // `prompt` tokens (no chunk crosses that point, and the last one before it
  // holds the observation window). Returns {total nll, predictions, peak
  // tokens held}.
  struct Score {
    double nll = 0.0;
    std::int64_t predictions = 0, peak_kv = 0;
  };
  Score score(std::span<const std::int32_t> text, std::int32_t prompt, std::int32_t from = 1) {
    Request r;
    add_streams(r);
    Score out;
    std::vector<float> logits;
    std::vector<std::int32_t> slots;
    const std::int32_t V = m_.config().vocab;
    const std::int32_t w = cfg_.observe_window;
    for (std::int32_t at = 0; at + 1 < std::int32_t(text.size());) {
      std::int32_t n = std::min(cfg_.chunk, std::int32_t(text.size()) - 1 - at);
      if (at < prompt) {  // no chunk crosses the prompt's end: a one-shot policy sees the prompt alone
        n = chunk_before(prompt - at, n);
      } else if (Cache::selects) {
        n = 1;  // page selection serves decode queries: past the prompt, every token is one
      }
      if (auto st = reserve(r, n, slots); !st) throw std::runtime_error("score: " + st.message());
      AttentionTrace trace;
      trace.ragged = streams_ > 1;
      PagedKv<Cache> kv(cache_, pool_, r.seqs, slots, at, positions_, groups(), layout(), &stats_.keys);
      fwd_.run(kv, text.subspan(std::size_t(at), std::size_t(n)), at, logits, false, &trace, at + n == prompt ? w : 0);
      out.peak_kv = std::max(out.peak_kv, held(r));
      for (std::int32_t i = std::max(0, from - 1 - at); i < n; ++i) {  // log-softmax at the target
        out.nll += token_nll(&logits[std::size_t(i) * std::size_t(V)], V, text[std::size_t(at + i + 1)]);
        ++out.predictions;
      }
      at += n;
      if (cfg_.evict_in_prefill || (at >= prompt && at - n < prompt)) feed_and_evict(r, trace);
    }
    free_streams(r);
    return out;
  }
  const EngineStats& stats() const { return stats_; }
  // Blocks a request of `tokens` (then `new_tokens` more) needs for its whole
  // life under the policy, over all its streams.
  kvcache::Result<std::int64_t> blocks_needed(std::int64_t tokens, std::int64_t new_tokens, std::int64_t chunk) const {
    auto need = cache_.blocks_needed(tokens, new_tokens, chunk);
    if (!need) return need.status();
    return *need * streams_;
  }

  // What r holds, read back through the page table as the forward pass
  // reads it: view(r).read(layer, kv_head) gives each held token's K/V and
  // the position its group's table names (they move with each group's
  // compaction), for tests to check against the policy's bookkeeping.
  PagedKv<Cache> view(const Request& r) { return {cache_, pool_, r.seqs, {}, 0, positions_, groups(), layout()}; }
  // Tokens r holds: with one stream per layer, their mean over the layers
  // (rounded up), so figures compare with one stream's.
  std::int64_t held(const Request& r) const {
    std::int64_t sum = 0;
    for (const auto s : r.seqs) sum += *cache_.tokens_held(s);
    return (sum + streams_ - 1) / streams_;
  }
  // The position table a (layer, kv-head) reads (token policies' groups).
  std::int32_t group_of(std::int32_t layer, std::int32_t head) const { return layout().of(layer, head); }

  // Runs until every request is done.
  void run(std::vector<Request>& reqs) {
    while (std::any_of(reqs.begin(), reqs.end(), [](const Request& r) { return !r.done; })) step(reqs);
  }

  void step(std::vector<Request>& reqs) {
    admit(reqs);
    std::vector<Request*> running;
    for (auto& r : reqs)
      if (r.running) running.push_back(&r);
    std::stable_sort(running.begin(), running.end(), [](auto* a, auto* b) { return a->priority > b->priority; });
    for (Request* r : running) {
      if (!r->running) continue;  // preempted earlier in this step
      advance(*r, reqs);
    }
    std::int64_t held = 0, batch = 0;
    for (auto& r : reqs)
      if (r.running) held += this->held(r), ++batch;
    stats_.max_batch = std::max(stats_.max_batch, batch);
    stats_.kv_high_water = std::max(stats_.kv_high_water, held);
    stats_.kv_over_time.push_back(held);
    ++stats_.steps;
  }

 private:
  typename kvcache::SelectionArg<Selection>::type selection_arg(const EngineConfig& cfg) {
    if constexpr (Cache::selects) {
      kvcache::QuestConfig q = cfg.quest;
      q.bounds = bounds_;
      return q;
    } else {
      return {};
    }
  }
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
  std::int64_t* pos_table(std::int32_t g) {
    return positions_.data() + std::size_t(g) * std::size_t(blocks_) * std::size_t(cfg_.block_size);
  }
  // A chunk of at most n tokens with `left` tokens to the prompt's end: never
  // past it, and cut so the last one holds the whole observation window.
  std::int32_t chunk_before(std::int32_t left, std::int32_t n) const {
    const std::int32_t w = cfg_.observe_window;
    n = std::min(n, left);
    if (w > 0 && left - n > 0 && left - n < w && left > w) n = left - w;
    return n;
  }
  std::int32_t tokens_of(const Request& r) const { return std::int32_t(r.prompt.size() + r.output.size()); }
  std::int64_t chunk_for_accounting() const { return cfg_.evict_in_prefill ? cfg_.chunk : 0; }

  void add_streams(Request& r) {
    r.seqs.clear();
    for (std::int32_t s = 0; s < streams_; ++s) r.seqs.push_back(*cache_.add_sequence());
  }
  void free_streams(Request& r) {
    for (const auto s : r.seqs) (void)cache_.free(s);
    r.seqs.clear();
  }
  std::int64_t blocks_held(const Request& r) const {
    std::int64_t sum = 0;
    for (const auto s : r.seqs) sum += *cache_.blocks_held(s);
    return sum;
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

  // Highest priority first, while a handle is free and the pool covers the
  // request's whole life under the policy's bound, less the blocks the
  // cache's ledger has promised to running requests and they do not hold yet
  // (Cache::promise, promised_blocks).
  void admit(std::vector<Request>& reqs) {
    std::vector<Request*> waiting;
    for (auto& r : reqs)
      if (!r.running && !r.done) waiting.push_back(&r);
    std::stable_sort(waiting.begin(), waiting.end(), [](auto* a, auto* b) { return a->priority > b->priority; });
    for (Request* r : waiting) {
      const std::int64_t remaining_new = r->max_new - std::int64_t(r->output.size());
      auto need = blocks_needed(tokens_of(*r), cfg_.optimistic ? 0 : remaining_new, chunk_for_accounting());
      if (!need || cache_.free_sequences() < streams_ || *need > cache_.free_blocks() - cache_.promised_blocks()) break;
      add_streams(*r);
      for (const kvcache::SeqId s : r->seqs)  // each stream's share of the need
        if (auto st = cache_.promise(s, std::min<std::int64_t>(*need / streams_, cache_.table().max_blocks_per_stream())); !st)
          throw std::runtime_error(st.message());
      r->running = true;
      r->fed = 0;
      r->need_blocks = *need;
    }
  }

  // One step of one request: a prefill chunk, or one decoded token.
  void advance(Request& r, std::vector<Request>& reqs) {
    const std::int32_t total = tokens_of(r), w = cfg_.observe_window;
    std::int32_t n = std::min(cfg_.chunk, total - r.fed);  // a prefill chunk, or the last token decoded
    n = chunk_before(total - r.fed, n);  // the last chunk holds the whole observation window
    std::vector<std::int32_t> slots;
    for (;;) {
      const auto st = reserve(r, n, slots);
      if (st) break;
      if (st.code() != kvcache::Errc::out_of_blocks) throw std::runtime_error(st.message());
      if (!preempt_lowest(reqs, r)) return;  // r itself was preempted
    }
    std::vector<std::int32_t> tokens(static_cast<std::size_t>(n));
    for (std::int32_t i = 0; i < n; ++i) {
      const std::int32_t at = r.fed + i;
      tokens[std::size_t(i)] =
          at < std::int32_t(r.prompt.size()) ? r.prompt[std::size_t(at)] : r.output[std::size_t(at) - r.prompt.size()];
    }
    AttentionTrace trace;
    trace.ragged = streams_ > 1;
    PagedKv<Cache> kv(cache_, pool_, r.seqs, slots, r.fed, positions_, groups(), layout(), &stats_.keys);
    fwd_.run(kv, tokens, r.fed, r.last_logits, true, &trace, w);
    r.fed += n;
    r.peak_kv = std::max(r.peak_kv, held(r));
    const bool prefill_done = r.fed >= total;
    if (cfg_.evict_in_prefill || prefill_done) feed_and_evict(r, trace);
    if (prefill_done) {
      const auto& lg = r.last_logits;
      r.output.push_back(std::int32_t(std::max_element(lg.begin(), lg.end()) - lg.begin()));
      if (cfg_.keep_logits) r.logits.insert(r.logits.end(), lg.begin(), lg.end());
      ++stats_.tokens_generated;
      if (std::int32_t(r.output.size()) >= r.max_new) finish(r);
    }
  }

  void feed_and_evict(Request& r, const AttentionTrace& trace) {
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
    auto e = cache_.evict(seq, kvcache::EvictionSpans{evicted_, rotations_, moves_, group_moves_});
    if (!e) throw std::runtime_error("evict: " + e.status().message());
    if constexpr (kvcache::TokenEviction<Policy>) {
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
        if (auto st = kvcache::compaction_host(p); !st) throw std::runtime_error("compaction: " + st.message());
        std::int64_t* pos = pos_table(g);
        for (std::int32_t k = lo; k < hi; ++k) pos[moves_[std::size_t(k)].dst] = pos[moves_[std::size_t(k)].src];
      }
    }
    refresh_bounds(r);  // after the compaction: the pages it rewrote
  }

  // Frees the lowest-priority running request, which may be `keep` itself
  // (then false: `keep` stops this step); it goes back to waiting and
  // re-prefills what it had. `keep` alone and still short of blocks throws.
  bool preempt_lowest(std::vector<Request>& reqs, Request& keep) {
    Request* victim = nullptr;
    for (auto& r : reqs)
      if (r.running &&
          (!victim || r.priority < victim->priority || (r.priority == victim->priority && r.id > victim->id)))
        victim = &r;
    if (!victim) throw std::runtime_error("out of blocks with nothing to preempt");
    const auto running = std::count_if(reqs.begin(), reqs.end(), [](const Request& r) { return r.running; });
    if (victim == &keep && running == 1)
      throw std::runtime_error("request " + std::to_string(keep.id) + " does not fit the pool on its own");
    ++stats_.preemptions;
    stats_.reprefilled += victim->fed;
    free_streams(*victim);
    victim->running = false;
    victim->fed = 0;
    return victim != &keep;
  }
  void finish(Request& r) {
    free_streams(r);
    r.running = false;
    r.done = true;
  }

  const Model& m_;
  EngineConfig cfg_;
  Forward fwd_;
  std::int32_t streams_;  // per request: 1, or one per layer
  kvcache::Geometry geometry_;
  std::int32_t blocks_;
  std::vector<std::byte> memory_;
  kvcache::PoolView pool_;
  std::vector<float> bounds_;  // page selection's store: [layers][blocks][kv_heads][2][head_dim]
  Cache cache_;
  std::vector<std::int64_t> positions_;  // [groups][pool slot]: token position, moves with compaction
  EngineStats stats_;
  std::vector<float> reduced_;
  std::vector<std::int32_t> evicted_, group_moves_;
  std::vector<kvcache::BlockRotation> rotations_;
  std::vector<kvcache::SlotMove> moves_;
  std::vector<std::int32_t> counts_;
  std::vector<kvcache::BlockCopy> copies_;
  std::vector<std::int32_t> stale_pages_, stale_fill_;
};

}  // namespace engine
