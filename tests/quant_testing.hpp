// Helpers for quantized-pool tests: the bytes a row must hold (built from
// the group codecs, not from the kernels' row code), and a pool that knows
// where each row's codes and group entries are (Geometry's own offsets).
#pragma once

#include <kvcache/core/geometry.hpp>
#include <kvcache/kernels/detail/quant_groups.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernel_testing.hpp"

namespace kvtest {

// The entry types' values, ascending, to round group scales and minima
// without the library's bit arithmetic: every finite f16 (and fp8 e4m3).
template <class Decode>
std::vector<float> sorted_finite(std::uint32_t codes, Decode decode) {
  std::vector<float> v;
  for (std::uint32_t b = 0; b < codes; ++b)
    if (const float x = decode(b); std::isfinite(x)) v.push_back(x);
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}
inline const std::vector<float>& finite_values(kv::DType t) {
  static const std::vector<float> f16 = sorted_finite(0x10000u, [](std::uint32_t b) { return kv::cvt::f16_to_f32(std::uint16_t(b)); });
  static const std::vector<float> e4m3 = sorted_finite(0x100u, [](std::uint32_t b) { return kv::cvt::e4m3_to_f32(std::uint8_t(b)); });
  return t == kv::DType::fp8_e4m3 ? e4m3 : f16;
}
// The smallest value of t at least x (x no more than t's largest), and the largest at most x (at least t's smallest).
inline float round_up_to(kv::DType t, float x) { return *std::lower_bound(finite_values(t).begin(), finite_values(t).end(), x); }
inline float round_down_to(kv::DType t, float x) {
  const auto& v = finite_values(t);
  return x < v.front() ? v.front() : *(std::upper_bound(v.begin(), v.end(), x) - 1);
}

// The bytes a row must hold: its codes, then its group entries (none for an engine-held scale).
struct RowBytes {
  std::vector<std::uint8_t> codes, entries;
};
inline RowBytes reference_row(const kv::Geometry& g, std::int32_t kv, const float* x) {
  const auto& s = g.spec();
  const kv::SideFormat& f = g.side(kv);
  RowBytes r{std::vector<std::uint8_t>(std::size_t(g.row_bytes())), std::vector<std::uint8_t>(std::size_t(g.group_bytes_per_row(kv)))};
  if (f.scales == kv::Scales::group) {
    kv::quant::quantize_row(x, s.head_dim, s.dtype, f, r.codes.data(), r.entries.data());
  } else if (kv::dtype_bits(s.dtype) == 4) {
    for (int i = 0; i < s.head_dim; i += 2)
      r.codes[std::size_t(i / 2)] =
          std::uint8_t(kv::quant::encode(s.dtype, false, x[i]) | (kv::quant::encode(s.dtype, false, x[i + 1]) << 4));
  } else {
    for (int i = 0; i < s.head_dim; ++i) kv::store_elem(s.dtype, r.codes.data(), i, x[i]);
  }
  return r;
}

// A row's values from its codes and entries, with the group codecs.
inline std::vector<float> reference_values(const kv::Geometry& g, std::int32_t kv, const std::byte* codes, const std::byte* entries) {
  const auto& s = g.spec();
  const kv::SideFormat& f = g.side(kv);
  std::vector<float> x(static_cast<std::size_t>(s.head_dim));
  if (f.scales == kv::Scales::group)
    kv::quant::dequantize_row(codes, entries, s.head_dim, s.dtype, f, x.data());
  else
    for (int d = 0; d < s.head_dim; ++d) x[std::size_t(d)] = kv::quant::load_code(s.dtype, false, codes, d);
  return x;
}

struct QPool {
  kv::Geometry g;
  std::int64_t blocks;
  kv::Strides st;
  std::vector<std::byte> bytes;
  kv::PoolView view;
  QPool(const kv::GeometrySpec& s, std::int64_t n) : g(*kv::Geometry::make(s)), blocks(n), st(*g.strides(n)) {
    bytes.resize(std::size_t(*g.pool_bytes(n)));
    poison(bytes);
    view = *kv::make_pool_view(g, bytes.data(), n);
  }
  std::size_t codes_at(std::int64_t b, int l, int kv, int t, int h) const { return std::size_t(st.offset(b, l, kv, t, h)); }
  std::size_t entries_at(std::int64_t b, int l, int kv, int t, int h) const {
    return std::size_t(st.offset(b, l, kv, 0, 0) + g.group_entries_offset(kv, t, h));
  }
  // Marks a row's codes and entries in `mask`.
  void mark(std::vector<char>& mask, std::int64_t b, int l, int kv, int t, int h) const {
    std::fill_n(mask.begin() + std::ptrdiff_t(codes_at(b, l, kv, t, h)), g.row_bytes(), 1);
    std::fill_n(mask.begin() + std::ptrdiff_t(entries_at(b, l, kv, t, h)), g.group_bytes_per_row(kv), 1);
  }
  // Whether a row holds exactly `want`.
  bool holds(const RowBytes& want, std::int64_t b, int l, int kv, int t, int h) const {
    return std::equal(want.codes.begin(), want.codes.end(), reinterpret_cast<const std::uint8_t*>(&bytes[codes_at(b, l, kv, t, h)])) &&
           std::equal(want.entries.begin(), want.entries.end(),
                      reinterpret_cast<const std::uint8_t*>(&bytes[entries_at(b, l, kv, t, h)]));
  }
};

}  // namespace kvtest
