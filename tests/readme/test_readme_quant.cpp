// The quantized-KV page's snippet (docs/quantization.md), run in a fixture
// that supplies a key row with an outlier channel, then checked: the sizes
// it states, the row it reads back, and the copy that moved codes and scales.
#include <catch2/catch.hpp>

#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kernels/quant.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace kv = kvcache;
using std::int64_t;
using std::size_t;

namespace {
struct QuantPage {
  std::vector<float> key;
  QuantPage() {
    for (int i = 0; i < 128; ++i) key.push_back(std::sin(float(i)) * (i == 77 ? 30.0f : 1.0f));
  }
};
}  // namespace

TEST_CASE_METHOD(QuantPage, "docs quantization: an int8 grouped pool, a row quantized and read back, a block copied") {
#include "snippets/kv_format.inc"
  REQUIRE(copied.ok());
  // K entries: 4 groups x (f16 scale + f16 minimum); V's are smaller, planes take K's size.
  CHECK(g->group_bytes_per_row(0) == 16);
  CHECK(g->group_bytes_per_row(1) == 8);
  CHECK(g->plane_bytes() == 16 * 8 * 128 + 16 * 8 * 16);
  CHECK(per_token == 2 * 2 * 8 * (128 + 16));
  // Every value comes back within half a step of its group's code.
  for (int grp = 0; grp < 4; ++grp) {
    const auto first = key.begin() + grp * 32;
    const auto [lo, hi] = std::minmax_element(first, first + 32);
    const float step = (*hi - *lo) / 255.0f;
    for (int i = grp * 32; i < grp * 32 + 32; ++i) CHECK(std::fabs(back[size_t(i)] - key[size_t(i)]) <= step * 0.51f);
  }
  // Block 6 holds block 3's codes and scales: it reads back the same row.
  std::vector<float> from6(128);
  const std::byte* plane6 = view.row(6, 1, 0, 0, 0);
  kv::quant::dequantize_row(view.row(6, 1, 0, 5, 2), plane6 + g->group_entries_offset(0, 5, 2), 128, kv::DType::int8,
                            g->side(0), from6.data());
  CHECK(from6 == back);
  CHECK(std::memcmp(view.row(6, 0, 0, 0, 0), view.row(3, 0, 0, 0, 0), size_t(g->block_bytes())) == 0);
}
