// The quantized-KV page's snippet (docs/quantization.md), run in a fixture
// that supplies one token's keys (an outlier channel per head) and values,
// then checked: the sizes it states, the token read back within half a code
// step of each group, and the copy that moved codes and scales.
#include <catch2/catch.hpp>

#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kernels/gather.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kernels/seal.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace kv = kvcache;
using std::int32_t;
using std::int64_t;
using std::size_t;

namespace {
struct QuantPage {
  std::vector<float> key, value;
  QuantPage() {
    for (int i = 0; i < 8 * 128; ++i) {
      key.push_back(std::sin(float(i)) * (i % 128 == 77 ? 30.0f : 1.0f));
      value.push_back(std::cos(float(i) * 0.37f));
    }
  }
};
// Every value of each group of 32 within half a code step: 255 steps over the range with a minimum, else 127 over the magnitude.
void check_groups(const float* x, const float* y, bool minimum) {
  for (int grp = 0; grp < 8 * 128 / 32; ++grp) {
    const auto [lo, hi] = std::minmax_element(x + grp * 32, x + grp * 32 + 32);
    const float step = minimum ? (*hi - *lo) / 255.0f : std::max(std::fabs(*lo), std::fabs(*hi)) / 127.0f;
    for (int i = grp * 32; i < grp * 32 + 32; ++i) CHECK(std::fabs(y[i] - x[i]) <= step * 0.51f);
  }
}
}  // namespace

TEST_CASE_METHOD(QuantPage, "docs quantization: a token written quantized, its block copied, read back dequantized") {
#include "snippets/kv_format.inc"
  REQUIRE(wrote.ok());
  REQUIRE(copied.ok());
  REQUIRE(read.ok());
  // K entries: 4 groups x (f16 scale + f16 minimum); V's are smaller, planes take K's size.
  CHECK(g->group_bytes_per_row(0) == 16);
  CHECK(g->group_bytes_per_row(1) == 8);
  CHECK(g->plane_bytes() == 16 * 8 * 128 + 16 * 8 * 16);
  CHECK(per_token == 2 * 2 * 8 * (128 + 16));
  check_groups(key.data(), k_back.data() + 5 * 8 * 128, true);
  check_groups(value.data(), v_back.data() + 5 * 8 * 128, false);
  CHECK(std::memcmp(view.row(6, 0, 0, 0, 0), view.row(3, 0, 0, 0, 0), size_t(g->block_bytes())) == 0);
}

namespace {
// A block of 32 tokens' keys with two outlier channels per head (30 times
// wider), and values, as the residual an engine kept in fp32.
struct KiviResidual {
  std::vector<float> residual_k, residual_v;
  KiviResidual() {
    for (int i = 0; i < 32 * 8 * 128; ++i) {
      const int d = i % 128;
      residual_k.push_back(std::sin(float(i) * 0.71f) * (d == 9 || d == 77 ? 30.0f : 1.0f) + 0.05f * float(d % 7));
      residual_v.push_back(std::cos(float(i) * 0.37f));
    }
  }
};
}  // namespace

TEST_CASE_METHOD(KiviResidual, "docs quantization: a KIVI block sealed from the residual, read back per channel") {
#include "snippets/channel_keys.inc"
  REQUIRE(sealed.ok());
  REQUIRE(read.ok());
  CHECK(per_token == 8 * 2 * (32 + 16));
  CHECK(g->plane_entry_bytes(0) == 8 * 128 * 4);
  // Each key within half a code step (a third of its channel's range over the block) of what was sealed.
  for (int h = 0; h < 8; ++h)
    for (int d = 0; d < 128; ++d) {
      float lo = 1e30f, hi = -1e30f;
      for (int t = 0; t < 32; ++t) lo = std::min(lo, residual_k[size_t((t * 8 + h) * 128 + d)]), hi = std::max(hi, residual_k[size_t((t * 8 + h) * 128 + d)]);
      for (int t = 0; t < 32; ++t) {
        const size_t at = size_t((t * 8 + h) * 128 + d);
        REQUIRE(std::fabs(k_back[at] - residual_k[at]) <= (hi - lo) / 3.0f * 0.51f + 1e-3f);
      }
    }
  // Values: groups of 32 along each row, 3 steps over the group's range.
  for (int grp = 0; grp < 32 * 8 * 128 / 32; ++grp) {
    const auto [lo, hi] = std::minmax_element(residual_v.begin() + grp * 32, residual_v.begin() + grp * 32 + 32);
    for (int i = grp * 32; i < grp * 32 + 32; ++i) REQUIRE(std::fabs(v_back[size_t(i)] - residual_v[size_t(i)]) <= (*hi - *lo) / 3.0f * 0.51f + 1e-3f);
  }
}
