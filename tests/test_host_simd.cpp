// The host's AVX2 row conversions (kernels/host_simd.hpp) against the
// scalar element conversions they replace: every 8- and 16-bit input code,
// random float bit patterns (NaNs, infinities, subnormals included), every
// whole-byte type pair, several multipliers, and row lengths that leave a
// scalar tail. Bits must be equal, NaN payloads included. On a CPU without
// AVX2 move_row runs the scalar loop and the comparison still holds.
#include <catch2/catch.hpp>

#include <kvcache/kernels/common.hpp>
#include <kvcache/kernels/host_simd.hpp>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

using namespace kvcache;

namespace {
const DType kTypes[] = {DType::f32, DType::f16, DType::bf16, DType::fp8_e4m3, DType::fp8_e5m2, DType::int8};

// Inputs of type t: every code of an 8- or 16-bit type (each twice, so rows
// start at different codes), or random bit patterns plus specials for f32.
std::vector<std::uint8_t> inputs(DType t, std::mt19937_64& rng) {
  const std::int64_t b = dtype_bytes(t);
  std::vector<std::uint8_t> v;
  if (b < 4) {
    const std::uint32_t codes = 1u << (8 * b);
    for (int rep = 0; rep < 2; ++rep)
      for (std::uint32_t c = 0; c < codes; ++c) {
        const std::uint32_t code = rep == 0 ? c : codes - 1 - c;
        for (std::int64_t i = 0; i < b; ++i) v.push_back(static_cast<std::uint8_t>(code >> (8 * i)));
      }
    return v;
  }
  const std::uint32_t specials[] = {0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u, 0xffc12345u, 0x7fbfffffu,
                                    0x00000001u, 0x80000001u, 0x007fffffu, 0x477ff000u, 0x477fefffu, 0x43e00000u,
                                    0x4b400000u, 0x4a800000u, 0x42fe0000u, 0xc2ff0000u, 0x3f000000u, 0x33000000u};
  auto push = [&](std::uint32_t u) {
    for (int i = 0; i < 4; ++i) v.push_back(static_cast<std::uint8_t>(u >> (8 * i)));
  };
  for (std::uint32_t u : specials) push(u);
  for (int i = 0; i < 200000; ++i) {
    auto u = static_cast<std::uint32_t>(rng());
    // Half of them near the codes' ranges: exponents from 2^-30 to 2^20.
    if (i % 2) u = (u & 0x807fffffu) | ((97u + static_cast<std::uint32_t>(rng() % 51)) << 23);
    push(u);
  }
  return v;
}
}  // namespace

TEST_CASE("move_row's AVX2 loops give the scalar conversions' bits, for every whole-byte type pair") {
  std::mt19937_64 rng(Catch::rngSeed() + 101);
  // Read through a volatile: a multiplier the compiler cannot see (it may drop a multiply by a known 1).
  volatile float muls[] = {1.0f, 0.375f, 3.1f, 1.0f / 448.0f, 20.0f / 127.0f};
  for (DType st : kTypes) {
    const std::vector<std::uint8_t> in = inputs(st, rng);
    const auto n = static_cast<std::int32_t>(in.size() / static_cast<std::size_t>(dtype_bytes(st)));
    for (DType dt : kTypes)
      for (std::size_t m = 0; m < std::size(muls); ++m) {
        const float mul = muls[m];
        if (raw_move(dt, st, mul)) continue;  // a copy, not a conversion
        CAPTURE(static_cast<int>(st), static_cast<int>(dt), mul);
        std::vector<std::uint8_t> want(static_cast<std::size_t>(row_bytes(dt, n))), got(want.size(), 0xa5);
        for (std::int32_t i = 0; i < n; ++i) store_elem(dt, want.data(), i, load_elem(st, in.data(), i) * mul);
        // Rows of several lengths: 32-element blocks, 8-element steps and a scalar tail.
        for (std::int32_t len : {n, 8, 40, 77, 1000}) {
          std::fill(got.begin(), got.end(), 0xa5);
          for (std::int32_t at = 0; at < n; at += len) {
            const std::int32_t k = n - at < len ? n - at : len;
            move_row(got.data() + row_bytes(dt, at), dt, in.data() + row_bytes(st, at), st, k, mul, 0, 1);
          }
          CAPTURE(len);
          REQUIRE(std::memcmp(got.data(), want.data(), got.size()) == 0);
        }
        // When the CPU has AVX2 the vector loop did the work (not the scalar fallback).
        if (simd::available()) REQUIRE(simd::move_rows(got.data(), dt, in.data(), st, 77, mul) == 72);
      }
  }
}

TEST_CASE("move_rows leaves packed types and short rows to the scalar loop") {
  std::vector<std::uint8_t> a(64), b(64);
  CHECK(simd::move_rows(a.data(), DType::int4, b.data(), DType::f16, 32, 1.0f) == 0);
  CHECK(simd::move_rows(a.data(), DType::f16, b.data(), DType::int2, 32, 1.0f) == 0);
  CHECK(simd::move_rows(a.data(), DType::int8, b.data(), DType::f16, 7, 1.0f) == 0);
  CHECK(std::all_of(a.begin(), a.end(), [](std::uint8_t x) { return x == 0; }));
}
