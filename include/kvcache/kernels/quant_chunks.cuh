// Quantized rows on CUDA, a chunk of 8 elements per thread: scatter loads
// its chunk of the input, the threads of a group (group / 8 of them, a
// power of two inside one warp) reduce the group's range with warp
// shuffles, and each stores its chunk's codes in one store; gather reads a
// chunk's codes in one load and its group's entry. The per-row path
// (quant_rows.hpp) gives a whole group to one thread, so a row of 128
// values in groups of 32 kept 4 threads busy and 28 idle.
//
// The arithmetic is the host's, value by value: the range is exact (integer
// max / min of the floats' bits), the scale comes from quant::group_scale,
// each code from quant::encode of the same product, so both backends write
// the same bits (tests/cuda/test_kernels_cuda.cpp checks them).
#pragma once

#include <cuda_runtime.h>

#include "quant.hpp"
#include "quant_rows.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace cuda_detail {

inline constexpr std::int32_t kChunk = 8;  // elements a thread moves

/// Rows of this pool go chunk by chunk, to or from `other` (the caller's
/// element type): codes of at most 8 bits (group scales, engine-held ones,
/// or the call's scale alone), whole chunks a row (a group is then whole
/// chunks too: 16 to 128 values), and a float type on the caller's side, so
/// every element converts (a raw copy of codes keeps the per-row path).
inline bool chunked_rows(const PoolView& v, DType other) noexcept {
  return dtype_bits(v.dtype) <= 8 && v.head_dim % kChunk == 0 &&
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
template <int N>
__device__ inline void move_bytes(void* dst, const void* src, const void* global) {
  const auto a = reinterpret_cast<std::uintptr_t>(global);
  if (move_words<N, uint4>(dst, src, a) || move_words<N, uint2>(dst, src, a) || move_words<N, std::uint32_t>(dst, src, a) ||
      move_words<N, std::uint16_t>(dst, src, a))
    return;
#pragma unroll
  for (int i = 0; i < N; ++i) static_cast<std::uint8_t*>(dst)[i] = static_cast<const std::uint8_t*>(src)[i];
}
// move_bytes of n (2, 4, 8, 16 or 32: a chunk of any element type) bytes.
__device__ inline void move_chunk_bytes(void* dst, const void* src, std::int32_t n, const void* global) {
  switch (n) {
    case 2: return move_bytes<2>(dst, src, global);
    case 4: return move_bytes<4>(dst, src, global);
    case 8: return move_bytes<8>(dst, src, global);
    case 16: return move_bytes<16>(dst, src, global);
    default: return move_bytes<32>(dst, src, global);
  }
}

// The lanes of the calling thread's aligned segment of `width` lanes (a
// power of two below 32). The launch keeps each group's threads in one such
// segment: a row is head_dim / 8 threads, a multiple of the group's.
__device__ inline unsigned segment_mask(std::int32_t width) {
  const unsigned lane = threadIdx.x & 31u;
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

/// Chunk c of one row of side kv: 8 elements of src (type st) times mul,
/// quantized into codes (the row's) and, with group scales, the row's
/// entries. Every thread of the chunk's group must call it (shuffles).
__device__ inline void store_chunk(const PoolView& v, std::int32_t kv, std::byte* codes, std::byte* entries,
                                   const std::byte* src, DType st, float mul, std::int32_t c) {
  float x[kChunk];
  alignas(16) std::uint8_t in[kChunk * 4];
  const std::byte* from = src + row_bytes(st, std::int64_t{c} * kChunk);
  move_chunk_bytes(in, from, static_cast<std::int32_t>(row_bytes(st, kChunk)), from);
  load_row(st, in, x, kChunk);
  for (std::int32_t i = 0; i < kChunk; ++i) x[i] *= mul;
  const SideFormat& f = side_format(v, kv);
  float inv = 1.0f, m = 0.0f;
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
    const quant::GroupScale g = quant::group_scale(v.dtype, f.minimum, lo, hi, amax);
    if (c % width == 0) {  // the group's first thread stores its entry
      std::byte* e = entries + c / width * group_entry_bytes(v.dtype, f);
      quant::store_entry_value(v.dtype, e, 0, g.scale);
      if (f.minimum) quant::store_entry_value(v.dtype, e, 1, g.minimum);
    }
    inv = g.scale > 0.0f ? 1.0f / g.scale : 0.0f;
    m = g.minimum;
  }
  // Codes as quant::quantize_group (group scales) or store_elem / the 4-bit
  // row loop (element-wise) compute them, packed as the pool holds them.
  const bool grouped = f.scales == Scales::group;
  std::uint32_t q[kChunk];
  for (std::int32_t i = 0; i < kChunk; ++i)
    q[i] = quant::encode(v.dtype, f.minimum, !grouped ? x[i] : f.minimum ? (x[i] - m) * inv : x[i] * inv);
  const std::int32_t bits = dtype_bits(v.dtype);
  // Element i at bit i * bits of a little-endian word: byte j holds
  // elements 8j / bits onwards, low bits first, as the pool packs them.
  alignas(16) std::uint64_t word = 0;
  for (std::int32_t i = 0; i < kChunk; ++i) word |= std::uint64_t{q[i]} << (i * bits);
  std::byte* to = codes + row_bytes(v.dtype, std::int64_t{c} * kChunk);
  move_chunk_bytes(to, &word, bits, to);  // 8 elements of `bits` bits: `bits` bytes
}

/// Chunk c of one row of side kv, dequantized (with its group's entry), times
/// mul, into out (the row's, type ot).
__device__ inline void load_chunk(const PoolView& v, std::int32_t kv, const std::byte* codes, const std::byte* entries,
                                  std::byte* out, DType ot, float mul, std::int32_t c) {
  const SideFormat& f = side_format(v, kv);
  alignas(16) std::uint8_t in[kChunk];
  const std::byte* from = codes + row_bytes(v.dtype, std::int64_t{c} * kChunk);
  move_chunk_bytes(in, from, dtype_bits(v.dtype), from);
  float x[kChunk];
  if (f.scales == Scales::group) {
    const quant::GroupScale g =
        quant::load_entry(v.dtype, f.minimum, entries + c * kChunk / f.group * group_entry_bytes(v.dtype, f));
    for (std::int32_t i = 0; i < kChunk; ++i) {
      const float q = quant::load_code(v.dtype, f.minimum, in, i);
      x[i] = f.minimum ? fmaf(q, g.scale, g.minimum) : q * g.scale;
    }
  } else {
    for (std::int32_t i = 0; i < kChunk; ++i) x[i] = quant::load_code(v.dtype, false, in, i);
  }
  alignas(16) std::uint8_t o[kChunk * 4];
  store_row(ot, o, x, mul, kChunk);
  std::byte* to = out + row_bytes(ot, std::int64_t{c} * kChunk);
  move_chunk_bytes(to, o, static_cast<std::int32_t>(row_bytes(ot, kChunk)), to);
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

}  // namespace cuda_detail
KVCACHE_END_NAMESPACE
