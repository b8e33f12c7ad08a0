// CUDA launcher of page selection. A CTA per row scores its candidate pages
// (the pages between the forced ones) into one segment per row; CUB's stable
// segmented sort ranks each segment (ties keep the lower page, as the host
// does); a CTA per row then marks its best pages and writes the row in
// logical page order. Rows that fit the budget are copied whole by the first
// kernel and their segments are empty. Scratch comes from the caller: ask
// page_select_cuda_scratch_bytes first. No allocation, no synchronization.
#pragma once

#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>
#include <cub/device/device_segmented_sort.cuh>

#include "kvcache/kernels/cuda/launch.cuh"
#include "kvcache/kernels/page_select.hpp"

KVCACHE_BEGIN_NAMESPACE

namespace cuda_detail {
struct PageSelectScratch : SortScratch {
  std::uint8_t* chosen;  // [items]: a row's picked pages, by logical index
};
// Carves `base` (nullptr: sizes only) for `items` = pages x kv-heads entries and `rows` rows; returns total bytes.
inline cudaError_t carve_page_select(void* base, std::int64_t items, std::int64_t rows, PageSelectScratch& s, std::size_t& total) {
  const auto n = std::size_t(items), r = std::size_t(rows);
  const std::size_t sizes[7] = {align256(n * 4), align256(n * 4), align256(n * 4), align256(n * 4),
                                align256(r * 4), align256(r * 4), align256(n)};
  s.cub_bytes = 0;
  cudaError_t err = cub::DeviceSegmentedSort::StableSortPairsDescending(
      nullptr, s.cub_bytes, static_cast<const float*>(nullptr), static_cast<float*>(nullptr),
      static_cast<const std::int32_t*>(nullptr), static_cast<std::int32_t*>(nullptr), static_cast<std::int64_t>(n),
      static_cast<std::int64_t>(r), static_cast<const std::int32_t*>(nullptr), static_cast<const std::int32_t*>(nullptr));
  if (err != cudaSuccess) return err;
  void** slots[7] = {reinterpret_cast<void**>(&s.keys_in), reinterpret_cast<void**>(&s.keys_out),
                     reinterpret_cast<void**>(&s.vals_in), reinterpret_cast<void**>(&s.vals_out),
                     reinterpret_cast<void**>(&s.begin), reinterpret_cast<void**>(&s.end),
                     reinterpret_cast<void**>(&s.chosen)};
  total = carve_buffers(base, slots, sizes, 7, &s.cub_temp, s.cub_bytes);
  return cudaSuccess;
}

// Row r = (s, h): its entries start at indptr[s] x H + h x n (n: pages of s).
static __global__ void page_select_score_kernel(PageSelectParams p, PageSelectScratch s) {
  const std::int64_t rows = std::int64_t{p.num_seqs} * p.num_kv_heads;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const auto seq = static_cast<std::int32_t>(r / p.num_kv_heads), h = static_cast<std::int32_t>(r % p.num_kv_heads);
    const std::int32_t first = p.indptr[seq], n = p.indptr[seq + 1] - first;
    const std::int32_t base = first * p.num_kv_heads + h * n;
    const std::int32_t* pages = p.indices + first;
    if (n <= p.budget) {  // everything fits: copied, nothing to rank
      if (threadIdx.x == 0) s.begin[r] = s.end[r] = base;
      for (std::int32_t j = static_cast<std::int32_t>(threadIdx.x); j < n; j += static_cast<std::int32_t>(blockDim.x))
        p.out_indices[p.out_indptr[r] + j] = pages[j];
      continue;
    }
    const std::int32_t lo = p.first_pages, hi = n - p.last_pages;
    if (threadIdx.x == 0) {
      s.begin[r] = base + lo;
      s.end[r] = base + hi;
    }
    for (std::int32_t j = lo + static_cast<std::int32_t>(threadIdx.x); j < hi; j += static_cast<std::int32_t>(blockDim.x)) {
      s.keys_in[base + j] = page_select_bound(p, seq, h, pages[j]);
      s.vals_in[base + j] = j;
      s.chosen[base + j] = 0;
    }
  }
}

// The row's best pages (the head of its sorted segment) in logical order, between the forced ones.
template <int kThreads>
static __global__ void page_select_emit_kernel(PageSelectParams p, PageSelectScratch s) {
  using Scan = cub::BlockScan<std::int32_t, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ std::int32_t carry;
  const std::int64_t rows = std::int64_t{p.num_seqs} * p.num_kv_heads;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const auto seq = static_cast<std::int32_t>(r / p.num_kv_heads), h = static_cast<std::int32_t>(r % p.num_kv_heads);
    const std::int32_t first = p.indptr[seq], n = p.indptr[seq + 1] - first;
    if (n <= p.budget) continue;
    const std::int32_t base = first * p.num_kv_heads + h * n, lo = p.first_pages, hi = n - p.last_pages;
    const std::int32_t pick = p.budget - p.first_pages - p.last_pages;
    const std::int32_t* pages = p.indices + first;
    std::int32_t* out = p.out_indices + p.out_indptr[r];
    for (std::int32_t k = static_cast<std::int32_t>(threadIdx.x); k < pick; k += kThreads) s.chosen[base + s.vals_out[base + lo + k]] = 1;
    for (std::int32_t j = static_cast<std::int32_t>(threadIdx.x); j < lo; j += kThreads) out[j] = pages[j];
    for (std::int32_t j = hi + static_cast<std::int32_t>(threadIdx.x); j < n; j += kThreads) out[p.budget - (n - j)] = pages[j];
    if (threadIdx.x == 0) carry = lo;
    __syncthreads();
    for (std::int32_t tile = lo; tile < hi; tile += kThreads) {  // ascending: each chosen page at its rank among the chosen
      const std::int32_t j = tile + static_cast<std::int32_t>(threadIdx.x);
      const std::int32_t flag = j < hi ? s.chosen[base + j] : 0;
      std::int32_t before = 0, total = 0;
      Scan(scan).ExclusiveSum(flag, before, total);
      if (flag) out[carry + before] = pages[j];
      __syncthreads();
      if (threadIdx.x == 0) carry += total;
      __syncthreads();
    }
  }
}
}  // namespace cuda_detail

/// Scratch bytes page_select_cuda needs for a batch of `num_pages` pages
/// (indptr[num_seqs]) over `num_seqs` sequences of `num_kv_heads` heads (asks CUB).
inline cudaError_t page_select_cuda_scratch_bytes(std::int32_t num_pages, std::int32_t num_seqs, std::int32_t num_kv_heads,
                                                  std::size_t* bytes) {
  if (!bytes || num_pages < 0 || num_seqs < 0 || num_kv_heads < 1) return cudaErrorInvalidValue;
  cuda_detail::PageSelectScratch s{};
  return cuda_detail::carve_page_select(nullptr, std::int64_t{num_pages} * num_kv_heads, std::int64_t{num_seqs} * num_kv_heads,
                                        s, *bytes);
}

/// CUDA launcher of page_select on `stream`: the host backend's choices, bit
/// for bit. The host checks what it can see (shape, budget, scratch size);
/// the CSR, the blocks and out_indptr live on the device and are the
/// caller's (page_select_indptr computes out_indptr on the host). A NaN
/// query makes that page's bound -inf instead of failing.
inline cudaError_t page_select_cuda(const PageSelectParams& p, cudaStream_t stream) {
  if (auto st = check_page_select_shape(p); !st) return cuda_detail::invalid(st);
  if (p.num_seqs == 0) return cudaSuccess;
  const std::int64_t items = std::int64_t{p.num_pages} * p.num_kv_heads, rows = std::int64_t{p.num_seqs} * p.num_kv_heads;
  if (items > INT32_MAX) return cudaErrorInvalidValue;
  cuda_detail::PageSelectScratch s{};
  std::size_t need = 0;
  if (cudaError_t err = cuda_detail::carve_page_select(p.scratch, items, rows, s, need); err != cudaSuccess) return err;
  if (!p.scratch || p.scratch_bytes < need) return cudaErrorInvalidValue;
  constexpr int kThreads = 256;
  cuda_detail::page_select_score_kernel<<<cuda_detail::grid_for(rows), 128, 0, stream>>>(p, s);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  if (cudaError_t err = cub::DeviceSegmentedSort::StableSortPairsDescending(s.cub_temp, s.cub_bytes, s.keys_in, s.keys_out,
                                                                            s.vals_in, s.vals_out, items, rows, s.begin,
                                                                            s.end, stream);
      err != cudaSuccess)
    return err;
  cuda_detail::page_select_emit_kernel<kThreads><<<cuda_detail::grid_for(rows), kThreads, 0, stream>>>(p, s);
  return cudaGetLastError();
}

KVCACHE_END_NAMESPACE
