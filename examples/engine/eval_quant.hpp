// kvcache_eval --quant: the fidelity of quantized KV. Each KV format the
// pool can store runs the full cache, the eviction policy that ranks first
// at half the context (H2O at 512) and Write-Gated KV (λ = 0.01), on the
// same work set; agreement is against the f32 full cache. Peak KV is given
// in tokens and in bytes (the format's bytes per token, from Geometry).
// Engine-held scales are 1, or calibrated (calibrate.hpp) on a window of
// text before the runs, as an engine without checkpoint scales does.
// Under Write-Gated KV, KIVI's rings stay in full precision (gated_kv.hpp).
#pragma once

#include <fmt/format.h>

#include <atomic>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "eval_runs.hpp"
#include "kv_formats.hpp"

namespace evalrun {

// Prints the table; gate_file is Write-Gated KV's λ = 0.01 gate set (skipped
// when empty); calibration: the window calibrated formats take their scales from.
inline void quant_study(const engine::Model& model, const engine::EngineConfig& cfg0, const Workset& w,
                        const std::vector<engine::Request>& full_outputs, const std::string& gate_file, std::int32_t threads,
                        std::span<const std::int32_t> calibration) {
  const auto& c = model.config();
  const auto& formats = engine::kv_formats();
  std::vector<engine::EngineConfig> cfgs;  // each format's, calibrated before the runs
  for (const auto& f : formats) cfgs.push_back(engine::with_kv_format(cfg0, f, model, calibration));
  struct Job {
    std::size_t format;
    int variant;  // 0: full cache, 1: h2o at half the context, 2: Write-Gated KV
  };
  std::vector<Job> jobs;
  for (std::size_t f = 0; f < formats.size(); ++f)
    for (int v = 0; v < (gate_file.empty() ? 2 : 3); ++v) jobs.push_back({f, v});
  std::vector<engine::GateSet> gates;
  if (!gate_file.empty()) gates.emplace_back(gate_file);
  std::vector<Row> rows(jobs.size());
  std::atomic<std::size_t> next{0};
  std::mutex progress;
  auto worker = [&] {
    for (std::size_t j; (j = next++) < jobs.size();) {
      const engine::NamedKvFormat& f = formats[jobs[j].format];
      const engine::EngineConfig& cfg = cfgs[jobs[j].format];
      if (jobs[j].variant == 0) {
        rows[j] = evaluate(model, kvcache::KeepAll{}, cfg, w, full_outputs);
        rows[j].policy = "full cache";
      } else if (jobs[j].variant == 1) {
        engine::with("h2o", c.context / 2, c, cfg, [&](auto policy, const engine::EngineConfig& adjusted) {
          rows[j] = evaluate(model, policy, adjusted, w, full_outputs);
        });
        rows[j].policy = fmt::format("h2o {}", c.context / 2);
      } else {
        GatedFigures fig;
        rows[j] = evaluate_gated(model, gates[0], w, full_outputs, fig, {}, kvcache::KeepAll{}, cfg);
        rows[j].policy = fmt::format("wg_kv λ={:g}", gates[0].lambda);
      }
      const std::lock_guard<std::mutex> lock(progress);
      fmt::print(stderr, "  {} / {}: {:.0f} s\n", f.label, rows[j].policy, rows[j].seconds);
    }
  };
  std::vector<std::thread> pool;
  for (std::int32_t t = 0; t < std::min<std::int32_t>(threads, std::int32_t(jobs.size())); ++t) pool.emplace_back(worker);
  for (auto& t : pool) t.join();

  fmt::print(
      "| KV format | bytes per token | policy | passkey | recall | repeated passage loss (nats/byte) | agreement "
      "| tokens before divergence | perplexity | peak KV (tokens) | peak KV (KiB) |\n"
      "| --- | ---: | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |\n");
  for (std::size_t j = 0; j < jobs.size(); ++j) {
    const engine::NamedKvFormat& f = formats[jobs[j].format];
    const std::int32_t block = cfgs[jobs[j].format].block_size;  // a format's own (KIVI's 32), or the engine's
    const auto g = kvcache::Geometry::make({.num_layers = c.layers, .num_kv_heads = c.kv_heads, .head_dim = c.head_dim(),
                                            .block_size = block, .dtype = f.dtype, .format = f.format});
    const std::int64_t per_token = g->block_bytes() / block;
    const Row& r = rows[j];
    fmt::print("| {} | {} | {} | {} | {} | {:.3f} ± {:.3f} | {:.3f} | {:.1f} | {:.3f} | {} | {:.1f} |\n", f.label, per_token,
               r.policy, pct(r.passkey), pct(r.recall), r.repeat_loss.value, r.repeat_loss.hi - r.repeat_loss.value,
               r.agreement.value, r.divergence, r.perplexity, r.peak_kv, double(r.peak_kv * per_token) / 1024.0);
  }
}

}  // namespace evalrun
