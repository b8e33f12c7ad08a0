// CUDA launchers of score reduction and top-k selection. Selection sorts each
// stream's scores with CUB's stable segmented sort (ties keep the lower
// position), after mapping -0 to +0 as the host backend does. Scratch comes
// from the caller: ask select_scratch_bytes first.
#pragma once

#include <cuda_runtime.h>

#include <cub/device/device_segmented_sort.cuh>

#include "kvcache/kernels/cuda/launch.cuh"
#include "kvcache/kernels/scores.hpp"

KVCACHE_BEGIN_NAMESPACE

static __global__ void score_kernel(ScoreParams p) {
  const std::int64_t n = std::int64_t{p.num_streams} * p.max_keys;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x)
    score_elem(p, static_cast<std::int32_t>(i / p.max_keys), static_cast<std::int32_t>(i % p.max_keys));
}

/// CUDA launcher of scores on `stream`; returns the launch's error, never synchronizes.
inline cudaError_t scores_cuda(const ScoreParams& p, cudaStream_t stream) {
  if (auto st = check_score_shape(p); !st) return cuda_detail::invalid(st);
  const std::int64_t n = std::int64_t{p.num_streams} * p.max_keys;
  if (n == 0) return cudaSuccess;
  score_kernel<<<cuda_detail::grid_for((n + 255) / 256), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

namespace cuda_detail {
using SelectScratch = SortScratch;
// Carves `base` (nullptr: sizes only) into the buffers; returns total bytes.
inline cudaError_t carve(void* base, std::int32_t streams, std::int32_t max_keys, SelectScratch& s, std::size_t& total) {
  const std::size_t n = std::size_t(streams) * std::size_t(max_keys);
  const std::size_t sizes[6] = {align256(n * 4), align256(n * 4), align256(n * 4), align256(n * 4),
                                align256(std::size_t(streams) * 4), align256(std::size_t(streams) * 4)};
  s.cub_bytes = 0;
  cudaError_t err = cub::DeviceSegmentedSort::StableSortPairs(nullptr, s.cub_bytes, static_cast<const float*>(nullptr),
                                                              static_cast<float*>(nullptr), static_cast<const std::int32_t*>(nullptr),
                                                              static_cast<std::int32_t*>(nullptr), static_cast<std::int64_t>(n),
                                                              streams, static_cast<const std::int32_t*>(nullptr),
                                                              static_cast<const std::int32_t*>(nullptr));
  if (err != cudaSuccess) return err;
  void** slots[6] = {reinterpret_cast<void**>(&s.keys_in), reinterpret_cast<void**>(&s.keys_out),
                     reinterpret_cast<void**>(&s.vals_in), reinterpret_cast<void**>(&s.vals_out),
                     reinterpret_cast<void**>(&s.begin), reinterpret_cast<void**>(&s.end)};
  total = carve_buffers(base, slots, sizes, 6, &s.cub_temp, s.cub_bytes);
  return cudaSuccess;
}

static __global__ void select_prepare(const float* scores, const std::int32_t* lengths, std::int32_t streams,
                               std::int32_t max_keys, SelectScratch s) {
  const std::int64_t n = std::int64_t{streams} * max_keys;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x) {
    const float v = scores[i];
    s.keys_in[i] = cvt::bits(v) == 0x80000000u ? 0.0f : v;
    s.vals_in[i] = static_cast<std::int32_t>(i % max_keys);
    if (i % max_keys == 0) {
      const auto st = static_cast<std::int32_t>(i / max_keys);
      s.begin[st] = static_cast<std::int32_t>(i);
      s.end[st] = static_cast<std::int32_t>(i) + lengths[st];
    }
  }
}

static __global__ void select_finish(const std::int32_t* lengths, std::int32_t streams, std::int32_t max_keys, std::int32_t k,
                              SelectScratch s, std::int32_t* out) {
  const std::int64_t n = std::int64_t{streams} * k;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x) {
    const auto st = static_cast<std::int32_t>(i / k), j = static_cast<std::int32_t>(i % k);
    out[i] = j < lengths[st] ? s.vals_out[std::int64_t{st} * max_keys + j] : -1;
  }
}
}  // namespace cuda_detail

/// Scratch bytes select_cuda needs for this shape (asks CUB: needs a device).
inline cudaError_t select_scratch_bytes(std::int32_t num_streams, std::int32_t max_keys, std::size_t* bytes) {
  cuda_detail::SelectScratch s{};
  return cuda_detail::carve(nullptr, num_streams, max_keys, s, *bytes);
}

/// Same contract as select_host; scores are not checked for NaN on the device.
inline cudaError_t select_cuda(const float* scores, const std::int32_t* lengths, std::int32_t num_streams,
                               std::int32_t max_keys, std::int32_t k, bool lowest, std::int32_t* out, void* scratch,
                               std::size_t scratch_bytes, cudaStream_t stream) {
  if (k < 0 || k > max_keys || num_streams < 0 || max_keys < 0) return cudaErrorInvalidValue;
  if (num_streams == 0 || k == 0) return cudaSuccess;
  cuda_detail::SelectScratch s{};
  std::size_t need = 0;
  if (cudaError_t err = cuda_detail::carve(scratch, num_streams, max_keys, s, need); err != cudaSuccess) return err;
  if (!scratch || scratch_bytes < need) return cudaErrorInvalidValue;
  const std::int64_t n = std::int64_t{num_streams} * max_keys;
  cuda_detail::select_prepare<<<cuda_detail::grid_for((n + 255) / 256), 256, 0, stream>>>(scores, lengths, num_streams,
                                                                                           max_keys, s);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  cudaError_t err =
      lowest ? cub::DeviceSegmentedSort::StableSortPairs(s.cub_temp, s.cub_bytes, s.keys_in, s.keys_out, s.vals_in,
                                                         s.vals_out, n, num_streams, s.begin, s.end, stream)
             : cub::DeviceSegmentedSort::StableSortPairsDescending(s.cub_temp, s.cub_bytes, s.keys_in, s.keys_out,
                                                                   s.vals_in, s.vals_out, n, num_streams, s.begin,
                                                                   s.end, stream);
  if (err != cudaSuccess) return err;
  cuda_detail::select_finish<<<cuda_detail::grid_for((std::int64_t{num_streams} * k + 255) / 256), 256, 0, stream>>>(
      lengths, num_streams, max_keys, k, s, out);
  return cudaGetLastError();
}

KVCACHE_END_NAMESPACE
