// The tiered engine on a hybrid model (tiered.hpp's turns over
// hybrid_backend.hpp's layout): the model's even layers full attention, its
// odd layers a sliding window, both groups in one device pool of pages, and
// one host tier of pages under it (GroupTiers, kvcache/tiers/group_tiers.hpp).
// A turn's prompt comes from the device prefix cache (admit shares it), or,
// where the device forgot it, from host memory: the hit is imported, each
// group's pending blocks are copied in from host memory (the full group's
// whole prefix, the window group's last window), and the import is committed;
// only the rest is computed. A finished turn offloads what its continuation
// can hit, holding its device blocks until the copy completes. Without a
// host tier the engine recomputes what the device forgot: the baseline.
//
// The engine is serial and its copies are host memcpys, so a copy completes
// before the next call; it still follows an asynchronous engine's order: the
// blocks a store reads are held until it completes, and an import's blocks
// are published (committed) only once their copy landed.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <kvcache/cache/hybrid.hpp>
#include <kvcache/tiers/group_tiers.hpp>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "engine_types.hpp"
#include "forward.hpp"
#include "hybrid_backend.hpp"
#include "model.hpp"
#include "tiered.hpp"

namespace engine {

// r's value, or a runtime_error naming `what` and the status.
template <class R>
auto check(R&& r, const char* what) {
  if (!r) throw std::runtime_error(std::string(what) + ": " + r.status().message());
  return *std::forward<R>(r);
}

class HybridTieredEngine {
 public:
  using Cache = kvcache::HybridCache<>;

  // cfg.device_blocks counts blocks of every layer (the dense engine's): the
  // pool has twice as many pages, each holding block_size tokens of one group's layers.
  HybridTieredEngine(const Model& m, const TieredConfig& cfg, std::int32_t window)
      : m_(m),
        cfg_(cfg),
        window_(window),
        fwd_(m),
        groups_(interleaved_groups(m, cfg.block_size, window, layers_)),
        pages_(2 * cfg.device_blocks + 1),
        device_mem_(std::size_t(pages_) * std::size_t(groups_.page_bytes())),
        host_mem_(std::size_t(2 * cfg.host_blocks) * std::size_t(groups_.page_bytes())),
        cache_({.groups = groups_, .num_blocks = pages_, .max_sequences = 1, .max_tokens = m.config().context,
                .prefill_chunk = cfg.chunk}),
        tiers_(cache_, {.host_blocks = 2 * cfg.host_blocks}) {
    for (std::int32_t g = 0; g < 2; ++g) views_[std::size_t(g)] = *kvcache::make_group_view(groups_, g, device_mem_.data(), pages_);
  }

  const Cache& cache() const { return cache_; }
  const kvcache::Tiers& tiers() const { return tiers_.tiers(); }
  const TieredStats& stats() const { return stats_; }

  // Serves one turn: the prompt (the conversation so far), then max_new
  // greedy tokens. Returns them; `turn` says where the prompt came from.
  std::vector<std::int32_t> serve(std::span<const std::int32_t> prompt, std::int32_t max_new, TurnStats& turn) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto len = std::int32_t(prompt.size());
    if (len < 1 || len + max_new > m_.config().context) throw std::invalid_argument("turn longer than the context");
    turn = {.prompt = len};
    std::vector<std::int32_t> tokens(prompt.begin(), prompt.end());  // the prompt, then what is generated
    kvcache::SeqId seq{};
    std::int32_t have = 0;  // tokens whose K/V the sequence holds (computed)
    const auto hit = tiered() ? check(tiers_.lookup(prompt), "lookup")
                              : kvcache::GroupTierHits{.device_tokens = cache_.match(prompt), .tokens = cache_.match(prompt)};
    turn.device_hit = std::int32_t(hit.device_tokens);
    if (hit.tokens > hit.device_tokens) {
      const auto imp = check(cache_.import(prompt.first(std::size_t(hit.tokens))), "import");
      turn.device_hit = imp.cached_tokens;
      const auto done = onboard(imp.id);
      seq = done.seq, have = done.tokens;
      if (done.committed) turn.host_hit = have - turn.device_hit;
    } else {  // admission shares the device hit and reserves the first chunk
      slots_.resize(std::size_t(2 * len));
      const auto a = check(cache_.admit(prompt, slots_), "admit");
      seq = a.seq, have = a.cached_tokens;
      turn.device_hit = a.cached_tokens;
      dense_.resize(std::size_t(2 * a.reserved));
      for (std::int32_t g = 0; g < 2; ++g)
        std::copy_n(slots_.begin() + std::ptrdiff_t(g) * len, a.reserved, dense_.begin() + std::ptrdiff_t(g) * a.reserved);
      forward(seq, tokens, have, a.reserved, dense_);
      have += a.reserved;
    }
    turn.computed = len - turn.device_hit - turn.host_hit;
    while (have < len) {  // the prefill of what no tier held, a chunk at a time
      const std::int32_t n = std::min(cfg_.chunk, len - have);
      slots_.resize(std::size_t(2 * n));
      (void)check(cache_.reserve(seq, prompt.subspan(std::size_t(have), std::size_t(n)), slots_), "reserve");
      forward(seq, tokens, have, n, slots_);
      have += n;
    }
    std::vector<std::int32_t> out{argmax()};
    turn.ttft_s = seconds_since(t0);
    for (std::int32_t pos = len; std::int32_t(out.size()) < max_new; ++pos) {
      tokens.push_back(out.back());
      slots_.resize(2);
      (void)check(cache_.reserve(seq, std::span(tokens).last(1), slots_), "reserve");
      forward(seq, tokens, pos, 1, slots_);
      out.push_back(argmax());
    }
    finish(seq, tokens);
    stats_.turns += 1, stats_.generated += max_new, stats_.prompt_tokens += len;
    stats_.device_hit_tokens += turn.device_hit, stats_.host_hit_tokens += turn.host_hit, stats_.computed_tokens += turn.computed;
    stats_.ttft_s += turn.ttft_s, stats_.seconds += seconds_since(t0);
    if (auto st = cache_.check_invariants(); !st) throw std::runtime_error("cache: " + st.message());
    if (auto st = tiers_.tiers().check_invariants(); !st) throw std::runtime_error("tiers: " + st.message());
    return out;
  }

 private:
  static double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  std::int32_t argmax() const { return std::int32_t(std::max_element(logits_.begin(), logits_.end()) - logits_.begin()); }
  bool tiered() const { return cfg_.host_blocks > 0; }
  std::byte* page(std::vector<std::byte>& mem, std::int32_t p) { return mem.data() + std::ptrdiff_t(p) * groups_.page_bytes(); }

  // Tokens [at, at + n) through the model: each group's K/V into its slots ([groups][n]), then computed.
  void forward(kvcache::SeqId seq, std::span<const std::int32_t> tokens, std::int32_t at, std::int32_t n,
               std::span<const std::int32_t> slots) {
    HybridKv kv(cache_, views_, seq, slots, window_, none_, nullptr);
    fwd_.run(kv, tokens.subspan(std::size_t(at), std::size_t(n)), at, logits_, true);
    if (auto st = cache_.computed(seq, at + n); !st) throw std::runtime_error("computed: " + st.message());
  }
  // The import's pending blocks from host memory (whole pages); committed when all landed.
  kvcache::OnboardResult onboard(std::uint64_t import) {
    const auto job = check(tiers_.plan_onboard(import), "plan_onboard");
    for (const auto& m : job.moves) std::memcpy(page(device_mem_, m.dst), page(host_mem_, m.src), std::size_t(groups_.page_bytes()));
    const auto done = check(tiers_.complete_onboard(job.id), "complete_onboard");
    stats_.blocks_onboarded += std::int64_t(job.moves.size());
    stats_.bytes_onboarded += std::int64_t(job.moves.size()) * groups_.page_bytes();
    return done;
  }
  // The turn ends: what its continuation can hit goes to host memory, its blocks held until the copy completes.
  void finish(kvcache::SeqId seq, std::span<const std::int32_t> tokens) {
    if (!tiered()) {
      if (auto st = cache_.free(seq); !st) throw std::runtime_error("free: " + st.message());
      return;
    }
    auto job = tiers_.plan_offload(seq, tokens);
    if (!job && job.status().code() != kvcache::Errc::out_of_blocks) throw std::runtime_error("plan_offload: " + job.status().message());
    ids_.clear();
    if (job)
      for (const auto& m : job->moves) ids_.push_back(m.src);
    const auto hold = check(cache_.hold(ids_), "hold");
    if (auto st = cache_.free(seq); !st) throw std::runtime_error("free: " + st.message());
    if (job) {
      for (const auto& m : job->moves) std::memcpy(page(host_mem_, m.dst), page(device_mem_, m.src), std::size_t(groups_.page_bytes()));
      (void)check(tiers_.tiers().complete(job->id), "complete");
      stats_.blocks_offloaded += std::int64_t(job->moves.size());
      stats_.bytes_offloaded += std::int64_t(job->moves.size()) * groups_.page_bytes();
    }
    if (auto st = cache_.release_hold(hold); !st) throw std::runtime_error("release_hold: " + st.message());
  }

  const Model& m_;
  TieredConfig cfg_;
  std::int32_t window_;
  Forward fwd_;
  std::array<std::vector<std::int32_t>, 2> layers_;
  kvcache::LayerGroups groups_;
  std::int32_t pages_;
  std::vector<std::byte> device_mem_, host_mem_;
  Cache cache_;
  kvcache::GroupTiers<Cache> tiers_;
  std::array<kvcache::PoolView, 2> views_{};
  std::vector<std::uint8_t> none_;
  TieredStats stats_;
  std::vector<float> logits_;
  std::vector<std::int32_t> slots_, dense_;
  std::vector<kvcache::BlockId> ids_;
};

}  // namespace engine
