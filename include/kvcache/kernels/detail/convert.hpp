// The scalar dtype conversions every backend shares: fp32 to and from
// fp16, bf16, fp8 e4m3 (OCP E4M3FN, saturating) and e5m2, and the rounded,
// clamped integer of an int code. Round to nearest even throughout. They
// are KVCACHE_HOST_DEVICE with no intrinsics, so the host backend and the
// CUDA kernels compute the same bits; kernels/host/x86/avx2_rows.hpp's vector loops are
// checked against them.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvcache/config.hpp"

KVCACHE_BEGIN_NAMESPACE

namespace cvt {
/// The largest finite f16 and fp8 e4m3 values: where a scale stored in that
/// type saturates, and e4m3's largest code.
inline constexpr float kF16Max = 65504.0f;
inline constexpr float kE4m3Max = 448.0f;
KVCACHE_HOST_DEVICE inline std::uint32_t bits(float f) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
KVCACHE_HOST_DEVICE inline float from_bits(std::uint32_t u) noexcept {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
KVCACHE_HOST_DEVICE inline float bf16_to_f32(std::uint16_t h) noexcept { return from_bits(std::uint32_t{h} << 16); }
KVCACHE_HOST_DEVICE inline std::uint16_t f32_to_bf16(float f) noexcept {
  std::uint32_t u = bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

// c ? a : b with a mask instead of a branch (the host vectorizer gives up on
// loops whose selects the compiler turned into jumps).
KVCACHE_HOST_DEVICE inline std::uint32_t sel(bool c, std::uint32_t a, std::uint32_t b) noexcept {
  return b ^ ((a ^ b) & (0u - static_cast<std::uint32_t>(c)));
}

// The conversions below compute every case and select one, without
// branches, so host loops over them vectorize. Subnormal results come from
// one float add: x + C, with C's ulp equal to the target's smallest step,
// rounds x to nearest even in that step (C's mantissa then holds the code).
KVCACHE_HOST_DEVICE inline float f16_to_f32(std::uint16_t h) noexcept {
  const std::uint32_t sign = std::uint32_t{h & 0x8000u} << 16, em = h & 0x7fffu, exp = em >> 10;
  const std::uint32_t normal = (em << 13) + (112u << 23), special = (em << 13) | 0x7f800000u;
  const std::uint32_t sub = bits(static_cast<float>(em) * 5.9604644775390625e-08f);  // man * 2^-24, exact
  return from_bits(sign | sel(exp == 0, sub, sel(exp == 31, special, normal)));
}
KVCACHE_HOST_DEVICE inline std::uint16_t f32_to_f16(float f) noexcept {
  const std::uint32_t u = bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  std::uint32_t m = a - 0x38000000u;
  m += 0xfffu + ((m >> 13) & 1u);
  const std::uint32_t normal = m >> 13, sub = bits(from_bits(a) + 0.5f) - 0x3f000000u;  // steps of 2^-24
  // NaN; >= 65520 rounds to inf; a normal half; a subnormal half or zero.
  const std::uint32_t mag = sel(a > 0x7f800000u, 0x7e00u, sel(a >= 0x477ff000u, 0x7c00u, sel(a >= 0x38800000u, normal, sub)));
  return static_cast<std::uint16_t>(sign | mag);
}

KVCACHE_HOST_DEVICE inline float e4m3_to_f32(std::uint8_t q) noexcept {
  const std::uint32_t sign = std::uint32_t{q & 0x80u} << 24, em = q & 0x7fu;
  const std::uint32_t normal = (em << 20) + (120u << 23);
  const std::uint32_t sub = bits(static_cast<float>(em) * 0.001953125f);  // man * 2^-9
  return from_bits(sign | sel(em == 0x7fu, 0x7fc00000u, sel((em >> 3) == 0, sub, normal)));
}
KVCACHE_HOST_DEVICE inline std::uint8_t f32_to_e4m3(float f) noexcept {
  const std::uint32_t u = bits(f), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
  std::uint32_t m = a - 0x3c000000u;
  m += 0x7ffffu + ((m >> 20) & 1u);
  const std::uint32_t normal = m >> 20, sub = bits(from_bits(a) + 16384.0f) - 0x46800000u;  // steps of 2^-9
  // NaN; >= 448 saturates; normal from 2^-6; subnormal.
  const std::uint32_t mag = sel(a > 0x7f800000u, 0x7fu, sel(a >= 0x43e00000u, 0x7eu, sel(a >= 0x3c800000u, normal, sub)));
  return static_cast<std::uint8_t>(sign | mag);
}

KVCACHE_HOST_DEVICE inline float e5m2_to_f32(std::uint8_t q) noexcept {
  return f16_to_f32(static_cast<std::uint16_t>(std::uint16_t{q} << 8));  // e5m2 is f16's top byte
}
KVCACHE_HOST_DEVICE inline std::uint8_t f32_to_e5m2(float f) noexcept {
  // From the float's own mantissa, not through f16 (that would round twice).
  const std::uint32_t u = bits(f), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
  std::uint32_t m = a - 0x38000000u;
  m += 0xfffffu + ((m >> 21) & 1u);
  const std::uint32_t normal = m >> 21, sub = bits(from_bits(a) + 128.0f) - 0x43000000u;  // steps of 2^-16
  // NaN; >= 57344 saturates (no inf); normal from 2^-14; subnormal.
  const std::uint32_t mag = sel(a > 0x7f800000u, 0x7fu, sel(a >= 0x47600000u, 0x7bu, sel(a >= 0x38800000u, normal, sub)));
  return static_cast<std::uint8_t>(sign | mag);
}
/// v rounded to nearest even and clamped to [lo, hi] (|lo|, |hi| < 2^22);
/// NaN gives 0. Integer selects only: the host vectorizes it (float selects
/// next to the add stop g++'s vectorizer); one float add, exact on both backends.
KVCACHE_HOST_DEVICE inline std::int32_t to_int(float v, std::int32_t lo, std::int32_t hi) noexcept {
  const std::uint32_t u = bits(v), a = u & 0x7fffffffu;
  // Adding 1.5 * 2^23 leaves v's nearest-even integer in the mantissa (for |v| < 2^22).
  std::int32_t r = static_cast<std::int32_t>(bits(v + 12582912.0f) - 0x4b400000u);
  r = r < lo ? lo : r;
  r = r > hi ? hi : r;
  const std::uint32_t big = sel(u >> 31 != 0, static_cast<std::uint32_t>(lo), static_cast<std::uint32_t>(hi));
  return static_cast<std::int32_t>(sel(a > 0x7f800000u, 0u, sel(a >= 0x4a800000u, big, static_cast<std::uint32_t>(r))));
}
}  // namespace cvt

KVCACHE_END_NAMESPACE
