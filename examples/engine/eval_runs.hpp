// The evaluation's runs (kvcache_eval): the work set every configuration is
// fed, one table row per configuration, and how a row is filled: tasks
// served as requests (passkey, recall, agreement with the full cache) and
// teacher-forced text (repeated passages, perplexity), through the paged
// engine or Write-Gated KV's.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include "gated.hpp"
#include "serving.hpp"
#include "stats.hpp"
#include "tasks.hpp"

namespace evalrun {

using engine::Interval;
using engine::mean_ci;
using engine::wilson;

constexpr double kDepths[] = {0.1, 0.3, 0.5, 0.7, 0.9};
constexpr std::size_t kNumDepths = std::size(kDepths);

struct Sizes {
  std::int32_t passkey_per_depth, recall, repeat, agree_requests, ppl_windows;
};

// What the evaluation feeds every policy: drawn once, the same for all.
struct Workset {
  std::vector<engine::TaskSample> passkey[kNumDepths], recall, repeat;
  std::vector<engine::Request> agree;                // prompts for greedy agreement
  std::vector<std::vector<std::int32_t>> windows;   // held-out windows for perplexity
};

struct Row {
  std::string policy;
  std::int32_t budget = 0;  // 0: the full cache
  Interval passkey, passkey_depth[kNumDepths], recall, repeat_loss, agreement;
  double divergence = 0.0, perplexity = 0.0, seconds = 0.0;
  std::int64_t peak_kv = 0;
  engine::KeyCounts keys;  // what decode queries read, over every request and teacher-forced text
  std::vector<engine::Request> outputs;  // the agreement requests as served
};

void add(engine::KeyCounts& to, const engine::KeyCounts& k) {
  to.read += k.read, to.dense += k.dense, to.reads += k.reads;
  to.sparse_read += k.sparse_read, to.sparse_reads += k.sparse_reads;
}

// Runs the samples as requests (prompt, then greedy decoding of the answer's
// length) and counts exact answers; the peak KV per request goes to `peak`.
template <class Policy, class Selection>
std::int64_t answered(const engine::Model& m, const Policy& p, const engine::EngineConfig& cfg,
                      const std::vector<engine::TaskSample>& samples, std::int64_t& peak, engine::KeyCounts& keys) {
  std::vector<engine::Request> reqs;
  for (const auto& s : samples) {
    engine::Request r;
    r.id = std::int32_t(reqs.size());
    r.prompt = s.prompt;
    r.max_new = std::int32_t(s.answer.size());
    reqs.push_back(std::move(r));
  }
  const auto served = engine::serve<Policy, Selection>(m, p, cfg, reqs);
  add(keys, served.stats.keys);
  std::int64_t hits = 0;
  for (std::size_t i = 0; i < samples.size(); ++i) {
    hits += served.reqs[i].output == samples[i].answer;
    peak = std::max(peak, served.reqs[i].peak_kv);
  }
  return hits;
}

// The teacher-forced columns: the repeated passages' answer loss, and the
// windows' perplexity (every byte from the second on). score(text, prompt,
// from) returns {nll, predictions, peak_kv}.
template <class Score>
void teacher_forced(const Workset& w, Row& row, Score&& score) {
  std::vector<double> losses;
  for (const auto& s : w.repeat) {  // the answer's loss, teacher-forced after the prompt
    std::vector<std::int32_t> text = s.prompt;
    text.insert(text.end(), s.answer.begin(), s.answer.end());
    const auto sc = score(text, std::int32_t(s.prompt.size()), std::int32_t(s.prompt.size()));
    losses.push_back(sc.nll / double(sc.predictions));
    row.peak_kv = std::max(row.peak_kv, sc.peak_kv);
  }
  row.repeat_loss = mean_ci(losses);
  double nll = 0.0;
  std::int64_t predictions = 0;
  for (const auto& text : w.windows) {
    const auto sc = score(text, std::int32_t(text.size()) / 2, 1);
    nll += sc.nll;
    predictions += sc.predictions;
    row.peak_kv = std::max(row.peak_kv, sc.peak_kv);
  }
  row.perplexity = std::exp(nll / double(predictions));
}

template <class Policy, class Selection = kvcache::SelectAll>
Row evaluate(const engine::Model& m, const Policy& p, const engine::EngineConfig& cfg, const Workset& w,
             const std::vector<engine::Request>& full_outputs) {
  const auto t0 = std::chrono::steady_clock::now();
  Row row;
  std::int64_t hits_all = 0, n_all = 0;
  for (std::size_t d = 0; d < kNumDepths; ++d) {
    const std::int64_t hits = answered<Policy, Selection>(m, p, cfg, w.passkey[d], row.peak_kv, row.keys);
    row.passkey_depth[d] = wilson(hits, std::int64_t(w.passkey[d].size()));
    hits_all += hits;
    n_all += std::int64_t(w.passkey[d].size());
  }
  row.passkey = wilson(hits_all, n_all);
  row.recall = wilson(answered<Policy, Selection>(m, p, cfg, w.recall, row.peak_kv, row.keys), std::int64_t(w.recall.size()));
  engine::Engine<Policy, Selection> scorer(m, cfg, p);
  teacher_forced(w, row, [&](const std::vector<std::int32_t>& text, std::int32_t prompt, std::int32_t from) {
    return scorer.score(text, prompt, from);
  });
  add(row.keys, scorer.stats().keys);
  const auto served = engine::serve<Policy, Selection>(m, p, cfg, w.agree);
  add(row.keys, served.stats.keys);
  const auto& full = full_outputs.empty() ? served.reqs : full_outputs;
  const auto [same, all] = engine::agreement_counts(full, served.reqs);
  row.agreement = wilson(same, all);  // tokens are not independent: the interval is indicative only
  row.outputs = served.reqs;
  row.divergence = engine::first_divergence(full, served.reqs);
  row.peak_kv = std::max(row.peak_kv, served.peak_per_request());
  row.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return row;
}

// Write-Gated KV's extra figures: what its gates admit and what its queries read.
struct GatedFigures {
  double lambda = 0.0, admitted = 0.0, keys_per_query = 0.0, dense_keys_per_query = 0.0;
};

// The same tasks under Write-Gated KV with one gate set, a request at a time,
// alone or composed with Quest (Selection) and a token policy on the global regions (Eviction);
// `stored`: how the pool stores K/V (its kv_dtype, kv_format and kv_scales; the rest is not read).
template <class Selection = kvcache::SelectAll, class Eviction = kvcache::KeepAll>
Row evaluate_gated(const engine::Model& m, const engine::GateSet& g, const Workset& w,
                   const std::vector<engine::Request>& full_outputs, GatedFigures& fig, kvcache::QuestConfig quest = {},
                   Eviction eviction = {}, const engine::EngineConfig& stored = {}) {
  const auto t0 = std::chrono::steady_clock::now();
  Row row;
  engine::GatedEngine<Selection, Eviction> e(m, g,
                                             engine::EngineConfig{.block_size = stored.block_size,  // a format's own (KIVI's 32), or 16
                                                                  .chunk = 64,
                                                                  .max_batch = 1,
                                                                  .quest = quest,
                                                                  .kv_dtype = stored.kv_dtype,
                                                                  .kv_format = stored.kv_format,
                                                                  .kv_scales = stored.kv_scales},
                                             eviction);
  auto answered = [&](const std::vector<engine::TaskSample>& samples) {
    std::int64_t hits = 0;
    for (const auto& s : samples) hits += e.generate(s.prompt, std::int32_t(s.answer.size()), row.peak_kv) == s.answer;
    return hits;
  };
  std::int64_t hits_all = 0, n_all = 0;
  for (std::size_t d = 0; d < kNumDepths; ++d) {
    const std::int64_t hits = answered(w.passkey[d]);
    row.passkey_depth[d] = wilson(hits, std::int64_t(w.passkey[d].size()));
    hits_all += hits;
    n_all += std::int64_t(w.passkey[d].size());
  }
  row.passkey = wilson(hits_all, n_all);
  row.recall = wilson(answered(w.recall), std::int64_t(w.recall.size()));
  teacher_forced(w, row, [&](const std::vector<std::int32_t>& text, std::int32_t, std::int32_t from) {
    return e.score(text, from);  // no one-shot policy: the prompt's end does not matter
  });
  for (const auto& r : w.agree) {
    engine::Request out = r;
    out.output = e.generate(r.prompt, r.max_new, row.peak_kv);
    row.outputs.push_back(std::move(out));
  }
  const auto [same, all] = engine::agreement_counts(full_outputs, row.outputs);
  row.agreement = wilson(same, all);
  row.divergence = engine::first_divergence(full_outputs, row.outputs);
  const auto& c = e.counts();
  fig = {g.lambda, double(c.admitted) / double(std::max<std::int64_t>(1, c.admitted + c.dropped)),
         double(c.keys_read) / double(std::max<std::int64_t>(1, c.decode_queries * g.kv_heads)),
         double(c.dense_keys) / double(std::max<std::int64_t>(1, c.decode_queries * g.kv_heads))};
  row.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return row;
}

// Quest as the engine runs it: the first and last pages forced, the first
// layer dense (the paper keeps 2 of 32 dense; this model has 4 layers).
kvcache::QuestConfig quest_config(std::int32_t budget, const engine::ModelConfig& c) {
  return {.token_budget = budget, .first_pages = 1, .last_pages = 1, .dense_layers = 1, .query_group = c.q_heads / c.kv_heads};
}

std::string pct(const Interval& i) { return fmt::format("{:.2f} [{:.2f}, {:.2f}]", i.value, i.lo, i.hi); }

}  // namespace evalrun
