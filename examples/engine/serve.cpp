// kvcache_serve: serves one workload (the held-out text's requests, as the
// demo cuts them) with one named policy, and writes what the engine did as
// JSON: every request's prompt, greedy output and the logits each output
// token was chosen from, and the engine's statistics. The Python example
// engine (examples/python/) is tested against this output.
//
//   kvcache_serve [--policy NAME] [--budget TOKENS] [--requests N] [--prompt TOKENS] [--new TOKENS]
//                 [--pool TOKENS] [--chunk TOKENS] [--batch N] [--block TOKENS] [--optimistic]
//                 [--window TOKENS] [--kv-format NAME] [--json FILE]
//                 [--model FILE] [--prompts FILE] [--reference]
// --window: the hybrid engine (odd layers a sliding window of that many tokens, one pool; keep_all, or
//           sink_window or block_scores on the even, full layers).
// --kv-format: how the pool stores K/V (kv_formats.hpp: f32, the default, f16, fp8_e4m3_tensor,
//              fp8_e4m3_head, int8_g32, ...); a calibrated format's scales come from the held-out
//              text's last context window. int2_kivi (KIVI's keys per channel) sets blocks of 32;
//              a different --block is refused.
// --model: the weights (default: the shipped tiny model), or a Llama in a GGUF file (gguf.hpp:
//          SmolLM2-135M-Instruct, which `scripts/models` installs; pretrained.py's gguf_path finds it).
// --prompts: the requests' prompts as token ids, one prompt a line (a GGUF model has no tokenizer
//            here: examples/python/pretrained.py tokenizes); --requests and --prompt are then unused.
// --reference: after serving, each request's prompt and output again in one dense forward pass with
//              no cache (a buffer of the pass's own K/V): prints, and writes to the JSON, the largest
//              difference from the engine's logits and whether every output is its argmax.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "forward.hpp"
#include "gguf.hpp"
#include "kv_formats.hpp"
#include "kv_store.hpp"
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

// One prompt a line, token ids separated by spaces; each id must be in the vocabulary.
std::vector<engine::Request> read_prompts(const std::string& path, std::int32_t vocab, std::int32_t max_new) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error("cannot open " + path);
  std::vector<engine::Request> reqs;
  for (std::string line; std::getline(f, line);) {
    engine::Request r;
    r.id = std::int32_t(reqs.size());
    r.priority = r.id % 3;
    r.max_new = max_new;
    std::istringstream in(line);
    for (long long t; in >> t;) {
      if (t < 0 || t >= vocab)
        throw std::runtime_error(fmt::format("{}: line {}: token {} (the vocabulary has {})", path, r.id + 1, t, vocab));
      r.prompt.push_back(std::int32_t(t));
    }
    if (!in.eof()) throw std::runtime_error(fmt::format("{}: line {}: not a token id list", path, r.id + 1));
    if (!r.prompt.empty()) reqs.push_back(std::move(r));
  }
  if (reqs.empty()) throw std::runtime_error(path + ": no prompts");
  return reqs;
}

// The dense reference: prompt + output (less the last) in one pass, no cache. Per request: the largest
// |engine logit - reference logit| over its outputs, and whether every output is the reference's argmax.
std::vector<std::pair<double, bool>> check_reference(const engine::Model& model, const engine::Served& s) {
  const std::int32_t vocab = model.config().vocab;
  std::vector<std::pair<double, bool>> out;
  engine::Forward fwd(model);  // once: it transposes every weight matrix
  for (const auto& r : s.reqs) {
    std::vector<std::int32_t> seq = r.prompt;
    seq.insert(seq.end(), r.output.begin(), r.output.end() - 1);
    engine::ContiguousKv store(model.config(), std::int32_t(seq.size()));
    std::vector<float> logits;
    fwd.run(store, seq, 0, logits, false);
    double worst = 0.0;
    bool greedy = true;
    for (std::size_t j = 0; j < r.output.size(); ++j) {
      const float* want = &logits[(r.prompt.size() - 1 + j) * std::size_t(vocab)];
      const float* got = &r.logits[j * std::size_t(vocab)];
      for (std::int32_t v = 0; v < vocab; ++v) worst = std::max(worst, double(std::fabs(got[v] - want[v])));
      greedy = greedy && std::max_element(want, want + vocab) - want == r.output[j];
    }
    out.emplace_back(worst, greedy);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) try {
  std::string policy = "keep_all", json, kv_format = "f32", model_path = std::string(ENGINE_MODEL_DIR) + "/kjv-tiny.bin",
              prompts;
  std::map<std::string, std::int32_t> num{{"--budget", 256}, {"--requests", 4}, {"--prompt", 512}, {"--new", 128},
                                          {"--pool", 8192},  {"--chunk", 64},   {"--batch", 8},    {"--block", 16}};
  bool optimistic = false, reference = false;
  std::int32_t window = 0;
  const auto usage = [&] {
    fmt::print(stderr,
               "usage: {} [--policy NAME] [--budget N] [--requests N] [--prompt N] [--new N] [--pool TOKENS] "
               "[--chunk N] [--batch N] [--block N] [--optimistic] [--window N] [--kv-format NAME] [--json FILE] "
               "[--model FILE] [--prompts FILE] [--reference]\n",
               argv[0]);
    return 2;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--optimistic" || a == "--reference") {
      (a == "--optimistic" ? optimistic : reference) = true;
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
    } else if (a == "--model") {
      model_path = v;
    } else if (a == "--prompts") {
      prompts = v;
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
  const engine::Model model = engine::load_model(model_path);
  if (prompts.empty() && model.config().vocab != 256)  // the held-out text is bytes: the tiny model's tokens
    return fmt::print(stderr, "--model {}: a vocabulary of {} tokens; give --prompts (token ids)\n", model_path,
                      model.config().vocab),
           2;
  const auto reqs = prompts.empty() ? engine::workload(engine::heldout(), num["--requests"], num["--prompt"], num["--new"])
                                    : read_prompts(prompts, model.config().vocab, num["--new"]);
  // A calibrated format's window: the held-out text, or the prompts (the model's own tokens).
  std::vector<std::int32_t> heldout = engine::heldout();
  if (!prompts.empty()) {
    heldout.clear();
    for (const auto& r : reqs) heldout.insert(heldout.end(), r.prompt.begin(), r.prompt.end());
  }
  const engine::EngineConfig cfg0 =
      engine::with_kv_format({.max_kv_tokens = num["--pool"],
                              .block_size = num["--block"],
                              .chunk = num["--chunk"],
                              .max_batch = num["--batch"],
                              .optimistic = optimistic,
                              .keep_logits = true},
                             format, model, engine::calibration_window(heldout, model.config().context));
  std::string text;
  const auto check = [&](const engine::Served& served) {
    if (!reference) return;
    const auto found = check_reference(model, served);
    std::string field = ",\n \"reference\": [";
    for (std::size_t i = 0; i < found.size(); ++i) {
      fmt::print("request {}: the dense reference's logits within {:.3g}, greedy tokens {}\n", i, found[i].first,
                 found[i].second ? "equal" : "DIFFERENT");
      field += fmt::format("{}{{\"max_logit_diff\": {}, \"greedy_equal\": {}}}", i ? ", " : "", found[i].first,
                           found[i].second);
    }
    text.insert(text.size() - 2, field + "]");  // before the closing "}\n"
  };
  if (window > 0) {  // the hybrid engine: keep-all, or a block policy on the full layers
    if (policy != "keep_all" && policy != "sink_window" && policy != "block_scores")
      return fmt::print(stderr, "--window: the hybrid engine runs keep_all, sink_window or block_scores, not {}\n", policy), 2;
    engine::with(policy, num["--budget"], model.config(), cfg0, [&](auto p, engine::EngineConfig cfg) {
      using P = decltype(p);
      if constexpr (std::is_same_v<P, kvcache::KeepAll> || std::is_same_v<P, kvcache::SinkWindowEviction> ||
                    std::is_same_v<P, kvcache::BlockScoreEviction>) {
        cfg.layer_streams = false;  // the full layers' group is one stream
        const auto served = engine::serve_hybrid(model, cfg, reqs, window, p);
        fmt::print("hybrid, window {}, {} at {} on the full layers: {} steps, {} tokens generated, high-water {} tokens "
                   "({:.0f} tokens/s)\n",
                   window, policy, num["--budget"], served.stats.steps, served.stats.tokens_generated,
                   served.stats.kv_high_water, served.tokens_per_second());
        text = to_json(served, policy, num["--budget"], kv_format, cfg.kv_scales);
        check(served);
      }
    });
  } else {
    engine::with(policy, num["--budget"], model.config(), cfg0, [&](auto p, const engine::EngineConfig& cfg) {
      const auto served = engine::serve(model, p, cfg, reqs);
      fmt::print(
          "{} at {}, KV {}: {} steps, {} tokens generated, {} preemptions, {} re-prefilled, high-water {} tokens "
          "({:.0f} tokens/s)\n",
          policy, num["--budget"], kv_format, served.stats.steps, served.stats.tokens_generated, served.stats.preemptions,
          served.stats.reprefilled, served.stats.kv_high_water, served.tokens_per_second());
      text = to_json(served, policy, num["--budget"], kv_format, cfg.kv_scales);
      check(served);
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
