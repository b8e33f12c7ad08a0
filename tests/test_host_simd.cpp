// The host's AVX2 and AVX-512 row conversions (kernels/host/x86/avx2_rows.hpp,
// kernels/host/x86/avx512_rows.hpp) against the
// scalar element conversions they replace: every 8- and 16-bit input code,
// random float bit patterns (NaNs, infinities, subnormals included), every
// whole-byte type pair, several multipliers, and row lengths that leave a
// scalar tail. Bits must be equal, NaN payloads included. On a CPU without
// AVX2 move_row runs the scalar loop and the comparison still holds.
#include <catch2/catch.hpp>

#include <kvcache/kernels/detail/common.hpp>
#include <kvcache/kernels/host/groups.hpp>
#include <kvcache/kernels/host/rows.hpp>
#include <kvcache/kernels/host/x86/avx2_rows.hpp>
#include <kvcache/kernels/host/x86/avx512_rows.hpp>
#include <kvcache/kernels/host/x86/avx2_channels.hpp>
#include <kvcache/kernels/detail/quant.hpp>
#include <kvcache/kernels/detail/quant_rows.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
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

// The vector backends this CPU runs, each called alone, and how many
// elements of a row of n each should do.
struct Backend {
  const char* name;
  std::int32_t (*rows)(void*, DType, const void*, DType, std::int32_t, float, bool, bool);
  std::int32_t (*expect)(DType, DType, float, std::int32_t);
};
std::vector<Backend> backends() {
  std::vector<Backend> v;
#if KVCACHE_HOST_SIMD
  if (simd::available())
    v.push_back({"avx2", &simd::avx2::move_rows, [](DType, DType, float, std::int32_t n) { return n - n % 8; }});
#if !defined(KVCACHE_NO_AVX512)
  if (simd::avx512_available())
    v.push_back({"avx512", &simd::avx512::move_rows, [](DType dt, DType st, float mul, std::int32_t n) {
                   return simd::avx512::wide(dt, st, mul) ? n - n % 64 : 0;
                 }});
#endif
#endif
  return v;
}
}  // namespace

TEST_CASE("move_row's AVX2 and AVX-512 loops give the scalar conversions' bits, for every whole-byte type pair") {
  std::mt19937_64 rng(Catch::rngSeed() + 101);
  // Read through a volatile: a multiplier the compiler cannot see (it may drop a multiply by a known 1).
  // 1e36 overflows int8 codes to inf; inf makes a 0 code the default NaN
  // (int8 and e4m3 to fp16 skip their NaN select: see the next case). e4m3
  // codes read through fp16 take the multiplier times 256 where that is
  // exact: 1e36 does, 2e36 (past 2^120) falls back, and -0.375 and a
  // subnormal 1e-40 round products below the normal range.
  volatile float muls[] = {1.0f, 0.375f, 3.1f, 1.0f / 448.0f, 20.0f / 127.0f, 1e36f, std::numeric_limits<float>::infinity(),
                           2e36f, -0.375f, 1e-40f};
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
        // Streamed (non-temporal) rows: whole 64-byte lines from a line-aligned
        // start, and rows that are not (they fall back to cached stores).
        std::vector<std::uint8_t> buf(got.size() + 64);
        auto* line = buf.data() + (64 - reinterpret_cast<std::uintptr_t>(buf.data()) % 64) % 64;
        for (std::int32_t len : {64, 256, 40}) {
          std::fill(buf.begin(), buf.end(), 0xa5);
          for (std::int32_t at = 0; at < n; at += len) {
            const std::int32_t k = n - at < len ? n - at : len;
            if (len % 64 == 0 && k == len) REQUIRE(simd::streams_whole_lines(line + row_bytes(dt, at), dt, k));
            move_row(line + row_bytes(dt, at), dt, in.data() + row_bytes(st, at), st, k, mul, 0, 1, false, true);
          }
          stream_fence();
          CAPTURE(len);
          REQUIRE(std::memcmp(line, want.data(), want.size()) == 0);
        }
        // When the CPU has AVX2 the vector loop did the work (not the scalar fallback).
        if (simd::available()) REQUIRE(simd::move_rows(got.data(), dt, in.data(), st, 77, mul) == 72);
        // Each vector backend alone over the whole row, cached and streamed:
        // move_row runs the 512-bit loops on runs of 64 and the AVX2 loops on
        // what is left, so without this the AVX2 loops would see short rows only.
        for (const Backend& b : backends()) {
          for (bool stream : {false, true}) {
            CAPTURE(b.name, stream);
            std::fill(buf.begin(), buf.end(), 0xa5);
            const std::int32_t done = b.rows(line, dt, in.data(), st, n, mul, stream, false);
            stream_fence();
            REQUIRE(done == b.expect(dt, st, mul, n));
            move_row(line + row_bytes(dt, done), dt, in.data() + row_bytes(st, done), st, n - done, mul, 0, 1);
            REQUIRE(std::memcmp(line, want.data(), want.size()) == 0);
          }
        }
      }
  }
}

TEST_CASE("a write's division by its scale: every backend gives x / d's bits (vLLM's fp8(x / scale)), every float source") {
  // Issue 62: writes computed x * (1 / d), which differs from x / d near
  // rounding midpoints (x = 0x3ad734d6, d = 0.0731: vLLM's e4m3 0x0b,
  // kvcache's 0x0c). The 512-bit loops correct the product by its FMA
  // residual where that is exact, and divide elsewhere (a divisor outside
  // [2^-60, 2^60], a bf16 or f32 destination).
  std::mt19937_64 rng(Catch::rngSeed() + 307);
  volatile float divs[] = {0.0731f, 1.0f, 3.1f, 1.0f / 448.0f, 127.0f / 20.0f, 0.375f, 1e-30f, 0x1p70f, 2.5e-5f};
  {
    const float x = cvt::from_bits(0x3ad734d6u), d = divs[0];
    std::uint8_t q = 0;
    move_row(&q, DType::fp8_e4m3, &x, DType::f32, 1, d, 0, 1, false, false, true);
    CHECK(q == 0x0b);
    CHECK(q == cvt::f32_to_e4m3(x / d));
  }
  for (DType st : {DType::f32, DType::f16, DType::bf16}) {
    const std::vector<std::uint8_t> in = inputs(st, rng);
    const auto n = static_cast<std::int32_t>(in.size() / static_cast<std::size_t>(dtype_bytes(st)));
    for (DType dt : kTypes)
      for (std::size_t m = 0; m < std::size(divs); ++m) {
        const float d = divs[m];
        if (raw_move(dt, st, d)) continue;
        CAPTURE(static_cast<int>(st), static_cast<int>(dt), d);
        std::vector<std::uint8_t> want(static_cast<std::size_t>(row_bytes(dt, n))), got(want.size(), 0xa5);
        for (std::int32_t i = 0; i < n; ++i) store_elem(dt, want.data(), i, load_elem(st, in.data(), i) / d);
        for (std::int32_t len : {n, 8, 40, 77}) {
          std::fill(got.begin(), got.end(), 0xa5);
          for (std::int32_t at = 0; at < n; at += len) {
            const std::int32_t k = n - at < len ? n - at : len;
            move_row(got.data() + row_bytes(dt, at), dt, in.data() + row_bytes(st, at), st, k, d, 0, 1, false, false, true);
          }
          CAPTURE(len);
          REQUIRE(std::memcmp(got.data(), want.data(), got.size()) == 0);
        }
        for (const Backend& b : backends()) {
          CAPTURE(b.name);
          std::fill(got.begin(), got.end(), 0xa5);
          const std::int32_t done = b.rows(got.data(), dt, in.data(), st, n, d, false, true);
          move_row(got.data() + row_bytes(dt, done), dt, in.data() + row_bytes(st, done), st, n - done, d, 0, 1, false, false, true);
          REQUIRE(std::memcmp(got.data(), want.data(), got.size()) == 0);
        }
      }
  }
}

TEST_CASE("the FMA quotient of the 512-bit loops is x / d's code for every f16 and bf16 value and many divisors") {
  // Every 16-bit pattern (NaN, inf, subnormals included) by 400 divisors,
  // random over [2^-60, 2^60] and calibration-like (amax / 448): the codes
  // (e4m3, e5m2, int8, f16) are those of the correctly rounded quotient.
  std::mt19937_64 rng(Catch::rngSeed() + 401);
  std::vector<float> ds;
  for (int i = 0; i < 200; ++i) ds.push_back(std::ldexp(1.0f + float(rng() % 1000000) / 1e6f, int(rng() % 121) - 60));
  for (int i = 0; i < 200; ++i) ds.push_back((0.5f + float(rng() % 100000) / 1e4f) / 448.0f);
  for (DType st : {DType::f16, DType::bf16}) {
    std::vector<std::uint16_t> in(65536);
    for (std::uint32_t b = 0; b < 65536; ++b) in[b] = std::uint16_t(b);
    for (DType dt : {DType::fp8_e4m3, DType::fp8_e5m2, DType::int8, DType::f16})
      for (const float d : ds) {
        std::vector<std::uint8_t> want(static_cast<std::size_t>(row_bytes(dt, 65536))), got(want.size());
        for (std::int32_t i = 0; i < 65536; ++i) store_elem(dt, want.data(), i, load_elem(st, in.data(), i) / d);
        move_row(got.data(), dt, in.data(), st, 65536, d, 0, 1, false, false, true);
        if (std::memcmp(got.data(), want.data(), got.size()) != 0) {
          CAPTURE(static_cast<int>(st), static_cast<int>(dt), d);
          REQUIRE(std::memcmp(got.data(), want.data(), got.size()) == 0);
        }
      }
  }
}

TEST_CASE("int8 and e4m3 to fp16 keep the scalar code's NaN for a NaN multiplier with a payload") {
  // The launchers refuse a NaN scale; move_rows still gives the scalar bits.
  std::vector<std::uint8_t> in(512);  // 256 codes; the rest quiets g++'s bounds warning on move_row's (dead) copy path
  for (int i = 0; i < 256; ++i) in[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(i);
  volatile float nan = cvt::from_bits(0x7fa00001u);
  for (DType st : {DType::int8, DType::fp8_e4m3}) {
    CAPTURE(static_cast<int>(st));
    std::vector<std::uint16_t> want(256), got(256, 0xa5a5);
    for (std::int32_t i = 0; i < 256; ++i) store_elem(DType::f16, want.data(), i, load_elem(st, in.data(), i) * nan);
    move_row(got.data(), DType::f16, in.data(), st, 256, nan, 0, 1);
    CHECK(want[1] == 0x7e00);
    for (std::size_t i = 0; i < 256; ++i) {
      CAPTURE(i);
      // e4m3's NaN codes times a NaN: either operand's NaN, as the compiler
      // orders the multiply (clang and g++ differ), so only NaN-ness is defined.
      if (std::isnan(load_elem(st, in.data(), static_cast<std::int64_t>(i)))) CHECK((got[i] & 0x7fffu) > 0x7c00u);
      else CHECK(got[i] == want[i]);
    }
  }
}

#if KVCACHE_HOST_SIMD
namespace {
__attribute__((target("avx2,f16c"))) void e4m3_as_f16(const std::uint8_t* q, std::uint16_t* h) {
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(h), simd::avx2::e4m3_as_f16(_mm256_cvtepi8_epi16(codes)));
}
}  // namespace

TEST_CASE("e4m3 codes read through fp16 are their values times 2^-8, and the multiplier's range is where that is exact") {
  if (!simd::available()) return;
  // Every code: fp16 bits of the value times 2^-8 (NaN codes: sign | 0x7e00).
  alignas(32) std::uint8_t q[256];
  for (int i = 0; i < 256; ++i) q[i] = static_cast<std::uint8_t>(i);
  for (int at = 0; at < 256; at += 16) {
    alignas(32) std::uint16_t h[16];
    e4m3_as_f16(q + at, h);
    for (int j = 0; j < 16; ++j) {
      const float v = cvt::e4m3_to_f32(q[at + j]);
      CAPTURE(at + j);
      if (std::isnan(v)) CHECK(h[j] == ((q[at + j] & 0x80) << 8 | 0x7e00));
      else CHECK(cvt::f16_to_f32(h[j]) == std::ldexp(v, -8));
    }
  }
  CHECK(simd::avx2::e4m3_prescales(0x1.fffffep119f));
  CHECK_FALSE(simd::avx2::e4m3_prescales(0x1p120f));
  CHECK_FALSE(simd::avx2::e4m3_prescales(-0x1p120f));
  CHECK(simd::avx2::e4m3_prescales(-std::numeric_limits<float>::infinity()));
  CHECK(simd::avx2::e4m3_prescales(-0.0f));
  CHECK_FALSE(simd::avx2::e4m3_prescales(std::numeric_limits<float>::quiet_NaN()));
  CHECK(simd::avx2::e4m3_prescales(std::numeric_limits<float>::denorm_min()));
}
#endif

TEST_CASE("move_rows leaves packed types and short rows to the scalar loop") {
  std::vector<std::uint8_t> a(64), b(64);
  CHECK(simd::move_rows(a.data(), DType::int4, b.data(), DType::f16, 32, 1.0f) == 0);
  CHECK(simd::move_rows(a.data(), DType::f16, b.data(), DType::int2, 32, 1.0f) == 0);
  CHECK(simd::move_rows(a.data(), DType::int8, b.data(), DType::f16, 7, 1.0f) == 0);
  CHECK(std::all_of(a.begin(), a.end(), [](std::uint8_t x) { return x == 0; }));
}

TEST_CASE("rows stream only as whole lines from a line-aligned start, and a streamed copy is a copy") {
  alignas(64) std::uint8_t dst[320] = {}, src[320];
  for (int i = 0; i < 320; ++i) src[i] = static_cast<std::uint8_t>(i * 7 + 1);
  CHECK(simd::streams_whole_lines(dst, DType::int8, 64));
  CHECK(simd::streams_whole_lines(dst, DType::f16, 32));
  CHECK_FALSE(simd::streams_whole_lines(dst + 32, DType::int8, 64));  // not at a line
  CHECK_FALSE(simd::streams_whole_lines(dst, DType::int8, 32));       // half a line
  CHECK_FALSE(simd::streams_whole_lines(dst, DType::f32, 40));        // 160 bytes: a partial line
  CHECK_FALSE(simd::stream_copy(dst + 16, src, 256));
  CHECK_FALSE(simd::stream_copy(dst, src, 96));
  CHECK(std::all_of(std::begin(dst), std::end(dst), [](std::uint8_t x) { return x == 0; }));  // refused: nothing written
  if (simd::available()) {
    REQUIRE(simd::stream_copy(dst + 64, src + 3, 256));
    simd::stream_fence();
    CHECK(std::memcmp(dst + 64, src + 3, 256) == 0);
    CHECK(std::all_of(dst, dst + 64, [](std::uint8_t x) { return x == 0; }));
  }
  // move_row's raw path: a copy either way.
  alignas(64) std::uint8_t out[256] = {};
  move_row(out, DType::f16, src, DType::f16, 128, 1.0f, 0, 1, false, true);
  stream_fence();
  CHECK(std::memcmp(out, src, 256) == 0);
}

namespace {
// Group quantization written out with the scalar conversions only (no
// fast_rows, no fast_abs_max_bits): what quant::quantize_group stores.
void reference_quantize(const std::uint8_t* src, DType st, DType code, std::int32_t group, std::int32_t groups, float div,
                        std::uint8_t* codes, std::uint8_t* entries) {
  for (std::int32_t g = 0; g < groups; ++g) {
    std::vector<float> x(static_cast<std::size_t>(group));
    std::uint32_t m = 0;
    for (std::int32_t i = 0; i < group; ++i) {
      x[static_cast<std::size_t>(i)] = load_elem(st, src, std::int64_t{g} * group + i) / div;
      m = std::max(m, cvt::bits(x[static_cast<std::size_t>(i)]) & 0x7fffffffu);
    }
    const quant::GroupScale s = quant::group_scale(code, false, 0.0f, 0.0f, cvt::from_bits(m));
    const std::uint16_t e = cvt::f32_to_f16(s.scale);
    std::memcpy(entries + 2 * g, &e, 2);
    // The code rounds x / scale (x * 0 for a zero or NaN scale: a group of zeros, or one holding a NaN).
    for (std::int32_t i = 0; i < group; ++i) {
      const float v = x[static_cast<std::size_t>(i)];
      codes[g * group + i] = static_cast<std::uint8_t>(quant::encode(code, false, s.scale > 0.0f ? v / s.scale : v * 0.0f));
    }
  }
}
}  // namespace

TEST_CASE("the host's group loops give quantize_group's and dequantize_group's bits, every format") {
  std::mt19937_64 rng(Catch::rngSeed() + 211);
  // Writes divide by the call's scale (mul: what the source is divided by on
  // the way in, and multiplied by on the way out). A negative one, and ones
  // the 512-bit loops leave to the AVX2 ones (0, inf).
  volatile float muls[] = {1.0f, 0.375f, 1.0f / 3.0f, -0.375f, 0.0f, std::numeric_limits<float>::infinity(), 0.0731f};
  const DType floats[] = {DType::f32, DType::f16, DType::bf16};
  const std::uint32_t specials[] = {0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u, 0xffc12345u, 0x00000001u, 0x80000000u,
                                    0x477ff000u, 0x477fefffu, 0x7f7fffffu, 0xff7fffffu, 0x00800000u, 0x33800000u, 0xc7800000u};
  // Symmetric whole bytes (against reference_quantize, written out here),
  // with a minimum (int8, int4, int2) and symmetric packed codes (int4,
  // int2, fp4 with e4m3 scales), against the scalar quantize_group.
  const std::pair<DType, bool> formats[] = {{DType::int8, false}, {DType::fp8_e4m3, false}, {DType::fp8_e5m2, false},
                                            {DType::int8, true},  {DType::int4, true},      {DType::int2, true},
                                            {DType::int4, false}, {DType::int2, false},     {DType::fp4_e2m1, false}};
  for (DType st : floats)
    for (const auto& [code, minimum] : formats)
      for (std::int32_t group : {8, 16, 32, 64, 128})
        for (std::int32_t groups : {1, 3, 8, 9, 20}) {
          const std::int32_t n = group * groups;
          const bool whole = !minimum && dtype_bits(code) == 8;
          // Normal groups (one with an outlier, one shifted off zero, as a
          // minimum is for), all-equal ones, specials, tiny and huge ranges
          // (scales that round to subnormals or saturate), fp4's midpoints.
          std::vector<float> f(static_cast<std::size_t>(n));
          std::normal_distribution<float> normal(0.0f, 1.0f);
          for (std::int32_t g = 0; g < groups; ++g) {
            const auto kind = rng() % 7;
            const float range = kind == 3 ? 1e-9f : kind == 4 ? 1e9f : 1.0f;
            for (std::int32_t i = 0; i < group; ++i) {
              float v = kind == 1 ? 2.5f : normal(rng) * range + (kind == 5 ? 40.0f : 0.0f);
              if (kind == 0 && i == 5) v *= 40.0f;
              // fp4's midpoints, exact at scale 1 (a largest |value| of 6): each tie goes to the even code.
              constexpr float kTies[] = {6.0f, 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
              if (kind == 6) v = (rng() % 2 ? -1.0f : 1.0f) * kTies[i % 8];
              if (kind == 2 && rng() % 8 == 0) v = cvt::from_bits(specials[rng() % std::size(specials)]);
              f[static_cast<std::size_t>(g * group + i)] = v;
            }
          }
          std::vector<std::uint8_t> src(static_cast<std::size_t>(row_bytes(st, n)));
          for (std::int32_t i = 0; i < n; ++i) store_elem(st, src.data(), i, f[static_cast<std::size_t>(i)]);
          const std::int64_t entry_bytes = group_entry_bytes(code, {.scales = Scales::group, .group = group, .minimum = minimum});
          for (float mul : muls) {
            CAPTURE(static_cast<int>(st), static_cast<int>(code), minimum, group, groups, mul);
            std::vector<std::uint8_t> want_codes(static_cast<std::size_t>(row_bytes(code, n))),
                want_entries(static_cast<std::size_t>(entry_bytes * groups));
            std::vector<float> x(static_cast<std::size_t>(group));
            if (whole) {
              reference_quantize(src.data(), st, code, group, groups, mul, want_codes.data(), want_entries.data());
            } else {
              for (std::int32_t g = 0; g < groups; ++g) {
                for (std::int32_t i = 0; i < group; ++i) x[static_cast<std::size_t>(i)] = load_elem(st, src.data(), g * group + i) / mul;
                quant::quantize_group(x.data(), group, code, minimum, want_codes.data() + row_bytes(code, std::int64_t{g} * group),
                                      want_entries.data() + entry_bytes * g);
              }
            }
            std::vector<std::uint8_t> codes(want_codes.size(), 0xa5), entries(want_entries.size(), 0xa5);
            const bool fast = simd::available();
            REQUIRE(fast_quantize_groups(reinterpret_cast<std::byte*>(codes.data()), reinterpret_cast<std::byte*>(entries.data()),
                                         src.data(), st, code, minimum, group, groups, mul, quant::code_max(code, false)) == fast);
            if (!fast) continue;
            REQUIRE(codes == want_codes);
            REQUIRE(entries == want_entries);

            // Back, from these codes with random entry bits too (NaN, inf, subnormal scales and minima).
            for (int trial = 0; trial < 2; ++trial) {
              if (trial == 1)
                for (auto& b : entries) b = static_cast<std::uint8_t>(rng());
              const DType ot = st;
              std::vector<std::uint8_t> got(static_cast<std::size_t>(row_bytes(ot, n)), 0xa5), want(got.size());
              REQUIRE(fast_dequantize_groups(got.data(), ot, reinterpret_cast<const std::byte*>(codes.data()),
                                             reinterpret_cast<const std::byte*>(entries.data()), code, minimum, group, groups, mul));
              // nan_only: only NaN-ness is defined there. A NaN times a NaN
              // (or, with a minimum, a NaN scale plus a NaN minimum) is a
              // NaN whose sign and payload are either operand's, as the
              // compiler orders the operation.
              std::vector<std::uint8_t> nan_only(static_cast<std::size_t>(n), 0);
              for (std::int32_t g = 0; g < groups; ++g) {
                const std::uint8_t* c = codes.data() + row_bytes(code, std::int64_t{g} * group);
                const std::uint8_t* e = entries.data() + entry_bytes * g;
                if (whole) {  // (code * scale) * mul, written out
                  std::uint16_t h;
                  std::memcpy(&h, e, 2);
                  const float scale = cvt::f16_to_f32(h);
                  for (std::int32_t i = 0; i < group; ++i) {
                    const float cv = quant::load_code(code, false, c, i);
                    x[static_cast<std::size_t>(i)] = cv * scale;
                    nan_only[static_cast<std::size_t>(g * group + i)] = std::isnan(cv) && std::isnan(scale);
                  }
                } else {
                  quant::dequantize_group(c, e, group, code, minimum, x.data());
                  for (std::int32_t i = 0; i < group; ++i) nan_only[static_cast<std::size_t>(g * group + i)] = std::isnan(x[static_cast<std::size_t>(i)]);
                }
                for (std::int32_t i = 0; i < group; ++i) store_elem(ot, want.data(), g * group + i, x[static_cast<std::size_t>(i)] * mul);
              }
              for (std::int32_t at = 0; at < n; ++at) {
                CAPTURE(trial, at);
                if (nan_only[static_cast<std::size_t>(at)]) {
                  REQUIRE(std::isnan(load_elem(ot, got.data(), at)));
                  continue;
                }
                const auto eb = static_cast<std::size_t>(dtype_bytes(ot));
                REQUIRE(std::memcmp(got.data() + static_cast<std::size_t>(at) * eb, want.data() + static_cast<std::size_t>(at) * eb, eb) == 0);
              }
            }
          }
        }
}

TEST_CASE("the host's channel loops read a row back with load_channel_elem's bits, every code, minimum and output type") {
  std::mt19937_64 rng(Catch::rngSeed() + 307);
  // A negative multiplier, and ones the 512-bit loops leave to the AVX2 ones (0, inf).
  volatile float muls[] = {1.0f, 0.375f, 1.0f / 3.0f, -0.375f, 0.0f, std::numeric_limits<float>::infinity()};
  for (DType code : {DType::int8, DType::int4, DType::int2})
    for (bool minimum : {true, false})
      for (DType ot : {DType::f32, DType::f16, DType::bf16})
        for (std::int32_t n : {8, 16, 64, 136, 512}) {
          const SideFormat f{.scales = Scales::channel, .minimum = minimum};
          std::vector<std::uint8_t> codes(static_cast<std::size_t>(row_bytes(code, n))),
              entries(static_cast<std::size_t>(group_entry_bytes(code, f) * n));
          for (auto& b : codes) b = static_cast<std::uint8_t>(rng());
          for (int trial = 0; trial < 2; ++trial) {
            // Entries as a seal writes them (f16 scales and minima of real
            // ranges), then random bits (NaN, inf, subnormals).
            std::normal_distribution<float> normal(0.0f, 1.0f);
            for (std::size_t i = 0; i < entries.size(); i += 2) {
              const std::uint16_t h = trial == 0 ? cvt::f32_to_f16(normal(rng) * (i % 4 == 0 ? 0.1f : 3.0f))
                                                 : static_cast<std::uint16_t>(rng());
              std::memcpy(entries.data() + i, &h, 2);
            }
            for (float mul : muls) {
              CAPTURE(static_cast<int>(code), minimum, static_cast<int>(ot), n, trial, mul);
              std::vector<std::uint8_t> got(static_cast<std::size_t>(row_bytes(ot, n)), 0xa5), want(got.size());
              const auto* c = reinterpret_cast<const std::byte*>(codes.data());
              const auto* e = reinterpret_cast<const std::byte*>(entries.data());
              for (std::int32_t i = 0; i < n; ++i) store_elem(ot, want.data(), i, load_channel_elem(code, f, c, e, i) * mul);
              const bool fast = simd::available();
              REQUIRE(fast_dequantize_channels(got.data(), ot, c, e, code, minimum, n, mul) == fast);
              if (!fast) continue;
              for (std::int32_t i = 0; i < n; ++i) {
                CAPTURE(i);
                const float w = load_elem(ot, want.data(), i);
                if (std::isnan(w)) {  // a NaN scale plus a NaN minimum: either operand's payload
                  REQUIRE(std::isnan(load_elem(ot, got.data(), i)));
                  continue;
                }
                const auto eb = static_cast<std::size_t>(dtype_bytes(ot));
                REQUIRE(std::memcmp(got.data() + static_cast<std::size_t>(i) * eb, want.data() + static_cast<std::size_t>(i) * eb, eb) == 0);
              }
            }
          }
        }
  // Other codes, channel counts that are not a multiple of 8, 8-bit outputs: the scalar path.
  std::vector<std::byte> c(64), e(256);
  std::vector<float> out(64);
  CHECK_FALSE(fast_dequantize_channels(out.data(), DType::f32, c.data(), e.data(), DType::fp8_e4m3, false, 32, 1.0f));
  CHECK_FALSE(fast_dequantize_channels(out.data(), DType::f32, c.data(), e.data(), DType::int4, true, 12, 1.0f));
  CHECK_FALSE(fast_dequantize_channels(out.data(), DType::int8, c.data(), e.data(), DType::int4, true, 32, 1.0f));
}

TEST_CASE("the host's group loops leave fp8 with a minimum, odd groups and 8-bit callers to the scalar code") {
  std::vector<std::byte> c(64), e(8);
  std::vector<std::uint16_t> x(32, 0x3c00);
  CHECK_FALSE(fast_quantize_groups(c.data(), e.data(), x.data(), DType::f16, DType::fp4_e2m1, true, 16, 2, 1.0f, 6.0f));
  CHECK_FALSE(fast_quantize_groups(c.data(), e.data(), x.data(), DType::f16, DType::fp8_e4m3, true, 32, 1, 1.0f, 448.0f));
  CHECK_FALSE(fast_quantize_groups(c.data(), e.data(), x.data(), DType::f16, DType::int4, true, 12, 1, 1.0f, 15.0f));
  CHECK_FALSE(fast_quantize_groups(c.data(), e.data(), x.data(), DType::int8, DType::fp8_e4m3, false, 32, 1, 1.0f, 448.0f));
  CHECK_FALSE(fast_dequantize_groups(x.data(), DType::fp8_e4m3, c.data(), e.data(), DType::int8, false, 32, 1, 1.0f));
  CHECK(std::all_of(c.begin(), c.end(), [](std::byte b) { return b == std::byte{0}; }));
}

#if !defined(KVCACHE_NO_AVX512)
// Which loops the group case above exercised: on an AVX-512 CPU the 512-bit
// loops take groups of 16 to 128 (symmetric whole bytes; integers with a
// minimum) and nothing else, so a dispatch that fell through to the AVX2
// loops would not pass unseen; elsewhere they take nothing.
TEST_CASE("the 512-bit group loops take the formats they are for, where the CPU has AVX-512") {
  const bool wide = simd::avx512_available();
  for (DType o : {DType::f32, DType::f16, DType::bf16})
    for (std::int32_t g : {16, 32, 64, 128}) {
      for (DType c : {DType::int8, DType::int4, DType::int2}) CHECK(simd::avx512::minimum_wide(c, g, o) == wide);
      for (DType c : {DType::int8, DType::fp8_e4m3, DType::fp8_e5m2, DType::int4, DType::int2, DType::fp4_e2m1})
        CHECK(simd::avx512::groups_wide(c, false, g, o) == wide);
    }
  CHECK_FALSE(simd::avx512::minimum_wide(DType::int4, 8, DType::f16));
  CHECK_FALSE(simd::avx512::minimum_wide(DType::fp8_e4m3, 32, DType::f16));
  CHECK_FALSE(simd::avx512::minimum_wide(DType::int4, 32, DType::int8));
  CHECK_FALSE(simd::avx512::groups_wide(DType::int4, true, 32, DType::f16));  // minimum_wide's
  CHECK_FALSE(simd::avx512::groups_wide(DType::fp4_e2m1, false, 8, DType::f16));
  CHECK_FALSE(simd::avx512::groups_wide(DType::fp4_e2m1, false, 16, DType::fp8_e4m3));
  std::vector<std::byte> c(64), e(8);
  std::vector<std::uint16_t> x(32, 0x3c00);
  for (float mul : {0.0f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    CHECK_FALSE(simd::avx512::quantize_groups_min(c.data(), e.data(), reinterpret_cast<const std::byte*>(x.data()), DType::f16,
                                                  DType::int4, 32, 1, mul));
    CHECK_FALSE(simd::avx512::quantize_groups(c.data(), e.data(), reinterpret_cast<const std::byte*>(x.data()), DType::f16,
                                              DType::fp4_e2m1, false, 16, 2, mul, 6.0f));
  }
  CHECK(std::all_of(c.begin(), c.end(), [](std::byte b) { return b == std::byte{0}; }));
}

#if KVCACHE_HOST_SIMD
// g++ 12's AVX-512 intrinsics warn where they are inlined (GCC bug 105593;
// the library's headers silence it the same way).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
namespace {
// The 512-bit sub-byte helpers on sixteen lanes, out of line with their
// target (their always-inlined bodies need it).
template <DType C>
KVCACHE_AVX512 void wide_codes(const float* v, std::uint32_t* out) {
  _mm512_storeu_si512(out, simd::avx512::packed_codes<C>(_mm512_loadu_ps(v)));
}
template <DType C, bool Min>
KVCACHE_AVX512 void wide_values(const std::byte* codes, float* out) {
  _mm512_storeu_ps(out, simd::avx512::load_codes<C, Min>(codes, 0));
}
}  // namespace
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// The group case above reaches these through quantized rows; here each
// code is checked alone: every bf16 value (so every exponent, both zeros,
// infinities, NaNs and subnormals) and fp4's ties with their neighbours,
// and every byte of codes read back.
TEST_CASE("the 512-bit symmetric codes are encode's for every bf16 value and fp4's ties, and read back as load_code's") {
  if (!simd::avx512_available()) return;  // the case above checks that nothing reaches them here
  std::vector<float> v;
  for (std::uint32_t b = 0; b < 65536; ++b) v.push_back(cvt::from_bits(b << 16));
  for (float t : {0.25f, 0.5f, 0.75f, 1.25f, 1.5f, 1.75f, 2.5f, 3.5f, 5.0f, 6.0f, 6.5f, 7.0f, 7.5f, 126.5f, 127.5f})
    for (float sign : {1.0f, -1.0f})
      for (float u : {t, std::nextafter(t, 0.0f), std::nextafter(t, 100.0f)}) v.push_back(sign * u);
  while (v.size() % 16 != 0) v.push_back(0.0f);
  std::uint32_t out[16];
  for (DType code : {DType::int8, DType::int4, DType::int2, DType::fp4_e2m1})
    for (std::size_t i = 0; i < v.size(); i += 16) {
      if (code == DType::int8) wide_codes<DType::int8>(v.data() + i, out);
      if (code == DType::int4) wide_codes<DType::int4>(v.data() + i, out);
      if (code == DType::int2) wide_codes<DType::int2>(v.data() + i, out);
      if (code == DType::fp4_e2m1) wide_codes<DType::fp4_e2m1>(v.data() + i, out);
      for (std::size_t j = 0; j < 16; ++j) {
        CAPTURE(static_cast<int>(code), v[i + j], cvt::bits(v[i + j]));
        REQUIRE(out[j] == quant::encode(code, false, v[i + j]));
      }
    }
  // Every byte value, repeated over the 16 bytes sixteen codes take at most.
  float got[16];
  for (int b = 0; b < 256; ++b) {
    std::byte bytes[16];
    std::fill(std::begin(bytes), std::end(bytes), static_cast<std::byte>(b));
    const auto check = [&](DType code, bool minimum) {
      for (std::int32_t j = 0; j < 16; ++j) {
        CAPTURE(static_cast<int>(code), minimum, b, j);
        const float want = quant::load_code(code, minimum, bytes, j);
        REQUIRE(std::memcmp(&got[j], &want, 4) == 0);
      }
    };
    wide_values<DType::int4, false>(bytes, got), check(DType::int4, false);
    wide_values<DType::int4, true>(bytes, got), check(DType::int4, true);
    wide_values<DType::int2, false>(bytes, got), check(DType::int2, false);
    wide_values<DType::int2, true>(bytes, got), check(DType::int2, true);
    wide_values<DType::fp4_e2m1, false>(bytes, got), check(DType::fp4_e2m1, false);
    wide_values<DType::int8, true>(bytes, got), check(DType::int8, true);
  }
}
#endif
#endif

TEST_CASE("the host's FMA loop gives fmaf's bits, and load_codes gives load_code's values for every byte") {
  std::mt19937_64 rng(Catch::rngSeed() ^ 0xf3a);
  std::uniform_real_distribution<float> u(-100.0f, 100.0f);
  const float specials[] = {0.0f, -0.0f, 1e-40f, -1e-45f, INFINITY, -INFINITY, NAN, 3.4e38f, -3.4e38f, 1.0f};
  std::vector<float> a(1003), b(a.size()), c(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    a[i] = i % 37 == 0 ? specials[i % 10] : u(rng);
    b[i] = i % 41 == 0 ? specials[(i / 3) % 10] : u(rng) * 1e-3f;
    c[i] = i % 43 == 0 ? specials[(i / 5) % 10] : u(rng);
  }
  const auto same = [](float x, float y) { return std::memcmp(&x, &y, 4) == 0 || (std::isnan(x) && std::isnan(y)); };
  for (int step : {0, 1}) {
    std::vector<float> out(a.size(), 9.0f);
    const std::int32_t done = fast_fma(out.data(), a.data(), b.data(), step, c.data(), step, std::int32_t(a.size()));
    CHECK(done == (simd::fma_available() ? 1000 : 0));
    for (std::int32_t i = 0; i < done; ++i) REQUIRE(same(out[std::size_t(i)], std::fma(a[std::size_t(i)], b[std::size_t(step * i)], c[std::size_t(step * i)])));
    for (std::size_t i = std::size_t(done); i < out.size(); ++i) CHECK(out[i] == 9.0f);  // the rest is the caller's
  }
  std::vector<std::uint8_t> bytes(256);
  for (int i = 0; i < 256; ++i) bytes[std::size_t(i)] = std::uint8_t(i);
  for (DType code : {DType::int8, DType::int4, DType::int2})
    for (bool minimum : {false, true}) {
      const std::int32_t n = 256 * 8 / dtype_bits(code);
      std::vector<float> got(static_cast<std::size_t>(n));
      quant::load_codes(code, minimum, bytes.data(), n, got.data());
      for (std::int32_t i = 0; i < n; ++i) REQUIRE(got[std::size_t(i)] == quant::load_code(code, minimum, bytes.data(), i));
    }
}
