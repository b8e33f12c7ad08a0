// kvcache example engine: the shipped tiny model serving requests through
// kvcache on the CPU, with every eviction policy. Prints seven markdown
// tables: memory, preemption, quality against budget, batch capacity, the
// seed experiments' sliding-window study, the limits of a fixed cache, and
// hybrid layers (a window on every other layer) in one pool.
//
//   kvcache_engine                              all seven tables
//   kvcache_engine --policy NAME [--budget N] [--kv-format NAME]
//                                               one policy: its output and figures, the pool stored
//                                               in a KV format (kv_formats.hpp; f32 by default)
//   kvcache_engine --out DIR                    also writes DIR/quality.csv and DIR/memory.csv (plots)
#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "kv_formats.hpp"
#include "serving.hpp"

using engine::agreement;
using engine::first_divergence;
using engine::heldout;
using engine::serve;
using engine::Served;
using engine::with;
using engine::workload;

int main(int argc, char** argv) try {
  std::string only, out_dir, kv_format;
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
    else if (a == "--kv-format")
      kv_format = argv[i + 1];
    else
      return fmt::print(stderr, "usage: {} [--policy NAME] [--budget TOKENS] [--kv-format NAME] [--out DIR]\n", argv[0]),
             2;
  }
  if (!kv_format.empty() && only.empty()) return fmt::print(stderr, "--kv-format: with --policy\n"), 2;
  const engine::NamedKvFormat& format = engine::kv_format_named(kv_format.empty() ? "f32" : kv_format);
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
    const auto stored = engine::with_kv_format(roomy, format, model, engine::calibration_window(text, c.context));
    with(only, budget, c, stored, [&](auto policy, const engine::EngineConfig& cfg) {
      const auto r = serve(model, policy, cfg, reqs, only);
      fmt::print(
          "{} at {} tokens, KV {}: peak KV per request {} tokens, high-water {} tokens, {:.0f} tokens/s, "
          "token agreement with the f32 full cache {:.3f}\n\n",
          only, budget, format.name, r.peak_per_request(), r.stats.kv_high_water, r.tokens_per_second(),
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
        auto sc = cfg;  // the policy's own settings (grouping, window, prefill eviction), chunks of 16
        sc.chunk = scoring.chunk;
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

  // 5. The sliding-window study of the seed experiments: short requests in a
  // tight pool, the full cache against small windows.
  fmt::print(
      "\n### 5. Sliding-window study: 4 concurrent requests, 48-byte prompts, 96 new tokens each, a pool of "
      "256 tokens, admitted when their prefill fits\n\n"
      "| cache | agreement | peak KV per request, mean / max | KV high-water | preemptions | tokens/s |\n"
      "| --- | ---: | ---: | ---: | ---: | ---: |\n");
  std::vector<engine::Request> short_reqs;
  for (std::int32_t i = 0; i < 4; ++i) {
    engine::Request r;
    r.id = i;
    r.priority = i % 2;
    const auto at = std::size_t(i) * 9973 % (text.size() - 48);
    r.prompt.assign(text.begin() + std::ptrdiff_t(at), text.begin() + std::ptrdiff_t(at) + 48);
    r.max_new = 96;
    short_reqs.push_back(std::move(r));
  }
  engine::EngineConfig small = roomy;
  small.max_kv_tokens = 256;
  small.optimistic = true;
  auto study_row = [&](const std::string& label, const Served& r, const Served& ref) {
    double mean_peak = 0.0;
    for (const auto& q : r.reqs) mean_peak += double(q.peak_kv) / double(r.reqs.size());
    fmt::print("| {} | {:.3f} | {:.0f} / {} | {} | {} | {:.0f} |\n", label, agreement(ref.reqs, r.reqs), mean_peak,
               r.peak_per_request(), r.stats.kv_high_water, r.stats.preemptions, r.tokens_per_second());
  };
  const auto study_full = serve(model, kvcache::KeepAll{}, small, short_reqs, "5. window study: keep_all");
  study_row("full (keep_all)", study_full, study_full);
  for (std::int32_t w : {8, 16, 20, 32})
    with("sliding_window", w, c, small, [&](auto policy, const engine::EngineConfig& cfg) {
      study_row(fmt::format("sliding window {}", w),
                serve(model, policy, cfg, short_reqs, fmt::format("5. window study: {}", w)), study_full);
    });

  // 6. The block-eviction documentation's limit checks: in a fixed cache, the
  // longest generation one request gets, and how few requests fill it.
  fmt::print(
      "\n### 6. Limits of a fixed cache: a pool of 1,024 tokens, 128-byte prompts, admission by lifetime need\n\n"
      "| policy | longest generation admitted | generated and checked | peak KV per request | requests that "
      "fill the pool |\n| --- | ---: | ---: | ---: | ---: |\n");
  engine::EngineConfig fixed_pool = roomy;
  fixed_pool.max_kv_tokens = 1024;
  fixed_pool.max_batch = 1;
  for (const std::string name : {"keep_all", "sliding_window", "block_scores"})
    with(name, 256, c, fixed_pool, [&](auto policy, const engine::EngineConfig& cfg) {
      engine::Engine<decltype(policy)> probe(model, cfg, policy);
      // The longest generation the accounting admits (capped at 8x the pool:
      // with eviction only time bounds it).
      const std::int64_t cap = 8 * cfg.max_kv_tokens, free = probe.cache().free_blocks();
      std::int64_t lo = 0, hi = cap;
      while (lo < hi) {
        const std::int64_t mid = (lo + hi + 1) / 2;
        const auto need = probe.blocks_needed(128, mid, cfg.chunk);
        if (need && *need <= free)
          lo = mid;
        else
          hi = mid - 1;
      }
      const std::int64_t run_len = std::min<std::int64_t>(lo, 2048);  // generated here, to show it completes
      auto one = engine::workload(text, 1, 128, std::int32_t(run_len));
      const auto r = serve(model, policy, cfg, one, "6. limits: " + name);
      const std::int64_t peak = r.peak_per_request();
      fmt::print("| {}{} | {} | {} | {} | {} |\n", name, name == "keep_all" ? "" : " 256",
                 lo >= cap ? fmt::format("≥ {} (unbounded)", cap) : std::to_string(lo), r.reqs[0].output.size(), peak,
                 (cfg.max_kv_tokens + peak - 1) / peak);
    });

  // 7. Hybrid layers: the batch-capacity workload with layers 1 and 3 a
  // sliding window (Gemma's interleave), their pages from the same pool.
  fmt::print(
      "\n### 7. Hybrid layers: table 4's workload, layers 1 and 3 a sliding window, one pool of the same bytes\n\n"
      "| layers | peak KV per request (tokens a layer) | largest batch | steps | tokens/s | token agreement with all full |\n"
      "| --- | ---: | ---: | ---: | ---: | ---: |\n");
  engine::EngineConfig hybrid = fixed;
  const auto all_full = serve(model, kvcache::KeepAll{}, hybrid, long_reqs, "7. hybrid: all full");
  fmt::print("| all full | {} | {} | {} | {:.0f} | 1.000 |\n", all_full.peak_per_request(), all_full.stats.max_batch,
             all_full.stats.steps, all_full.tokens_per_second());
  for (std::int32_t w : {c.context, 256, 128}) {
    const auto r = engine::serve_hybrid(model, hybrid, long_reqs, w);
    fmt::print("| full + window {}{} | {} | {} | {} | {:.0f} | {:.3f} |\n", w, w >= c.context ? " (covers the context)" : "",
               r.peak_per_request(), r.stats.max_batch, r.stats.steps, r.tokens_per_second(), agreement(all_full.reqs, r.reqs));
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
