// Where the forward pass keeps K/V.
//   PagedKv       kvcache's paged pool through the host kernels: the chunk is
//                 scattered to the slots reserve() returned, and a layer's
//                 held tokens are gathered back through the exported CSR page
//                 table. Token positions live beside the pool, per slot, and
//                 move with compaction like the K/V rows do.
//   ContiguousKv  a plain growing buffer: the reference the paged path must
//                 match token for token.
// With a page-selecting cache (Quest), PagedKv also keeps the page bounds
// current (page_bounds_update after every scatter) and, for a decode query,
// asks the cache which pages each kv-head reads: read() then marks only
// their tokens selected, and the keys read are counted against the dense read.
#pragma once

#include <array>
#include <cstdint>
#include <kvcache/kernels/gather.hpp>
#include <kvcache/kernels/page_bounds.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kvcache.hpp>
#include <span>
#include <stdexcept>
#include <vector>

#include "channel_kv.hpp"
#include "engine_types.hpp"
#include "forward.hpp"
#include "kv_scales.hpp"

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

// One request's view of the paged pool for one forward call. A request is
// one stream of the cache (one page table for every layer), or one stream
// per layer in a single-layer pool, so each layer's page table keeps its own
// tokens (block policies as OpenVINO runs them: one choice per layer).
template <class Cache>
class PagedKv {
 public:
  // seqs: the request's stream, or one per layer. slots: the chunk's slots,
  // [streams][n]. positions: the engine's table of token positions per pool
  // slot, one table per group of a token policy that compacts kv-heads
  // separately ([groups][pool slots]); it lives across calls. scales: the
  // pool format's engine-held scales (null: 1), checked by the backend.
  // residual: a channel-scaled pool's open blocks (channel_kv.hpp), which
  // writes go to and reads take those blocks' rows from.
  PagedKv(Cache& cache, const kvcache::PoolView& pool, std::span<const kvcache::SeqId> seqs,
          std::span<const std::int32_t> slots, std::int64_t first_pos, std::vector<std::int64_t>& positions,
          std::int32_t groups = 1, GroupLayout layout = {0, 1, 1}, KeyCounts* counts = nullptr,
          const HeldScales* scales = nullptr, ChannelResidual* residual = nullptr)
      : cache_(cache),
        pool_(pool),
        seqs_(seqs.begin(), seqs.end()),
        slots_(slots),
        n_(seqs.empty() ? 0 : std::int32_t(slots.size() / seqs.size())),
        first_(first_pos),
        slot_pos_(positions),
        groups_(groups),
        layout_(groups == 1 ? GroupLayout{0, 0, 1} : layout),
        pool_slots_(pool.num_blocks * pool.block_size),
        counts_(counts),
        scales_(scales),
        residual_(residual) {
    if (seqs.empty() || (seqs.size() > 1 && (pool.num_layers != 1 || groups != 1)))
      throw std::invalid_argument("PagedKv: one stream per layer needs a single-layer pool and one position table");
  }
  PagedKv(Cache& cache, const kvcache::PoolView& pool, kvcache::SeqId seq, std::span<const std::int32_t> slots,
          std::int64_t first_pos, std::vector<std::int64_t>& positions, std::int32_t groups = 1,
          GroupLayout layout = {0, 1, 1})
      : PagedKv(cache, pool, std::span<const kvcache::SeqId>(&seq, 1), slots, first_pos, positions, groups, layout) {}

  void write(std::int32_t l, const float* k, const float* v, std::int32_t n) {
    const std::int64_t hd = pool_.head_dim, row = std::int64_t{pool_.num_kv_heads} * hd;
    const auto slots = slots_.subspan(std::size_t(stream(l)) * std::size_t(n_), std::size_t(n));
    if (residual_) {
      residual_->write(pool_layer(l), slots.data(), k, v, n);
      return record(l, slots, n);
    }
    kvcache::ScatterParams p{pool_, {k, v, kvcache::DType::f32, 0, row * 4, hd * 4}, {slots.data()}, n, pool_layer(l),
                             1};
    if (scales_) p.k_scales = scales_->array(0, l, pool_layer(l)), p.v_scales = scales_->array(1, l, pool_layer(l));
    if (auto st = kvcache::scatter_host(p); !st) throw std::runtime_error("scatter: " + st.message());
    if constexpr (Cache::selects) {  // the written keys enter their pages' bounds
      kvcache::PageBoundsUpdateParams u{pool_, pool_layer(l), slots.data(), n, cache_.page_bounds(pool_layer(l))->data()};
      if (auto st = kvcache::page_bounds_update_host(u); !st) throw std::runtime_error("page_bounds_update: " + st.message());
    }
    record(l, slots, n);
  }
  // A decode query (n == 1) of a page-selecting cache: the pages each
  // kv-head reads, as a mask over the held tokens (q: [q_heads][head_dim]).
  void select(std::int32_t l, const float* q, std::int32_t n) {
    if constexpr (Cache::selects) {
      selected_layer_ = -1;
      if (n != 1 || seqs_.size() != 1) return;  // prefill reads densely, as Quest's paper does
      if (mapped_ != 0) map(0);
      const std::int32_t H = pool_.num_kv_heads, B = pool_.block_size;
      const auto group = cache_.selection().config().query_group;
      const auto blocks = *cache_.table().blocks(seqs_[0]);
      chosen_indptr_.resize(std::size_t(H) + 1);
      chosen_.resize(std::size_t(H) * blocks.size());
      const std::span<const float> queries(q, std::size_t(H) * std::size_t(group) * std::size_t(pool_.head_dim));
      if (auto r = cache_.select(seqs_, l, queries, {chosen_indptr_, chosen_}); !r)
        throw std::runtime_error("select: " + r.status().message());
      mask_.assign(std::size_t(H) * std::size_t(held_), 0);
      ones_.assign(std::size_t(H), 0);
      for (std::int32_t h = 0; h < H; ++h) {
        // Both lists are in logical order: one walk maps the chosen blocks to row indices.
        std::size_t j = 0;
        for (std::int32_t c = chosen_indptr_[std::size_t(h)]; c < chosen_indptr_[std::size_t(h) + 1]; ++c) {
          while (blocks[j] != chosen_[std::size_t(c)]) ++j;
          const std::int32_t lo = std::max(0, std::int32_t(j) * B - front_);
          const std::int32_t hi = std::min(held_, (std::int32_t(j) + 1) * B - front_);
          for (std::int32_t t = lo; t < hi; ++t) mask_[std::size_t(h * held_ + t)] = 1;
          ones_[std::size_t(h)] += std::max(0, hi - lo);
        }
      }
      selected_layer_ = l;
    } else {
      (void)l, (void)q, (void)n;
    }
  }
  HeldKv read(std::int32_t l, std::int32_t g) {
    const std::int32_t hd = pool_.head_dim, row = pool_.num_kv_heads * hd;
    if (gathered_ != l) gather(l);
    const std::int32_t group = layout_.of(l, g);
    const std::ptrdiff_t first = std::ptrdiff_t(front_) * row + std::ptrdiff_t(g) * hd;  // past the dead front
    HeldKv h{k_.data() + first, v_.data() + first, pos_.data() + std::ptrdiff_t(group) * held_, held_, row};
    const bool picked = selected_layer_ == l;
    if (picked) h.selected = mask_.data() + std::ptrdiff_t(g) * held_;
    if (counts_ && n_ == 1) {
      counts_->read += picked ? ones_[std::size_t(g)] : held_;
      counts_->dense += held_;
      ++counts_->reads;
      if constexpr (Cache::selects)
        if (picked && l >= cache_.selection().config().dense_layers)
          counts_->sparse_read += ones_[std::size_t(g)], ++counts_->sparse_reads;
    }
    return h;
  }

 private:
  // The written tokens' positions, and the reads they make stale.
  void record(std::int32_t l, std::span<const std::int32_t> slots, std::int32_t n) {
    if (l == 0 || seqs_.size() > 1) {  // one table per group, or one per layer's stream (one group)
      for (std::int32_t g = 0; g < groups_; ++g)
        for (std::int32_t i = 0; i < n; ++i) slot_pos_[std::size_t(g * pool_slots_ + slots[std::size_t(i)])] = first_ + i;
      mapped_ = -1;  // positions changed
    }
    gathered_ = -1;
  }
  std::int32_t stream(std::int32_t l) const { return seqs_.size() == 1 ? 0 : l; }
  std::int32_t pool_layer(std::int32_t l) const { return seqs_.size() == 1 ? l : 0; }
  // A stream's page table and positions are the same for every layer it
  // serves in one forward call (write() fills layer 0 first), so they are
  // read once per stream.
  void map(std::int32_t s) {
    const kvcache::SeqId seq = seqs_[std::size_t(s)];
    const std::array<kvcache::SeqId, 1> one{seq};
    const auto blocks = *cache_.table().blocks(seq);
    indices_.resize(blocks.size());
    if (auto r = cache_.export_csr(one, indptr_, indices_, last_); !r)
      throw std::runtime_error("csr: " + r.status().message());
    // A sliding window's dead front slots are gathered too (the CSR starts at
    // the row's first block); read() starts past them.
    front_ = *cache_.table().front(seq);
    held_ = std::int32_t(*cache_.tokens_held(seq));
    const std::int32_t B = pool_.block_size;
    pos_.resize(std::size_t(groups_) * std::size_t(held_));
    for (std::int32_t g = 0; g < groups_; ++g)
      for (std::int32_t t = 0; t < held_; ++t) {
        const std::int32_t j = front_ + t;
        pos_[std::size_t(g * held_ + t)] =
            slot_pos_[std::size_t(g * pool_slots_ + blocks[std::size_t(j / B)] * B + j % B)];
      }
    mapped_ = s;
  }
  void gather(std::int32_t l) {
    if (mapped_ != stream(l)) map(stream(l));
    const std::int32_t rows = front_ + held_, hd = pool_.head_dim, row = pool_.num_kv_heads * hd;
    k_.resize(std::size_t(rows) * std::size_t(row));
    v_.resize(k_.size());
    const std::array<std::int32_t, 2> out_indptr{0, rows};
    kvcache::GatherParams p{pool_, pool_layer(l), indptr_.data(), indices_.data(),     out_indptr.data(), 1,
                            rows,  k_.data(),     v_.data(),      kvcache::DType::f32, row * 4,           hd * 4};
    if (scales_) p.k_scales = scales_->array(0, l, pool_layer(l)), p.v_scales = scales_->array(1, l, pool_layer(l));
    if (auto st = kvcache::gather_host(p); !st) throw std::runtime_error("gather: " + st.message());
    if (residual_) residual_->overlay(pool_layer(l), indices_, rows, k_.data(), v_.data());
    gathered_ = l;
  }

  Cache& cache_;
  kvcache::PoolView pool_;
  std::vector<kvcache::SeqId> seqs_;
  std::span<const std::int32_t> slots_;
  std::int32_t n_;
  std::int64_t first_;
  std::vector<std::int64_t>& slot_pos_;
  std::int32_t groups_;
  GroupLayout layout_;
  std::int64_t pool_slots_;
  std::int32_t mapped_ = -1, gathered_ = -1, held_ = 0, front_ = 0;
  std::array<std::int32_t, 2> indptr_{};
  std::array<std::int32_t, 1> last_{};
  std::vector<std::int32_t> indices_;
  std::vector<float> k_, v_;  // [front + held][kv_heads][head_dim]
  std::vector<std::int64_t> pos_;
  KeyCounts* counts_;
  const HeldScales* scales_;
  ChannelResidual* residual_;
  std::int32_t selected_layer_ = -1;  // the layer mask_ holds (select() for a decode query)
  std::vector<std::int32_t> chosen_indptr_, chosen_, ones_;
  std::vector<std::uint8_t> mask_;  // [kv_heads][held]
};

}  // namespace engine
