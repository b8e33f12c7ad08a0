// The host's group quantization by the widest loops this CPU runs: whole-
// byte symmetric codes and integer codes with a minimum in groups of 16,
// 32, 64 or 128 by the 512-bit loops (kernels/host/x86/avx512_groups.hpp,
// kernels/host/x86/avx512_minimum.hpp), every other format the group loops take by
// the AVX2 ones (kernels/host/x86/avx2_groups.hpp), the rest by the caller's scalar
// quantize_group. Every one gives the scalar code's bits, so which ran is
// not visible in the result.
#pragma once

#include <cstdint>

#include "kvcache/kernels/host/cpu.hpp"
#include "kvcache/kernels/host/x86/avx512_groups.hpp"
#include "kvcache/kernels/host/x86/avx512_minimum.hpp"
#include "kvcache/kernels/host/x86/avx2_groups.hpp"
#include "kvcache/config.hpp"
#include "kvcache/core/kv_format.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace simd {

#if KVCACHE_HOST_SIMD
/// True when the group loops (AVX-512 or AVX2) take a row of `code` in
/// groups of a multiple of 8 values (symmetric: int8, int4, int2, fp8 e4m3
/// or e5m2, fp4 e2m1; with a minimum: int8, int4 or int2) to or from
/// `other` (f32, f16 or bf16) on this CPU.
inline bool groups_fast(DType code, bool minimum, std::int32_t group, DType other) noexcept {
  const bool integer = code == DType::int8 || code == DType::int4 || code == DType::int2;
  const bool code_ok =
      integer || (!minimum && (code == DType::fp8_e4m3 || code == DType::fp8_e5m2 || code == DType::fp4_e2m1));
  const bool other_ok = other == DType::f32 || other == DType::f16 || other == DType::bf16;
  return code_ok && other_ok && group % 8 == 0 && available();
}

/// quant::quantize_group of each of `groups` groups of src (st, divided by
/// div: the call's scale, finite and non-zero) into codes and entries
/// (packed, as quantize_group writes them); false when groups_fast says no
/// (nothing written).
KVCACHE_HOST_KERNEL bool quantize_groups(std::byte* codes, std::byte* entries, const void* src, DType st, DType code,
                                         bool minimum, std::int32_t group, std::int32_t groups, float div,
                                         float code_max) noexcept
#if KVCACHE_HOST_KERNEL_DECLARED
    ;
#else
{
  if (!groups_fast(code, minimum, group, st)) return false;
  const auto* s = static_cast<const std::byte*>(src);
#if !defined(KVCACHE_NO_AVX512)
  if (minimum ? avx512::quantize_groups_min(codes, entries, s, st, code, group, groups, div)
              : avx512::quantize_groups(codes, entries, s, st, code, minimum, group, groups, div, code_max))
    return true;
#endif
  switch (st) {
    case DType::f32:
      return avx2::quantize_to<DType::f32>(code, minimum, codes, entries, s, group, groups, div, code_max);
    case DType::f16:
      return avx2::quantize_to<DType::f16>(code, minimum, codes, entries, s, group, groups, div, code_max);
    default:
      return avx2::quantize_to<DType::bf16>(code, minimum, codes, entries, s, group, groups, div, code_max);
  }
}
#endif

/// quant::dequantize_group of each group, times mul, stored as ot; false
/// when groups_fast says no (nothing written).
KVCACHE_HOST_KERNEL bool dequantize_groups(void* out, DType ot, const std::byte* codes, const std::byte* entries,
                                           DType code, bool minimum, std::int32_t group, std::int32_t groups,
                                           float mul) noexcept
#if KVCACHE_HOST_KERNEL_DECLARED
    ;
#else
{
  if (!groups_fast(code, minimum, group, ot)) return false;
  auto* o = static_cast<std::byte*>(out);
#if !defined(KVCACHE_NO_AVX512)
  if (minimum ? avx512::dequantize_groups_min(o, ot, codes, entries, code, group, groups, mul)
              : avx512::dequantize_groups(o, ot, codes, entries, code, minimum, group, groups, mul))
    return true;
#endif
  if (minimum) switch (code) {
      case DType::int8:
        return avx2::dequantize_to<DType::int8, true>(ot, o, codes, entries, group, groups, mul);
      case DType::int4:
        return avx2::dequantize_to<DType::int4, true>(ot, o, codes, entries, group, groups, mul);
      default:
        return avx2::dequantize_to<DType::int2, true>(ot, o, codes, entries, group, groups, mul);
    }
  switch (code) {
    case DType::int8:
      return avx2::dequantize_to<DType::int8>(ot, o, codes, entries, group, groups, mul);
    case DType::fp8_e4m3:
      return avx2::dequantize_to<DType::fp8_e4m3>(ot, o, codes, entries, group, groups, mul);
    case DType::fp8_e5m2:
      return avx2::dequantize_to<DType::fp8_e5m2>(ot, o, codes, entries, group, groups, mul);
    case DType::int4:
      return avx2::dequantize_to<DType::int4>(ot, o, codes, entries, group, groups, mul);
    case DType::int2:
      return avx2::dequantize_to<DType::int2>(ot, o, codes, entries, group, groups, mul);
    default:
      return avx2::dequantize_to<DType::fp4_e2m1>(ot, o, codes, entries, group, groups, mul);
  }
}
#endif
#endif

}  // namespace simd

KVCACHE_END_NAMESPACE
