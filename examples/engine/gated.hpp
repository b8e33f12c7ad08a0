// The example engine under Write-Gated KV: the scheduler (scheduler.hpp) over
// GatedBackend, a head-paged Cache<BlockPool, PageTable, WriteGate,
// Selection, Eviction> whose per-layer writes (gated_kv.hpp) gate, place and
// promote every (token, kv-head). The loop is the token-paged engine's:
// continuous batching by the cache's accounting, chunked prefill, greedy
// decoding; GatedEngine adds the evaluation's one-request calls (score,
// generate).
#pragma once

#include <algorithm>
#include <cstdint>
#include <kvcache/admission/write_gate.hpp>
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kvcache.hpp>
#include <span>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#include "channel_kv.hpp"
#include "engine_types.hpp"
#include "gated_kv.hpp"
#include "model.hpp"
#include "scheduler.hpp"

namespace engine {

// Every request is one cache handle whose rows are its (layer, kv-head)
// pairs; the pool is single-head, sized so `max_batch` requests each hold
// their heads' worst case (ring + cap, rows of a full context). The writes
// take their slots inside the forward pass, layer by layer, so nothing can
// be preempted halfway: requests are admitted by their lifetime bound
// (EngineConfig::optimistic is refused), and max_kv_tokens is not read.
template <class Selection = kvcache::SelectAll, class Eviction = kvcache::KeepAll>
class GatedBackend {
 public:
  using Cache = GatedCacheOf<Selection, Eviction>;
  static constexpr bool traces = false;  // a token policy observes through GatedKv::attend
  static constexpr bool decode_selects = Cache::selects;

  GatedBackend(const Model& m, const EngineConfig& cfg, const GateSet& g, Eviction eviction = {})
      : g_(g),
        context_(m.config().context),
        geometry_(*kvcache::Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = m.config().head_dim(),
                                            .block_size = cfg.block_size, .dtype = cfg.kv_dtype,
                                            .format = cfg.kv_format})),
        row_blocks_(m.config().context / cfg.block_size + 2),
        blocks_(cfg.max_batch * g.layers * g.kv_heads * row_blocks_ + 1),
        memory_(std::size_t(*geometry_.pool_bytes(blocks_))),
        pool_(*kvcache::make_pool_view(geometry_, memory_.data(), blocks_)),
        scales_(cfg.kv_scales, cfg.kv_format, m.config()),
        bounds_(Cache::selects ? std::size_t(kvcache::QuestSelection::bounds_floats(geometry_, blocks_)) : 0),
        cache_({.geometry = geometry_, .num_blocks = blocks_, .max_sequences = cfg.max_batch, .max_blocks_per_sequence = row_blocks_},
               kvcache::WriteGateConfig{.num_layers = g.layers, .num_kv_heads = g.kv_heads, .local_window = g.window, .tau = g.tau},
               selection_arg<typename kvcache::SelectionArg<Selection>::type>(cfg.quest, bounds_), eviction),
        adm_(std::size_t(cfg.max_batch)) {
    const auto& c = m.config();
    if (g.layers != c.layers || g.kv_heads != c.kv_heads || g.head_dim != c.head_dim())
      throw std::invalid_argument("gates: shape differs from the model's");
    if (cfg.optimistic) throw std::invalid_argument("optimistic: Write-Gated KV writes reserve inside the forward pass");
    if (cfg.layer_streams) throw std::invalid_argument("layer_streams: not with Write-Gated KV");
    if (Cache::selects && ChannelResidual::needed(pool_))
      throw std::invalid_argument("kv_format: channel scales (KIVI) with page selection: open blocks have no bounds");
  }

  const Cache& cache() const { return cache_; }
  const GateCounts& counts() const { return counts_; }
  std::int32_t handles() const { return 1; }
  bool ragged_trace() const { return false; }  // one stream: the trace sums over layers
  kvcache::Result<std::int64_t> blocks_needed(std::int64_t tokens, std::int64_t new_tokens, std::int64_t chunk) const {
    return cache_.blocks_needed(tokens, new_tokens, chunk);
  }
  std::int64_t room() const { return cache_.free_blocks(); }
  std::int32_t free_handles() const { return cache_.free_sequences(); }

  void open(Request& r) {
    r.seqs = {*cache_.add_sequence()};
    // [layer][kv_head][position]: gate >= tau, for a full context and its answer.
    adm(r).assign(std::size_t(g_.layers * g_.kv_heads) * std::size_t(context_ + 256), 0);
  }
  void close(Request& r) {
    if (residual())
      for (std::int32_t l = 0; l < g_.layers; ++l)
        for (std::int32_t h = 0; h < g_.kv_heads; ++h)
          for (const std::int32_t b : row(r, l, h)) residual_.drop(b);
    for (const auto s : r.seqs) (void)cache_.free(s);
    r.seqs.clear();
  }
  void promise(const Request&, std::int64_t) {}  // head rows keep no ledger
  // The layer writes take their slots (GatedKv::write).
  kvcache::Status reserve(const Request&, std::int32_t, std::vector<std::int32_t>& slots) {
    slots.clear();
    return {};
  }
  GatedKv<Cache> store(Request& r, std::int64_t at, std::span<const std::int32_t>, KeyCounts*) {
    return {cache_, pool_, r.seqs[0], g_, at, adm(r), counts_, scales_, residual()};
  }
  // A channel-scaled pool's open blocks (KIVI's residual and the rings).
  const ChannelResidual& residual_blocks() const { return residual_; }
  // A token policy: every head row's global region after the step's
  // observation (GatedKv::attended), and the moves it asks for.
  void after_forward(Request& r, const AttentionTrace&) {
    if constexpr (Cache::evicts_global) {
      moves_.resize(std::size_t(g_.layers * g_.kv_heads) * std::size_t(row_blocks_ * geometry_.block_size()));
      if (residual()) return evict_channels(r);
      auto e = cache_.evict(r.seqs[0], moves_);
      if (!e) throw std::runtime_error("evict: " + e.status().message());
      if (auto st = kvcache::compaction_host({pool_, moves_.data(), e->moves}); !st)
        throw std::runtime_error("compaction: " + st.message());
    } else {
      (void)r;
    }
  }
  // The tokens r's heads hold, divided by layers x kv-heads: the figure a
  // dense stream's token count compares with.
  std::int64_t held(const Request& r) const {
    const std::int64_t heads = std::int64_t(g_.layers) * g_.kv_heads;
    return (*cache_.tokens_held(r.seqs[0]) + heads - 1) / heads;
  }

 private:
  std::vector<std::uint8_t>& adm(const Request& r) { return adm_[std::size_t(r.seqs[0].index)]; }
  ChannelResidual* residual() { return ChannelResidual::needed(pool_) ? &residual_ : nullptr; }
  // The blocks of r's (layer, kv-head) row, logical order.
  std::span<const std::int32_t> row(const Request& r, std::int32_t l, std::int32_t h) const {
    return *cache_.table().blocks(*cache_.admission().head(r.seqs[0], l, h));
  }
  // A token policy's eviction on a channel-scaled pool: each head row's moves
  // run as the residual's compaction (the row read back, moved, the blocks a
  // move wrote into sealed again; the ring stays held).
  void evict_channels(Request& r) {
    const std::int32_t rows = g_.layers * g_.kv_heads;
    blocks_before_.assign(std::size_t(rows), {});
    rows_before_.assign(std::size_t(rows), 0);
    std::unordered_map<std::int32_t, std::int32_t> owner;  // block -> head row
    for (std::int32_t i = 0; i < rows; ++i) {
      const auto b = row(r, i / g_.kv_heads, i % g_.kv_heads);
      blocks_before_[std::size_t(i)].assign(b.begin(), b.end());
      rows_before_[std::size_t(i)] = std::int32_t(cache_.admission().positions(r.seqs[0], i / g_.kv_heads, i % g_.kv_heads)->size());
      for (const std::int32_t x : b) owner[x] = i;
    }
    auto e = cache_.evict(r.seqs[0], moves_);
    if (!e) throw std::runtime_error("evict: " + e.status().message());
    std::vector<std::vector<kvcache::SlotMove>> per_row(static_cast<std::size_t>(rows));
    for (std::int32_t m = 0; m < e->moves; ++m)
      per_row[std::size_t(owner.at(moves_[std::size_t(m)].src / geometry_.block_size()))].push_back(moves_[std::size_t(m)]);
    for (std::int32_t i = 0; i < rows; ++i) {
      const auto after = row(r, i / g_.kv_heads, i % g_.kv_heads);
      const auto rows_after = std::int32_t(cache_.admission().positions(r.seqs[0], i / g_.kv_heads, i % g_.kv_heads)->size());
      if (per_row[std::size_t(i)].empty() && rows_after == rows_before_[std::size_t(i)]) continue;
      const ChannelResidual::Moves m{per_row[std::size_t(i)], 0, 1, 0, 0};
      residual_.compact(blocks_before_[std::size_t(i)], rows_before_[std::size_t(i)], after, rows_after, std::span(&m, 1));
    }
  }

  const GateSet& g_;
  std::int32_t context_;
  kvcache::Geometry geometry_;
  std::int32_t row_blocks_, blocks_;
  std::vector<std::byte> memory_;
  kvcache::PoolView pool_;
  HeldScales scales_;  // EngineConfig::kv_scales, checked: one a (layer, kv-head) call
  std::vector<float> bounds_;  // Quest's store (single-head pool: one slice)
  Cache cache_;
  std::vector<std::vector<std::uint8_t>> adm_;  // per handle: what the gates admitted
  GateCounts counts_;
  std::vector<kvcache::SlotMove> moves_;
  ChannelResidual residual_{pool_};  // a channel-scaled pool's open blocks and rings
  std::vector<std::vector<std::int32_t>> blocks_before_;  // evict_channels: each head row's blocks and length before
  std::vector<std::int32_t> rows_before_;
};

// The scheduler over Write-Gated KV, with the evaluation's one-request calls.
template <class Selection = kvcache::SelectAll, class Eviction = kvcache::KeepAll>
class GatedEngine : public Scheduler<GatedBackend<Selection, Eviction>> {
 public:
  using Backend = GatedBackend<Selection, Eviction>;
  using Cache = typename Backend::Cache;

  // A batching engine (run, step): cfg.quest configures Quest when Selection is QuestSelection.
  GatedEngine(const Model& m, const GateSet& g, const EngineConfig& cfg, Eviction eviction = {})
      : Scheduler<Backend>(m, cfg, g, std::move(eviction)) {}
  // One request at a time (score, generate), in chunks of `chunk`.
  GatedEngine(const Model& m, const GateSet& g, std::int32_t chunk = 64, std::int32_t block_size = 16,
              kvcache::QuestConfig quest = {}, Eviction eviction = {})
      : GatedEngine(m, g, EngineConfig{.block_size = block_size, .chunk = chunk, .max_batch = 1, .quest = quest},
                    std::move(eviction)) {}

  const Cache& cache() const { return this->backend().cache(); }
  const GateCounts& counts() const { return this->backend().counts(); }

  // The nll of text[from..] given what precedes it, the policy active after every chunk.
  typename Scheduler<Backend>::Score score(std::span<const std::int32_t> text, std::int32_t from = 1) {
    return Scheduler<Backend>::score(text, std::int32_t(text.size()) - 1, from);  // all of it is prompt: chunks throughout
  }
  // Greedy decoding of max_new tokens after the prompt; returns them, and
  // raises peak_kv to the most the request held.
  std::vector<std::int32_t> generate(std::span<const std::int32_t> prompt, std::int32_t max_new, std::int64_t& peak_kv) {
    std::vector<Request> one(1);
    one[0].prompt.assign(prompt.begin(), prompt.end());
    one[0].max_new = max_new;
    this->run(one);
    peak_kv = std::max(peak_kv, one[0].peak_kv);
    return one[0].output;
  }
};

}  // namespace engine
