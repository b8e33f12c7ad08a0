// kvcache_eval: every eviction policy at budgets of 12.5 %, 25 % and 50 % of
// the model's 1,024-token context, on tasks whose answers lie far back in
// the context (tasks.hpp), against the full cache. One markdown table, with
// sample sizes and 95 % intervals (Wilson for accuracies, normal for means),
// so a small difference is not read as a ranking. Then Quest's page
// selection at token budgets of 64, 128 and 256 with every token held (its
// bandwidth figure: keys read per decode query), and Write-Gated KV.
//
//   kvcache_eval [--full] [--quant] [--policy NAME] [--threads N] [--out DIR]
//     --full     larger samples (minutes become tens of minutes)
//     --quant    the quantized-KV table instead (eval_quant.hpp)
//     --policy   only this policy (and the full cache it is compared with)
//     --out DIR  also writes DIR/eval.csv (for bench/plot_eval.py)
#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "eval_quant.hpp"

using namespace evalrun;

int main(int argc, char** argv) try {
  bool full_mode = false, quant_mode = false;
  std::string only, out_dir;
  std::int32_t threads = std::max(1, std::int32_t(std::thread::hardware_concurrency()));
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--full") {
      full_mode = true;
    } else if (a == "--quant") {
      quant_mode = true;
    } else if ((a == "--policy" || a == "--out" || a == "--threads") && i + 1 < argc) {
      const std::string v = argv[++i];
      if (a == "--policy") only = v;
      if (a == "--out") out_dir = v;
      if (a == "--threads") {
        std::size_t used = 0;
        try {
          threads = std::stoi(v, &used);
        } catch (const std::exception&) {
        }
        if (used == 0 || used != v.size() || threads < 1)
          return fmt::print(stderr, "--threads needs a positive count, got '{}'\n", v), 2;
      }
    } else {
      return fmt::print(stderr, "usage: {} [--full] [--quant] [--policy NAME] [--threads N] [--out DIR]\n", argv[0]), 2;
    }
  }
  if (!only.empty() && only != "keep_all" && only != "wg_kv" && only != "quest" &&
      std::find(engine::policy_names().begin(), engine::policy_names().end(), only) == engine::policy_names().end())
    return fmt::print(stderr, "unknown policy '{}' (one of: {})\n", only, fmt::join(engine::policy_names(), ", ")), 2;

  const engine::Model model(std::string(ENGINE_MODEL_DIR) + "/kjv-tiny.bin");
  const auto& c = model.config();
  const auto text = engine::heldout();
  const Sizes sz = full_mode ? Sizes{40, 100, 50, 8, 8} : Sizes{8, 24, 12, 2, 2};
  const std::int32_t L = c.context;

  Workset w;
  std::mt19937_64 rng(20261123);
  const engine::Tasks tasks(text);
  for (std::size_t d = 0; d < kNumDepths; ++d)
    for (std::int32_t i = 0; i < sz.passkey_per_depth; ++i) w.passkey[d].push_back(tasks.passkey(rng, L, kDepths[d]));
  for (std::int32_t i = 0; i < sz.recall; ++i) w.recall.push_back(tasks.recall(rng, L));
  for (std::int32_t i = 0; i < sz.repeat; ++i) w.repeat.push_back(tasks.repeat(rng, L));
  w.agree = engine::workload(text, sz.agree_requests, 512, 128);
  for (std::int32_t i = 0; i < sz.ppl_windows; ++i) {
    const auto at = std::size_t(i) * 7919 % (text.size() - std::size_t(L));
    w.windows.emplace_back(text.begin() + std::ptrdiff_t(at), text.begin() + std::ptrdiff_t(at) + L);
  }

  // Room for a batch of full-context requests; chunks of 64, eviction after each.
  const engine::EngineConfig cfg0{.max_kv_tokens = 4 * (L + 64), .block_size = 16, .chunk = 64, .max_batch = 4};
  const std::vector<std::int32_t> budgets{L / 8, L / 4, L / 2};
  struct Job {
    std::string name;
    std::int32_t budget;
    bool decode_only = false;
  };
  std::vector<Job> jobs;
  for (const auto& name : engine::policy_names())
    if (name != "keep_all" && (only.empty() || only == name))
      for (std::int32_t b : budgets) jobs.push_back({name, b});
  // The average-attention paper's study: eviction in decode only (the whole
  // prompt is held through prefill) against prefill + decode, at 25 %.
  for (const std::string name : {"sliding_window", "h2o", "average_attention"})
    if (only.empty() || only == name) jobs.push_back({name, L / 4, true});
  // Quest: every token stays; each decode query reads its kv-head's best pages within the budget.
  if (only.empty() || only == "quest")
    for (std::int32_t b : {64, 128, 256}) jobs.push_back({"quest", b});

  fmt::print(
      "model: {} layers, {} kv-heads, context {}; tasks at {} bytes; samples: passkey {} per depth x {} depths, "
      "recall {}, repeated passages {}, agreement {} requests x 128 tokens, perplexity {} windows of {}\n\n",
      c.layers, c.kv_heads, L, L, sz.passkey_per_depth, kNumDepths, sz.recall, sz.repeat, sz.agree_requests,
      sz.ppl_windows, L);
  Row full = evaluate(model, kvcache::KeepAll{}, cfg0, w, {});
  full.policy = "full cache";
  const auto& full_outputs = full.outputs;
  if (quant_mode) {
    const std::string gates = std::string(ENGINE_MODEL_DIR) + "/gates-0.01.bin";
    quant_study(model, cfg0, w, full_outputs, std::ifstream(gates) ? gates : std::string(), threads,
                engine::calibration_window(text, L));
    return 0;
  }

  std::vector<Row> rows(jobs.size());
  std::atomic<std::size_t> next{0};
  std::mutex progress;
  auto worker = [&] {
    for (std::size_t j; (j = next++) < jobs.size();) {
      auto base = cfg0;
      base.evict_in_prefill = !jobs[j].decode_only;
      if (jobs[j].name == "quest") {
        base.quest = quest_config(jobs[j].budget, c);
        rows[j] = evaluate<kvcache::KeepAll, kvcache::QuestSelection>(model, kvcache::KeepAll{}, base, w, full_outputs);
      } else {
        engine::with(jobs[j].name, jobs[j].budget, c, base, [&](auto policy, const engine::EngineConfig& cfg) {
          rows[j] = evaluate(model, policy, cfg, w, full_outputs);
        });
      }
      rows[j].policy = jobs[j].name + (jobs[j].decode_only ? " (decode only)" : "");
      rows[j].budget = jobs[j].budget;
      const std::lock_guard<std::mutex> lock(progress);
      fmt::print(stderr, "  {} at {}: {:.0f} s\n", jobs[j].name, jobs[j].budget, rows[j].seconds);
    }
  };
  std::vector<std::thread> pool;
  for (std::int32_t t = 0; t < std::min<std::int32_t>(threads, std::int32_t(jobs.size())); ++t) pool.emplace_back(worker);
  for (auto& t : pool) t.join();
  rows.insert(rows.begin(), full);

  // Write-Gated KV, one row per shipped gate set (train/train_gates.py).
  std::vector<std::string> gate_files;
  if (only.empty() || only == "wg_kv")
    for (const char* lambda : {"0.003", "0.01", "0.03"}) {
      const std::string path = std::string(ENGINE_MODEL_DIR) + "/gates-" + lambda + ".bin";
      if (std::ifstream(path)) gate_files.push_back(path);
    }
  std::vector<engine::GateSet> gate_sets;
  for (const auto& f : gate_files) gate_sets.emplace_back(f);
  // Each gate set alone, then the middle one (λ = 0.01) composed: with Quest at a
  // budget of 64 global tokens, with H2O keeping 128 heavy hitters in each global
  // region (the eviction policy that ranks first above), and with both.
  struct GatedJob {
    std::size_t set;
    int variant;  // 0: alone, 1: + Quest, 2: + H2O, 3: all three
  };
  std::vector<GatedJob> gated_jobs;
  for (std::size_t j = 0; j < gate_sets.size(); ++j) gated_jobs.push_back({j, 0});
  for (std::size_t j = 0; j < gate_sets.size(); ++j)
    if (gate_sets[j].lambda == 0.01f)
      for (int v : {1, 2, 3}) gated_jobs.push_back({j, v});
  std::vector<Row> gated(gated_jobs.size());
  std::vector<GatedFigures> figures(gated_jobs.size());
  std::atomic<std::size_t> next_gate{0};
  auto gated_worker = [&] {
    for (std::size_t j; (j = next_gate++) < gated_jobs.size();) {
      const engine::GateSet& g = gate_sets[gated_jobs[j].set];
      const kvcache::QuestConfig quest = quest_config(64, c);
      const kvcache::H2OEviction h2o({.heavy = 128, .recent = 0});
      std::string label = fmt::format("wg_kv λ={:g}", g.lambda);
      switch (gated_jobs[j].variant) {
        case 0: gated[j] = evaluate_gated(model, g, w, full_outputs, figures[j]); break;
        case 1:
          gated[j] = evaluate_gated<kvcache::QuestSelection>(model, g, w, full_outputs, figures[j], quest);
          label += " + quest 64";
          break;
        case 2:
          gated[j] = evaluate_gated<kvcache::SelectAll, kvcache::H2OEviction>(model, g, w, full_outputs, figures[j], {}, h2o);
          label += " + h2o 128";
          break;
        default:
          gated[j] = evaluate_gated<kvcache::QuestSelection, kvcache::H2OEviction>(model, g, w, full_outputs, figures[j], quest, h2o);
          label += " + quest 64 + h2o 128";
      }
      gated[j].policy = label;
      gated[j].budget = -1;
      const std::lock_guard<std::mutex> lock(progress);
      fmt::print(stderr, "  {}: {:.0f} s\n", label, gated[j].seconds);
    }
  };
  pool.clear();
  for (std::int32_t t = 0; t < std::min<std::int32_t>(threads, std::int32_t(gated_jobs.size())); ++t)
    pool.emplace_back(gated_worker);
  for (auto& t : pool) t.join();
  rows.insert(rows.end(), gated.begin(), gated.end());

  fmt::print(
      "| policy | budget | passkey | passkey at depth 10/30/50/70/90 % | recall | repeated passage loss (nats/byte) "
      "| agreement | tokens before divergence | perplexity | peak KV |\n"
      "| --- | ---: | --- | --- | --- | --- | ---: | ---: | ---: | ---: |\n");
  std::string csv = "policy,budget,metric,value,lo,hi,n\n";
  for (const auto& r : rows) {
    std::string depths;
    for (std::size_t d = 0; d < kNumDepths; ++d) depths += fmt::format("{}{:.2f}", d ? " / " : "", r.passkey_depth[d].value);
    fmt::print("| {} | {} | {} | {} | {} | {:.3f} ± {:.3f} | {:.3f} | {:.1f} | {:.3f} | {} |\n", r.policy,
               r.budget > 0 ? std::to_string(r.budget) : r.budget < 0 ? "gated" : "all", pct(r.passkey), depths, pct(r.recall), r.repeat_loss.value,
               r.repeat_loss.hi - r.repeat_loss.value, r.agreement.value, r.divergence, r.perplexity, r.peak_kv);
    auto put = [&](const std::string& metric, const Interval& i) {
      csv += fmt::format("{},{},{},{:.4f},{:.4f},{:.4f},{}\n", r.policy, r.budget, metric, i.value, i.lo, i.hi, i.n);
    };
    put("passkey", r.passkey);
    for (std::size_t d = 0; d < kNumDepths; ++d) put(fmt::format("passkey@{:.1f}", kDepths[d]), r.passkey_depth[d]);
    put("recall", r.recall);
    put("repeat_loss", r.repeat_loss);
    put("agreement", r.agreement);
    put("perplexity", {r.perplexity, r.perplexity, r.perplexity, 1});
    put("peak_kv", {double(r.peak_kv), double(r.peak_kv), double(r.peak_kv), 1});
  }
  if (!figures.empty()) {
    fmt::print(
        "\nWrite-Gated KV (W = {} tokens per head, tau = {:g}): peak KV is the tokens a request's heads hold "
        "divided by layers x kv-heads; keys read per decode query and kv-head, against the dense cache's. "
        "Composed rows: + quest 64 reads each head row's ring and at most 64 of its global tokens (4 pages, the first "
        "and last among them; layer 0 dense); + h2o 128 keeps each head's 128 heaviest admitted tokens.\n\n"
        "| gates | admitted (of tokens leaving the ring) | peak KV | keys read per decode query | dense | ratio |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: |\n",
        gate_sets[0].window, gate_sets[0].tau);
    for (std::size_t j = 0; j < figures.size(); ++j)
      fmt::print("| {} | {:.3f} | {} | {:.1f} | {:.1f} | {:.2f} |\n", gated[j].policy.substr(6), figures[j].admitted,
                 gated[j].peak_kv, figures[j].keys_per_query, figures[j].dense_keys_per_query,
                 figures[j].keys_per_query / figures[j].dense_keys_per_query);
  }
  fmt::print(
      "\nPage selection (Quest, first layer dense, first and last pages always read): keys read per decode query "
      "and kv-head, averaged over all layers and over the sparse ones, against the dense read of the same tokens.\n\n"
      "| policy | budget | keys read per decode query | in sparse layers | dense | ratio |\n"
      "| --- | ---: | ---: | ---: | ---: | ---: |\n");
  for (const auto& r : rows)
    if (r.budget == 0 || r.policy == "quest") {
      const double n = double(std::max<std::int64_t>(1, r.keys.reads));
      const std::string sparse =
          r.keys.sparse_reads > 0 ? fmt::format("{:.1f}", double(r.keys.sparse_read) / double(r.keys.sparse_reads)) : "-";
      fmt::print("| {} | {} | {:.1f} | {} | {:.1f} | {:.2f} |\n", r.policy, r.budget > 0 ? std::to_string(r.budget) : "all",
                 double(r.keys.read) / n, sparse, double(r.keys.dense) / n,
                 double(r.keys.read) / double(std::max<std::int64_t>(1, r.keys.dense)));
    }
  fmt::print(
      "\nIntervals: 95 %, Wilson for accuracies (n = samples), normal for the mean loss. Agreement counts tokens, "
      "which are not independent: read it with the tokens before the first divergence.\n");
  if (!out_dir.empty()) std::ofstream(out_dir + "/eval.csv") << csv;
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "kvcache_eval: {}\n", e.what());
  return 1;
}
