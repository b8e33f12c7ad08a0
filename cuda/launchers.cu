#include "launchers.hpp"

#include <kvcache/kernels/block_copy.cuh>
#include <kvcache/kernels/compaction.cuh>
#include <kvcache/kernels/gather.cuh>
#include <kvcache/kernels/page_bounds.cuh>
#include <kvcache/kernels/page_select.cuh>
#include <kvcache/kernels/ring_admit.cuh>
#include <kvcache/kernels/ring_write.cuh>
#include <kvcache/kernels/rope.cuh>
#include <kvcache/kernels/scatter.cuh>
#include <kvcache/kernels/seal.cuh>
#include <kvcache/kernels/scores.cuh>
#include <kvcache/kernels/write_gate.cuh>

namespace kvgpu {
cudaError_t scatter(const kv::ScatterParams& p, cudaStream_t s) { return kv::scatter_cuda(p, s); }
cudaError_t gather(const kv::GatherParams& p, cudaStream_t s) { return kv::gather_cuda(p, s); }
cudaError_t seal_blocks(const kv::SealParams& p, cudaStream_t s) { return kv::seal_blocks_cuda(p, s); }
cudaError_t block_copy(const kv::BlockCopyParams& p, cudaStream_t s) { return kv::block_copy_cuda(p, s); }
cudaError_t ring_write(const kv::RingWriteParams& p, cudaStream_t s) { return kv::ring_write_cuda(p, s); }
cudaError_t compaction(const kv::CompactionParams& p, cudaStream_t s) { return kv::compaction_cuda(p, s); }
cudaError_t rope(const kv::RopeParams& p, cudaStream_t s) { return kv::rope_cuda(p, s); }
cudaError_t scores(const kv::ScoreParams& p, cudaStream_t s) { return kv::scores_cuda(p, s); }
cudaError_t select_scratch_bytes(std::int32_t streams, std::int32_t max_keys, std::size_t* bytes) {
  return kv::select_scratch_bytes(streams, max_keys, bytes);
}
cudaError_t select(const float* scores, const std::int32_t* lengths, std::int32_t streams, std::int32_t max_keys,
                   std::int32_t k, bool lowest, std::int32_t* out, void* scratch, std::size_t scratch_bytes,
                   cudaStream_t s) {
  return kv::select_cuda(scores, lengths, streams, max_keys, k, lowest, out, scratch, scratch_bytes, s);
}
cudaError_t page_bounds(const kv::PageBoundsParams& p, cudaStream_t s) { return kv::page_bounds_cuda(p, s); }
cudaError_t page_bounds_update(const kv::PageBoundsUpdateParams& p, cudaStream_t s) { return kv::page_bounds_update_cuda(p, s); }
cudaError_t write_gate(const kv::WriteGateParams& p, cudaStream_t s) { return kv::write_gate_cuda(p, s); }
cudaError_t ring_admit(const kv::RingAdmitParams& p, cudaStream_t s) { return kv::ring_admit_cuda(p, s); }
cudaError_t page_select_scratch_bytes(std::int32_t pages, std::int32_t seqs, std::int32_t kv_heads, std::size_t* bytes) {
  return kv::page_select_cuda_scratch_bytes(pages, seqs, kv_heads, bytes);
}
cudaError_t page_select(const kv::PageSelectParams& p, cudaStream_t s) { return kv::page_select_cuda(p, s); }
}  // namespace kvgpu
