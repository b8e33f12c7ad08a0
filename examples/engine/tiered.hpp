// The example engine with memory tiers: multi-turn conversations served one
// turn at a time over a device pool too small for them all, with a host tier
// under it (kvcache/tiers/). Each turn's prompt is the conversation so far
// plus a new user message. Its leading blocks come from the device prefix
// cache when they are still there, else from host memory (onboarded with
// block_copy into the blocks admit() reserved for them), and only the rest
// is computed. Blocks go to host memory by the configured write policy:
// write-back (just before the device pool recycles them), write-through (as
// soon as they are written) or write-through by reuse. Without a host tier
// the engine recomputes what the device forgot: the baseline.
//
// The engine is serial and its copies are host memcpys, so a copy completes
// before the next call; it still follows the order an asynchronous engine
// needs: stores are planned before the allocations that recycle their
// sources, a finished request's blocks are held until their store completes,
// and onboarded blocks are computed (published) only once their copy landed.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kvcache.hpp>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "forward.hpp"
#include "kv_store.hpp"
#include "model.hpp"

namespace engine {

struct TieredConfig {
  std::int32_t device_blocks = 64;  // the device pool (null block excluded)
  std::int32_t host_blocks = 0;     // the host tier (0: none, recompute what the device forgot)
  std::int32_t block_size = 16;
  std::int32_t chunk = 64;  // prefill chunk
  kvcache::WriteMode write = kvcache::WriteMode::write_back;
};

// What one turn did.
struct TurnStats {
  std::int32_t prompt = 0, device_hit = 0, host_hit = 0, computed = 0;  // prompt tokens, and where each came from
  double ttft_s = 0.0;  // admission to the first generated token: lookups, onboarding copies and the prefill
};

struct TieredStats {
  std::int64_t turns = 0, generated = 0, prompt_tokens = 0, device_hit_tokens = 0, host_hit_tokens = 0,
               computed_tokens = 0, blocks_offloaded = 0, blocks_onboarded = 0, bytes_offloaded = 0, bytes_onboarded = 0;
  double seconds = 0.0, ttft_s = 0.0;  // all turns; their TTFT summed
  double tokens_per_second() const { return seconds > 0 ? double(generated) / seconds : 0.0; }
  double mean_ttft_ms() const { return turns ? 1e3 * ttft_s / double(turns) : 0.0; }
};

class TieredEngine {
 public:
  using Cache = kvcache::Cache<>;

  TieredEngine(const Model& m, const TieredConfig& cfg)
      : m_(m),
        cfg_(cfg),
        fwd_(m),
        geometry_(*kvcache::Geometry::make({.num_layers = m.config().layers,
                                            .num_kv_heads = m.config().kv_heads,
                                            .head_dim = m.config().head_dim(),
                                            .block_size = cfg.block_size,
                                            .dtype = kvcache::DType::f32})),
        device_mem_(std::size_t(*geometry_.pool_bytes(cfg.device_blocks + 1))),
        device_(*kvcache::make_pool_view(geometry_, device_mem_.data(), cfg.device_blocks + 1)),
        host_mem_(std::size_t(cfg.host_blocks > 0 ? *geometry_.pool_bytes(cfg.host_blocks) : 0)),
        host_(cfg.host_blocks > 0 ? *kvcache::make_pool_view(geometry_, host_mem_.data(), cfg.host_blocks) : kvcache::PoolView{}),
        cache_({.geometry = geometry_,
                .num_blocks = cfg.device_blocks + 1,
                .max_sequences = 1,
                .max_blocks_per_sequence = m.config().context / cfg.block_size + 1,
                .event_capacity = cfg.host_blocks > 0 && cfg.write == kvcache::WriteMode::write_through ? 4 * cfg.device_blocks : 0,
                .publish_on_reserve = true}),
        tiers_({.host_blocks = cfg.host_blocks, .block_size = cfg.block_size}),
        policy_({.mode = cfg.write}),
        positions_(std::size_t(cfg.device_blocks + 1) * std::size_t(cfg.block_size), -1) {}

  const Cache& cache() const { return cache_; }
  const kvcache::Tiers& tiers() const { return tiers_; }
  const TieredStats& stats() const { return stats_; }

  // Serves one turn: the prompt (the conversation so far), then max_new
  // greedy tokens. Returns them; `turn` says where the prompt came from.
  std::vector<std::int32_t> serve(std::span<const std::int32_t> prompt, std::int32_t max_new, TurnStats& turn) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::int32_t B = cfg_.block_size, len = std::int32_t(prompt.size());
    if (len < 1 || len + max_new > m_.config().context) throw std::invalid_argument("turn longer than the context");
    turn = {.prompt = len};
    // Where the prompt's blocks are, before anything changes: the device
    // cache's match (a peek), then host memory after it.
    hit_.resize(std::size_t(len / B) + 1);
    hit_.resize(std::size_t(cache_.match_prefix(prompt, {}, hit_)));
    const std::int32_t host_blocks = host_hits(prompt, std::int32_t(hit_.size()));
    // Admission reserves the host hits' blocks (the onboard's targets) or the
    // first chunk: a reserved slot is read by attention, so only what is
    // about to be written is reserved.
    const std::int32_t cached = std::int32_t(hit_.size()) * B;
    const std::int32_t first = host_blocks > 0 ? host_blocks * B : std::min(cfg_.chunk, len - cached);
    offload_before_admit(cached + first);
    slots_.assign(std::size_t(len), -1);  // by position: the slot each reserved prompt token has
    auto a = cache_.admit(prompt, std::span(slots_).subspan(std::size_t(cached)), {.reserve = first});
    if (!a) throw std::runtime_error("admit: " + a.status().message());
    if (a->cached_tokens != cached) throw std::logic_error("the device hit changed between match and admit");
    const kvcache::SeqId seq = a->seq;
    std::int32_t reserved = cached + a->reserved;
    const std::int32_t host_hit = onboard(seq, host_blocks, cached);
    turn.device_hit = cached, turn.host_hit = host_hit;
    turn.computed = len - cached - host_hit;
    // The prefill: the tokens no tier held (a block that failed to land
    // included: its slots are already reserved), in chunks.
    for (std::int32_t at = cached + host_hit; at < len;) {
      const std::int32_t n = std::min(cfg_.chunk, len - at);
      if (at + n > reserved) {
        offload_before(blocks_for(at + n) - blocks_for(reserved));
        const auto ids = prompt.subspan(std::size_t(reserved), std::size_t(at + n - reserved));
        auto r = cache_.reserve(seq, ids, std::span(slots_).subspan(std::size_t(reserved), ids.size()));
        if (!r) throw std::runtime_error("reserve: " + r.status().message());
        reserved = at + n;
      }
      PagedKv<Cache> kv(cache_, device_, seq, std::span(slots_).subspan(std::size_t(at), std::size_t(n)), at, positions_);
      fwd_.run(kv, prompt.subspan(std::size_t(at), std::size_t(n)), at, logits_, true);
      at += n;
    }
    std::vector<std::int32_t> out{argmax()};
    turn.ttft_s = seconds_since(t0);
    if (auto job = written()) run(*job);  // write-through: the prompt's blocks are written now
    if (cfg_.write == kvcache::WriteMode::write_through_reused && tiered()) {  // every full block this prompt used
      const auto blocks = cache_.table().blocks(seq)->first(std::size_t(len / B));
      offloads_.resize(blocks.size());
      const auto n = policy_.on_use(cache_.pool(), blocks, offloads_);
      if (!n) throw std::runtime_error("on_use: " + n.status().message());
      if (auto job = plan(std::span(offloads_).first(std::size_t(*n)))) run(*job);  // the live request's blocks: no hold
    }
    std::int32_t one_slot = 0;
    for (std::int32_t pos = len; std::int32_t(out.size()) < max_new; ++pos) {
      offload_before(pos % B == 0 ? 1 : 0);
      const std::int32_t tok = out.back();
      auto r = cache_.reserve(seq, std::span(&tok, 1), std::span(&one_slot, 1));
      if (!r) throw std::runtime_error("reserve: " + r.status().message());
      PagedKv<Cache> kv(cache_, device_, seq, std::span(&one_slot, 1), pos, positions_);
      fwd_.run(kv, std::span(&tok, 1), pos, logits_, true);
      out.push_back(argmax());
    }
    finish(seq);
    stats_.turns += 1, stats_.generated += max_new, stats_.prompt_tokens += len;
    stats_.device_hit_tokens += cached, stats_.host_hit_tokens += host_hit, stats_.computed_tokens += turn.computed;
    stats_.ttft_s += turn.ttft_s, stats_.seconds += seconds_since(t0);
    if (auto st = cache_.check_invariants(); !st) throw std::runtime_error("cache: " + st.message());
    if (auto st = tiers_.check_invariants(); !st) throw std::runtime_error("tiers: " + st.message());
    return out;
  }

 private:
  static double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  std::int32_t argmax() const { return std::int32_t(std::max_element(logits_.begin(), logits_.end()) - logits_.begin()); }
  bool tiered() const { return cfg_.host_blocks > 0; }
  std::int32_t blocks_for(std::int32_t tokens) const { return (tokens + cfg_.block_size - 1) / cfg_.block_size; }

  // The prompt's blocks after the device's `device_blocks` that host memory holds.
  std::int32_t host_hits(std::span<const std::int32_t> prompt, std::int32_t device_blocks) {
    if (!tiered()) return 0;
    chain_.resize(prompt.size() / std::size_t(cfg_.block_size));
    chain_.resize(std::size_t(cache_.hash_chain(prompt, {}, chain_)));
    where_.resize(chain_.size());
    const auto hit = tiers_.lookup(chain_, device_blocks, std::int64_t(prompt.size()), where_);
    if (!hit) throw std::runtime_error("lookup: " + hit.status().message());
    return hit->host;
  }
  // Copies `n` host blocks into the device blocks admit() reserved after the
  // device hit; returns the tokens onboarded (only blocks that landed count).
  std::int32_t onboard(kvcache::SeqId seq, std::int32_t n, std::int32_t cached) {
    if (n == 0) return 0;
    const std::int32_t B = cfg_.block_size;
    const auto first = std::size_t(cached / B);
    const auto blocks = cache_.table().blocks(seq)->subspan(first, std::size_t(n));
    auto job = tiers_.plan_load(kvcache::Tier::host, kvcache::Tier::device, std::span(chain_).subspan(first, std::size_t(n)), blocks);
    if (!job) throw std::runtime_error("plan_load: " + job.status().message());
    copy(host_, device_, job->moves);
    const auto landed = tiers_.complete(job->id);
    if (!landed) throw std::runtime_error("complete: " + landed.status().message());
    stats_.blocks_onboarded += *landed, stats_.bytes_onboarded += std::int64_t(*landed) * geometry_.block_bytes();
    // The landed blocks now hold their tokens: the forward pass reads their positions.
    for (std::int32_t b = 0; b < *landed; ++b)
      for (std::int32_t i = 0; i < B; ++i)
        positions_[std::size_t(blocks[std::size_t(b)]) * std::size_t(B) + std::size_t(i)] = (std::int64_t(first) + b) * B + i;
    return *landed * B;
  }

  // Write-back: before the admission allocates (the blocks up to token
  // `end` past the device hit), store what it will recycle, counting the
  // hit's blocks that are free but cached (retaining them takes them out of
  // the LRU first) and never naming a hit block itself.
  void offload_before_admit(std::int32_t end) {
    if (!tiered() || cfg_.write != kvcache::WriteMode::write_back) return;
    std::int32_t taken = 0;
    for (const kvcache::BlockId b : hit_) taken += cache_.pool().ref_count(b) == 0;
    const std::int32_t need = blocks_for(end) - std::int32_t(hit_.size()) + taken;
    offloads_.resize(std::size_t(need));
    offloads_.resize(std::size_t(policy_.before_allocate(cache_.pool(), need, offloads_)));
    std::erase_if(offloads_, [&](const kvcache::Offload& o) { return std::find(hit_.begin(), hit_.end(), o.block) != hit_.end(); });
    if (auto job = plan(offloads_)) run(*job);
  }
  // Write-back: before `allocations` blocks are taken, store what they recycle.
  void offload_before(std::int32_t allocations) {
    if (!tiered() || cfg_.write != kvcache::WriteMode::write_back || allocations == 0) return;
    offloads_.resize(std::size_t(allocations));
    offloads_.resize(std::size_t(policy_.before_allocate(cache_.pool(), allocations, offloads_)));
    if (auto job = plan(offloads_)) run(*job);  // in stream order before the allocation's writes: no hold
  }
  // Write-through: the store of the blocks published since the last call (written by now).
  std::optional<kvcache::TierJob> written() {
    if (!tiered() || cfg_.write != kvcache::WriteMode::write_through) return std::nullopt;
    events_.resize(std::size_t(cache_.pool().events().capacity()));
    events_.resize(std::size_t(cache_.drain_events(events_)));
    offloads_.resize(events_.size());
    const auto n = policy_.on_stored(events_, offloads_);
    if (!n) throw std::runtime_error("on_stored: " + n.status().message());
    return plan(std::span(offloads_).first(std::size_t(*n)));
  }
  // The request ends while its last blocks' store is in flight: the store
  // holds them, the handle is freed, and the hold ends when the copy completes.
  void finish(kvcache::SeqId seq) {
    const auto job = written();
    std::uint64_t hold = 0;
    if (job) {
      ids_.clear();
      for (const auto& m : job->moves) ids_.push_back(m.src);
      auto h = cache_.hold(ids_);
      if (!h) throw std::runtime_error("hold: " + h.status().message());
      hold = *h;
    }
    if (auto st = cache_.free(seq); !st) throw std::runtime_error("free: " + st.message());
    if (!job) return;
    run(*job);
    if (auto st = cache_.release_hold(hold); !st) throw std::runtime_error("release_hold: " + st.message());
  }
  // A store of `blocks` into host memory; none when there is nothing to
  // store or host memory cannot take them all (a store is all or nothing).
  std::optional<kvcache::TierJob> plan(std::span<const kvcache::Offload> blocks) {
    if (blocks.empty()) return std::nullopt;
    auto job = tiers_.plan_store(kvcache::Tier::device, kvcache::Tier::host, blocks);
    if (job) return *job;
    if (job.status().code() != kvcache::Errc::out_of_blocks) throw std::runtime_error("plan_store: " + job.status().message());
    return std::nullopt;
  }
  // Runs a store: the copies, then complete().
  void run(const kvcache::TierJob& job) {
    const auto n = std::int64_t(job.moves.size());
    copy(device_, host_, job.moves);
    if (auto done = tiers_.complete(job.id); !done) throw std::runtime_error("complete: " + done.status().message());
    stats_.blocks_offloaded += n, stats_.bytes_offloaded += n * geometry_.block_bytes();
  }
  // The engine's copy: one block_copy over the job's pairs (a device engine
  // launches it on its stream, or issues cudaMemcpyAsync per block).
  void copy(const kvcache::PoolView& src, const kvcache::PoolView& dst, std::span<const kvcache::BlockMove> moves) {
    pairs_.clear();
    for (const auto& m : moves) pairs_.push_back({m.src, m.dst});
    if (auto st = kvcache::block_copy_host({src, dst, pairs_.data(), std::int32_t(pairs_.size())}); !st)
      throw std::runtime_error("block_copy: " + st.message());
  }

  const Model& m_;
  TieredConfig cfg_;
  Forward fwd_;
  kvcache::Geometry geometry_;
  std::vector<std::byte> device_mem_;
  kvcache::PoolView device_;
  std::vector<std::byte> host_mem_;
  kvcache::PoolView host_;
  Cache cache_;
  kvcache::Tiers tiers_;
  kvcache::WritePolicy policy_;
  std::vector<std::int64_t> positions_;  // per device slot: the token position it holds
  TieredStats stats_;
  std::vector<float> logits_;
  std::vector<std::int32_t> slots_, ids_;
  std::vector<kvcache::BlockId> hit_;
  std::vector<kvcache::BlockHash> chain_;
  std::vector<kvcache::Tier> where_;
  std::vector<kvcache::Offload> offloads_;
  std::vector<kvcache::BlockEvent> events_;
  std::vector<kvcache::BlockCopy> pairs_;
};

// A multi-turn workload: `conversations` conversations cut from `text`, each
// opening with `first` tokens, then every turn adding `user` new tokens
// after the model's previous answer of `max_new` tokens. Turns go round the
// conversations (every first turn, then every second one, ...), so a
// conversation comes back after the others have filled the device pool.
struct MultiTurn {
  std::int32_t conversations = 8, turns = 4, first = 192, user = 48, max_new = 32;
};

struct MultiTurnRun {
  std::vector<std::vector<std::int32_t>> outputs;  // [turn * conversations + conversation]
  std::vector<TurnStats> turns;
  TieredStats stats;
};

// Serves workload w on engine e (TieredEngine, HybridTieredEngine).
template <class Engine>
MultiTurnRun serve_multiturn_on(Engine& e, const std::vector<std::int32_t>& text, const MultiTurn& w) {
  MultiTurnRun out;
  std::vector<std::vector<std::int32_t>> history(std::size_t(w.conversations));
  const auto cut = [&](std::size_t at, std::int32_t n) {
    at %= text.size() - std::size_t(n);
    return std::vector<std::int32_t>(text.begin() + std::ptrdiff_t(at), text.begin() + std::ptrdiff_t(at) + n);
  };
  for (std::int32_t t = 0; t < w.turns; ++t)
    for (std::int32_t c = 0; c < w.conversations; ++c) {
      auto& h = history[std::size_t(c)];
      const auto msg = t == 0 ? cut(std::size_t(c) * 4001, w.first) : cut(std::size_t(c * 7919 + t * 613), w.user);
      h.insert(h.end(), msg.begin(), msg.end());
      TurnStats ts;
      auto answer = e.serve(h, w.max_new, ts);
      h.insert(h.end(), answer.begin(), answer.end());
      out.outputs.push_back(std::move(answer));
      out.turns.push_back(ts);
    }
  out.stats = e.stats();
  return out;
}

inline MultiTurnRun serve_multiturn(const Model& m, const TieredConfig& cfg, const std::vector<std::int32_t>& text,
                                    const MultiTurn& w) {
  TieredEngine e(m, cfg);
  return serve_multiturn_on(e, text, w);
}

}  // namespace engine
