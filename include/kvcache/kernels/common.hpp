// Shared by every kernel: the pool view kernels take by value, rows loaded
// and stored through the dtype conversions (convert.hpp), and the row
// mover. Everything here is KVCACHE_HOST_DEVICE and compiles with g++ alone; the host backend and the CUDA kernels run the
// same code, so their results are bit-identical (no intrinsics, explicit fma;
// host_simd.hpp runs move_row's conversions eight at a time, the same bits).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "convert.hpp"
#include "host_rows.hpp"
#include "host_simd_reduce.hpp"
#include "host_stream.hpp"
#include "kvcache/config.hpp"
#include "kvcache/geometry.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// A concrete pool: caller memory + its geometry. Trivially copyable, by value.
struct PoolView {
  void* base = nullptr;  ///< Base address of the pool.
  Strides strides{};  ///< Byte strides of the geometry.
  std::int64_t num_blocks = 0;  ///< Blocks in the pool.
  std::int32_t num_layers = 0;  ///< Layers per block.
  std::int32_t num_kv_heads = 0;  ///< Kv-heads per token.
  std::int32_t head_dim = 0;  ///< Elements per head.
  std::int32_t block_size = 0;  ///< Tokens per block.
  DType dtype = DType::f16;  ///< Element type.
  /// Planes per (block, layer): 2 (K and V), or 1 (one plane: MLA's latent, or
  /// one side of K and V with different head dims). A 1-plane view reads and
  /// writes only the K side of a kernel's source or output.
  std::int32_t kv_planes = 2;
  /// K's and V's scaling (kv_format.hpp); group entries sit scales_offset bytes into each plane.
  KvFormat format{};
  std::int64_t scales_offset = 0;  ///< Bytes from a plane's start to its group entries.
  std::int64_t plane_bytes = 0;  ///< Bytes of one (block, layer, K|V) plane: codes, then group entries.

  /// Address of one (block, layer, K|V, token, head) row of head_dim elements.
  KVCACHE_HOST_DEVICE std::byte* row(std::int64_t block, std::int32_t layer, std::int32_t kv, std::int32_t token,
                                     std::int32_t head) const noexcept {
    return static_cast<std::byte*>(base) + strides.offset(block, layer, kv, token, head);
  }
};
static_assert(std::is_trivially_copyable_v<PoolView>);

/// Side kv's format (0 = K, 1 = V).
KVCACHE_HOST_DEVICE inline const SideFormat& side_format(const PoolView& v, std::int32_t kv) noexcept {
  return kv == 0 ? v.format.k : v.format.v;
}

/// A view of `num_blocks` blocks of geometry g at base; invalid_argument for a null base, geometry_overflow past int64.
inline Result<PoolView> make_pool_view(const Geometry& g, void* base, std::int64_t num_blocks) noexcept {
  if (base == nullptr) return Status{Errc::invalid_argument, "base", 0, 1};
  auto s = g.strides(num_blocks);
  if (!s) return s.status();
  const auto& sp = g.spec();
  return PoolView{base, *s, num_blocks, sp.num_layers, sp.num_kv_heads, sp.head_dim, sp.block_size, sp.dtype, g.kv_planes(),
                  sp.format, g.scales_offset(), g.plane_bytes()};
}

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
    case DType::int2: break;  // packed: kernels/quant.hpp reads them by row
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
    case DType::int2: return;  // packed: kernels/quant.hpp writes them by row
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

/// The first elements of store_row(dt, dst, load_row(st, src) times mul)
/// (divide: store_row_divided(..., by mul)) by the host's vector loops
/// (host_simd.hpp, host_simd512.hpp), the same bits; returns how many (a
/// multiple of 8; 0 on CUDA, without AVX2, or for packed types).
KVCACHE_HOST_DEVICE inline std::int32_t fast_rows(void* dst, DType dt, const void* src, DType st, std::int32_t n,
                                                  float mul, bool stream = false, bool divide = false) noexcept {
#if KVCACHE_HOST_SIMD
  return simd::move_rows(dst, dt, src, st, n, mul, stream, divide);
#else
  (void)stream, (void)divide;
  return 0;
#endif
}

/// The largest of |x[0, k)|'s bits into m, for the first k elements the
/// host's AVX2 loops take (a multiple of 8; 0 on CUDA or without AVX2); returns k.
KVCACHE_HOST_DEVICE inline std::int32_t fast_abs_max_bits(const float* x, std::int32_t n, std::uint32_t& m) noexcept {
#if KVCACHE_HOST_SIMD
  return simd::abs_max_bits(x, n, m);
#else
  (void)x, (void)n, (void)m;
  return 0;
#endif
}

/// out[i] = fmaf(a[i], b, c) (b, c: arrays for step 1, one value for 0) for the first k
/// elements on the host's FMA, fmaf's bits; returns k (0 on CUDA or without FMA).
KVCACHE_HOST_DEVICE inline std::int32_t fast_fma(float* out, const float* a, const float* b, std::int32_t bstep, const float* c,
                                                 std::int32_t cstep, std::int32_t n) noexcept {
#if KVCACHE_HOST_SIMD
  return simd::fmadd(out, a, b, bstep, c, cstep, n);
#else
  (void)out, (void)a, (void)b, (void)bstep, (void)c, (void)cstep, (void)n;
  return 0;
#endif
}

/// How a row moves: raw bytes (same dtype, no scaling) in 16-byte vectors when
/// aligned, else element by element through float (dtype change or scale).
struct alignas(16) Vec16 {
  /// The 128 bits, least significant word first.
  std::uint32_t w[4];
};

/// True when a row can move as raw bytes (same type, no scaling).
KVCACHE_HOST_DEVICE inline bool raw_move(DType dst, DType src, float mul) noexcept { return dst == src && mul == 1.0f; }

/// Host copy of a row run. Fixed-size chunks compile to inline vector moves;
/// a library memcpy of >= 2 KiB switches to `rep movsb`, which runs several
/// times slower when source and destination share page offsets (4K aliasing),
/// as paged pools and token-strided inputs often do.
inline void host_copy(void* dst, const void* src, std::size_t n) noexcept {
  auto* d = static_cast<std::byte*>(dst);
  const auto* s = static_cast<const std::byte*>(src);
  for (; n >= 256; n -= 256, d += 256, s += 256) std::memcpy(d, s, 256);
  for (; n >= 16; n -= 16, d += 16, s += 16) std::memcpy(d, s, 16);
  if (n) std::memcpy(d, s, n);
}

/// dst[i] = convert(src[i] * mul) for the row's n elements (divide:
/// convert(src[i] / mul), a write's engine-held scale); lane/nlanes split
/// the row among cooperating threads (host: 0/1). A raw move goes by 16-byte
/// vectors when aligned; `by_elements` forces element units instead, so a
/// kernel that rewrites a row it just read can give both passes the same
/// partition (no lane then reads bytes another lane writes). `stream`: the
/// host stores whole-line rows non-temporally (kStreamBytes).
KVCACHE_HOST_DEVICE inline void move_row(void* dst, DType dt, const void* src, DType st, std::int32_t n, float mul,
                                         std::int32_t lane, std::int32_t nlanes, bool by_elements = false,
                                         bool stream = false, bool divide = false) noexcept {
  const bool raw = raw_move(dt, st, mul);
  if (raw && !by_elements) {
    const std::int64_t bytes = std::int64_t{n} * dtype_bytes(dt);
#if !defined(__CUDA_ARCH__)
    if (nlanes == 1) {
#if KVCACHE_HOST_SIMD
      if (stream && simd::stream_copy(dst, src, bytes)) return;
#endif
      host_copy(dst, src, static_cast<std::size_t>(bytes));
      return;
    }
#endif
    if (((reinterpret_cast<std::uintptr_t>(dst) | reinterpret_cast<std::uintptr_t>(src) |
          static_cast<std::uintptr_t>(bytes)) & 15u) == 0) {
      for (std::int64_t i = lane; i < bytes / 16; i += nlanes)
        static_cast<Vec16*>(dst)[i] = static_cast<const Vec16*>(src)[i];
    } else {
      for (std::int64_t i = lane; i < bytes; i += nlanes)
        static_cast<std::byte*>(dst)[i] = static_cast<const std::byte*>(src)[i];
    }
    return;
  }
  if (raw) {
    const std::int64_t eb = dtype_bytes(dt);
    for (std::int32_t i = lane; i < n; i += nlanes)
      for (std::int64_t b = 0; b < eb; ++b)
        static_cast<std::byte*>(dst)[i * eb + b] = static_cast<const std::byte*>(src)[i * eb + b];
    return;
  }
  if (nlanes == 1) {  // one thread: a head row at a time through a float buffer, each type's switch once
    const std::int32_t done = fast_rows(dst, dt, src, st, n, mul, stream, divide);
    float buf[256];
    for (std::int32_t at = done; at < n; at += 256) {
      const std::int32_t m = n - at < 256 ? n - at : 256;
      load_row(st, static_cast<const std::byte*>(src) + row_bytes(st, at), buf, m);
      if (divide) store_row_divided(dt, static_cast<std::byte*>(dst) + row_bytes(dt, at), buf, mul, m);
      else store_row(dt, static_cast<std::byte*>(dst) + row_bytes(dt, at), buf, mul, m);
    }
    return;
  }
  for (std::int32_t i = lane; i < n; i += nlanes) {
    const float x = load_elem(st, src, i);
    store_elem(dt, dst, i, divide ? x / mul : x * mul);
  }
}

KVCACHE_END_NAMESPACE
