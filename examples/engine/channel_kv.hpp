// KIVI's residual, for a pool with a channel-scaled side (Scales::channel):
// a block's codes exist only once its last token is known, so the engine
// keeps each open block's K and V in full precision here, reads them from
// here, and seals the block (kvcache::seal_blocks_host) once it is full.
// As in KIVI, the step that fills a block still reads it in full precision:
// a layer's full blocks are sealed when that layer next writes.
//
//   write    a layer's blocks filled by an earlier step sealed, then a
//            chunk's rows into their blocks' residuals.
//   hold     a block that is never sealed: Write-Gated KV's ring, whose
//            rows are rewritten one at a time (gated_kv.hpp); move and
//            copy carry rows and blocks as the gate's promotions and
//            copy-on-write move them.
//   overlay  a gathered sequence's rows of blocks not sealed in that layer,
//            from the residual (gather read codes never written there).
//   compact  a token policy's moves: the sequence read back (dequantized,
//            and the residual), the moves applied, each block a move wrote
//            into sealed again from its new tokens, and the new last block
//            made the residual if it is partial. Only channels whose tokens
//            changed get new codes: a channel sealed from its own read-back
//            values gets its codes back, since its smallest and largest
//            tokens read back as the entry's minimum and minimum + 3 steps.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <kvcache/kernels/gather.hpp>
#include <kvcache/kernels/seal.hpp>
#include <kvcache/kvcache.hpp>
#include <span>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace engine {

class ChannelResidual {
 public:
  explicit ChannelResidual(const kvcache::PoolView& pool)
      : pool_(pool), row_(std::int64_t{pool.num_kv_heads} * pool.head_dim), plane_(std::int64_t{pool.block_size} * row_) {}

  // Whether a pool needs one (a side with channel scales).
  static bool needed(const kvcache::PoolView& pool) { return kvcache::channel_pool(pool); }

  // n tokens' rows (k, v: [n][kv_heads][head_dim] floats, `stride` floats
  // apart, 0: packed) for pool layer `layer`, at `slots` (-1: none), after
  // the blocks the layer filled earlier are sealed (seal_pending). A block
  // whose last row is written waits for the layer's next write.
  void write(std::int32_t layer, const std::int32_t* slots, const float* k, const float* v, std::int32_t n,
             std::int64_t stride = 0) {
    seal_pending(layer);
    const std::int64_t step = stride == 0 ? row_ : stride;
    for (std::int32_t i = 0; i < n; ++i)
      if (slots[i] >= 0) put(layer, slots[i], k + i * step, v + i * step);
  }
  // The blocks layer `layer` filled, sealed now.
  void seal_pending(std::int32_t layer) {
    auto& full = pending_[std::size_t(layer)];
    for (const std::int32_t b : full) {
      Open& o = open_.at(b);
      seal(b, o.k.data() + layer * plane_, o.v.data() + layer * plane_, plane_, layer, 1);
      o.sealed[std::size_t(layer)] = 1;
      if (--o.unsealed == 0) open_.erase(b);
    }
    full.clear();
  }
  // Block `block` is never sealed: its rows live here until it is dropped.
  void hold(std::int32_t block) { open(block).held = true; }
  // Slot `src`'s row (in the residual) copied to slot `dst`, in pool layer `layer`.
  void move(std::int32_t layer, std::int32_t src, std::int32_t dst) {
    const float *k = row(layer, src, 0), *v = row(layer, src, 1);
    if (k == nullptr) throw std::runtime_error("ChannelResidual::move: slot " + std::to_string(src) + " is not open");
    const std::vector<float> kk(k, k + row_), vv(v, v + row_);  // dst may share src's block
    put(layer, dst, kk.data(), vv.data());
  }
  // Block `dst` starts as a copy of block `src` (copy-on-write): its open rows, if any.
  void copy(std::int32_t src, std::int32_t dst) {
    const auto it = open_.find(src);
    if (it == open_.end()) return;  // sealed in every layer: the pool's bytes are the copy
    Open o = it->second;
    open_[dst] = std::move(o);
    for (auto& full : pending_)
      if (std::find(full.begin(), full.end(), src) != full.end()) full.push_back(dst);
  }
  // Slot `slot`'s K (kv = 0) or V row in pool layer `layer`, if it is read
  // from here (its block not sealed in that layer); else nullptr.
  const float* row(std::int32_t layer, std::int32_t slot, std::int32_t kv) const {
    const auto it = open_.find(slot / pool_.block_size);
    if (it == open_.end() || it->second.sealed[std::size_t(layer)]) return nullptr;
    const auto& x = kv == 0 ? it->second.k : it->second.v;
    return x.data() + layer * plane_ + (slot % pool_.block_size) * row_;
  }

  // Rows [0, rows) of a sequence whose blocks are `blocks` (logical order),
  // gathered for pool layer `layer` into k, v ([rows][kv_heads][head_dim]):
  // the open blocks' rows from the residual.
  void overlay(std::int32_t layer, std::span<const std::int32_t> blocks, std::int32_t rows, float* k, float* v) const {
    const std::int32_t B = pool_.block_size;
    for (std::size_t j = 0; j < blocks.size(); ++j) {
      const auto it = open_.find(blocks[j]);
      if (it == open_.end() || it->second.sealed[std::size_t(layer)]) continue;
      const std::int32_t first = std::int32_t(j) * B, n = std::min(B, rows - first);
      if (n <= 0) continue;
      const auto from = it->second.k.begin() + std::ptrdiff_t(layer * plane_);
      std::copy(from, from + std::ptrdiff_t(n * row_), k + std::ptrdiff_t(first * row_));
      const auto vfrom = it->second.v.begin() + std::ptrdiff_t(layer * plane_);
      std::copy(vfrom, vfrom + std::ptrdiff_t(n * row_), v + std::ptrdiff_t(first * row_));
    }
  }

  // One compaction call's moves and the rows they cover (CompactionParams'
  // fields: layers [first_layer, + num_layers), kv-heads [first_head, +
  // num_heads), 0 heads = all).
  struct Moves {
    std::span<const kvcache::SlotMove> moves;
    std::int32_t first_layer = 0, num_layers = 1, first_head = 0, num_heads = 0;
  };
  // A sequence that held `rows_before` rows in `before` (its blocks, logical
  // order) holds `rows_after` in `after` (a prefix of them) once `moves` ran.
  void compact(std::span<const std::int32_t> before, std::int32_t rows_before, std::span<const std::int32_t> after,
               std::int32_t rows_after, std::span<const Moves> moves) {
    const std::int32_t B = pool_.block_size, L = pool_.num_layers, hd = pool_.head_dim;
    const std::int64_t layer_rows = std::int64_t{rows_before} * row_;
    std::vector<float> k(std::size_t(L * layer_rows)), v(k.size());
    const std::array<std::int32_t, 2> indptr{0, std::int32_t(before.size())}, out{0, rows_before};
    for (std::int32_t l = 0; l < L; ++l) {
      float *kl = k.data() + l * layer_rows, *vl = v.data() + l * layer_rows;
      const kvcache::GatherParams p{pool_, l, indptr.data(), before.data(), out.data(), 1, rows_before, kl, vl,
                                    kvcache::DType::f32, row_ * 4, hd * 4};
      if (auto st = kvcache::gather_host(p); !st) throw std::runtime_error("gather: " + st.message());
      overlay(l, before, rows_before, kl, vl);
    }
    std::unordered_map<std::int32_t, std::int32_t> logical;  // block -> its index in `before`
    for (std::size_t j = 0; j < before.size(); ++j) logical[before[j]] = std::int32_t(j);
    const auto row_of = [&](std::int32_t slot) { return logical.at(slot / B) * B + slot % B; };
    std::vector<char> dirty(after.size(), 0);
    for (const Moves& m : moves) {
      const std::int32_t heads = m.num_heads == 0 ? pool_.num_kv_heads : m.num_heads;
      for (const kvcache::SlotMove& mv : m.moves) {
        const std::int32_t src = row_of(mv.src), dst = row_of(mv.dst);
        if (dst >= rows_after) throw std::runtime_error("compact: a move past the sequence's new end");
        dirty[std::size_t(dst / B)] = 1;
        for (std::int32_t l = m.first_layer; l < m.first_layer + m.num_layers; ++l)
          for (float* x : {k.data(), v.data()}) {
            float* base = x + l * layer_rows;
            std::copy(base + src * row_ + m.first_head * hd, base + src * row_ + (m.first_head + heads) * hd,
                      base + dst * row_ + m.first_head * hd);
          }
      }
    }
    // Full blocks a move wrote into, or not yet sealed in every layer, are
    // sealed from what was read; the rest keep their codes.
    // Held blocks stay here with their rows.
    std::vector<char> was_open(after.size(), 0), held(after.size(), 0);
    for (std::size_t j = 0; j < after.size(); ++j) {
      const auto it = open_.find(after[j]);
      was_open[j] = it != open_.end();
      held[j] = was_open[j] && it->second.held;
    }
    for (const std::int32_t b : before) drop(b);
    for (std::size_t j = 0; j < after.size(); ++j) {
      const std::int32_t first = std::int32_t(j) * B;
      if (first + B <= rows_after && !held[j]) {
        if (dirty[j] || was_open[j]) seal(after[j], k.data() + first * row_, v.data() + first * row_, layer_rows, 0, L);
        continue;
      }
      Open& o = open(after[j]);  // the new last block, partial, or a held one: its rows go back to the residual
      o.held = held[j] != 0;
      for (std::int32_t l = 0; l < L; ++l)
        for (std::int32_t t = 0; t < std::min(B, rows_before - first); ++t) {
          const std::ptrdiff_t from = std::ptrdiff_t(l * layer_rows + (first + t) * row_), to = std::ptrdiff_t(l * plane_ + t * row_);
          std::copy(k.begin() + from, k.begin() + from + row_, o.k.begin() + to);
          std::copy(v.begin() + from, v.begin() + from + row_, o.v.begin() + to);
        }
    }
  }

  // A block leaves the sequence (freed): its residual goes too.
  void drop(std::int32_t block) {
    open_.erase(block);
    for (auto& full : pending_) full.erase(std::remove(full.begin(), full.end(), block), full.end());
  }
  // Open blocks held, for tests.
  std::size_t open_blocks() const { return open_.size(); }

 private:
  struct Open {
    std::vector<float> k, v;  // [pool layers][block_size][kv_heads][head_dim]
    std::vector<char> sealed;  // [pool layers]: the pool holds this layer's codes
    std::int32_t unsealed = 0;  // layers not sealed yet
    bool held = false;          // never sealed (hold)
  };
  // One row into its block's residual; a held block is never queued for sealing.
  void put(std::int32_t layer, std::int32_t slot, const float* k, const float* v) {
    const std::int32_t B = pool_.block_size, block = slot / B, at = slot % B;
    Open& o = open(block);
    const std::ptrdiff_t to = std::ptrdiff_t(layer * plane_ + at * row_);
    std::copy(k, k + row_, o.k.begin() + to);
    std::copy(v, v + row_, o.v.begin() + to);
    auto& full = pending_[std::size_t(layer)];
    if (at == B - 1 && !o.held && std::find(full.begin(), full.end(), block) == full.end()) full.push_back(block);
  }
  Open& open(std::int32_t block) {
    Open& o = open_[block];
    if (o.k.empty()) {
      o.k.assign(std::size_t(pool_.num_layers * plane_), 0.0f), o.v.assign(o.k.size(), 0.0f);
      o.sealed.assign(std::size_t(pool_.num_layers), 0);
      o.unsealed = pool_.num_layers;
    }
    return o;
  }
  // Block `block`'s layers [first, + layers) sealed from k, v ([layers][block_size][row], layer_stride floats apart).
  void seal(std::int32_t block, const float* k, const float* v, std::int64_t layer_stride, std::int32_t first, std::int32_t layers) {
    const kvcache::SealParams p{pool_, {k, v, kvcache::DType::f32, layer_stride * 4, row_ * 4, std::int64_t{pool_.head_dim} * 4},
                                &block, 1, first, layers};
    if (auto st = kvcache::seal_blocks_host(p); !st) throw std::runtime_error("seal_blocks: " + st.message());
  }

  kvcache::PoolView pool_;
  std::int64_t row_, plane_;
  std::unordered_map<std::int32_t, Open> open_;
  std::vector<std::vector<std::int32_t>> pending_ = std::vector<std::vector<std::int32_t>>(std::size_t(pool_.num_layers));  // [layer]: full, not sealed
};

}  // namespace engine
