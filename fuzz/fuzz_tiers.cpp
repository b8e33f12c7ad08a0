// libFuzzer target: host and disk tiers whose sizes and job limit the input
// chooses, then store and load plans, lookups, completions with failed moves
// in any order, and resets (tests/tiers_harness.hpp: every copy modelled,
// the invariants, failed calls and lookups changing nothing, every hash a
// tier serves sitting in a block that holds exactly it).
#include <kvcache/tiers/tiers.hpp>


#include "input.hpp"

#include "tiers_harness.hpp"

namespace kv = kvcache;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz_input::Bytes in{data, size};
  // Absent tiers too: no host tier (device only), no disk tier (a disk tier needs a host tier).
  const std::int32_t host = in.pick(17), disk = host > 0 ? in.pick(20) : 0;
  const kv::TiersConfig cfg{.host_blocks = host, .disk_blocks = disk, .block_size = 1 + in.pick(8), .max_jobs = 1 + in.pick(8)};
  const auto pick = [&in](std::int32_t n) { return in.pick(n); };
  const auto need = fuzz_input::need_for("fuzz_tiers");
  kvtest::TiersHarness<decltype(pick), decltype(need)> h(pick, need, cfg);
  for (int ops = 0; ops < 400 && in.n > 0; ++ops) h.step();
  return 0;
}
