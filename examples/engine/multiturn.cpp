// kvcache_multiturn: multi-turn conversations whose working set exceeds the
// device pool but fits a host tier, served by the tiered engine (tiered.hpp)
// with each write policy and without a host tier (recompute what the device
// forgot). Prints time to first token, tokens/s, where the prompt tokens came
// from, the bytes moved each way, and whether every mode generated the same
// tokens as recompute. Then the same conversations on a hybrid model (the
// odd layers a sliding window of --window tokens; tiered_hybrid.hpp), with
// and without a host tier under its one pool of pages.
//
//   kvcache_multiturn [--conversations N] [--turns N] [--first TOKENS] [--user TOKENS] [--new TOKENS]
//                     [--device BLOCKS] [--host BLOCKS] [--block TOKENS] [--chunk TOKENS] [--window TOKENS]
//                     [--json FILE]
// --json: each mode's generated tokens and statistics, the full-attention
// modes and the hybrid ones ("hybrid_recompute", "hybrid_host")
// (examples/python/tiered.py writes the same, and
// python/tests/test_tiered_engine.py compares them).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "serving.hpp"
#include "tiered.hpp"
#include "tiered_hybrid.hpp"

int main(int argc, char** argv) try {
  std::map<std::string, std::int32_t> num{{"--conversations", 8}, {"--turns", 4},  {"--first", 192}, {"--user", 48},
                                          {"--new", 32},           {"--device", 64}, {"--host", 512}, {"--block", 16},
                                          {"--chunk", 64},         {"--window", 64}};
  std::string json;
  for (int i = 1; i < argc; i += 2) {
    if (std::string(argv[i]) == "--json" && i + 1 < argc) {
      json = argv[i + 1];
      continue;
    }
    const auto it = num.find(argv[i]);
    std::size_t used = 0;
    std::int32_t x = 0;
    if (it != num.end() && i + 1 < argc) try {
        x = std::stoi(argv[i + 1], &used);
      } catch (const std::exception&) {
      }
    if (it == num.end() || i + 1 >= argc || used == 0 || argv[i + 1][used] != 0 || x <= 0) {
      fmt::print(stderr,
                 "usage: {} [--conversations N] [--turns N] [--first N] [--user N] [--new N] [--device BLOCKS] "
                 "[--host BLOCKS] [--block N] [--chunk N] [--window N] (positive integers) [--json FILE]\n",
                 argv[0]);
      return 2;
    }
    it->second = x;
  }
  const engine::Model model(std::string(ENGINE_MODEL_DIR) + "/kjv-tiny.bin");
  const engine::MultiTurn w{.conversations = num["--conversations"], .turns = num["--turns"], .first = num["--first"],
                            .user = num["--user"], .max_new = num["--new"]};
  const std::int32_t B = num["--block"];
  const std::int64_t longest = w.first + std::int64_t(w.turns - 1) * (w.user + w.max_new) + w.max_new;
  fmt::print("{} conversations x {} turns (prompts up to {} tokens); device pool {} blocks of {} tokens ({} tokens), "
             "host tier {} blocks; working set {} tokens\n\n",
             w.conversations, w.turns, longest - w.max_new, num["--device"], B, std::int64_t(num["--device"]) * B,
             num["--host"], longest * w.conversations);
  const auto text = engine::heldout();
  struct Mode {
    const char* name;
    const char* key;  // in the JSON
    std::int32_t host;
    kvcache::WriteMode write;
  };
  const Mode modes[] = {{"recompute (device only)", "recompute", 0, kvcache::WriteMode::write_back},
                        {"host tier, write-back", "write_back", num["--host"], kvcache::WriteMode::write_back},
                        {"host tier, write-through", "write_through", num["--host"], kvcache::WriteMode::write_through},
                        {"host tier, write-through reused", "write_through_reused", num["--host"],
                         kvcache::WriteMode::write_through_reused}};
  std::string text_json = "{";
  const auto header = [] {
    fmt::print("| {:<31} | {:>9} | {:>8} | {:>9} | {:>8} | {:>8} | {:>8} | {:>9} | {:>9} | {:>7} |\n", "mode", "TTFT ms",
               "TTFT x", "tokens/s", "device", "host", "computed", "offload", "onboard", "same");
    fmt::print("| {:-<31} | {:->9} | {:->8} | {:->9} | {:->8} | {:->8} | {:->8} | {:->9} | {:->9} | {:->7} |\n", "", "", "",
               "", "", "", "", "", "", "");
  };
  // One mode's generated tokens and statistics in the JSON.
  const auto add_json = [&](const char* key, const engine::MultiTurnRun& run) {
    const auto& s = run.stats;
    std::vector<std::string> outs;
    for (const auto& o : run.outputs) outs.push_back(fmt::format("[{}]", fmt::join(o, ", ")));
    text_json += fmt::format(
        "{}\n \"{}\": {{\"outputs\": [{}], \"stats\": {{\"turns\": {}, \"generated\": {}, \"prompt_tokens\": {}, "
        "\"device_hit_tokens\": {}, \"host_hit_tokens\": {}, \"computed_tokens\": {}, \"blocks_offloaded\": {}, "
        "\"blocks_onboarded\": {}}}}}",
        text_json.size() > 1 ? "," : "", key, fmt::join(outs, ", "), s.turns, s.generated, s.prompt_tokens,
        s.device_hit_tokens, s.host_hit_tokens, s.computed_tokens, s.blocks_offloaded, s.blocks_onboarded);
  };
  const auto mib = [](std::int64_t b) { return fmt::format("{:.1f} MiB", double(b) / (1 << 20)); };
  // One row: `run` against the first run of its table (`reference`, `base_ttft`).
  const auto row = [&](const char* name, const engine::MultiTurnRun& run, const std::vector<std::vector<std::int32_t>>& reference,
                       double base_ttft) {
    const auto& s = run.stats;
    std::int64_t same = 0;
    for (std::size_t i = 0; i < reference.size(); ++i) same += run.outputs[i] == reference[i];
    fmt::print("| {:<31} | {:>9.2f} | {:>8.2f} | {:>9.0f} | {:>8} | {:>8} | {:>8} | {:>9} | {:>9} | {:>3}/{:<3} |\n", name,
               s.mean_ttft_ms(), base_ttft / s.mean_ttft_ms(), s.tokens_per_second(), s.device_hit_tokens, s.host_hit_tokens,
               s.computed_tokens, mib(s.bytes_offloaded), mib(s.bytes_onboarded), same, reference.size());
  };
  header();
  std::vector<std::vector<std::int32_t>> reference;
  double base_ttft = 0.0;
  for (const Mode& mode : modes) {
    const engine::TieredConfig cfg{.device_blocks = num["--device"], .host_blocks = mode.host, .block_size = B,
                                   .chunk = num["--chunk"], .write = mode.write};
    const auto run = engine::serve_multiturn(model, cfg, text, w);
    if (reference.empty()) reference = run.outputs, base_ttft = run.stats.mean_ttft_ms();
    add_json(mode.key, run);
    row(mode.name, run, reference, base_ttft);
  }
  // The hybrid model: its own recompute is the reference (a window changes what the model generates).
  const std::int32_t W = num["--window"];
  fmt::print("\nHybrid: even layers full attention, odd layers a window of {} tokens, one pool of {} pages "
             "(each {} tokens of half the layers), host tier {} pages; the full group moves its whole prefix, the window "
             "group its last window\n\n",
             W, 2 * num["--device"], B, 2 * num["--host"]);
  header();
  std::vector<std::vector<std::int32_t>> hybrid_reference;
  double hybrid_ttft = 0.0;
  for (const std::int32_t host : {0, num["--host"]}) {
    engine::HybridTieredEngine e(model, {.device_blocks = num["--device"], .host_blocks = host, .block_size = B, .chunk = num["--chunk"]}, W);
    const auto run = engine::serve_multiturn_on(e, text, w);
    if (hybrid_reference.empty()) hybrid_reference = run.outputs, hybrid_ttft = run.stats.mean_ttft_ms();
    add_json(host == 0 ? "hybrid_recompute" : "hybrid_host", run);
    row(host == 0 ? "hybrid, recompute (device only)" : "hybrid, host tier (at finish)", run, hybrid_reference, hybrid_ttft);
  }
  fmt::print("\nTTFT x: recompute's mean time to first token over this mode's. device, host, computed: prompt tokens "
             "served from the device prefix cache, onboarded from host memory, and computed; same: turns whose "
             "generated tokens equal recompute's (the hybrid table: the hybrid model's recompute).\n");
  if (!json.empty()) {
    text_json += "\n}\n";
    std::FILE* f = std::fopen(json.c_str(), "w");
    if (!f || std::fputs(text_json.c_str(), f) < 0 || std::fclose(f) != 0)
      return fmt::print(stderr, "kvcache_multiturn: cannot write {}\n", json), 1;
  }
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "kvcache_multiturn: {}\n", e.what());
  return 1;
}
