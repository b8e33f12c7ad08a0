// What the engine's drivers share (main.cpp: the four tables; eval.cpp: the
// fidelity evaluation): the held-out text, workloads cut from it, serving a
// workload to completion, comparing outputs, and running a named policy.
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include "engine.hpp"
#include "hybrid_backend.hpp"
#include "policies.hpp"

#ifndef ENGINE_MODEL_DIR
#define ENGINE_MODEL_DIR "examples/engine/model"
#endif

namespace engine {


inline std::vector<std::int32_t> heldout() {
  std::ifstream f(std::string(ENGINE_MODEL_DIR) + "/heldout.bin", std::ios::binary);
  if (!f) throw std::runtime_error("cannot open " ENGINE_MODEL_DIR "/heldout.bin");
  std::vector<std::int32_t> t;
  for (char c; f.get(c);) t.push_back(static_cast<unsigned char>(c));
  return t;
}

// Requests cut from the held-out text at fixed places; prompts of 4 lengths.
inline std::vector<Request> workload(const std::vector<std::int32_t>& text, std::int32_t n, std::int32_t prompt,
                                      std::int32_t max_new) {
  std::vector<Request> reqs;
  for (std::int32_t i = 0; i < n; ++i) {
    Request r;
    r.id = i;
    r.priority = i % 3;
    const std::int32_t len = prompt - 32 * (i % 4);
    const auto at = std::size_t(i) * 4001 % (text.size() - std::size_t(len));
    r.prompt.assign(text.begin() + std::ptrdiff_t(at), text.begin() + std::ptrdiff_t(at) + len);
    r.max_new = max_new;
    reqs.push_back(std::move(r));
  }
  return reqs;
}

struct Served {
  EngineStats stats;
  std::vector<Request> reqs;
  double seconds = 0.0;
  std::int64_t peak_per_request() const {
    std::int64_t p = 0;
    for (const auto& r : reqs) p = std::max(p, r.peak_kv);
    return p;
  }
  double tokens_per_second() const { return double(stats.tokens_generated) / seconds; }
};

// Selection: kvcache::SelectAll, or QuestSelection (cfg.quest configures it).
template <class Policy, class Selection = kvcache::SelectAll>
Served serve(const Model& m, Policy p, const EngineConfig& cfg, std::vector<Request> reqs,
             const std::string& label = "") {
  Engine<Policy, Selection> e(m, cfg, p);
  const auto t0 = std::chrono::steady_clock::now();
  std::int64_t shown = 0;
  // A progress line rewritten in place only on a terminal: a redirected log
  // stays one line per record.
  const bool tty = !label.empty() && isatty(fileno(stderr)) != 0;
  while (std::any_of(reqs.begin(), reqs.end(), [](const auto& r) { return !r.done; })) {
    e.step(reqs);
    if (tty && e.stats().tokens_generated - shown >= 256) {  // a progress line on long runs
      shown = e.stats().tokens_generated;
      fmt::print(stderr, "\r  {}: {} tokens generated, step {}   ", label, shown, e.stats().steps);
    }
  }
  if (shown) fmt::print(stderr, "\r{:80}\r", "");
  return {e.stats(), reqs, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()};
}

// The same workload on the hybrid engine: odd layers a sliding window of
// `window` tokens, the even ones under `eviction` (KeepAll, or a block policy).
template <class Eviction = kvcache::KeepAll>
Served serve_hybrid(const Model& m, const EngineConfig& cfg, std::vector<Request> reqs, std::int32_t window,
                    Eviction eviction = {}) {
  HybridEngine<kvcache::SelectAll, Eviction> e(m, cfg, window, eviction);
  const auto t0 = std::chrono::steady_clock::now();
  e.run(reqs);
  return {e.stats(), reqs, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()};
}

// Runs `f` with the named policy at `budget`, on a config adjusted for it.
template <class F>
void with(const std::string& name, std::int32_t budget, const ModelConfig& c, EngineConfig cfg, F&& f) {
  if (!with_policy(
          name, budget, c,
          [&](auto policy, auto adjust) {
            adjust(cfg);
            f(policy, cfg);
          },
          cfg.block_size))
    throw std::invalid_argument(
        fmt::format("unknown policy '{}' (one of: {})", name, fmt::join(policy_names(), ", ")));
}

// Generated tokens equal to the reference's, and all generated tokens.
inline std::pair<std::int64_t, std::int64_t> agreement_counts(const std::vector<Request>& a,
                                                              const std::vector<Request>& b) {
  std::int64_t same = 0, all = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    for (std::size_t t = 0; t < a[i].output.size(); ++t) same += a[i].output[t] == b[i].output[t], ++all;
  return {same, all};
}
inline double agreement(const std::vector<Request>& a, const std::vector<Request>& b) {
  const auto [same, all] = agreement_counts(a, b);
  return double(same) / double(all);
}

// Mean number of generated tokens before the first one that differs.
inline double first_divergence(const std::vector<Request>& a, const std::vector<Request>& b) {
  double sum = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const auto d = std::mismatch(a[i].output.begin(), a[i].output.end(), b[i].output.begin(), b[i].output.end());
    sum += double(d.first - a[i].output.begin());
  }
  return sum / double(a.size());
}

}  // namespace engine
