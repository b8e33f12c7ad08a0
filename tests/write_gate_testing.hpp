// Shared by the Write-Gated KV tests: the method on plain lists (one head's
// ring of W logical slots and its global list), the K/V each written token
// carries, and a single-head f32 pool the engine's kernels write into.
#pragma once

#include <catch2/catch.hpp>

#include <kvcache/table/head_rows.hpp>
#include <kvcache/core/geometry.hpp>
#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/ring_write.hpp>
#include <kvcache/kernels/scatter.hpp>

#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace gate_testing {
using namespace kvcache;

inline std::mt19937_64 fresh_rng() { return std::mt19937_64(Catch::rngSeed() ^ std::random_device{}()); }

// The method on lists: one head.
struct RefHead {
  struct Entry {
    std::int32_t pos = -1;
    bool admitted = false;
  };
  std::vector<Entry> ring;
  std::int32_t start = 0, len = 0;
  std::vector<std::int32_t> global;
  explicit RefHead(std::int32_t w) : ring(std::size_t(w)) {}
  std::int32_t w() const { return std::int32_t(ring.size()); }

  // One token; false when a promotion meets the cap under `refuse`.
  bool write(std::int32_t pos, bool admitted, std::int32_t cap, bool refuse, std::int32_t& dropped_at_cap) {
    if (len < w()) {
      ring[std::size_t((start + len++) % w())] = {pos, admitted};
      return true;
    }
    Entry& victim = ring[std::size_t(start)];
    start = (start + 1) % w();
    if (victim.admitted) {
      if (std::int32_t(global.size()) < cap) global.push_back(victim.pos);
      else if (refuse) return false;
      else ++dropped_at_cap;
    }
    victim = {pos, admitted};
    return true;
  }
  void truncate(std::int32_t n) {
    const bool was_full = len == w();
    len -= n;
    if (was_full)
      for (std::int32_t j = 0; j < n && !global.empty(); ++j) {
        start = (start - 1 + w()) % w();
        ring[std::size_t(start)] = {global.back(), true};
        global.pop_back();
        ++len;
      }
    if (len < w() && start != 0) {  // re-pack into [0, len): kept slots past len, in ring order, fill the holes
      auto valid = [&](std::int32_t x) { return (x - start + w()) % w() < len; };
      std::vector<Entry> next = ring;
      std::int32_t hole = 0;
      for (std::int32_t k = 0; k < len; ++k) {
        const std::int32_t r = (start + k) % w();
        if (r < len) continue;
        while (valid(hole)) ++hole;
        next[std::size_t(hole++)] = ring[std::size_t(r)];
      }
      ring = next;
      start = 0;
    }
  }
  // Newest tokens the ring's back holds as a run of consecutive positions ending at appended - 1.
  std::int32_t rollback_limit(std::int64_t appended) const {
    std::int32_t run = 0;
    while (run < len && ring[std::size_t((start + len - 1 - run) % w())].pos == appended - 1 - run) ++run;
    return run;
  }
  // The row the head's stream must hold: ring slots, then global.
  std::vector<std::int32_t> row() const {
    std::vector<std::int32_t> out;
    const std::int32_t live = len < w() ? len : w();
    for (std::int32_t r = 0; r < live; ++r) out.push_back(ring[std::size_t(r)].pos);
    out.insert(out.end(), global.begin(), global.end());
    return out;
  }
};

inline constexpr std::int32_t kDim = 4;
// The K value a (sequence, layer, head, position) writes: distinct, exact in f32.
inline float key_of(std::int32_t seq, std::int32_t layer, std::int32_t head, std::int32_t pos) {
  return float(((seq * 8 + layer) * 8 + head) * 4096 + pos);
}

// A single-head f32 pool and what the engine runs on it.
struct KvMemory {
  std::int32_t block, heads;
  Geometry geo;
  std::vector<float> memory;
  PoolView view;

  KvMemory(std::int32_t b, std::int32_t blocks, std::int32_t kv_heads)
      : block(b),
        heads(kv_heads),
        geo(*Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = kDim, .block_size = b, .dtype = DType::f32})),
        memory(std::size_t(*geo.pool_bytes(blocks)) / 4, -1.0f),
        view(*make_pool_view(geo, memory.data(), blocks)) {}

  // K (V) of token slot `slot` (f32 element 0).
  float k_at(std::int32_t slot) const { return *reinterpret_cast<const float*>(view.row(slot / block, 0, 0, slot % block, 0)); }
  float v_at(std::int32_t slot) const { return *reinterpret_cast<const float*>(view.row(slot / block, 0, 1, slot % block, 0)); }

  void copy_blocks(std::span<const BlockCopy> copies) {
    if (!copies.empty()) REQUIRE(block_copy_host({view, view, copies.data(), std::int32_t(copies.size())}).ok());
  }

  void move(std::span<const SlotMove> moves) {
    if (!moves.empty()) REQUIRE(compaction_host({view, moves.data(), std::int32_t(moves.size())}).ok());
  }

  // The K/V a layer's write of n tokens carries, [n][heads][kDim]: entry t * heads + h.
  KvSource source(std::int32_t seq, std::int32_t layer, std::int64_t pos0, std::int32_t n) {
    const std::int32_t H = heads;
    k_src.assign(std::size_t(n * H * kDim), 0.0f);
    v_src.assign(k_src.size(), 0.0f);
    for (std::int32_t t = 0; t < n; ++t)
      for (std::int32_t h = 0; h < H; ++h)
        for (std::int32_t d = 0; d < kDim; ++d) {
          k_src[std::size_t((t * H + h) * kDim + d)] = key_of(seq, layer, h, std::int32_t(pos0 + t));
          v_src[std::size_t((t * H + h) * kDim + d)] = -key_of(seq, layer, h, std::int32_t(pos0 + t));
        }
    return KvSource{k_src.data(), v_src.data(), DType::f32, 0, kDim * 4, 0};
  }

  // What the engine does for one layer's write after the copies: moves, then
  // the tokens (scatter), or both in one ring_write when promote is given.
  void run(std::span<const SlotMove> moves, std::span<const std::int32_t> slots, std::span<const std::int32_t> promote,
           std::int32_t seq, std::int32_t layer, std::int64_t pos0, std::int32_t n) {
    const KvSource src = source(seq, layer, pos0, n);
    if (!promote.empty()) {
      REQUIRE(ring_write_host({view, src, n * heads, 0, 1, slots.data(), promote.data()}).ok());
      return;
    }
    if (!moves.empty()) REQUIRE(compaction_host({view, moves.data(), std::int32_t(moves.size())}).ok());
    REQUIRE(scatter_host({view, src, TokenAddress{slots.data()}, n * heads}).ok());
  }
  std::vector<float> k_src, v_src;
};

// One layer's write of n tokens to s through a head-paged cache, with random
// gates (a third admitted), into buffers sized for it: moves for n + W tokens
// per head, `copies_per_head` copies per head. The engine's commands stay in
// `w` for the caller to run; w.pos0 is the write's first position.
struct RandomWrite {
  std::vector<float> gates;
  std::vector<std::int32_t> slots;
  std::vector<SlotMove> moves;
  std::vector<BlockCopy> copies;
  std::int64_t pos0 = 0;
  GateWriteSpans spans() { return {slots, moves, {}, copies}; }
};
template <class Cache>
Result<GateWriteInfo> random_write(Cache& cache, std::mt19937_64& rng, SeqId s, std::int32_t layer, std::int32_t n,
                                   std::int32_t copies_per_head, RandomWrite& w) {
  const std::int32_t H = cache.admission().num_kv_heads(), W = cache.admission().local_window();
  w.gates.resize(std::size_t(n * H));
  for (auto& g : w.gates) g = rng() % 3 == 0 ? 0.9f : 0.1f;
  w.slots.assign(w.gates.size(), 0);
  w.moves.resize(std::size_t(n * H + W * H));
  w.copies.resize(std::size_t(copies_per_head * H));
  w.pos0 = *cache.admission().appended(s, layer);
  return cache.write(s, layer, w.gates, w.spans());
}
}  // namespace gate_testing
