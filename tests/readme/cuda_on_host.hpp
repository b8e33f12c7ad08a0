// The few CUDA runtime names the README's GPU snippets use, on the host: each
// *_cuda launcher runs the host backend (which validates everything the CUDA
// side would skip) and throws on an error; "device" pointers are host memory.
// test_readme runs the GPU snippets through this without a GPU; readme_cuda.cu
// compiles the same snippets against the real launchers with nvcc.
#pragma once

#include <cstddef>
#include <cstring>
#include <stdexcept>

#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/page_bounds.hpp>
#include <kvcache/kernels/page_select.hpp>
#include <kvcache/kernels/ring_admit.hpp>
#include <kvcache/kernels/rope.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kernels/write_gate.hpp>

using cudaStream_t = struct HostStream*;
enum cudaError_t { cudaSuccess = 0 };
enum cudaMemcpyKind { cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2 };

inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind, cudaStream_t) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return cudaSuccess;
}

KVCACHE_BEGIN_NAMESPACE
namespace readme_detail {
inline cudaError_t ran(const Status& st) {
  if (!st) throw std::runtime_error("host kernel: " + st.message());
  return cudaSuccess;
}
}  // namespace readme_detail

inline cudaError_t scatter_cuda(const ScatterParams& p, cudaStream_t) { return readme_detail::ran(scatter_host(p)); }
inline cudaError_t block_copy_cuda(const BlockCopyParams& p, cudaStream_t) {
  return readme_detail::ran(block_copy_host(p));
}
inline cudaError_t compaction_cuda(const CompactionParams& p, cudaStream_t) {
  return readme_detail::ran(compaction_host(p));
}
inline cudaError_t rope_cuda(const RopeParams& p, cudaStream_t) { return readme_detail::ran(rope_host(p)); }
inline cudaError_t ring_admit_cuda(const RingAdmitParams& p, cudaStream_t) { return readme_detail::ran(ring_admit_host(p)); }
inline cudaError_t write_gate_cuda(const WriteGateParams& p, cudaStream_t) {
  return readme_detail::ran(write_gate_host(p));
}
inline cudaError_t page_bounds_cuda(const PageBoundsParams& p, cudaStream_t) { return readme_detail::ran(page_bounds_host(p)); }
inline cudaError_t page_bounds_update_cuda(const PageBoundsUpdateParams& p, cudaStream_t) {
  return readme_detail::ran(page_bounds_update_host(p));
}
inline cudaError_t page_select_cuda(const PageSelectParams& p, cudaStream_t) { return readme_detail::ran(page_select_host(p)); }
// What the host backend needs: the batch's page count bounds its longest row.
inline cudaError_t page_select_cuda_scratch_bytes(std::int32_t num_pages, std::int32_t, std::int32_t kv_heads, std::size_t* bytes) {
  *bytes = page_select_scratch_bytes(num_pages, kv_heads);
  return cudaSuccess;
}
KVCACHE_END_NAMESPACE
