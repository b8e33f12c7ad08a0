// Shared by every kernel body: the pool view's checks (the view itself is
// params/pool_view.hpp), and rows loaded and stored through the dtype
// conversions (kernels/detail/convert.hpp). Everything here is
// KVCACHE_HOST_DEVICE and compiles with g++ alone, and includes nothing of
// either backend; the host backend and the CUDA kernels run the same code,
// so their results are bit-identical (no intrinsics, explicit fma). The row
// mover, which reaches the host's vector loops, is rows.hpp.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvcache/kernels/detail/convert.hpp"
#include "kvcache/kernels/detail/backend.hpp"
#include "kvcache/kernels/params/pool_view.hpp"
#include "kvcache/config.hpp"
#include "kvcache/core/geometry.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// A view's kv_planes is 1 or 2: invalid_argument naming `what` otherwise.
inline Status check_planes(const PoolView& v, const char* what) noexcept {
  if (v.kv_planes != 1 && v.kv_planes != 2) return Status{Errc::invalid_argument, what, v.kv_planes, 2};
  return {};
}

/// A dtype field holds a type the element-wise kernels move: one of DType's
/// whole-byte enumerators, up to int8 (a cast integer may hold none, and the
/// 4-bit codes share bytes): invalid_argument naming the field otherwise.
inline Status check_dtype(DType d, const char* what) noexcept {
  if (dtype_bits(d) < 8) return Status{Errc::invalid_argument, what, static_cast<std::int64_t>(d), 5};
  return {};
}

/// The engine-held scale of (layer, head) on side kv (0 = K, 1 = V):
/// scales[layer] when the side's format is Scales::tensor, scales[layer *
/// num_kv_heads + head] for Scales::head; 1 without an array. Kernels
/// multiply it with their call's k_scale / v_scale.
KVCACHE_HOST_DEVICE inline float held_scale(const PoolView& v, std::int32_t kv, const float* scales, std::int32_t layer,
                                            std::int32_t head) noexcept {
  if (!scales) return 1.0f;
  return side_format(v, kv).scales == Scales::head ? scales[std::int64_t{layer} * v.num_kv_heads + head] : scales[layer];
}

/// Engine-held scale arrays (k_scales, v_scales) are given only for a side
/// whose format holds them (tensor: one per layer; head: one per (layer,
/// kv-head)). When read_values (host memory), every value must be positive
/// and finite: the error names the first that is not.
inline Status check_held_scales(const PoolView& v, const float* k_scales, const float* v_scales, bool read_values) noexcept {
  for (std::int32_t kv = 0; kv < 2; ++kv) {
    const float* s = kv == 0 ? k_scales : v_scales;
    if (!s) continue;
    const Scales scheme = side_format(v, kv).scales;
    if (scheme != Scales::tensor && scheme != Scales::head)
      return Status{Errc::invalid_argument, kv == 0 ? "k_scales (format.k holds no engine-held scales)" : "v_scales (format.v holds no engine-held scales)",
                    static_cast<std::int64_t>(scheme), 2};
    if (!read_values) continue;
    const std::int64_t n = std::int64_t{v.num_layers} * (scheme == Scales::head ? v.num_kv_heads : 1);
    for (std::int64_t i = 0; i < n; ++i)
      if (!(s[i] > 0.0f) || !std::isfinite(s[i])) return Status{Errc::invalid_argument, kv == 0 ? "k_scales_at" : "v_scales_at", i, n};
  }
  return {};
}

/// A host-visible CSR page table of n sequences (indptr has n + 1 entries):
/// offsets start at 0 or more and never decrease, so indices holds
/// indptr[n] entries. An error names the first bad entry.
inline Status check_csr(const std::int32_t* indptr, std::int32_t n) noexcept {
  if (n <= 0) return {};
  if (!indptr) return Status{Errc::invalid_argument, "indptr", 0, 1};
  if (indptr[0] < 0) return Status{Errc::invalid_argument, "indptr_at", 0, 0};
  for (std::int32_t s = 0; s < n; ++s)
    if (indptr[s + 1] < indptr[s]) return Status{Errc::invalid_argument, "indptr_at", s + 1, indptr[s]};
  return {};
}

/// Element i of p, converted from t to float.
KVCACHE_HOST_DEVICE inline float load_elem(DType t, const void* p, std::int64_t i) noexcept {
  switch (t) {
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::f16: return cvt::f16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
    case DType::bf16: return cvt::bf16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
    case DType::fp8_e4m3: return cvt::e4m3_to_f32(static_cast<const std::uint8_t*>(p)[i]);
    case DType::fp8_e5m2: return cvt::e5m2_to_f32(static_cast<const std::uint8_t*>(p)[i]);
    case DType::int8: return static_cast<float>(static_cast<const std::int8_t*>(p)[i]);
    case DType::int4:
    case DType::fp4_e2m1:
    case DType::int2: break;  // packed: kernels/detail/quant_groups.hpp reads them by row
  }
  return 0.0f;
}
/// Elements [0, n) of p, converted from t to float, into out: load_elem
/// with the type's switch outside the loop, so the loop can vectorize.
KVCACHE_HOST_DEVICE inline void load_row(DType t, const void* p, float* out, std::int32_t n) noexcept {
  switch (t) {
    case DType::f32:
      for (std::int32_t i = 0; i < n; ++i) out[i] = static_cast<const float*>(p)[i];
      return;
    case DType::f16:
      for (std::int32_t i = 0; i < n; ++i) out[i] = cvt::f16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
      return;
    case DType::bf16:
      for (std::int32_t i = 0; i < n; ++i) out[i] = cvt::bf16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
      return;
    case DType::fp8_e4m3:
      for (std::int32_t i = 0; i < n; ++i) out[i] = cvt::e4m3_to_f32(static_cast<const std::uint8_t*>(p)[i]);
      return;
    case DType::fp8_e5m2:
      for (std::int32_t i = 0; i < n; ++i) out[i] = cvt::e5m2_to_f32(static_cast<const std::uint8_t*>(p)[i]);
      return;
    case DType::int8:
      for (std::int32_t i = 0; i < n; ++i) out[i] = static_cast<float>(static_cast<const std::int8_t*>(p)[i]);
      return;
    default:
      for (std::int32_t i = 0; i < n; ++i) out[i] = load_elem(t, p, i);
      return;
  }
}
/// Stores v as element i of p in type t (round to nearest even; fp8 and int8 saturate, int8 at +-127).
KVCACHE_HOST_DEVICE inline void store_elem(DType t, void* p, std::int64_t i, float v) noexcept {
  switch (t) {
    case DType::f32: static_cast<float*>(p)[i] = v; return;
    case DType::f16: static_cast<std::uint16_t*>(p)[i] = cvt::f32_to_f16(v); return;
    case DType::bf16: static_cast<std::uint16_t*>(p)[i] = cvt::f32_to_bf16(v); return;
    case DType::fp8_e4m3: static_cast<std::uint8_t*>(p)[i] = cvt::f32_to_e4m3(v); return;
    case DType::fp8_e5m2: static_cast<std::uint8_t*>(p)[i] = cvt::f32_to_e5m2(v); return;
    case DType::int8: static_cast<std::int8_t*>(p)[i] = static_cast<std::int8_t>(cvt::to_int(v, -127, 127)); return;
    case DType::int4:
    case DType::fp4_e2m1:
    case DType::int2: return;  // packed: kernels/detail/quant_groups.hpp writes them by row
  }
}

/// Stores in[0, n) divided by d as elements [0, n) of p in type t: what a
/// write with an engine-held scale d stores (the rounding of x / d, as
/// vLLM's fp8 cache write computes it; not x * (1 / d), which differs near
/// rounding midpoints).
KVCACHE_HOST_DEVICE inline void store_row_divided(DType t, void* p, const float* in, float d, std::int32_t n) noexcept {
  switch (t) {
    case DType::fp8_e4m3:
      for (std::int32_t i = 0; i < n; ++i) static_cast<std::uint8_t*>(p)[i] = cvt::f32_to_e4m3(in[i] / d);
      return;
    case DType::int8:
      for (std::int32_t i = 0; i < n; ++i) static_cast<std::int8_t*>(p)[i] = static_cast<std::int8_t>(cvt::to_int(in[i] / d, -127, 127));
      return;
    default:
      for (std::int32_t i = 0; i < n; ++i) store_elem(t, p, i, in[i] / d);
      return;
  }
}

/// Stores in[0, n) times mul as elements [0, n) of p in type t: store_elem
/// with the type's switch outside the loop, so the loop can vectorize.
KVCACHE_HOST_DEVICE inline void store_row(DType t, void* p, const float* in, float mul, std::int32_t n) noexcept {
  switch (t) {
    case DType::f32:
      for (std::int32_t i = 0; i < n; ++i) static_cast<float*>(p)[i] = in[i] * mul;
      return;
    case DType::f16:
      for (std::int32_t i = 0; i < n; ++i) static_cast<std::uint16_t*>(p)[i] = cvt::f32_to_f16(in[i] * mul);
      return;
    case DType::bf16:
      for (std::int32_t i = 0; i < n; ++i) static_cast<std::uint16_t*>(p)[i] = cvt::f32_to_bf16(in[i] * mul);
      return;
    case DType::fp8_e4m3:
      for (std::int32_t i = 0; i < n; ++i) static_cast<std::uint8_t*>(p)[i] = cvt::f32_to_e4m3(in[i] * mul);
      return;
    case DType::fp8_e5m2:
      for (std::int32_t i = 0; i < n; ++i) static_cast<std::uint8_t*>(p)[i] = cvt::f32_to_e5m2(in[i] * mul);
      return;
    case DType::int8:
      for (std::int32_t i = 0; i < n; ++i)
        static_cast<std::int8_t*>(p)[i] = static_cast<std::int8_t>(cvt::to_int(in[i] * mul, -127, 127));
      return;
    default:
      for (std::int32_t i = 0; i < n; ++i) store_elem(t, p, i, in[i] * mul);
      return;
  }
}

KVCACHE_END_NAMESPACE
