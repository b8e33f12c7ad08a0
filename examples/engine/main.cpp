// kvcache example engine: the shipped tiny model serving requests through
// kvcache on the CPU, with every eviction policy. Prints four markdown tables:
// memory, preemption, quality against budget, batch capacity.
//
//   kvcache_engine                              all four tables
//   kvcache_engine --policy NAME [--budget N]   one policy: its output and figures
//   kvcache_engine --out DIR                    also writes DIR/quality.csv and DIR/memory.csv (plots)
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <unistd.h>

#include "engine.hpp"
#include "policies.hpp"

#ifndef ENGINE_MODEL_DIR
#define ENGINE_MODEL_DIR "examples/engine/model"
#endif

namespace {

std::vector<std::int32_t> heldout() {
  std::ifstream f(std::string(ENGINE_MODEL_DIR) + "/heldout.bin", std::ios::binary);
  if (!f) throw std::runtime_error("cannot open " ENGINE_MODEL_DIR "/heldout.bin");
  std::vector<std::int32_t> t;
  for (char c; f.get(c);) t.push_back(static_cast<unsigned char>(c));
  return t;
}

// Requests cut from the held-out text at fixed places; prompts of 4 lengths.
std::vector<engine::Request> workload(const std::vector<std::int32_t>& text, std::int32_t n, std::int32_t prompt,
                                      std::int32_t max_new) {
  std::vector<engine::Request> reqs;
  for (std::int32_t i = 0; i < n; ++i) {
    engine::Request r;
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
  engine::EngineStats stats;
  std::vector<engine::Request> reqs;
  double seconds = 0.0;
  std::int64_t peak_per_request() const {
    std::int64_t p = 0;
    for (const auto& r : reqs) p = std::max(p, r.peak_kv);
    return p;
  }
  double tokens_per_second() const { return double(stats.tokens_generated) / seconds; }
};

template <class Policy>
Served serve(const engine::Model& m, Policy p, const engine::EngineConfig& cfg, std::vector<engine::Request> reqs,
             const std::string& label = "") {
  engine::Engine<Policy> e(m, cfg, p);
  const auto t0 = std::chrono::steady_clock::now();
  std::int64_t shown = 0;
  // A progress line rewritten in place only on a terminal: a redirected log
  // stays one line per record.
  const bool tty = isatty(fileno(stderr)) != 0;
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

// Runs `f` with the named policy at `budget`, on a config adjusted for it.
template <class F>
void with(const std::string& name, std::int32_t budget, const engine::ModelConfig& c, engine::EngineConfig cfg, F&& f) {
  if (!engine::with_policy(name, budget, c, [&](auto policy, auto adjust) {
        adjust(cfg);
        f(policy, cfg);
      }))
    throw std::invalid_argument(
        fmt::format("unknown policy '{}' (one of: {})", name, fmt::join(engine::policy_names(), ", ")));
}

double agreement(const std::vector<engine::Request>& a, const std::vector<engine::Request>& b) {
  std::int64_t same = 0, all = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    for (std::size_t t = 0; t < a[i].output.size(); ++t) same += a[i].output[t] == b[i].output[t], ++all;
  return double(same) / double(all);
}

// Mean number of generated tokens before the first one that differs.
double first_divergence(const std::vector<engine::Request>& a, const std::vector<engine::Request>& b) {
  double sum = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const auto d = std::mismatch(a[i].output.begin(), a[i].output.end(), b[i].output.begin(), b[i].output.end());
    sum += double(d.first - a[i].output.begin());
  }
  return sum / double(a.size());
}

}  // namespace

int main(int argc, char** argv) try {
  std::string only, out_dir;
  std::int32_t budget = 256;
  for (int i = 1; i < argc; i += 2) {
    const std::string a = argv[i];
    if (i + 1 >= argc) return fmt::print(stderr, "{} needs a value\n", a), 2;
    if (a == "--policy")
      only = argv[i + 1];
    else if (a == "--budget") {
      std::size_t used = 0;
      try {
        budget = std::stoi(argv[i + 1], &used);
      } catch (const std::exception&) {
      }
      if (used == 0 || argv[i + 1][used] != '\0' || budget <= 0)
        return fmt::print(stderr, "--budget needs a positive token count, got '{}'\n", argv[i + 1]), 2;
    } else if (a == "--out")
      out_dir = argv[i + 1];
    else
      return fmt::print(stderr, "usage: {} [--policy NAME] [--budget TOKENS] [--out DIR]\n", argv[0]), 2;
  }
  const engine::Model model(std::string(ENGINE_MODEL_DIR) + "/kjv-tiny.bin");
  const auto text = heldout();
  const auto& c = model.config();
  fmt::print(
      "model: {} layers, width {}, {} q-heads / {} kv-heads, context {}, byte-level, trained on the KJV; "
      "greedy decoding\n\n",
      c.layers, c.dim, c.q_heads, c.kv_heads, c.context);
  const engine::EngineConfig roomy{.max_kv_tokens = 8192, .block_size = 16, .chunk = 64, .max_batch = 8};

  if (!only.empty()) {  // one policy: what it generates, and its figures
    with(only, budget, c, roomy, [](auto, const engine::EngineConfig&) {});  // a bad name or size fails first
    const auto reqs = workload(text, 4, 512, 128);
    const auto full = serve(model, kvcache::KeepAll{}, roomy, reqs, "keep_all");
    with(only, budget, c, roomy, [&](auto policy, const engine::EngineConfig& cfg) {
      const auto r = serve(model, policy, cfg, reqs, only);
      fmt::print(
          "{} at {} tokens: peak KV per request {} tokens, high-water {} tokens, {:.0f} tokens/s, "
          "token agreement with the full cache {:.3f}\n\n",
          only, budget, r.peak_per_request(), r.stats.kv_high_water, r.tokens_per_second(),
          agreement(full.reqs, r.reqs));
      for (const auto& q : r.reqs)
        fmt::print("request {}: ...{}\n  -> {}\n", q.id, std::string(q.prompt.end() - 60, q.prompt.end()),
                   std::string(q.output.begin(), q.output.end()));
    });
    return 0;
  }

  // 1. Memory: the same concurrent requests, full cache against sliding window.
  const auto reqs = workload(text, 6, 512, 128);
  fmt::print(
      "### 1. Memory: 6 concurrent requests, prompts of 416-512 tokens, 128 new tokens each, chunks of 64\n\n"
      "| cache | peak KV per request (tokens) | KV high-water, all requests (tokens) | tokens/s |\n"
      "| --- | ---: | ---: | ---: |\n");
  std::map<std::string, std::vector<std::int64_t>> kv_over_time;
  const auto full = serve(model, kvcache::KeepAll{}, roomy, reqs, "1. memory: keep_all");
  fmt::print("| full (keep_all) | {} | {} | {:.0f} |\n", full.peak_per_request(), full.stats.kv_high_water,
             full.tokens_per_second());
  kv_over_time["keep_all"] = full.stats.kv_over_time;
  for (std::int32_t w : {256, 128}) {
    with("sliding_window", w, c, roomy, [&](auto policy, const engine::EngineConfig& cfg) {
      const auto r = serve(model, policy, cfg, reqs, fmt::format("1. memory: sliding_window {}", w));
      fmt::print("| sliding window {} | {} | {} | {:.0f} |\n", w, r.peak_per_request(), r.stats.kv_high_water,
                 r.tokens_per_second());
      kv_over_time[fmt::format("sliding_window_{}", w)] = r.stats.kv_over_time;
    });
  }

  // 2. Preemption under a tight pool, optimistic admission.
  fmt::print(
      "\n### 2. Preemption: the same requests in a pool of 1,536 tokens, admitted when their prefill fits\n\n"
      "| policy | preemptions | re-prefilled tokens | steps | tokens/s |\n| --- | ---: | ---: | ---: | ---: |\n");
  engine::EngineConfig tight = roomy;
  tight.max_kv_tokens = 1536;
  tight.optimistic = true;
  for (const std::string name : {"keep_all", "sliding_window", "h2o", "average_attention"})
    with(name, 256, c, tight, [&](auto policy, const engine::EngineConfig& cfg) {
      const auto r = serve(model, policy, cfg, reqs, "2. preemption: " + name);
      fmt::print("| {}{} | {} | {} | {} | {:.0f} |\n", name, name == "keep_all" ? "" : " 256", r.stats.preemptions,
                 r.stats.reprefilled, r.stats.steps, r.tokens_per_second());
    });

  // 3. Quality against budget.
  const auto qreqs = workload(text, 4, 512, 96);
  const auto qfull = serve(model, kvcache::KeepAll{}, roomy, qreqs, "3. quality: keep_all");
  engine::EngineConfig scoring = roomy;
  scoring.chunk = 16;
  auto perplexity = [&](auto policy, const engine::EngineConfig& cfg, std::int64_t& peak) {
    engine::Engine<decltype(policy)> e(model, cfg, policy);
    double nll = 0.0;
    std::int64_t n = 0;
    for (std::size_t at : {std::size_t(0), std::size_t(20000), std::size_t(40000)}) {  // 1,024-token windows
      const auto s = e.score(std::span(text).subspan(at, std::size_t(c.context)), 512);
      nll += s.nll;
      n += s.predictions;
      peak = std::max(peak, s.peak_kv);
    }
    return std::exp(nll / double(n));
  };
  std::int64_t full_peak = 0;
  const double full_ppl = perplexity(kvcache::KeepAll{}, scoring, full_peak);
  fmt::print(
      "\n### 3. Quality against budget: greedy agreement with the full cache (4 requests, 512-token prompts, "
      "96 new tokens), held-out perplexity over 1,024-token contexts fed in chunks of 16 with the policy "
      "active\n\nfull cache: perplexity {:.3f}, peak KV {} tokens\n\n"
      "| policy | budget | token agreement | tokens before first divergence | perplexity | peak KV (tokens) |\n"
      "| --- | ---: | ---: | ---: | ---: | ---: |\n",
      full_ppl, full_peak);
  std::string csv = fmt::format("policy,budget,agreement,divergence,perplexity,peak_kv\nkeep_all,0,1,{},{:.4f},{}\n",
                                qreqs.front().max_new, full_ppl, full_peak);  // budget 0: the reference
  for (const auto& name : engine::policy_names()) {
    if (name == "keep_all") continue;
    for (std::int32_t b : {128, 256, 512})
      with(name, b, c, roomy, [&](auto policy, const engine::EngineConfig& cfg) {
        const auto r = serve(model, policy, cfg, qreqs, fmt::format("3. quality: {} {}", name, b));
        auto sc = scoring;
        sc.evict_in_prefill = cfg.evict_in_prefill;
        std::int64_t peak = 0;
        const double ppl = perplexity(policy, sc, peak);
        const double agree = agreement(qfull.reqs, r.reqs), diverge = first_divergence(qfull.reqs, r.reqs);
        fmt::print("| {} | {} | {:.3f} | {:.1f} | {:.3f} | {} |\n", name, b, agree, diverge, ppl, peak);
        csv += fmt::format("{},{},{:.4f},{:.2f},{:.4f},{}\n", name, b, agree, diverge, ppl, peak);
      });
  }

  // 4. Batch capacity under a fixed pool: long prompts, short outputs.
  fmt::print(
      "\n### 4. Batch capacity: 12 requests with 768-token prompts and 32 new tokens, a pool of 3,072 tokens, "
      "admission by lifetime need\n\n| policy | eviction | largest batch | steps | tokens/s |\n"
      "| --- | --- | ---: | ---: | ---: |\n");
  const auto long_reqs = workload(text, 12, 768 + 96, 32);
  engine::EngineConfig fixed = roomy;
  fixed.max_kv_tokens = 3072;
  fixed.max_batch = 12;
  for (const std::string name : {"keep_all", "sliding_window", "average_attention", "h2o"})
    for (bool in_prefill : {false, true}) {
      if (name == "keep_all" && in_prefill) continue;
      auto cfg0 = fixed;
      cfg0.evict_in_prefill = in_prefill;
      with(name, 256, c, cfg0, [&](auto policy, const engine::EngineConfig& cfg) {
        const auto r = serve(model, policy, cfg, long_reqs,
                             fmt::format("4. capacity: {} {}", name, in_prefill ? "prefill+decode" : "decode"));
        fmt::print("| {}{} | {} | {} | {} | {:.0f} |\n", name, name == "keep_all" ? "" : " 256",
                   name == "keep_all" ? "none"
                   : in_prefill       ? "prefill + decode"
                                      : "decode only",
                   r.stats.max_batch, r.stats.steps, r.tokens_per_second());
      });
    }

  if (!out_dir.empty()) {
    std::ofstream(out_dir + "/quality.csv") << csv;
    std::ofstream mem(out_dir + "/memory.csv");
    mem << "cache,step,kv_tokens\n";
    for (const auto& [name, series] : kv_over_time)
      for (std::size_t i = 0; i < series.size(); ++i) mem << name << ',' << i << ',' << series[i] << '\n';
  }
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "kvcache_engine: {}\n", e.what());
  return 1;
}
