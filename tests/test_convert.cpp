// dtype conversions against independent references: for fp16 the exact
// value of every code and a nearest-code search, and the compiler's _Float16
// where it has one (g++ 12 on x86; clang 14 on x86 has none); for bf16 and
// fp8 a nearest-representable search over all codes.
#include <catch2/catch.hpp>

#include <kvcache/kernels/detail/common.hpp>
#include <kvcache/kernels/detail/quant.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

using namespace kvcache;

namespace {
float f(std::uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}
// Random floats across every exponent, subnormals and the rounding edges included.
std::vector<float> probe_floats(std::size_t n) {
  std::mt19937_64 rng(Catch::rngSeed() + 17);
  std::vector<float> v;
  for (std::size_t i = 0; i < n; ++i) {
    float x = f(static_cast<std::uint32_t>(rng()));
    if (!std::isfinite(x)) continue;
    v.push_back(x);
    v.push_back(std::ldexp(x, -int(rng() % 140)));  // push into small ranges
  }
  for (float x : {0.0f, -0.0f, 1.0f, 65504.0f, 65519.99f, 65520.0f, 448.0f, 464.0f, 1e-8f, 5.96e-8f, 2.98e-8f,
                  0.001953125f, 0.0009765625f, 1.0625f, 1.1875f})
    v.push_back(x), v.push_back(-x);
  return v;
}
// Nearest of a code table (ties to the even code), saturating at the largest finite.
template <class Decode>
std::uint32_t nearest_code(float x, std::uint32_t codes, Decode decode, std::uint32_t sign_bit) {
  const double ax = std::fabs(double(x));
  std::uint32_t best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (std::uint32_t c = 0; c < codes; ++c) {
    const double v = decode(c);
    if (!std::isfinite(v)) continue;
    const double err = std::fabs(v - ax);
    if (err < best_err || (err == best_err && (c & 1u) == 0)) best = c, best_err = err;
  }
  return (std::signbit(x) ? sign_bit : 0u) | best;
}
// The exact magnitude of an fp16 code in [0, 0x7c00]; 0x7c00 (infinity) is
// taken as 2^16, where IEEE rounding with an unbounded exponent would land.
double f16_magnitude(std::uint32_t c) {
  const int exp = int(c >> 10), man = int(c & 0x3ffu);
  return exp == 0 ? std::ldexp(double(man), -24) : std::ldexp(double(1024 + man), exp - 25);
}
// Round to nearest, ties to the even code, overflow to infinity: a binary
// search over the magnitudes (they grow with the code).
std::uint16_t f16_reference(float x) {
  const std::uint32_t sign = std::signbit(x) ? 0x8000u : 0u;
  const double ax = std::fabs(double(x));
  std::uint32_t lo = 0, hi = 0x7c00;  // f16_magnitude(lo) <= ax < f16_magnitude(hi), or ax past 2^16
  if (ax >= f16_magnitude(hi)) return static_cast<std::uint16_t>(sign | 0x7c00u);
  while (hi - lo > 1) {
    const std::uint32_t mid = (lo + hi) / 2;
    (f16_magnitude(mid) <= ax ? lo : hi) = mid;
  }
  const double dl = ax - f16_magnitude(lo), dh = f16_magnitude(hi) - ax;
  const std::uint32_t code = dl < dh ? lo : (dh < dl ? hi : ((lo & 1u) ? hi : lo));
  return static_cast<std::uint16_t>(sign | code);
}
}  // namespace

TEST_CASE("fp16 conversion matches the exact value and nearest code of every input") {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const auto h16 = static_cast<std::uint16_t>(h);
    const std::uint32_t mag = h & 0x7fffu;
    const float got = cvt::f16_to_f32(h16);
    if (mag > 0x7c00u) {
      REQUIRE(std::isnan(got));
      continue;
    }
    const double want = mag == 0x7c00u ? std::numeric_limits<double>::infinity() : f16_magnitude(mag);
    REQUIRE(double(got) == ((h & 0x8000u) ? -want : want));
    REQUIRE(std::signbit(got) == bool(h & 0x8000u));
  }
  for (float x : probe_floats(200000)) {
    INFO("x = " << x);
    REQUIRE(cvt::f32_to_f16(x) == f16_reference(x));
  }
  CHECK(cvt::f32_to_f16(std::numeric_limits<float>::quiet_NaN()) == 0x7e00);
}

#if defined(__FLT16_MANT_DIG__)
TEST_CASE("fp16 conversion matches the compiler's _Float16 on every input") {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    _Float16 ref;
    const auto h16 = static_cast<std::uint16_t>(h);
    std::memcpy(&ref, &h16, 2);
    const float want = static_cast<float>(ref), got = cvt::f16_to_f32(h16);
    if (std::isnan(want)) REQUIRE(std::isnan(got));
    else REQUIRE(std::memcmp(&want, &got, 4) == 0);
  }
  for (float x : probe_floats(200000)) {
    const _Float16 ref = static_cast<_Float16>(x);
    std::uint16_t want;
    std::memcpy(&want, &ref, 2);
    INFO("x = " << x);
    REQUIRE(cvt::f32_to_f16(x) == want);
  }
  CHECK(cvt::f32_to_f16(std::numeric_limits<float>::quiet_NaN()) == 0x7e00);
}
#endif

TEST_CASE("bf16 conversion rounds to nearest even and round-trips every code") {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const auto code = static_cast<std::uint16_t>(h);
    const float x = cvt::bf16_to_f32(code);
    REQUIRE(cvt::bits(x) == std::uint32_t{code} << 16);
    if (!std::isnan(x)) REQUIRE(cvt::f32_to_bf16(x) == code);
  }
  auto decode = [](std::uint32_t c) { return double(f(c << 16)); };
  std::mt19937_64 rng(Catch::rngSeed());
  for (int i = 0; i < 2000; ++i) {
    // A value between two neighbouring bf16 codes, ties included.
    const std::uint32_t c = static_cast<std::uint32_t>(rng() % 0x7f7f);
    const std::uint32_t low = rng() % 4 == 0 ? 0x8000u : static_cast<std::uint32_t>(rng() % 0x10000);
    const float x = f((c << 16) | low);
    const std::uint32_t lo = c, hi = c + 1;
    const double dl = std::fabs(decode(lo) - double(x)), dh = std::fabs(decode(hi) - double(x));
    const std::uint32_t want = dl < dh ? lo : (dh < dl ? hi : ((lo & 1u) ? hi : lo));
    REQUIRE(cvt::f32_to_bf16(x) == want);
  }
}

TEST_CASE("fp8 e4m3 conversion: every code decodes per the format and encodes to the nearest code") {
  auto decode = [](std::uint32_t c) {
    const int e = int((c >> 3) & 15u), m = int(c & 7u);
    if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
    return e == 0 ? std::ldexp(double(m), -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  };
  for (std::uint32_t c = 0; c < 256; ++c) {
    const double want = decode(c & 0x7fu) * ((c & 0x80u) ? -1.0 : 1.0);
    const float got = cvt::e4m3_to_f32(static_cast<std::uint8_t>(c));
    if (std::isnan(want)) REQUIRE(std::isnan(got));
    else REQUIRE(double(got) == want);
    if (!std::isnan(want)) REQUIRE(cvt::f32_to_e4m3(got) == c);
  }
  CHECK(cvt::f32_to_e4m3(448.0f) == 0x7e);
  CHECK(cvt::f32_to_e4m3(1e9f) == 0x7e);       // saturates
  CHECK(cvt::f32_to_e4m3(-1e9f) == 0xfe);
  CHECK(cvt::f32_to_e4m3(1.0625f) == 0x38);    // tie between 1.0 and 1.125 -> even
  CHECK(cvt::f32_to_e4m3(std::numeric_limits<float>::quiet_NaN()) == 0x7f);
  for (float x : probe_floats(20000)) {
    if (std::fabs(x) > 448.0f) continue;
    INFO("x = " << x);
    REQUIRE(cvt::f32_to_e4m3(x) == nearest_code(x, 0x7f, decode, 0x80u));
  }
}

TEST_CASE("fp8 e5m2 conversion: every code decodes per the format and encodes to the nearest code") {
  auto decode = [](std::uint32_t c) {
    const int e = int((c >> 2) & 31u), m = int(c & 3u);
    if (e == 31) return m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
    return e == 0 ? std::ldexp(double(m), -16) : std::ldexp(1.0 + m / 4.0, e - 15);
  };
  for (std::uint32_t c = 0; c < 256; ++c) {
    const double want = decode(c & 0x7fu) * ((c & 0x80u) ? -1.0 : 1.0);
    const float got = cvt::e5m2_to_f32(static_cast<std::uint8_t>(c));
    if (std::isnan(want)) REQUIRE(std::isnan(got));
    else REQUIRE(double(got) == want);
    if (std::isfinite(want)) REQUIRE(cvt::f32_to_e5m2(got) == c);
  }
  CHECK(cvt::f32_to_e5m2(57344.0f) == 0x7b);
  CHECK(cvt::f32_to_e5m2(1e9f) == 0x7b);  // saturates: a KV code never becomes inf
  CHECK(cvt::f32_to_e5m2(-1e9f) == 0xfb);
  CHECK(cvt::f32_to_e5m2(1.125f) == 0x3c);  // tie between 1.0 and 1.25 -> even
  CHECK(cvt::f32_to_e5m2(std::numeric_limits<float>::quiet_NaN()) == 0x7f);
  for (float x : probe_floats(20000)) {
    if (std::fabs(x) > 57344.0f) continue;
    INFO("x = " << x);
    REQUIRE(cvt::f32_to_e5m2(x) == nearest_code(x, 0x7b + 1, decode, 0x80u));
  }
}

TEST_CASE("fp4 e2m1 conversion: every code decodes per the format and encodes to the nearest code") {
  auto decode = [](std::uint32_t c) {
    const int e = int((c >> 1) & 3u), m = int(c & 1u);
    return e == 0 ? m * 0.5 : std::ldexp(1.0 + m / 2.0, e - 1);
  };
  for (std::uint32_t c = 0; c < 16; ++c) {
    const double want = decode(c & 7u) * ((c & 8u) ? -1.0 : 1.0);
    REQUIRE(double(quant::e2m1_to_f32(c)) == want);
    REQUIRE(quant::f32_to_e2m1(c == 8 ? -0.0f : float(want)) == c);  // code 8 is -0, and -0 encodes to it (issue 62)
  }
  CHECK(quant::f32_to_e2m1(-0.0f) == 8u);
  CHECK(quant::f32_to_e2m1(100.0f) == 7u);  // saturates at 6
  CHECK(quant::f32_to_e2m1(-100.0f) == 15u);
  CHECK(quant::f32_to_e2m1(std::numeric_limits<float>::quiet_NaN()) == 0u);
  for (float x : probe_floats(20000)) {
    if (std::fabs(x) > 6.0f || x == 0.0f) continue;
    INFO("x = " << x);
    REQUIRE(quant::f32_to_e2m1(x) == nearest_code(x, 8, decode, 8u));
  }
}

TEST_CASE("int8 elements round to nearest even and saturate at +-127") {
  std::int8_t b[1];
  const std::pair<float, int> cases[] = {{0.5f, 0},      {-0.5f, 0},      {1.5f, 2},         {-2.5f, -2},     {1.49f, 1},
                                         {126.6f, 127},  {1000.0f, 127},  {-1000.0f, -127},  {-127.5f, -127}, {2.5f, 2},
                                         {4.2e6f, 127},  {-4.2e6f, -127}, {-1e30f, -127},    {3e38f, 127},
                                         {-std::numeric_limits<float>::infinity(), -127},
                                         {std::numeric_limits<float>::infinity(), 127}};
  for (auto [x, want] : cases) {
    store_elem(DType::int8, b, 0, x);
    CHECK(int(b[0]) == want);
    CHECK(load_elem(DType::int8, b, 0) == float(want));
  }
  store_elem(DType::int8, b, 0, std::numeric_limits<float>::quiet_NaN());
  CHECK(int(b[0]) == 0);
}

TEST_CASE("int8 rounding is exact just below a half, and matches nearbyint everywhere in range") {
  std::int8_t b[1];
  store_elem(DType::int8, b, 0, 0.49999997f);
  CHECK(int(b[0]) == 0);
  store_elem(DType::int8, b, 0, -1.4999999f);
  CHECK(int(b[0]) == -1);
  for (float x : probe_floats(20000)) {
    store_elem(DType::int8, b, 0, x);
    const float want = std::fmax(-127.0f, std::fmin(127.0f, std::nearbyint(x)));  // default rounding: to nearest even
    INFO("x = " << x);
    REQUIRE(float(b[0]) == want);
  }
}

TEST_CASE("row conversions give each element's conversion, for every whole-byte type") {
  // store_row / load_row keep a loop per type so the host vectorizes it;
  // they must give exactly store_elem's / load_elem's bits.
  std::mt19937 rng(11);
  std::vector<float> in(515);
  for (std::size_t i = 0; i < in.size(); ++i)
    in[i] = i % 7 == 0 ? std::ldexp(float(rng() % 1000) - 500.0f, int(rng() % 40) - 30) : float(rng() % 100000) / 64.0f - 700.0f;
  in[1] = std::numeric_limits<float>::infinity(), in[2] = -0.0f, in[3] = std::numeric_limits<float>::quiet_NaN();
  for (const DType t : {DType::f32, DType::f16, DType::bf16, DType::fp8_e4m3, DType::fp8_e5m2, DType::int8}) {
    INFO("dtype " << int(t));
    const auto n = static_cast<std::int32_t>(in.size());
    std::vector<std::uint8_t> row(in.size() * 4), elems(row.size());
    store_row(t, row.data(), in.data(), 0.75f, n);
    for (std::int32_t i = 0; i < n; ++i) store_elem(t, elems.data(), i, in[std::size_t(i)] * 0.75f);
    REQUIRE(row == elems);
    std::vector<float> back(in.size());
    load_row(t, row.data(), back.data(), n);
    for (std::int32_t i = 0; i < n; ++i) {
      const float e = load_elem(t, row.data(), i);
      REQUIRE(std::memcmp(&back[std::size_t(i)], &e, 4) == 0);
    }
  }
}
