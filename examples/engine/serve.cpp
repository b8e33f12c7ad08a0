// kvcache_serve: serves one workload (the held-out text's requests, as the
// demo cuts them) with one named policy, and writes what the engine did as
// JSON: every request's prompt, greedy output and the logits each output
// token was chosen from, and the engine's statistics. The Python example
// engine (examples/python/) is tested against this output.
//
//   kvcache_serve [--policy NAME] [--budget TOKENS] [--requests N] [--prompt TOKENS] [--new TOKENS]
//                 [--pool TOKENS] [--chunk TOKENS] [--batch N] [--block TOKENS] [--optimistic]
//                 [--window TOKENS] [--kv-format NAME] [--json FILE]
// --window: the hybrid engine (keep_all; odd layers a sliding window of that many tokens, one pool).
// --kv-format: how the pool stores K/V (kv_formats.hpp: f32, the default, f16, fp8_e4m3_tensor,
//              fp8_e4m3_head, int8_g32, ...); a calibrated format's scales come from the held-out
//              text's last context window. int2_kivi (KIVI's keys per channel) sets blocks of 32;
//              a different --block is refused.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "kv_formats.hpp"
#include "serving.hpp"

namespace {

// Floats print as the shortest text that reads back as the same float32.
// kv_scales: the engine-held scales the pool used (empty lists: none), so
// another engine can store with the same ones.
std::string to_json(const engine::Served& s, const std::string& policy, std::int32_t budget, const std::string& kv_format,
                    const engine::KvScales& scales) {
  const auto& st = s.stats;
  std::string out = fmt::format(
      "{{\"policy\": \"{}\", \"budget\": {}, \"kv_format\": \"{}\", \"kv_scales\": {{\"k\": [{}], \"v\": [{}]}}, "
      "\"stats\": {{\"steps\": {}, \"tokens_generated\": {}, "
      "\"preemptions\": {}, \"reprefilled\": {}, \"kv_high_water\": {}, \"max_batch\": {}}},\n \"requests\": [",
      policy, budget, kv_format, fmt::join(scales.k, ", "), fmt::join(scales.v, ", "), st.steps, st.tokens_generated,
      st.preemptions, st.reprefilled, st.kv_high_water, st.max_batch);
  for (std::size_t i = 0; i < s.reqs.size(); ++i) {
    const auto& r = s.reqs[i];
    out += fmt::format(
        "{}\n  {{\"id\": {}, \"priority\": {}, \"max_new\": {}, \"peak_kv\": {}, \"prompt\": [{}], \"output\": [{}], "
        "\"logits\": [{}]}}",
        i ? "," : "", r.id, r.priority, r.max_new, r.peak_kv, fmt::join(r.prompt, ", "), fmt::join(r.output, ", "),
        fmt::join(r.logits, ", "));
  }
  return out + "\n]}\n";
}

}  // namespace

int main(int argc, char** argv) try {
  std::string policy = "keep_all", json, kv_format = "f32";
  std::map<std::string, std::int32_t> num{{"--budget", 256}, {"--requests", 4}, {"--prompt", 512}, {"--new", 128},
                                          {"--pool", 8192},  {"--chunk", 64},   {"--batch", 8},    {"--block", 16}};
  bool optimistic = false;
  std::int32_t window = 0;
  const auto usage = [&] {
    fmt::print(stderr,
               "usage: {} [--policy NAME] [--budget N] [--requests N] [--prompt N] [--new N] [--pool TOKENS] "
               "[--chunk N] [--batch N] [--block N] [--optimistic] [--window N] [--kv-format NAME] [--json FILE]\n",
               argv[0]);
    return 2;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--optimistic") {
      optimistic = true;
      continue;
    }
    if (i + 1 >= argc) return fmt::print(stderr, "{} needs a value\n", a), 2;
    const std::string v = argv[++i];
    if (a == "--policy") {
      policy = v;
    } else if (a == "--json") {
      json = v;
    } else if (a == "--kv-format") {
      kv_format = v;
    } else if (a == "--window") {
      std::size_t used = 0;
      try {
        window = std::stoi(v, &used);
      } catch (const std::exception&) {
      }
      if (used == 0 || used != v.size() || window <= 0)
        return fmt::print(stderr, "--window needs a positive token count, got '{}'\n", v), 2;
    } else if (auto it = num.find(a); it != num.end()) {
      std::size_t used = 0;
      std::int32_t x = 0;
      try {
        x = std::stoi(v, &used);
      } catch (const std::exception&) {
      }
      if (used == 0 || used != v.size() || x <= 0)
        return fmt::print(stderr, "{} needs a positive integer, got '{}'\n", a, v), 2;
      it->second = x;
    } else {
      return usage();
    }
  }
  if (const std::int32_t shortest = num["--prompt"] - 32 * std::min(3, num["--requests"] - 1); shortest <= 0)
    return fmt::print(stderr, "--prompt {}: request {} would get {} tokens (prompts are cut 32 shorter in turn)\n",
                      num["--prompt"], std::min(3, num["--requests"] - 1), shortest),
           2;
  const engine::NamedKvFormat& format = engine::kv_format_named(kv_format);  // a bad name fails before the model loads
  bool block_given = false;
  for (int i = 1; i < argc; ++i) block_given = block_given || std::string(argv[i]) == "--block";
  if (format.block_size > 0 && block_given && num["--block"] != format.block_size)
    return fmt::print(stderr, "--block {}: {} groups keys over blocks of {}\n", num["--block"], kv_format, format.block_size), 2;
  if (window > 0 && kv_format != "f32") return fmt::print(stderr, "--window: the hybrid engine stores f32\n"), 2;
  const engine::Model model(std::string(ENGINE_MODEL_DIR) + "/kjv-tiny.bin");
  const auto heldout = engine::heldout();
  const engine::EngineConfig cfg0 =
      engine::with_kv_format({.max_kv_tokens = num["--pool"],
                              .block_size = num["--block"],
                              .chunk = num["--chunk"],
                              .max_batch = num["--batch"],
                              .optimistic = optimistic,
                              .keep_logits = true},
                             format, model, engine::calibration_window(heldout, model.config().context));
  const auto reqs = engine::workload(heldout, num["--requests"], num["--prompt"], num["--new"]);
  std::string text;
  if (window > 0) {  // the hybrid engine: keep-all over layer groups
    if (policy != "keep_all") return fmt::print(stderr, "--window: the hybrid engine runs keep_all\n"), 2;
    const auto served = engine::serve_hybrid(model, cfg0, reqs, window);
    fmt::print("hybrid, window {}: {} steps, {} tokens generated, high-water {} tokens ({:.0f} tokens/s)\n", window,
               served.stats.steps, served.stats.tokens_generated, served.stats.kv_high_water, served.tokens_per_second());
    text = to_json(served, policy, num["--budget"], kv_format, cfg0.kv_scales);
  } else {
    engine::with(policy, num["--budget"], model.config(), cfg0, [&](auto p, const engine::EngineConfig& cfg) {
      const auto served = engine::serve(model, p, cfg, reqs);
      fmt::print(
          "{} at {}, KV {}: {} steps, {} tokens generated, {} preemptions, {} re-prefilled, high-water {} tokens "
          "({:.0f} tokens/s)\n",
          policy, num["--budget"], kv_format, served.stats.steps, served.stats.tokens_generated, served.stats.preemptions,
          served.stats.reprefilled, served.stats.kv_high_water, served.tokens_per_second());
      text = to_json(served, policy, num["--budget"], kv_format, cfg.kv_scales);
    });
  }
  if (!json.empty()) {
    std::FILE* f = std::fopen(json.c_str(), "w");
    if (!f || std::fputs(text.c_str(), f) < 0 || std::fclose(f) != 0)
      return fmt::print(stderr, "kvcache_serve: cannot write {}\n", json), 1;
  }
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "kvcache_serve: {}\n", e.what());
  return 1;
}
