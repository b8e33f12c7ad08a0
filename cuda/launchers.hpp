// Every CUDA launcher behind a plain function, compiled once by nvcc in
// launchers.cu and callable from code another compiler builds: the CUDA
// test and benchmark (Catch2 and Google Benchmark stay out of nvcc) and the
// Python module (python/).
#pragma once

#include <cuda_runtime_api.h>

#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/gather.hpp>
#include <kvcache/kernels/page_bounds.hpp>
#include <kvcache/kernels/page_select.hpp>
#include <kvcache/kernels/ring_write.hpp>
#include <kvcache/kernels/rope.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kernels/seal.hpp>
#include <kvcache/kernels/scores.hpp>
#include <kvcache/kernels/write_gate.hpp>
#include <kvcache/kernels/ring_admit.hpp>

namespace kvgpu {
namespace kv = kvcache;
cudaError_t scatter(const kv::ScatterParams& p, cudaStream_t s = nullptr);
cudaError_t gather(const kv::GatherParams& p, cudaStream_t s = nullptr);
cudaError_t seal_blocks(const kv::SealParams& p, cudaStream_t s = nullptr);
cudaError_t block_copy(const kv::BlockCopyParams& p, cudaStream_t s = nullptr);
cudaError_t ring_write(const kv::RingWriteParams& p, cudaStream_t s = nullptr);
cudaError_t compaction(const kv::CompactionParams& p, cudaStream_t s = nullptr);
cudaError_t rope(const kv::RopeParams& p, cudaStream_t s = nullptr);
cudaError_t scores(const kv::ScoreParams& p, cudaStream_t s = nullptr);
cudaError_t select_scratch_bytes(std::int32_t streams, std::int32_t max_keys, std::size_t* bytes);
cudaError_t select(const float* scores, const std::int32_t* lengths, std::int32_t streams, std::int32_t max_keys,
                   std::int32_t k, bool lowest, std::int32_t* out, void* scratch, std::size_t scratch_bytes,
                   cudaStream_t s = nullptr);
cudaError_t page_bounds(const kv::PageBoundsParams& p, cudaStream_t s = nullptr);
cudaError_t page_bounds_update(const kv::PageBoundsUpdateParams& p, cudaStream_t s = nullptr);
cudaError_t write_gate(const kv::WriteGateParams& p, cudaStream_t s = nullptr);
cudaError_t ring_admit(const kv::RingAdmitParams& p, cudaStream_t s = nullptr);
cudaError_t page_select_scratch_bytes(std::int32_t pages, std::int32_t seqs, std::int32_t kv_heads, std::size_t* bytes);
cudaError_t page_select(const kv::PageSelectParams& p, cudaStream_t s = nullptr);
}  // namespace kvgpu
