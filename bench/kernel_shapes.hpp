// The benchmark shapes shared by the host and CUDA kernel suites: 8 kv-heads x
// 128 dims, fp16, block 16, one layer; decode = 256 sequences x 1 token (each
// in its own block), prefill = 8 sequences x 2,048 tokens (blocks shuffled).
#pragma once

#include <kvcache/kernels/detail/common.hpp>
#include <kvcache/core/sequence_id.hpp>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

namespace kvbench {
namespace kv = kvcache;

inline kv::GeometrySpec spec(int layers = 1) {
  return {.num_layers = layers, .num_kv_heads = 8, .head_dim = 128, .block_size = 16, .dtype = kv::DType::f16};
}
constexpr std::int64_t kRowBytes = 8 * 128 * 2;  // one token's K (or V), all heads

struct Shape {
  const char* name;
  std::int32_t seqs, tokens_per_seq;
  std::int64_t tokens() const { return std::int64_t{seqs} * tokens_per_seq; }
  std::int32_t blocks_per_seq() const { return (tokens_per_seq + 15) / 16; }
  std::int64_t blocks() const { return std::int64_t{seqs} * blocks_per_seq(); }
  std::int64_t payload() const { return tokens() * 2 * kRowBytes; }  // K + V bytes moved
};
inline const Shape kDecode{"decode_256x1", 256, 1};
inline const Shape kPrefill{"prefill_8x2048", 8, 2048};

// Page tables of a shape: CSR over shuffled blocks (block 0 stays null), the
// slot of every token, and the dense output rows.
struct Layout {
  std::vector<std::int32_t> indptr, indices, out_indptr, slots;
  std::vector<kv::BlockCopy> pairs;  // one per block: copy it to a second region
  std::int64_t pool_blocks;
};
inline Layout layout(const Shape& s, std::uint64_t seed = 7) {
  Layout l;
  const std::int64_t nb = s.blocks();
  l.pool_blocks = 2 * nb + 1;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(nb));
  std::iota(ids.begin(), ids.end(), 1);
  std::shuffle(ids.begin(), ids.end(), std::mt19937_64(seed));
  l.indptr.push_back(0);
  l.out_indptr.push_back(0);
  for (std::int32_t q = 0; q < s.seqs; ++q) {
    for (std::int32_t b = 0; b < s.blocks_per_seq(); ++b) l.indices.push_back(ids[l.indices.size()]);
    l.indptr.push_back(std::int32_t(l.indices.size()));
    l.out_indptr.push_back(l.out_indptr.back() + s.tokens_per_seq);
    for (std::int32_t t = 0; t < s.tokens_per_seq; ++t)
      l.slots.push_back(l.indices[std::size_t(l.indptr[std::size_t(q)] + t / 16)] * 16 + t % 16);
  }
  for (std::int64_t b = 0; b < nb; ++b) l.pairs.push_back({ids[std::size_t(b)], std::int32_t(nb + 1 + b)});
  return l;
}

}  // namespace kvbench
