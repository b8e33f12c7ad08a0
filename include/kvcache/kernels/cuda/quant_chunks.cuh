// Quantized rows on CUDA, a chunk of 8 elements per thread: scatter loads
// its chunk of the input, the threads of a group (group / 8 of them, a
// power of two inside one warp) reduce the group's range with warp
// shuffles, and each stores its chunk's codes in one store; gather reads a
// chunk's codes in one load and its group's entry. The per-row path
// (kernels/detail/quant_rows.hpp) gives a whole group to one thread, so a row of 128
// values in groups of 32 kept 4 threads busy and 28 idle.
//
// The arithmetic is the host's, value by value: the range is exact (integer
// max / min of the floats' bits), the scale comes from quant::group_scale,
// each code from quant::encode of the same product, so both backends write
// the same bits (tests/cuda/test_quant_cuda.cpp checks them). f16 goes
// through the hardware's converts where their bits are the portable code's.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "kvcache/kernels/cuda/launch.cuh"
#include "kvcache/kernels/detail/quant.hpp"
#include "kvcache/kernels/detail/quant_rows.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace cuda_detail {

inline constexpr std::int32_t kChunk = 8;  // elements a thread moves

/// Rows of this pool go chunk by chunk, to or from `other` (the caller's
/// element type): codes of at most 8 bits (group scales, engine-held ones,
/// or the call's scale alone), whole chunks a row (a group is then whole
/// chunks too: 16 to 128 values), and a float type on the caller's side, so
/// every element converts (a raw copy of codes keeps the per-row path).
/// Channel scales (an entry per element) keep the per-row path too.
inline bool chunked_rows(const PoolView& v, DType other) noexcept {
  return dtype_bits(v.dtype) <= 8 && v.head_dim % kChunk == 0 && v.format.k.scales != Scales::channel &&
         v.format.v.scales != Scales::channel &&
         (other == DType::f32 || other == DType::f16 || other == DType::bf16);
}

// N bytes between a pool or caller row (global) and a 16-byte-aligned local
// buffer, in the widest words the global address allows: a chunk of 8 codes
// is one 8-byte load or store, 8 fp16 inputs one 16-byte one. N is a
// constant, so the buffer stays in registers.
template <int N, class W>
__device__ inline bool move_words(void* dst, const void* src, std::uintptr_t global) {
  if constexpr (N % sizeof(W) != 0) {
    return false;
  } else {
    if (global % sizeof(W) != 0) return false;
#pragma unroll
    for (int i = 0; i < N / static_cast<int>(sizeof(W)); ++i) static_cast<W*>(dst)[i] = static_cast<const W*>(src)[i];
    return true;
  }
}
// Aligned: the global address is a multiple of min(N, 16) (the launcher
// checked the bases and strides), so no test on the device.
template <int N, bool Aligned>
__device__ inline void move_bytes(void* dst, const void* src, const void* global) {
  if constexpr (Aligned) {  // the launcher checked every chunk's address: the widest word that divides N
    if constexpr (N % 16 == 0) move_words<N, uint4>(dst, src, 0);
    else if constexpr (N % 8 == 0) move_words<N, uint2>(dst, src, 0);
    else if constexpr (N % 4 == 0) move_words<N, std::uint32_t>(dst, src, 0);
    else move_words<N, std::uint16_t>(dst, src, 0);
    return;
  }
  const auto a = reinterpret_cast<std::uintptr_t>(global);
  if (move_words<N, uint4>(dst, src, a) || move_words<N, uint2>(dst, src, a) || move_words<N, std::uint32_t>(dst, src, a) ||
      move_words<N, std::uint16_t>(dst, src, a))
    return;
#pragma unroll
  for (int i = 0; i < N; ++i) static_cast<std::uint8_t*>(dst)[i] = static_cast<const std::uint8_t*>(src)[i];
}
// The lanes of the calling thread's aligned segment of `width` lanes (a
// power of two below 32). The launch keeps each group's threads in one such
// segment: a row is head_dim / 8 threads, a multiple of the group's.
__device__ inline unsigned segment_mask(std::int32_t width) {
  unsigned lane;  // the warp lane (a CTA's rows may span threadIdx.y)
  asm("mov.u32 %0, %%laneid;" : "=r"(lane));
  return ((1u << width) - 1u) << (lane & ~static_cast<unsigned>(width - 1));
}
template <class T>
__device__ inline T segment_max(T v, unsigned mask, std::int32_t width) {
  for (std::int32_t o = width / 2; o > 0; o /= 2) {
    const T u = __shfl_xor_sync(mask, v, o, width);
    v = u > v ? u : v;
  }
  return v;
}
template <class T>
__device__ inline T segment_min(T v, unsigned mask, std::int32_t width) {
  for (std::int32_t o = width / 2; o > 0; o /= 2) {
    const T u = __shfl_xor_sync(mask, v, o, width);
    v = u < v ? u : v;
  }
  return v;
}

// f16 <-> f32 through the hardware's converts where they give the portable
// code's bits (cvt::f16_to_f32 / f32_to_f16): both round to nearest even and
// keep subnormals and infinities; only a NaN differs (the hardware's is
// canonical), so a NaN takes the portable answer. f16 -> f32 then runs on
// the FMA pipe, where the portable code's int -> float step takes the slow
// conversion unit for every element.
__device__ inline float f16_to_f32(std::uint16_t h) {
  const std::uint32_t em = h & 0x7fffu;
  const float nan = cvt::from_bits((std::uint32_t{h & 0x8000u} << 16) | (em << 13) | 0x7f800000u);
  return em > 0x7c00u ? nan : __half2float(__ushort_as_half(h));
}
__device__ inline std::uint32_t f32x2_to_f16x2(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  std::uint32_t r = reinterpret_cast<const std::uint32_t&>(h);
  const std::uint32_t ua = cvt::bits(a), ub = cvt::bits(b);
  if ((ua & 0x7fffffffu) > 0x7f800000u) r = (r & 0xffff0000u) | ((ua >> 16) & 0x8000u) | 0x7e00u;
  if ((ub & 0x7fffffffu) > 0x7f800000u) r = (r & 0x0000ffffu) | (ub & 0x80000000u) | 0x7e000000u;
  return r;
}

/// The chunk (8 elements) of the caller's at `from` (type st, a float
/// type), divided by div (the write's scale: x / div, one IEEE division, as
/// the host's store_row_divided), as floats: load_row's conversions, each
/// type with its own fixed-size buffer so the buffers stay in registers.
template <bool Aligned>
__device__ inline void read_chunk(const std::byte* from, DType st, float div, float* x) {
  if (st == DType::f32) {
    alignas(16) float w[kChunk];
    move_bytes<32, Aligned>(w, from, from);
    for (std::int32_t i = 0; i < kChunk; ++i) x[i] = __fdiv_rn(w[i], div);
    return;
  }
  alignas(16) std::uint16_t w[kChunk];
  move_bytes<16, Aligned>(w, from, from);
  for (std::int32_t i = 0; i < kChunk; ++i) x[i] = __fdiv_rn(st == DType::f16 ? f16_to_f32(w[i]) : cvt::bf16_to_f32(w[i]), div);
}

/// x (chunk c of one row of side kv, already divided by the row's scale)
/// quantized into codes (the row's) and, with group scales, the row's
/// entries. Every thread of the chunk's group must call it (shuffles).
template <DType C, bool Aligned>
__device__ inline void quantize_chunk_as(const PoolView& v, std::int32_t kv, std::byte* codes, std::byte* entries, const float* x,
                                      std::int32_t c) {
  const SideFormat& f = side_format(v, kv);
  float s = 1.0f, m = 0.0f;
  if (f.scales == Scales::group) {
    const std::int32_t width = f.group / kChunk;
    const unsigned mask = segment_mask(width);
    float lo = 0.0f, hi = 0.0f, amax = 0.0f;
    if (f.minimum) {
      std::int32_t kmin = 0, kmax = 0;
      quant::key_range(x, kChunk, kmin, kmax);
      lo = quant::from_order_key(segment_min(kmin, mask, width));
      hi = quant::from_order_key(segment_max(kmax, mask, width));
    } else {  // |x| orders as its bits without the sign
      std::uint32_t a = 0;
      for (std::int32_t i = 0; i < kChunk; ++i) {
        const std::uint32_t b = cvt::bits(x[i]) & 0x7fffffffu;
        a = b > a ? b : a;
      }
      amax = cvt::from_bits(segment_max(a, mask, width));
    }
    const quant::GroupScale g = quant::group_scale(C, f.minimum, lo, hi, amax);
    if (c % width == 0) {  // the group's first thread stores its entry
      std::byte* e = entries + c / width * group_entry_bytes(C, f);
      quant::store_entry_value(C, e, 0, g.scale);
      if (f.minimum) quant::store_entry_value(C, e, 1, g.minimum);
    }
    s = g.scale;
    m = g.minimum;
  }
  // Codes as quant::quantize_group (group scales) or store_elem / the 4-bit
  // row loop (element-wise) compute them, packed as the pool holds them.
  const bool grouped = f.scales == Scales::group;
  std::uint32_t q[kChunk];
  for (std::int32_t i = 0; i < kChunk; ++i)
    q[i] = quant::encode(C, f.minimum, !grouped ? x[i] : quant::quotient(f.minimum ? x[i] - m : x[i], s));
  constexpr std::int32_t bits = dtype_bits(C);
  // Element i at bit i * bits of a little-endian word: byte j holds
  // elements 8j / bits onwards, low bits first, as the pool packs them.
  alignas(16) std::uint64_t word = 0;
  for (std::int32_t i = 0; i < kChunk; ++i) word |= std::uint64_t{q[i]} << (i * bits);
  std::byte* to = codes + row_bytes(C, std::int64_t{c} * kChunk);
  move_bytes<bits, Aligned>(to, &word, to);  // 8 elements of `bits` bits: `bits` bytes
}

/// f(std::integral_constant<DType, C>{}) for the pool's code type C (one
/// of at most 8 bits): one switch for many chunks, where quant::encode's
/// own switch would run per element (a jump table on a GPU, costlier than
/// the conversion).
template <class F>
__device__ inline void with_chunk_code(DType code, F&& f) {
  switch (code) {
    case DType::int8: return f(std::integral_constant<DType, DType::int8>{});
    case DType::fp8_e4m3: return f(std::integral_constant<DType, DType::fp8_e4m3>{});
    case DType::fp8_e5m2: return f(std::integral_constant<DType, DType::fp8_e5m2>{});
    case DType::int4: return f(std::integral_constant<DType, DType::int4>{});
    case DType::fp4_e2m1: return f(std::integral_constant<DType, DType::fp4_e2m1>{});
    case DType::int2: return f(std::integral_constant<DType, DType::int2>{});
    default: return;  // chunked_rows admits these only
  }
}

/// Chunk c of one row of side kv, dequantized with its group's entry (not
/// yet times the row's multiplier), into x.
template <DType C, bool Aligned>
__device__ inline void dequantize_chunk_as(const PoolView& v, std::int32_t kv, const std::byte* codes, const std::byte* entries,
                                        std::int32_t c, float* x) {
  const SideFormat& f = side_format(v, kv);
  alignas(16) std::uint8_t in[kChunk];
  const std::byte* from = codes + row_bytes(C, std::int64_t{c} * kChunk);
  move_bytes<dtype_bits(C), Aligned>(in, from, from);
  if (f.scales == Scales::group) {
    const quant::GroupScale g =
        quant::load_entry(C, f.minimum, entries + c * kChunk / f.group * group_entry_bytes(C, f));
    for (std::int32_t i = 0; i < kChunk; ++i) {
      const float q = quant::load_code(C, f.minimum, in, i);
      x[i] = f.minimum ? fmaf(q, g.scale, g.minimum) : q * g.scale;
    }
  } else {
    for (std::int32_t i = 0; i < kChunk; ++i) x[i] = quant::load_code(C, false, in, i);
  }
}

/// x times mul as the caller's chunk at `to` (type ot, a float type):
/// store_row's conversions, with read_chunk's fixed-size buffers.
template <bool Aligned>
__device__ inline void write_chunk(std::byte* to, DType ot, float mul, const float* x) {
  if (ot == DType::f32) {
    alignas(16) float w[kChunk];
    for (std::int32_t i = 0; i < kChunk; ++i) w[i] = x[i] * mul;
    move_bytes<32, Aligned>(to, w, to);
    return;
  }
  alignas(16) std::uint32_t w[kChunk / 2];
  for (std::int32_t i = 0; i < kChunk; i += 2)
    w[i / 2] = ot == DType::f16 ? f32x2_to_f16x2(x[i] * mul, x[i + 1] * mul)
                                : cvt::f32_to_bf16(x[i] * mul) | std::uint32_t{cvt::f32_to_bf16(x[i + 1] * mul)} << 16;
  move_bytes<16, Aligned>(to, w, to);
}

/// row_entries without its division: a plane's rows in codes order are
/// `token` rows apart per token and `head` rows per head (a pool's strides
/// are whole rows), worked out once on the host. Null for a side without
/// group scales (nothing reads it).
struct EntryRows {
  std::int64_t token = 0, head = 0;
  static EntryRows of(const PoolView& v) noexcept {
    const std::int64_t rb = row_bytes(v.dtype, v.head_dim);
    return {v.strides.token / rb, v.strides.head / rb};
  }
  __device__ std::byte* at(const PoolView& v, std::int64_t block, std::int32_t layer, std::int32_t kv, std::int32_t token_at,
                           std::int32_t head_at) const {
    if (side_format(v, kv).scales != Scales::group) return nullptr;
    return v.row(block, layer, kv, 0, 0) + v.scales_offset + (token_at * token + head_at * head) * row_entry_bytes(v, kv);
  }
};

/// Every code chunk of this pool starts at a multiple of its size (`bits`
/// bytes: 8, 4 or 2): base and strides allow the Aligned moves.
inline bool chunks_aligned(const PoolView& v) noexcept {
  const Strides& s = v.strides;
  const auto base = static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(v.base) & 15u);
  return ((base | s.block | s.layer | s.kv | s.token | s.head) & (dtype_bits(v.dtype) - 1)) == 0;
}

// Rows of chunks. A CTA's threads are planes x heads x chunks along x, for
// blockDim.y items along y. A thread's (K|V, head, chunk) is fixed, so what
// depends on it alone (its row bases, its multiplier: Rows::Th) is worked
// out once, and at prefill sizes each thread takes several items in turn.
// The pool's code type is switched on once, outside the item loop. Measured
// on an H200 (ncu), the one-item-a-CTA loop before this was compute-bound
// at about 590 instructions a chunk, most of them addressing and dispatch.
// Rows gives `Th thread(kv, head, chunk)`, `DType code()` and
// `item<C>(const Th&, item)`. A CTA may be 1,024 threads: at most 64
// registers each.
template <class Rows>
static __global__ void __launch_bounds__(1024) chunk_rows_kernel(Rows rows, std::int64_t items, std::int32_t heads, std::int32_t chunks) {
  const auto t = static_cast<std::int32_t>(threadIdx.x), r = t / chunks;
  const typename Rows::Th th = rows.thread(r / heads, r % heads, t % chunks);
  const std::int64_t first = std::int64_t{blockIdx.x} * blockDim.y + threadIdx.y, step = std::int64_t{gridDim.x} * blockDim.y;
  with_chunk_code(rows.code(), [&](auto code) {
    for (std::int64_t it = first; it < items; it += step) rows.template item<decltype(code)::value>(th, it);
  });
}

/// One item of a Rows outside chunk_rows_kernel: the generic row loop's
/// body (`operator()` of ScatterChunks / GatherChunks).
template <class Rows>
__device__ inline void chunk_row_item(const Rows& rows, std::int64_t it, std::int32_t kv, std::int32_t head, std::int32_t chunk) {
  const typename Rows::Th th = rows.thread(kv, head, chunk);
  with_chunk_code(rows.code(), [&](auto code) { rows.template item<decltype(code)::value>(th, it); });
}

/// Launches `fast` (Aligned moves) when `aligned` and a row set fits one
/// CTA, else `generic` in the generic row loop. Small batches (decode) give
/// each thread one item, for parallelism; large ones (prefill, 4,096 items
/// or more) eight, so the per-thread set-up is paid once for eight.
template <class Fast, class Generic>
inline cudaError_t launch_chunk_rows(const Fast& fast, const Generic& generic, bool aligned, std::int64_t items,
                                     std::int32_t heads, std::int32_t chunks, std::int32_t planes, cudaStream_t stream) {
  const std::int32_t x = planes * heads * chunks;
  if (!aligned || x > 1024) return launch_kv_rows(generic, items, heads, chunks, stream, planes);
  const std::int64_t y = x >= 256 ? 1 : 256 / x, per_thread = items < 4096 ? 1 : 8;
  const dim3 block(static_cast<unsigned>(x), static_cast<unsigned>(y));
  chunk_rows_kernel<<<grid_for((items + y * per_thread - 1) / (y * per_thread)), block, 0, stream>>>(fast, items, heads, chunks);
  return cudaGetLastError();
}

}  // namespace cuda_detail
KVCACHE_END_NAMESPACE
