// The memory-tiers page's snippet (docs/tiers.md), run in a fixture that
// supplies the engine's names (a prompt's block hashes, its device blocks,
// copies as the engine would make them), then checked against what it promises.
#include <catch2/catch.hpp>

#include <kvcache/tiers/tiers.hpp>

#include <cstdint>
#include <span>
#include <vector>

namespace kv = kvcache;
using std::int32_t;
using std::int64_t;

namespace {
struct TiersPage {
  std::vector<kv::BlockHash> hashes;
  std::vector<int32_t> device_blocks, new_blocks;
  int64_t prompt_tokens = 8 * 16 + 5;
  std::vector<std::uint64_t> device = std::vector<std::uint64_t>(64), host = std::vector<std::uint64_t>(4096);
  TiersPage() {
    for (int32_t i = 0; i < 8; ++i) {
      hashes.push_back({std::uint64_t(1000 + i), 7});
      device_blocks.push_back(1 + i);
      new_blocks.push_back(20 + i);
      device[std::size_t(1 + i)] = 0xabc0 + std::uint64_t(i);  // a block's content
    }
  }
  void copy_to_host(int32_t src, int32_t dst) { host[std::size_t(dst)] = device[std::size_t(src)]; }
  void copy_to_device(int32_t src, int32_t dst) { device[std::size_t(dst)] = host[std::size_t(src)]; }
};
}  // namespace

TEST_CASE_METHOD(TiersPage, "docs tiers: a finished request's blocks offloaded to host memory and onboarded on the next turn") {
#include "snippets/tiers.inc"
  CHECK(hit == kv::TierHits{.device = 0, .host = 8, .disk = 0});
  CHECK(landed == 8);
  for (int32_t i = 0; i < 8; ++i) CHECK(device[std::size_t(20 + i)] == 0xabc0 + std::uint64_t(i));
  CHECK(tiers.jobs_in_flight() == 0);
  CHECK(tiers.check_invariants().ok());
}
