// Exports a page table into caller-provided int32 buffers, in the encodings
// attention kernels read: dense [num_seqs, row_stride] block table (vLLM /
// FlashAttention), CSR indptr / indices / last_page_len (FlashInfer), and
// per-sequence lengths. They describe the slots a row holds: front +
// tokens, where front > 0 only under a sliding window (its kernel masks the
// dead front slots with the window). Every input is validated before any byte is written.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>

#include "kvcache/config.hpp"
#include "kvcache/table/page_table.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Row k of `out` holds the blocks of seqs[k], padded with the null block.
inline Status export_block_table(const PageTable& t, std::span<const SeqId> seqs, std::span<std::int32_t> out,
                                 std::int32_t row_stride) noexcept {
  if (row_stride < 1) return Status{Errc::invalid_argument, "row_stride", row_stride, 1};
  const std::int64_t need = std::int64_t(seqs.size()) * row_stride;
  if (std::int64_t(out.size()) < need) return Status{Errc::buffer_too_small, "out", std::int64_t(out.size()), need};
  for (const SeqId s : seqs) {
    if (!t.live(s)) return t.validate(s);
    const auto n = std::int64_t(t.blocks_unchecked(s).size());
    if (n > row_stride) return Status{Errc::buffer_too_small, "row_stride", row_stride, n};
  }
  std::int32_t* dst = out.data();
  for (const SeqId s : seqs) {
    const auto blocks = t.blocks_unchecked(s);
    std::int32_t b = 0;
    for (; b < std::int32_t(blocks.size()); ++b) dst[b] = blocks[std::size_t(b)];
    for (; b < row_stride; ++b) dst[b] = BlockPool::null_block;
    dst += row_stride;
  }
  return {};
}

/// FlashInfer paging: pages of seqs[k] are indices[indptr[k] .. indptr[k+1]);
/// the last holds last_page_len[k] tokens (0 for an empty sequence). Returns nnz.
inline Result<std::int32_t> export_csr(const PageTable& t, std::span<const SeqId> seqs,
                                       std::span<std::int32_t> indptr, std::span<std::int32_t> indices,
                                       std::span<std::int32_t> last_page_len) noexcept {
  if (indptr.size() < seqs.size() + 1)
    return Status{Errc::buffer_too_small, "indptr", std::int64_t(indptr.size()), std::int64_t(seqs.size() + 1)};
  if (last_page_len.size() < seqs.size())
    return Status{Errc::buffer_too_small, "last_page_len", std::int64_t(last_page_len.size()), std::int64_t(seqs.size())};
  std::int64_t nnz = 0;
  for (const SeqId s : seqs) {
    if (!t.live(s)) return t.validate(s);
    nnz += std::int64_t(t.blocks_unchecked(s).size());
  }
  if (std::int64_t(indices.size()) < nnz) return Status{Errc::buffer_too_small, "indices", std::int64_t(indices.size()), nnz};
  const BlockMath bs = t.block_math();  // a mask, not a division per sequence, for power-of-two blocks
  std::int32_t pos = 0;
  indptr[0] = 0;
  for (std::size_t k = 0; k < seqs.size(); ++k) {
    const auto blocks = t.blocks_unchecked(seqs[k]);
    std::copy(blocks.begin(), blocks.end(), indices.data() + pos);
    pos += std::int32_t(blocks.size());
    indptr[k + 1] = pos;
    const std::int32_t n = t.front_unchecked(seqs[k]) + t.tokens_unchecked(seqs[k]);
    last_page_len[k] = n == 0 ? 0 : bs.mod(n - 1) + 1;
  }
  return pos;
}

/// Slots each row spans (front + tokens held) into out, one per sequence.
inline Status export_lengths(const PageTable& t, std::span<const SeqId> seqs, std::span<std::int32_t> out) noexcept {
  if (out.size() < seqs.size())
    return Status{Errc::buffer_too_small, "out", std::int64_t(out.size()), std::int64_t(seqs.size())};
  for (const SeqId s : seqs)
    if (!t.live(s)) return t.validate(s);
  for (std::size_t k = 0; k < seqs.size(); ++k) out[k] = t.front_unchecked(seqs[k]) + t.tokens_unchecked(seqs[k]);
  return {};
}

KVCACHE_END_NAMESPACE
