// Write-Gated KV in the example engine: the trained gates (model/gates-<λ>.bin,
// from train/train_gates.py) and the K/V store the forward pass reads and
// writes for one request over GatedCache<WriteGate>
// (gated.hpp's backend hands it to the scheduler).
//
// Each layer's write: the library's write_gate kernel turns the chunk's pre-
// and post-RoPE keys into gates; the cache places every (token, kv-head) in
// its head's ring, promotes what the ring pushes out if it was admitted, and
// hands back copies, moves and slots, which run through the host kernels.
// Attention for the chunk reads each head's row as it was before the write
// (ring + global, through the head-folded CSR export) plus the chunk's own
// keys, with the rule the gates were trained for: a key farther than W
// behind the query is read only if admitted.
//
// Composed with Quest (Selection = QuestSelection) a decode query reads, of
// each head row, its ring and the global pages Quest picks; composed with a
// token policy (Eviction, e.g. H2O) each layer's attention to a head row's
// tokens is observed and every step ends with the global regions' eviction.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <kvcache/admission/write_gate.hpp>
#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/page_bounds.hpp>
#include <kvcache/kernels/detail/quant_rows.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kernels/write_gate.hpp>
#include <kvcache/kvcache.hpp>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "channel_kv.hpp"
#include "forward.hpp"
#include "kv_scales.hpp"
#include "model.hpp"

namespace engine {

// One trained gate set (write_gates in train_gates.py: header, then per
// layer norm_pre, norm_post, w1, b1, w2, b2 as WriteGateWeights lays them out).
class GateSet {
 public:
  explicit GateSet(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw std::runtime_error("cannot open gates " + path);
    std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    constexpr std::size_t kHeader = 4 + 6 * 4 + 4 * 4;
    if (bytes.size() < kHeader || std::memcmp(bytes.data(), "KVCG", 4) != 0)
      throw std::runtime_error(path + ": not a kvcache gate file (magic)");
    std::uint32_t u[6];
    float fl[4];
    std::memcpy(u, bytes.data() + 4, sizeof u);
    std::memcpy(fl, bytes.data() + 28, sizeof fl);
    if (u[0] != 1) throw std::runtime_error(path + ": format version " + std::to_string(u[0]) + ", expected 1");
    layers = std::int32_t(u[1]), kv_heads = std::int32_t(u[2]), head_dim = std::int32_t(u[3]), hidden = std::int32_t(u[4]);
    window = std::int32_t(u[5]), tau = fl[0], lambda = fl[1], eps = fl[2], min_gate = fl[3];
    const std::size_t floats = (bytes.size() - kHeader) / 4;
    if (floats != std::size_t(layers) * per_layer() || (bytes.size() - kHeader) % 4)
      throw std::runtime_error(path + ": " + std::to_string(floats) + " floats, the header implies " +
                               std::to_string(std::size_t(layers) * per_layer()));
    data_.resize(floats);
    std::memcpy(data_.data(), bytes.data() + kHeader, floats * 4);
  }
  // Layer l's weights for the write_gate kernel.
  kvcache::WriteGateWeights weights(std::int32_t l) const {
    const float* p = data_.data() + std::size_t(l) * per_layer();
    const std::size_t hd = std::size_t(head_dim), hid = std::size_t(hidden), H = std::size_t(kv_heads);
    kvcache::WriteGateWeights w{};
    w.norm_pre = p;
    w.norm_post = p + hd;
    w.w1 = w.norm_post + hd;
    w.b1 = w.w1 + H * 2 * hd * hid;
    w.w2 = w.b1 + H * hid;
    w.b2 = w.w2 + H * hid;
    w.num_kv_heads = kv_heads, w.head_dim = head_dim, w.hidden = hidden, w.norm_eps = eps, w.min_gate = min_gate;
    return w;
  }
  std::int32_t layers = 0, kv_heads = 0, head_dim = 0, hidden = 0, window = 0;
  float tau = 0.1f, lambda = 0.0f, eps = 1e-6f, min_gate = 1e-3f;

 private:
  std::size_t per_layer() const {
    const std::size_t hd = std::size_t(head_dim), hid = std::size_t(hidden), H = std::size_t(kv_heads);
    return 2 * hd + H * (2 * hd * hid + 2 * hid + 1);
  }
  std::vector<float> data_;
};

template <class Selection = kvcache::SelectAll, class Eviction = kvcache::KeepAll>
using GatedCacheOf = kvcache::GatedCache<kvcache::WriteGate, Selection, Eviction>;
using GatedCache = GatedCacheOf<>;

// What gated requests did, over every layer and kv-head: tokens that left
// the ring admitted or not, and the keys decode queries read (summed over
// (query, layer) pairs and kv-heads) against what a dense cache reads.
struct GateCounts {
  std::int64_t admitted = 0, dropped = 0, decode_queries = 0, keys_read = 0, dense_keys = 0;
};

// The forward pass's store for one request (see the file comment).
template <class C = GatedCache>
class GatedKv {
 public:
  // scales: the pool format's engine-held scales per (layer, kv-head), checked by the backend.
  // residual: a channel-scaled pool's open blocks (channel_kv.hpp): the
  // rings held there in full precision, a global block sealed once full.
  GatedKv(C& cache, const kvcache::PoolView& pool, kvcache::SeqId seq, const GateSet& gates,
          std::int64_t first_pos, std::vector<std::uint8_t>& admitted, GateCounts& counts, const HeldScales& scales,
          ChannelResidual* residual = nullptr)
      : cache_(cache), pool_(pool), seq_(seq), gates_(gates), first_(first_pos), adm_(admitted), counts_(counts),
        scales_(scales), residual_(residual), H_(gates.kv_heads), hd_(gates.head_dim), heads_(std::size_t(H_)) {}

  void pre_rope(std::int32_t, const float* k, std::int32_t n) { k_pre_.assign(k, k + std::ptrdiff_t(n) * H_ * hd_); }

  void write(std::int32_t l, const float* k, const float* v, std::int32_t n) {
    const std::int64_t row = std::int64_t(H_) * hd_;
    gate_.resize(std::size_t(n * H_));
    const kvcache::WriteGateParams gp{gates_.weights(l), k_pre_.data(), k, kvcache::DType::f32, row * 4, hd_ * 4, n,
                                      gate_.data()};
    if (auto st = kvcache::write_gate_host(gp); !st) throw std::runtime_error("write_gate: " + st.message());
    for (std::int32_t t = 0; t < n; ++t)
      for (std::int32_t h = 0; h < H_; ++h) adm_at(l, h, first_ + t) = gate_[std::size_t(t * H_ + h)] >= gates_.tau;
    snapshot(l);  // what attention reads: the rows before this write ...
    for (std::int32_t h = 0; h < H_; ++h) {  // ... and the chunk's own keys
      Head& hb = heads_[std::size_t(h)];
      for (std::int32_t t = 0; t < n; ++t) {
        hb.k.insert(hb.k.end(), k + t * row + h * hd_, k + t * row + (h + 1) * hd_);
        hb.v.insert(hb.v.end(), v + t * row + h * hd_, v + t * row + (h + 1) * hd_);
        hb.pos.push_back(first_ + t);
        hb.adm.push_back(adm_at(l, h, first_ + t));
      }
    }
    n_ = n;
    slots_.resize(std::size_t(n * H_));
    moves_.resize(std::size_t(H_ * gates_.window));
    copies_.resize(std::size_t(H_ * (first_ + n) / pool_.block_size + H_ * 2));
    auto r = cache_.write(seq_, l, gate_, {.slots = slots_, .moves = moves_, .copies = copies_});
    if (!r) throw std::runtime_error("gated write: " + r.status().message());
    counts_.admitted += r->promoted + r->direct;  // every layer's heads
    counts_.dropped += r->dropped + r->dropped_at_cap;
    if (auto st = kvcache::block_copy_host({pool_, pool_, copies_.data(), r->copies}); !st)
      throw std::runtime_error("block_copy: " + st.message());
    if (residual_) {
      write_residual(l, k, v, n, r->copies, r->moves);
    } else {
      if (auto st = kvcache::compaction_host({pool_, moves_.data(), r->moves}); !st)
        throw std::runtime_error("compaction: " + st.message());
      scatter(l, k, v, n);
    }
    if constexpr (C::selects) {  // what the write stored enters its pages' bounds (single-head pool: one slice)
      stored_.assign(slots_.begin(), slots_.begin() + n * H_);
      for (std::int32_t m = 0; m < r->moves; ++m) stored_.push_back(moves_[std::size_t(m)].dst);
      kvcache::PageBoundsUpdateParams u{pool_, 0, stored_.data(), std::int64_t(stored_.size()), cache_.page_bounds(0)->data()};
      if (auto st = kvcache::page_bounds_update_host(u); !st) throw std::runtime_error("page_bounds_update: " + st.message());
    }
  }

  // A decode query (n == 1): with Quest, the pages each head row reads (its
  // ring always); then the keys it reads per kv-head, against a dense cache.
  void select(std::int32_t l, const float* q, std::int32_t n) {
    if (n != 1) return;
    for (Head& hb : heads_) hb.sel.assign(hb.pos.size(), 1);
    if constexpr (C::selects) {
      const kvcache::SeqId one[] = {seq_};
      stale_.resize(std::size_t(gates_.layers * H_) * std::size_t(cache_.table().max_blocks_per_stream()));
      fill_.resize(stale_.size());
      auto listed = cache_.stale_pages(one, {stale_, fill_});  // pages an eviction compacted
      if (!listed) throw std::runtime_error("stale_pages: " + listed.status().message());
      if (auto st = kvcache::page_bounds_host({pool_, 0, stale_.data(), fill_.data(), *listed, cache_.page_bounds(0)->data()}); !st)
        throw std::runtime_error("page_bounds: " + st.message());
      const std::int32_t group = cache_.selection().config().query_group;
      chosen_ptr_.resize(std::size_t(H_ + 1));
      chosen_.resize(std::size_t(H_) * std::size_t(cache_.table().max_blocks_per_stream()));
      const std::span<const float> queries(q, std::size_t(H_ * group * hd_));
      if (auto r = cache_.select(one, l, queries, {chosen_ptr_, chosen_}); !r)
        throw std::runtime_error("select: " + r.status().message());
      const std::int32_t B = pool_.block_size;
      for (std::int32_t h = 0; h < H_; ++h) {
        // The chosen pages' positions, through the row as the write left it.
        const auto row = *cache_.table().blocks(*cache_.admission().head(seq_, l, h));
        const auto positions = *cache_.admission().positions(seq_, l, h);
        picked_.assign(std::size_t(first_ + 1), 0);
        for (std::size_t j = 0; j < positions.size(); ++j)
          if (std::find(chosen_.begin() + chosen_ptr_[std::size_t(h)], chosen_.begin() + chosen_ptr_[std::size_t(h + 1)],
                        row[j / std::size_t(B)]) != chosen_.begin() + chosen_ptr_[std::size_t(h + 1)])
            picked_[std::size_t(positions[j])] = 1;
        Head& hb = heads_[std::size_t(h)];
        for (std::size_t t = 0; t < hb.pos.size(); ++t) hb.sel[t] = hb.pos[t] >= first_ || picked_[std::size_t(hb.pos[t])];
      }
    }
    ++counts_.decode_queries;
    for (const Head& hb : heads_) counts_.keys_read += visible(hb, first_);
    counts_.dense_keys += H_ * (first_ + 1);
  }

  HeldKv read(std::int32_t, std::int32_t g) const {
    const Head& hb = heads_[std::size_t(g)];
    HeldKv held{hb.k.data(), hb.v.data(), hb.pos.data(), std::int32_t(hb.pos.size()), hd_, hb.adm.data(), gates_.window};
    if (n_ == 1 && C::selects) held.selected = hb.sel.data();
    return held;
  }

  // A token policy on the global regions: the layer's attention per held token ...
  void attend(std::int32_t, std::int32_t g, std::int32_t t, float a) {
    if constexpr (C::evicts_global) {
      Head& hb = heads_[std::size_t(g)];
      hb.sum.resize(hb.pos.size(), 0.0f);
      hb.sum[std::size_t(t)] += a;
    } else {
      (void)g, (void)t, (void)a;
    }
  }
  // ... observed per head row in the row's order (ring, then global), once the layer is done.
  void attended(std::int32_t l) {
    if constexpr (C::evicts_global) {
      scores_.clear();
      for (std::int32_t h = 0; h < H_; ++h) {
        Head& hb = heads_[std::size_t(h)];
        hb.sum.resize(hb.pos.size(), 0.0f);
        by_pos_.assign(std::size_t(first_ + n_), 0.0f);
        for (std::size_t t = 0; t < hb.pos.size(); ++t) by_pos_[std::size_t(hb.pos[t])] = hb.sum[t];
        const auto row = *cache_.admission().positions(seq_, l, h);
        for (const std::int32_t p : row) scores_.push_back(by_pos_[std::size_t(p)]);
        hb.sum.clear();
      }
      if (auto st = cache_.observe(seq_, l, kvcache::ScoreKind::head_attention_sums, scores_); !st)
        throw std::runtime_error("observe: " + st.message());
    } else {
      (void)l;
    }
  }

 private:
  // The slots of kv-head h's n rows (every H-th of the write's), in head_slots_.
  const std::int32_t* head_slots(std::int32_t h, std::int32_t n) {
    head_slots_.resize(std::size_t(n));
    for (std::int32_t t = 0; t < n; ++t) head_slots_[std::size_t(t)] = slots_[std::size_t(t * H_ + h)];
    return head_slots_.data();
  }
  // The write's tokens at their slots, quantized as the pool stores them: a
  // call per kv-head, since the pool is single-head and (layer, head)'s
  // scale goes as the call's k_scale / v_scale.
  void scatter(std::int32_t l, const float* k, const float* v, std::int32_t n) {
    const std::int64_t row = std::int64_t(H_) * hd_;
    for (std::int32_t h = 0; h < H_; ++h) {
      kvcache::ScatterParams sp{pool_, {k + h * hd_, v + h * hd_, kvcache::DType::f32, 0, row * 4, 0}, {head_slots(h, n)}, n};
      sp.k_scale = scales_.at(0, l, h), sp.v_scale = scales_.at(1, l, h);
      if (auto st = kvcache::scatter_host(sp); !st) throw std::runtime_error("scatter: " + st.message());
    }
  }
  // A channel-scaled pool: a row's codes depend on its whole block, so the
  // write runs in the residual. The rings are held there (never sealed); the
  // promotions copy ring rows to their global slots, then the new rows go
  // to theirs, and the global blocks this filled are sealed. The chunk's
  // attention reads its own keys exact, so a full block is sealed at once.
  void write_residual(std::int32_t l, const float* k, const float* v, std::int32_t n, std::int32_t copies, std::int32_t moves) {
    const std::int32_t ring_blocks = gates_.window / pool_.block_size;
    for (std::int32_t i = 0; i < copies; ++i) residual_->copy(copies_[std::size_t(i)].src, copies_[std::size_t(i)].dst);
    for (std::int32_t h = 0; h < H_; ++h) {
      const auto row = *cache_.table().blocks(*cache_.admission().head(seq_, l, h));
      for (std::size_t j = 0; j < std::min(row.size(), std::size_t(ring_blocks)); ++j) residual_->hold(row[j]);
    }
    for (std::int32_t m = 0; m < moves; ++m) residual_->move(0, moves_[std::size_t(m)].src, moves_[std::size_t(m)].dst);
    const std::int64_t row = std::int64_t(H_) * hd_;
    for (std::int32_t h = 0; h < H_; ++h) residual_->write(0, head_slots(h, n), k + h * hd_, v + h * hd_, n, row);
    residual_->seal_pending(0);
  }
  struct Head {
    std::vector<float> k, v;
    std::vector<std::int64_t> pos;
    std::vector<std::uint8_t> adm, sel;  // sel: the entry's page was chosen (decode queries under Quest)
    std::vector<float> sum;              // attention per entry (a token policy's observation)
  };
  std::uint8_t& adm_at(std::int32_t l, std::int32_t h, std::int64_t p) {
    const std::size_t per = adm_.size() / std::size_t(gates_.layers * H_);
    return adm_[std::size_t(l * H_ + h) * per + std::size_t(p)];
  }
  std::int64_t visible(const Head& hb, std::int64_t q) const {
    std::int64_t n = 0;
    for (std::size_t t = 0; t < hb.pos.size(); ++t)
      n += hb.pos[t] <= q && (hb.adm[t] || q - hb.pos[t] < gates_.window) && (hb.sel.empty() || hb.sel[t]) ? 1 : 0;
    return n;
  }
  // Appends one pool row's K or V as floats: dequantized when the pool stores
  // a quantized format, times (layer, head)'s engine-held scale.
  void read_row(std::int32_t l, std::int32_t h, std::int32_t block, std::int32_t token, std::int32_t kv,
                std::vector<float>& out) const {
    const std::size_t at = out.size();
    if (residual_)  // a ring row, or one of a global block not sealed yet
      if (const float* x = residual_->row(0, block * pool_.block_size + token, kv)) {
        out.insert(out.end(), x, x + hd_);
        return;
      }
    out.resize(at + std::size_t(hd_));
    kvcache::load_pool_span(pool_, kv, pool_.row(block, 0, kv, token, 0), kvcache::row_entries(pool_, block, 0, kv, token, 0),
                            0, hd_, out.data() + at);
    if (const float s = scales_.at(kv, l, h); s != 1.0f)
      for (std::size_t i = at; i < out.size(); ++i) out[i] *= s;
  }
  // Each head's row of layer l as the cache holds it now, read through the head-folded CSR export.
  void snapshot(std::int32_t l) {
    const kvcache::SeqId one[] = {seq_};
    const std::int32_t B = pool_.block_size;
    indptr_.resize(std::size_t(H_ + 1));
    last_.resize(std::size_t(H_));
    indices_.resize(std::size_t(H_) * std::size_t(cache_.table().max_blocks_per_stream()));
    if (auto r = cache_.export_heads_csr(one, l, indptr_, indices_, last_); !r)
      throw std::runtime_error("export_heads_csr: " + r.status().message());
    for (std::int32_t h = 0; h < H_; ++h) {
      Head& hb = heads_[std::size_t(h)];
      const auto positions = *cache_.admission().positions(seq_, l, h);
      const std::int32_t W = gates_.window;
      hb.k.clear(), hb.v.clear(), hb.pos.clear(), hb.adm.clear();
      for (std::size_t j = 0; j < positions.size(); ++j) {
        const std::int32_t b = indices_[std::size_t(indptr_[std::size_t(h)]) + j / std::size_t(B)];
        read_row(l, h, b, std::int32_t(j % std::size_t(B)), 0, hb.k);
        read_row(l, h, b, std::int32_t(j % std::size_t(B)), 1, hb.v);
        hb.pos.push_back(positions[j]);
        hb.adm.push_back(j >= std::size_t(W) || adm_at(l, h, positions[j]));  // global tokens were admitted
      }
    }
  }

  C& cache_;
  kvcache::PoolView pool_;
  kvcache::SeqId seq_;
  const GateSet& gates_;
  std::int64_t first_;
  std::vector<std::uint8_t>& adm_;
  GateCounts& counts_;
  const HeldScales& scales_;
  ChannelResidual* residual_;
  std::int32_t H_, hd_;
  std::vector<Head> heads_;
  std::vector<float> k_pre_, gate_;
  std::vector<std::int32_t> slots_, head_slots_, indptr_, indices_, last_;
  std::vector<kvcache::SlotMove> moves_;
  std::vector<kvcache::BlockCopy> copies_;
  std::int32_t n_ = 0;  // tokens of the current write
  std::vector<std::int32_t> stored_, stale_, fill_, chosen_ptr_, chosen_;
  std::vector<std::uint8_t> picked_;  // [position]: in a chosen page
  std::vector<float> scores_, by_pos_;
};

}  // namespace engine
