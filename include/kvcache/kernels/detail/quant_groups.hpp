// A group's and a row's quantization and dequantization (the scalar codes
// and scales are quant.hpp's): the portable bodies every backend runs, with
// the host's vector loops doing what they can first (kernels/host/fast_path.hpp).
#pragma once

#include <cmath>
#include <cstdint>

#include "kvcache/config.hpp"
#include "kvcache/core/kv_format.hpp"
#include "kvcache/kernels/detail/quant.hpp"
#include "kvcache/kernels/detail/rows.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace quant {

/// Quantizes x[0, n) (a whole group: 16 to 128 values) into codes (n elements of
/// `code`, from a byte boundary) and entry; returns what was stored.
KVCACHE_HOST_DEVICE inline GroupScale quantize_group(const float* x, std::int32_t n, DType code, bool minimum, void* codes,
                                                     void* entry) noexcept {
  // The range in the floats' bits, as integers: integer max and min vectorize
  // (float ones do not without -ffast-math). |x| orders as its bits without
  // the sign; x orders as its bits with the magnitude flipped when negative.
  float lo = 0.0f, hi = 0.0f, amax = 0.0f;
  if (minimum) {
    std::int32_t kmin = 0, kmax = 0;
    key_range(x, n, kmin, kmax);
    lo = from_order_key(kmin);
    hi = from_order_key(kmax);
  } else {
    std::uint32_t m = 0;
    for (std::int32_t i = fast_abs_max_bits(x, n, m); i < n; ++i) {
      const std::uint32_t a = cvt::bits(x[i]) & 0x7fffffffu;
      m = a > m ? a : m;
    }
    amax = cvt::from_bits(m);
  }
  const GroupScale g = group_scale(code, minimum, lo, hi, amax);
  store_entry_value(code, entry, 0, g.scale);
  if (minimum) store_entry_value(code, entry, 1, g.minimum);
  const float s = g.scale, m = g.minimum;
  auto* b = static_cast<std::uint8_t*>(codes);
  // Whole-byte symmetric codes are store_elem of x / s: the host's vector loops when it has them.
  if (!minimum && dtype_bits(code) == 8 && s > 0.0f && fast_rows(codes, code, x, DType::f32, n, s, false, true) == n) return g;
  // One loop per code, the switch outside it: the host compiler vectorizes them.
  switch (code) {
    case DType::int8:
      if (minimum) {
        for (std::int32_t i = 0; i < n; ++i) b[i] = static_cast<std::uint8_t>(cvt::to_int(quotient(x[i] - m, s), 0, 255));
      } else {
        for (std::int32_t i = 0; i < n; ++i)
          b[i] = static_cast<std::uint8_t>(static_cast<std::uint32_t>(cvt::to_int(quotient(x[i], s), -127, 127)) & 0xffu);
      }
      return g;
    case DType::int4:
    case DType::int2: {  // encode's integers, then packed: two loops the host vectorizes (encode's switch per value did not)
      const auto qhi = static_cast<std::int32_t>(code_max(code, minimum)), qlo = minimum ? 0 : -qhi;
      std::uint32_t q[128];
      for (std::int32_t i = 0; i < n; ++i) q[i] = static_cast<std::uint32_t>(cvt::to_int(quotient(x[i] - m, s), qlo, qhi));
      if (code == DType::int4)
        for (std::int32_t i = 0; i < n; i += 2) b[i >> 1] = static_cast<std::uint8_t>((q[i] & 15u) | ((q[i + 1] & 15u) << 4));
      else
        for (std::int32_t i = 0; i < n; i += 4)
          b[i >> 2] = static_cast<std::uint8_t>((q[i] & 3u) | ((q[i + 1] & 3u) << 2) | ((q[i + 2] & 3u) << 4) | ((q[i + 3] & 3u) << 6));
      return g;
    }
    case DType::fp4_e2m1:
      for (std::int32_t i = 0; i < n; i += 2)
        b[i >> 1] = static_cast<std::uint8_t>(f32_to_e2m1(quotient(x[i], s)) | (f32_to_e2m1(quotient(x[i + 1], s)) << 4));
      return g;
    case DType::fp8_e4m3:
      for (std::int32_t i = 0; i < n; ++i) b[i] = cvt::f32_to_e4m3(quotient(x[i], s));
      return g;
    default:
      for (std::int32_t i = 0; i < n; ++i) b[i] = static_cast<std::uint8_t>(encode(code, minimum, quotient(x[i] - m, s)));
      return g;
  }
}

/// Dequantizes n codes of a group with its entry into out[0, n).
KVCACHE_HOST_DEVICE inline void dequantize_group(const void* codes, const void* entry, std::int32_t n, DType code,
                                                 bool minimum, float* out) noexcept {
  const GroupScale g = load_entry(code, minimum, entry);
  const auto* b = static_cast<const std::uint8_t*>(codes);
  // Whole-byte symmetric codes are load_elem times the scale: the host's AVX2 loops when it has them.
  if (!minimum && dtype_bits(code) == 8 && fast_rows(out, DType::f32, codes, code, n, g.scale) == n) return;
  // Explicit fma with a minimum (host and device round alike: the host's FMA
  // instruction where it has one, fmaf's bits); a plain product without.
  if (minimum) {
    load_codes(code, true, codes, n, out);
    for (std::int32_t i = fast_fma(out, out, &g.scale, 0, &g.minimum, 0, n); i < n; ++i) out[i] = fmaf(out[i], g.scale, g.minimum);
    return;
  }
  switch (code) {
    case DType::int8:
      for (std::int32_t i = 0; i < n; ++i) out[i] = static_cast<float>(static_cast<std::int8_t>(b[i])) * g.scale;
      return;
    case DType::fp8_e4m3:
      for (std::int32_t i = 0; i < n; ++i) out[i] = cvt::e4m3_to_f32(b[i]) * g.scale;
      return;
    default:
      load_codes(code, false, codes, n, out);
      for (std::int32_t i = 0; i < n; ++i) out[i] *= g.scale;
      return;
  }
}

/// Quantizes a row of head_dim values group by group: codes at `codes`
/// (row_bytes(code, head_dim)), entries at `entries` (head_dim / group of them).
KVCACHE_HOST_DEVICE inline void quantize_row(const float* x, std::int32_t head_dim, DType code, const SideFormat& f,
                                             void* codes, void* entries) noexcept {
  const std::int64_t eb = group_entry_bytes(code, f);
  for (std::int32_t g = 0; g * f.group < head_dim; ++g)
    quantize_group(x + g * f.group, f.group, code, f.minimum,
                   static_cast<std::byte*>(codes) + row_bytes(code, std::int64_t{g} * f.group),
                   static_cast<std::byte*>(entries) + g * eb);
}

/// Dequantizes a row written by quantize_row into out[0, head_dim).
KVCACHE_HOST_DEVICE inline void dequantize_row(const void* codes, const void* entries, std::int32_t head_dim, DType code,
                                               const SideFormat& f, float* out) noexcept {
  const std::int64_t eb = group_entry_bytes(code, f);
  for (std::int32_t g = 0; g * f.group < head_dim; ++g)
    dequantize_group(static_cast<const std::byte*>(codes) + row_bytes(code, std::int64_t{g} * f.group),
                     static_cast<const std::byte*>(entries) + g * eb, f.group, code, f.minimum, out + g * f.group);
}

}  // namespace quant
KVCACHE_END_NAMESPACE
