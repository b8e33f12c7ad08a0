// Launch shape shared by the CUDA launchers: items (tokens, planes, ...) go to
// CTAs in a grid-stride loop; inside a CTA, threads cover rows x lanes, where
// a lane moves one 16-byte vector (raw copies) or one element (conversions).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace cuda_detail {

// Lanes per row: the row's units (16-byte vectors when the bytes allow it,
// else elements), at most max_lanes.
inline std::int32_t lanes_for(DType dst, DType src, float mul, std::int32_t elems, std::int32_t max_lanes = 32) {
  const std::int64_t bytes = std::int64_t{elems} * dtype_bytes(dst);
  const std::int64_t units = raw_move(dst, src, mul) ? (bytes % 16 == 0 ? bytes / 16 : bytes) : elems;
  return static_cast<std::int32_t>(units < 1 ? 1 : (units > max_lanes ? max_lanes : units));
}

inline unsigned threads_for(std::int32_t rows, std::int32_t lanes) {
  const std::int64_t t = std::int64_t{rows} * lanes;
  const std::int64_t warps = (t + 31) / 32;
  return static_cast<unsigned>(warps * 32 > 1024 ? 1024 : (warps * 32 < 64 ? 64 : warps * 32));
}

inline unsigned grid_for(std::int64_t items) {
  constexpr std::int64_t kMaxGrid = 1 << 20;  // grid-stride beyond this
  return static_cast<unsigned>(items < 1 ? 1 : (items > kMaxGrid ? kMaxGrid : items));
}

inline cudaError_t invalid(const Status& st) { return st.ok() ? cudaSuccess : cudaErrorInvalidValue; }

}  // namespace cuda_detail
KVCACHE_END_NAMESPACE
