// Where the forward pass keeps K/V.
//   PagedKv       kvcache's paged pool through the host kernels: the chunk is
//                 scattered to the slots reserve() returned, and a layer's
//                 held tokens are gathered back through the exported CSR page
//                 table. Token positions live beside the pool, per slot, and
//                 move with compaction like the K/V rows do.
//   ContiguousKv  a plain growing buffer: the reference the paged path must
//                 match token for token.
#pragma once

#include <array>
#include <cstdint>
#include <kvcache/kernels/gather.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kvcache.hpp>
#include <span>
#include <stdexcept>
#include <vector>

#include "forward.hpp"

namespace engine {

class ContiguousKv {
 public:
  ContiguousKv(const ModelConfig& c, std::int32_t capacity)
      : row_(c.kv_heads * c.head_dim()), hd_(c.head_dim()), k_(std::size_t(c.layers)), v_(std::size_t(c.layers)) {
    for (auto& l : k_) l.reserve(std::size_t(capacity) * std::size_t(row_));
    for (auto& l : v_) l.reserve(std::size_t(capacity) * std::size_t(row_));
    pos_.reserve(std::size_t(capacity));
  }
  void write(std::int32_t l, const float* k, const float* v, std::int32_t n) {
    k_[std::size_t(l)].insert(k_[std::size_t(l)].end(), k, k + std::ptrdiff_t(n) * row_);
    v_[std::size_t(l)].insert(v_[std::size_t(l)].end(), v, v + std::ptrdiff_t(n) * row_);
    if (l == 0)
      for (std::int32_t i = 0; i < n; ++i) pos_.push_back(std::int64_t(pos_.size()));  // tokens 0, 1, 2, ...
  }
  HeldKv read(std::int32_t l, std::int32_t g) const {
    return {k_[std::size_t(l)].data() + std::ptrdiff_t(g) * hd_, v_[std::size_t(l)].data() + std::ptrdiff_t(g) * hd_,
            pos_.data(), std::int32_t(pos_.size()), row_};
  }

 private:
  std::int32_t row_, hd_;
  std::vector<std::vector<float>> k_, v_;
  std::vector<std::int64_t> pos_;
};

// Which position table (one per token-policy group) a (layer, kv-head)
// reads: group = layer * per_layer + head * per_head, below `groups`.
struct GroupLayout {
  std::int32_t per_layer = 0, per_head = 0, groups = 1;
  std::int32_t of(std::int32_t layer, std::int32_t head) const { return layer * per_layer + head * per_head; }
};

// One sequence's view of the paged pool for one forward call.
template <class Cache>
class PagedKv {
 public:
  // positions: the engine's table of token positions per pool slot, one
  // table per group of a token policy that compacts kv-heads separately
  // ([groups][pool slots]); it lives across calls.
  PagedKv(const Cache& cache, const kvcache::PoolView& pool, kvcache::SeqId seq, std::span<const std::int32_t> slots,
          std::int64_t first_pos, std::vector<std::int64_t>& positions, std::int32_t groups = 1,
          GroupLayout layout = {0, 1, 1})
      : cache_(cache),
        pool_(pool),
        seq_(seq),
        slots_(slots),
        first_(first_pos),
        slot_pos_(positions),
        groups_(groups),
        layout_(groups == 1 ? GroupLayout{0, 0, 1} : layout),
        pool_slots_(pool.num_blocks * pool.block_size) {}

  void write(std::int32_t l, const float* k, const float* v, std::int32_t n) {
    const std::int64_t hd = pool_.head_dim, row = std::int64_t{pool_.num_kv_heads} * hd;
    kvcache::ScatterParams p{pool_, {k, v, kvcache::DType::f32, 0, row * 4, hd * 4}, {slots_.data()}, n, l, 1};
    if (auto st = kvcache::scatter_host(p); !st) throw std::runtime_error("scatter: " + st.message());
    if (l == 0) {
      for (std::int32_t g = 0; g < groups_; ++g)
        for (std::int32_t i = 0; i < n; ++i)
          slot_pos_[std::size_t(g * pool_slots_ + slots_[std::size_t(i)])] = first_ + i;
      mapped_ = false;  // positions changed
    }
    gathered_ = -1;
  }
  HeldKv read(std::int32_t l, std::int32_t g) {
    const std::int32_t hd = pool_.head_dim, row = pool_.num_kv_heads * hd;
    if (gathered_ != l) gather(l);
    const std::int32_t group = layout_.of(l, g);
    const std::ptrdiff_t first = std::ptrdiff_t(front_) * row + std::ptrdiff_t(g) * hd;  // past the dead front
    return {k_.data() + first, v_.data() + first, pos_.data() + std::ptrdiff_t(group) * held_, held_, row};
  }

 private:
  // The page table and positions are the same for every layer of one
  // forward call (write() fills layer 0 first), so they are read once.
  void map() {
    const std::array<kvcache::SeqId, 1> one{seq_};
    const auto blocks = *cache_.table().blocks(seq_);
    indices_.resize(blocks.size());
    if (auto r = cache_.export_csr(one, indptr_, indices_, last_); !r)
      throw std::runtime_error("csr: " + r.status().message());
    // A sliding window's dead front slots are gathered too (the CSR starts at
    // the row's first block); read() starts past them.
    front_ = *cache_.table().front(seq_);
    held_ = std::int32_t(*cache_.tokens_held(seq_));
    const std::int32_t B = pool_.block_size;
    pos_.resize(std::size_t(groups_) * std::size_t(held_));
    for (std::int32_t g = 0; g < groups_; ++g)
      for (std::int32_t t = 0; t < held_; ++t) {
        const std::int32_t j = front_ + t;
        pos_[std::size_t(g * held_ + t)] =
            slot_pos_[std::size_t(g * pool_slots_ + blocks[std::size_t(j / B)] * B + j % B)];
      }
    mapped_ = true;
  }
  void gather(std::int32_t l) {
    if (!mapped_) map();
    const std::int32_t rows = front_ + held_, hd = pool_.head_dim, row = pool_.num_kv_heads * hd;
    k_.resize(std::size_t(rows) * std::size_t(row));
    v_.resize(k_.size());
    const std::array<std::int32_t, 2> out_indptr{0, rows};
    kvcache::GatherParams p{pool_, l,         indptr_.data(), indices_.data(),     out_indptr.data(), 1,
                            rows,  k_.data(), v_.data(),      kvcache::DType::f32, row * 4,           hd * 4};
    if (auto st = kvcache::gather_host(p); !st) throw std::runtime_error("gather: " + st.message());
    gathered_ = l;
  }

  const Cache& cache_;
  kvcache::PoolView pool_;
  kvcache::SeqId seq_;
  std::span<const std::int32_t> slots_;
  std::int64_t first_;
  std::vector<std::int64_t>& slot_pos_;
  std::int32_t groups_;
  GroupLayout layout_;
  std::int64_t pool_slots_;
  bool mapped_ = false;
  std::int32_t gathered_ = -1, held_ = 0, front_ = 0;
  std::array<std::int32_t, 2> indptr_{};
  std::array<std::int32_t, 1> last_{};
  std::vector<std::int32_t> indices_;
  std::vector<float> k_, v_;  // [front + held][kv_heads][head_dim]
  std::vector<std::int64_t> pos_;
};

}  // namespace engine
