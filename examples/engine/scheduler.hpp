// The example engine's one scheduler loop, over either KV backend: requests
// are admitted by the cache's accounting, prompts are prefilled in chunks,
// every step decodes one token per running request, and when the pool runs
// out the lowest-priority running request is preempted (its handles freed,
// its prompt and tokens so far re-prefilled later). Greedy decoding: runs are
// reproducible.
//
// A backend owns the cache, the pool and what the forward pass reads; the
// scheduler owns the requests. What it asks of a backend (KvBackend):
//   handles()                        cache handles per request (1, or 1 per layer)
//   open(r) / close(r)               take / give back r's handles (r.seqs)
//   promise(r, blocks)               tell the cache what r will need (ledger)
//   blocks_needed(tokens, new, chunk), room(), free_handles()   admission
//   reserve(r, n, slots)             slots for n tokens, or out_of_blocks
//   store(r, at, slots, keys)        what Forward::run reads and writes
//   after_forward(r, trace)          observe and evict; compaction follows
//   held(r)                          tokens held, as one stream counts them
//   traces / decode_selects          whether it reads the attention trace;
//                                    whether its decode queries select pages
//   ragged_trace()                   whether the trace is per layer, over the
//                                    rows each layer holds (layers differ)
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine_types.hpp"
#include "forward.hpp"
#include "model.hpp"

namespace engine {

template <class B>
concept KvBackend = requires(B& b, const B& cb, Request& r, std::vector<std::int32_t>& slots, KeyCounts& keys,
                             const AttentionTrace& trace) {
  { cb.handles() } -> std::convertible_to<std::int32_t>;
  b.open(r);
  b.close(r);
  b.promise(r, std::int64_t{});
  { cb.blocks_needed(std::int64_t{}, std::int64_t{}, std::int64_t{}) } -> std::same_as<kvcache::Result<std::int64_t>>;
  { cb.room() } -> std::convertible_to<std::int64_t>;
  { cb.free_handles() } -> std::convertible_to<std::int32_t>;
  { b.reserve(r, std::int32_t{}, slots) } -> std::same_as<kvcache::Status>;
  b.store(r, std::int64_t{}, std::span<const std::int32_t>{}, &keys);
  b.after_forward(r, trace);
  { cb.held(r) } -> std::convertible_to<std::int64_t>;
  { cb.ragged_trace() } -> std::convertible_to<bool>;
  { B::traces } -> std::convertible_to<bool>;
  { B::decode_selects } -> std::convertible_to<bool>;
};

template <KvBackend Backend>
class Scheduler {
 public:
  template <class... Args>
  Scheduler(const Model& m, const EngineConfig& cfg, Args&&... backend_args)
      : m_(m), cfg_(cfg), fwd_(m), kv_(m, cfg, std::forward<Args>(backend_args)...) {}

  const EngineStats& stats() const { return stats_; }
  const Backend& backend() const { return kv_; }

  // Negative log-likelihood (nats) of text[from..] (from >= 1) given the
  // text before it, fed in chunks with the policy active: after every chunk
  // (or, with evict_in_prefill false, once after the first `prompt` tokens:
  // no chunk crosses that point, and the last one before it holds the
  // observation window) the backend observes and evicts. Past the prompt a
  // page-selecting backend is fed one token at a time, so teacher-forced
  // queries are decode queries. Returns {total nll, predictions, peak tokens held}.
  struct Score {
    double nll = 0.0;
    std::int64_t predictions = 0, peak_kv = 0;
  };
  Score score(std::span<const std::int32_t> text, std::int32_t prompt, std::int32_t from = 1) {
    Request r;
    kv_.open(r);
    Score out;
    std::vector<float> logits;
    std::vector<std::int32_t> slots;
    const std::int32_t V = m_.config().vocab;
    for (std::int32_t at = 0; at + 1 < std::int32_t(text.size());) {
      std::int32_t n = std::min(cfg_.chunk, std::int32_t(text.size()) - 1 - at);
      if (at < prompt) {
        n = chunk_before(prompt - at, n);
      } else if (Backend::decode_selects) {
        n = 1;
      }
      if (auto st = kv_.reserve(r, n, slots); !st) throw std::runtime_error("score: " + st.message());
      forward(r, text.subspan(std::size_t(at), std::size_t(n)), at, slots, logits, false, at + n == prompt);
      out.peak_kv = std::max(out.peak_kv, kv_.held(r));
      for (std::int32_t i = std::max(0, from - 1 - at); i < n; ++i) {  // log-softmax at the target
        out.nll += token_nll(&logits[std::size_t(i) * std::size_t(V)], V, text[std::size_t(at + i + 1)]);
        ++out.predictions;
      }
      at += n;
      if (cfg_.evict_in_prefill || (at >= prompt && at - n < prompt)) kv_.after_forward(r, trace_);
    }
    kv_.close(r);
    return out;
  }

  // Runs until every request is done.
  void run(std::vector<Request>& reqs) {
    while (std::any_of(reqs.begin(), reqs.end(), [](const Request& r) { return !r.done; })) step(reqs);
  }

  void step(std::vector<Request>& reqs) {
    admit(reqs);
    std::vector<Request*> running;
    for (auto& r : reqs)
      if (r.running) running.push_back(&r);
    if (running.empty())
      for (const auto& r : reqs)  // nothing runs and the first in line was not admitted: it never will be
        if (!r.done) throw std::runtime_error("request " + std::to_string(r.id) + " does not fit the pool on its own");
    std::stable_sort(running.begin(), running.end(), [](auto* a, auto* b) { return a->priority > b->priority; });
    for (Request* r : running) {
      if (!r->running) continue;  // preempted earlier in this step
      advance(*r, reqs);
    }
    std::int64_t held = 0, batch = 0;
    for (auto& r : reqs)
      if (r.running) held += kv_.held(r), ++batch;
    stats_.max_batch = std::max(stats_.max_batch, batch);
    stats_.kv_high_water = std::max(stats_.kv_high_water, held);
    stats_.kv_over_time.push_back(held);
    ++stats_.steps;
  }

 protected:
  Backend& kv() { return kv_; }

 private:
  // A chunk of at most n tokens with `left` tokens to the prompt's end: never
  // past it, and cut so the last one holds the whole observation window.
  std::int32_t chunk_before(std::int32_t left, std::int32_t n) const {
    const std::int32_t w = cfg_.observe_window;
    n = std::min(n, left);
    if (w > 0 && left - n > 0 && left - n < w && left > w) n = left - w;
    return n;
  }
  static std::int32_t tokens_of(const Request& r) { return std::int32_t(r.prompt.size() + r.output.size()); }

  void forward(Request& r, std::span<const std::int32_t> tokens, std::int64_t at, std::span<const std::int32_t> slots,
               std::vector<float>& logits, bool last_only, bool observe) {
    trace_ = {};
    trace_.ragged = kv_.ragged_trace();
    auto store = kv_.store(r, at, slots, &stats_.keys);
    fwd_.run(store, tokens, at, logits, last_only, Backend::traces ? &trace_ : nullptr, observe ? cfg_.observe_window : 0);
  }

  // Highest priority first, while a handle is free and the pool covers the
  // request's whole life under the policy's bound (or, optimistic, its
  // prefill), less the blocks the cache's ledger has promised to running
  // requests and they do not hold yet.
  void admit(std::vector<Request>& reqs) {
    std::vector<Request*> waiting;
    for (auto& r : reqs)
      if (!r.running && !r.done) waiting.push_back(&r);
    std::stable_sort(waiting.begin(), waiting.end(), [](auto* a, auto* b) { return a->priority > b->priority; });
    for (Request* r : waiting) {
      if (std::int32_t(r->output.size()) >= r->max_new) {  // nothing to generate
        r->done = true;
        continue;
      }
      const std::int64_t remaining_new = r->max_new - std::int64_t(r->output.size());
      auto need = kv_.blocks_needed(tokens_of(*r), cfg_.optimistic ? 0 : remaining_new, cfg_.evict_in_prefill ? cfg_.chunk : 0);
      if (!need || kv_.free_handles() < kv_.handles() || *need > kv_.room()) break;
      kv_.open(*r);
      kv_.promise(*r, *need);
      r->running = true;
      r->fed = 0;
      r->need_blocks = *need;
    }
  }

  // One step of one request: a prefill chunk, or one decoded token.
  void advance(Request& r, std::vector<Request>& reqs) {
    const std::int32_t total = tokens_of(r);
    const std::int32_t n = chunk_before(total - r.fed, std::min(cfg_.chunk, total - r.fed));
    std::vector<std::int32_t> slots;
    for (;;) {
      const auto st = kv_.reserve(r, n, slots);
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
    forward(r, tokens, r.fed, slots, r.last_logits, true, true);
    r.fed += n;
    r.peak_kv = std::max(r.peak_kv, kv_.held(r));
    const bool prefill_done = r.fed >= total;
    if (cfg_.evict_in_prefill || prefill_done) kv_.after_forward(r, trace_);
    if (prefill_done) {
      const auto& lg = r.last_logits;
      r.output.push_back(std::int32_t(std::max_element(lg.begin(), lg.end()) - lg.begin()));
      if (cfg_.keep_logits) r.logits.insert(r.logits.end(), lg.begin(), lg.end());
      ++stats_.tokens_generated;
      if (std::int32_t(r.output.size()) >= r.max_new) finish(r);
    }
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
    kv_.close(*victim);
    victim->running = false;
    victim->fed = 0;
    return victim != &keep;
  }
  void finish(Request& r) {
    kv_.close(r);
    r.running = false;
    r.done = true;
  }

  const Model& m_;
  EngineConfig cfg_;
  Forward fwd_;
  Backend kv_;
  EngineStats stats_;
  AttentionTrace trace_;  // the last forward pass's attention, for after_forward
};

}  // namespace engine
