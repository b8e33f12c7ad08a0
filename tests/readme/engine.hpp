// The engine side the README's snippets name without declaring it (cfg,
// chunks, slots, write_kv, attention, pool, stream, ...), as two fixtures:
// test_readme.cpp runs the snippets inside them on the host, readme_cuda.cu
// compiles the GPU snippets inside them with nvcc. Without CUDA, the runtime
// names come from cuda_on_host.hpp. Every buffer is as large as the README
// says it must be; nothing is sized to hide a snippet's mistake.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <stdexcept>
#include <vector>

#include <kvcache/kvcache.hpp>
#include <kvcache/eviction/average_attention.hpp>
#include <kvcache/eviction/block_scores.hpp>
#include <kvcache/eviction/h2o.hpp>
#include <kvcache/selection/quest.hpp>
#include <kvcache/eviction/sink_window.hpp>
#include <kvcache/eviction/sliding_window.hpp>
#include <kvcache/eviction/snapkv.hpp>
#include <kvcache/eviction/tova.hpp>
#include <kvcache/admission/write_gate.hpp>
#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/ring_write.hpp>
#include <kvcache/kernels/page_bounds.hpp>
#include <kvcache/kernels/scatter.hpp>

#ifdef __CUDACC__
#include <cuda_runtime.h>
#else
#include "cuda_on_host.hpp"
#endif

namespace readme {
namespace kv = kvcache;
using std::int32_t;
using std::int64_t;

// One sequence under one policy: 96 prefill chunks of 64 tokens, then 1,024
// decode steps. 1 layer, 2 kv-heads (4 query heads), head_dim 2, f32,
// block 16; K of (slot, head) holds the token's position in dim 0.
struct PolicyEngine {
  static constexpr int32_t num_layers = 1, num_kv_heads = 2, num_heads = 4, head_dim = 2, block = 16;
  static constexpr int32_t num_blocks = 1024, max_blocks = 512;
  kv::GeometrySpec spec{.num_layers = num_layers, .num_kv_heads = num_kv_heads, .head_dim = head_dim,
                        .block_size = block, .dtype = kv::DType::f32};
  kv::CacheConfig cfg{.geometry = kv::Geometry::make(spec).value(), .num_blocks = num_blocks, .max_sequences = 4,
                      .max_blocks_per_sequence = max_blocks};
  int32_t prompt_len = 2048, max_new = 1024;
  std::vector<int32_t> chunks = make_chunks();
  std::vector<int32_t> slots = std::vector<int32_t>(std::size_t(prompt_len));  // the largest chunk
  // Eviction output: token policies may move groups x held tokens; block policies list blocks.
  std::vector<kv::SlotMove> moves = std::vector<kv::SlotMove>(std::size_t(num_kv_heads * max_blocks * block));
  std::vector<int32_t> group_moves = std::vector<int32_t>(num_kv_heads + 1);
  std::vector<int32_t> evicted = std::vector<int32_t>(max_blocks);
  std::vector<kv::BlockRotation> rotations = std::vector<kv::BlockRotation>(max_blocks);
  std::vector<int32_t> blocks = std::vector<int32_t>(max_blocks), deltas = std::vector<int32_t>(max_blocks);
  std::vector<float> scores, sums, per_head_sums, last_query_probs, window_sums;
  // "Device" memory: the pool and the kernels' inputs.
  std::vector<float> memory = std::vector<float>(std::size_t(num_blocks * block * num_kv_heads * head_dim * 2));
  kv::PoolView pool = kv::make_pool_view(cfg.geometry, memory.data(), num_blocks).value();
  cudaStream_t stream{};
  std::vector<kv::SlotMove> moves_on_device = std::vector<kv::SlotMove>(moves.size());
  kv::SlotMove* moves_dev = moves_on_device.data();
  std::vector<int32_t> blocks_on_device = blocks, deltas_on_device = deltas;
  int32_t* blocks_dev = blocks_on_device.data();
  int32_t* deltas_dev = deltas_on_device.data();
  int32_t max_delta = max_blocks * block;
  std::vector<float> cos_on_device = std::vector<float>(std::size_t((max_delta + 1) * head_dim / 2));
  std::vector<float> sin_on_device = cos_on_device;
  float* cos_dev = cos_on_device.data();
  float* sin_dev = sin_on_device.data();

  int64_t written = 0;  // tokens written: the next token's position
  int64_t last_chunk = 0;
  // Sliding window W (0: none): attention records by how many keys the held
  // tokens fell short of what the chunk's earliest query needs (W - 1 before it).
  int64_t window = 0, keys_missing = 0;
  std::mt19937 rng{20261123};

  static std::vector<int32_t> make_chunks() {
    std::vector<int32_t> c(96, 64);
    c.insert(c.end(), 1024, 1);
    return c;
  }
  int64_t total_tokens() const {
    int64_t t = 0;
    for (int32_t n : chunks) t += n;
    return t;
  }
  float* key(int32_t slot, int32_t head) {
    return static_cast<float*>(static_cast<void*>(pool.row(slot / block, 0, 0, slot % block, head)));
  }
  // The engine's scatter: K of every head holds the token's position.
  void write_kv(std::span<const int32_t> to, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
      for (int32_t h = 0; h < num_kv_heads; ++h) *key(to[std::size_t(i)], h) = float(written + i);
    written += n;
    last_chunk = n;
  }
  // The engine's attention with a score output: rows x held scores, quantized
  // so ties (and the tie-breaks) occur.
  void attention(int32_t rows, int64_t held, std::vector<float>& out) {
    if (window > 0) keys_missing = std::max(keys_missing, std::min(written, window - 1 + last_chunk) - held);
    out.resize(std::size_t(rows * held));
    std::uniform_int_distribution<int> q(0, 31);
    for (float& x : out) x = float(q(rng)) / 32.0f;
  }
};

// The kernels section: a 2-layer fp16 pool of 8 blocks (2 kv-heads x 8 dims)
// and a fused QKV input of 20 tokens per layer (4 query heads).
struct KernelEngine {
  static constexpr int32_t num_layers = 2, kv_heads = 2, q_heads = 4, head_dim = 8, block = 16;
  static constexpr int64_t num_blocks = 8, num_tokens = 20;
  kv::Geometry geometry = kv::Geometry::make({.num_layers = num_layers, .num_kv_heads = kv_heads,
                                              .head_dim = head_dim, .block_size = block, .dtype = kv::DType::f16})
                              .value();
  std::vector<std::byte> memory = std::vector<std::byte>(std::size_t(geometry.pool_bytes(num_blocks).value()));
  void* kv_memory = memory.data();
  int32_t layer = 1;
  int64_t head_bytes = head_dim * 2, qkv_token_stride = (q_heads + 2 * kv_heads) * head_bytes;
  int64_t per_layer_bytes = num_tokens * qkv_token_stride;
  std::vector<std::byte> qkv = std::vector<std::byte>(std::size_t(num_layers * per_layer_bytes));
  const void* k_ptr = qkv.data() + q_heads * head_bytes;
  const void* v_ptr = qkv.data() + (q_heads + kv_heads) * head_bytes;
  std::vector<int32_t> slot_buffer = make_slots();
  const int32_t* slots_dev = slot_buffer.data();
  std::vector<kv::BlockCopy> copy_buffer{{.src = 1, .dst = 3}};
  const kv::BlockCopy* copies_dev = copy_buffer.data();
  int32_t num_copies = 1;
  std::vector<int32_t> block_buffer{2}, delta_buffer{-5};
  const int32_t* blocks_dev = block_buffer.data();
  const int32_t* deltas_dev = delta_buffer.data();
  int32_t num_rotations = 1, max_delta = 64;
  std::vector<float> cos_buffer = std::vector<float>(std::size_t((max_delta + 1) * head_dim / 2)), sin_buffer = cos_buffer;
  float* cos_dev = cos_buffer.data();
  float* sin_dev = sin_buffer.data();
  cudaStream_t stream{};
  // Write-gate weights of one layer (hidden 4 x head_dim) and its pre-RoPE keys (post-RoPE: k_ptr).
  std::vector<float> gate_weights = make_gate_weights();
  const float* norm_pre_dev = gate_weights.data();
  const float* norm_post_dev = norm_pre_dev + head_dim;
  const float* w1_dev = norm_post_dev + head_dim;
  const float* b1_dev = w1_dev + kv_heads * 2 * head_dim * 4 * head_dim;
  const float* w2_dev = b1_dev + kv_heads * 4 * head_dim;
  const float* b2_dev = w2_dev + kv_heads * 4 * head_dim;
  std::vector<std::byte> k_pre = std::vector<std::byte>(std::size_t(per_layer_bytes));
  const void* k_pre_ptr = k_pre.data() + q_heads * head_bytes;
  std::vector<float> gate_buffer = std::vector<float>(std::size_t(num_tokens * kv_heads), -1.0f);
  float* gates_dev = gate_buffer.data();
  // Quest: two sequences over blocks 1..7 of `layer` (6 pages, the last holding 5
  // tokens; 1 page of 3 tokens), every page just written; the step's queries.
  int32_t num_seqs = 2, num_pages = 7, num_touched = 7;
  std::vector<int32_t> indptr{0, 6, 7}, index_buffer{1, 2, 3, 4, 5, 6, 7}, fill_buffer{16, 16, 16, 16, 16, 5, 3};
  const int32_t* indptr_dev = indptr.data();
  const int32_t* indices_dev = index_buffer.data();
  const int32_t* touched_dev = index_buffer.data();
  const int32_t* fill_dev = fill_buffer.data();
  std::vector<float> bound_buffer = std::vector<float>(std::size_t(num_blocks * kv_heads * 2 * head_dim));
  float* bounds_dev = bound_buffer.data();
  std::vector<float> query_buffer = make_queries();
  const float* queries_dev = query_buffer.data();
  std::vector<int32_t> out_indptr_buffer = std::vector<int32_t>(5, -1), out_index_buffer = std::vector<int32_t>(10, -1);
  int32_t* out_indptr_dev = out_indptr_buffer.data();
  int32_t* out_indices_dev = out_index_buffer.data();
  std::vector<std::byte> scratch_buffer;
  void* engine_scratch(std::size_t bytes) {  // the engine's buffer, sized once per batch shape
    scratch_buffer.resize(bytes);
    return scratch_buffer.data();
  }
  static std::vector<float> make_queries() {  // [num_seqs][kv_heads][q_heads / kv_heads][head_dim]
    std::vector<float> q(std::size_t(2 * q_heads * head_dim));
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = float(int(i * 7 % 13) - 6) / 4.0f;
    return q;
  }

  KernelEngine() {  // every input element distinct and exactly representable in fp16
    for (std::size_t i = 0; i < qkv.size() / 2; ++i)
      kv::store_elem(kv::DType::f16, qkv.data(), std::int64_t(i), float(int(i % 997) - 498) / 64.0f);
    for (std::size_t i = 0; i < k_pre.size() / 2; ++i)
      kv::store_elem(kv::DType::f16, k_pre.data(), std::int64_t(i), float(int(i % 311) - 155) / 32.0f);
    for (std::size_t i = 0; i < memory.size() / 2; ++i)  // the pool's keys for the Quest snippet
      kv::store_elem(kv::DType::f16, memory.data(), std::int64_t(i), float(int(i * 37 % 101) - 50) / 16.0f);
  }
  static std::vector<float> make_gate_weights() {  // norms, w1, b1, w2, b2: small, deterministic
    const std::size_t n = 2 * head_dim + kv_heads * (2 * head_dim * 4 * head_dim + 2 * 4 * head_dim + 1);
    std::vector<float> w(n);
    for (std::size_t i = 0; i < n; ++i) w[i] = i < 2 * head_dim ? 1.0f : float(int(i % 23) - 11) / 40.0f;
    return w;
  }
  static std::vector<int32_t> make_slots() {  // tokens 0..19 at slots 16..35: blocks 1 and 2
    std::vector<int32_t> s(num_tokens);
    for (std::size_t t = 0; t < s.size(); ++t) s[t] = int32_t(block + int32_t(t));
    return s;
  }
};
// One sequence under Write-Gated KV: 2 layers x 2 kv-heads, head_dim 2, f32,
// single-head blocks of 16; 4 prefill chunks of 100 tokens, then 200 decode
// steps. Token p of (layer, head) gets gate 0.9 when (p * (head + 1) + layer)
// is a multiple of 5, else 0.02; K holds (p, 10 * layer + head) and V its negation.
struct GateEngine {
  static constexpr int32_t num_layers = 2, num_kv_heads = 2, head_dim = 2, block = 16;
  static constexpr int32_t num_blocks = 512, row_blocks = 48, W = 64;
  kv::Geometry head_geometry = kv::Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = head_dim,
                                                   .block_size = block, .dtype = kv::DType::f32}).value();
  std::vector<int32_t> chunks = make_chunks();
  // A write's buffers: slots [n][kv_heads]; moves: at most the W ring tokens
  // per head; copies: a head's row (after a fork).
  std::vector<int32_t> slots = std::vector<int32_t>(std::size_t(100 * num_kv_heads));
  std::vector<kv::SlotMove> moves = std::vector<kv::SlotMove>(std::size_t(W * num_kv_heads));
  std::vector<kv::BlockCopy> copies = std::vector<kv::BlockCopy>(std::size_t(row_blocks * num_kv_heads));
  // Exports: room for a batch of up to 4 sequences' head rows.
  std::vector<int32_t> indptr = std::vector<int32_t>(4 * num_kv_heads + 1);
  std::vector<int32_t> indices = std::vector<int32_t>(std::size_t(4 * num_kv_heads * row_blocks));
  std::vector<int32_t> last_page_len = std::vector<int32_t>(4 * num_kv_heads);
  std::vector<int32_t> promote = std::vector<int32_t>(std::size_t(4 * num_kv_heads));
  std::vector<float> memory = std::vector<float>(std::size_t(num_blocks * block * head_dim * 2));
  kv::PoolView pool = kv::make_pool_view(head_geometry, memory.data(), num_blocks).value();
  std::vector<float> gate_buffer, k_buffer, v_buffer;
  int64_t written = 0;  // the chunk's first position
  int32_t chunk = 0;
  int64_t rows_read = 0, keys_read = 0, wrong = 0;

  static std::vector<int32_t> make_chunks() {
    std::vector<int32_t> c(4, 100);
    c.insert(c.end(), 200, 1);
    return c;
  }
  static float gate(int32_t layer, int32_t head, int64_t p) { return (p * (head + 1) + layer) % 5 == 0 ? 0.9f : 0.02f; }
  // What a head holds after `end` tokens: the last W, and every earlier admitted one.
  static bool kept(int32_t layer, int32_t head, int64_t p, int64_t end) { return p >= end - W || gate(layer, head, p) >= 0.1f; }

  std::span<const float> gate_scores(int32_t layer, int32_t n) {
    chunk = n;
    gate_buffer.resize(std::size_t(n * num_kv_heads));
    for (int32_t t = 0; t < n; ++t)
      for (int32_t h = 0; h < num_kv_heads; ++h) gate_buffer[std::size_t(t * num_kv_heads + h)] = gate(layer, h, written + t);
    return gate_buffer;
  }
  kv::KvSource layer_kv(int32_t layer, int32_t n) {  // [n][kv_heads][head_dim] K and V
    k_buffer.assign(std::size_t(n * num_kv_heads * head_dim), 0.0f);
    v_buffer = k_buffer;
    for (int32_t t = 0; t < n; ++t)
      for (int32_t h = 0; h < num_kv_heads; ++h) {
        const std::size_t at = std::size_t((t * num_kv_heads + h) * head_dim);
        k_buffer[at] = float(written + t);
        k_buffer[at + 1] = float(10 * layer + h);
        v_buffer[at] = -k_buffer[at];
        v_buffer[at + 1] = -k_buffer[at + 1];
      }
    return kv::KvSource{k_buffer.data(), v_buffer.data(), kv::DType::f32, 0, head_dim * 4, 0};
  }
  // Stands for a stock paged kernel over the head rows: reads every key of
  // each row and checks the row holds exactly what the method keeps.
  void attention(int32_t layer, std::span<const int32_t> ptr, std::span<const int32_t> idx, std::span<const int32_t> last) {
    const int64_t end = written + chunk;
    for (int32_t h = 0; h < num_kv_heads; ++h) {
      const int32_t pages = ptr[std::size_t(h + 1)] - ptr[std::size_t(h)];
      const int32_t len = pages == 0 ? 0 : (pages - 1) * block + last[std::size_t(h)];
      std::vector<int64_t> held;
      for (int32_t j = 0; j < len; ++j) {
        const int32_t b = idx[std::size_t(ptr[std::size_t(h)] + j / block)];
        const float* k = reinterpret_cast<const float*>(pool.row(b, 0, 0, j % block, 0));
        const float* v = reinterpret_cast<const float*>(pool.row(b, 0, 1, j % block, 0));
        wrong += k[1] != float(10 * layer + h) || v[0] != -k[0] ? 1 : 0;
        held.push_back(int64_t(k[0]));
      }
      std::sort(held.begin(), held.end());
      std::vector<int64_t> want;
      for (int64_t p = 0; p < end; ++p)
        if (kept(layer, h, p, end)) want.push_back(p);
      wrong += held == want ? 0 : 1;
      ++rows_read;
      keys_read += len;
    }
    if (layer == num_layers - 1) written = end;
  }

  // The composition snippet's side (Write-Gated KV + Quest + H2O): the
  // step's queries (2 per kv-head), and attention over the chosen pages of
  // each head row, as the scores H2O observes: one per row token (ring, then
  // global), a softmax over the chosen tokens and 0 elsewhere.
  std::vector<float> query_buffer, score_buffer;
  std::vector<int32_t> rows_indptr = std::vector<int32_t>(num_kv_heads + 1);
  std::vector<int32_t> rows_indices = std::vector<int32_t>(std::size_t(num_kv_heads * row_blocks));
  std::vector<int32_t> rows_last = std::vector<int32_t>(num_kv_heads);
  std::vector<kv::SlotMove> evict_moves = std::vector<kv::SlotMove>(std::size_t(num_layers * num_kv_heads * row_blocks * block));
  int64_t chosen_keys = 0, row_keys = 0;
  int32_t most_read = 0;  // pages a head row of the sparse layer read at most in one step
  std::span<const float> queries(int32_t layer) {
    query_buffer.resize(std::size_t(num_kv_heads * 2 * head_dim));
    for (std::size_t i = 0; i < query_buffer.size(); ++i) query_buffer[i] = float((int64_t(i) * 7 + layer + written) % 5) - 2.0f;
    return query_buffer;
  }
  std::span<const float> attention_scores(int32_t layer, std::span<const int32_t> chosen_ptr, std::span<const int32_t> chosen) {
    score_buffer.clear();
    for (int32_t h = 0; h < num_kv_heads; ++h) {
      const int32_t pages = rows_indptr[std::size_t(h + 1)] - rows_indptr[std::size_t(h)];
      const int32_t len = pages == 0 ? 0 : (pages - 1) * block + rows_last[std::size_t(h)];
      std::vector<float> p(std::size_t(len), 0.0f);
      float sum = 0.0f;
      for (int32_t j = 0; j < len; ++j) {
        const int32_t b = rows_indices[std::size_t(rows_indptr[std::size_t(h)] + j / block)];
        if (std::find(chosen.begin() + chosen_ptr[std::size_t(h)], chosen.begin() + chosen_ptr[std::size_t(h + 1)], b) ==
            chosen.begin() + chosen_ptr[std::size_t(h + 1)])
          continue;  // a page the selection left out is not read
        const float* k = reinterpret_cast<const float*>(pool.row(b, 0, 0, j % block, 0));
        p[std::size_t(j)] = std::exp(std::fmod(k[0] * 0.37f + float(layer + h), 3.0f));
        sum += p[std::size_t(j)];
        chosen_keys += layer > 0 ? 1 : 0;  // the sparse layer's reads
      }
      for (auto& x : p) score_buffer.push_back(x / sum);
      row_keys += layer > 0 ? len : 0;
      if (layer > 0) most_read = std::max(most_read, chosen_ptr[std::size_t(h + 1)] - chosen_ptr[std::size_t(h)]);
    }
    return score_buffer;
  }

  // The batch snippet's side: a decode step of several sequences, sequence k
  // at position step_pos (its gates and K/V differ by sequence).
  int64_t step_pos = 0;
  static float batch_gate(std::size_t k, int32_t layer, int32_t head, int64_t p) {
    return gate(layer, head, p + 3 * int64_t(k));
  }
  std::span<const float> step_gates(int32_t layer, std::span<const kv::SeqId> batch) {  // [seqs][kv_heads]
    gate_buffer.resize(batch.size() * std::size_t(num_kv_heads));
    for (std::size_t k = 0; k < batch.size(); ++k)
      for (int32_t h = 0; h < num_kv_heads; ++h) gate_buffer[k * num_kv_heads + std::size_t(h)] = batch_gate(k, layer, h, step_pos);
    return gate_buffer;
  }
  kv::KvSource step_kv(int32_t layer, std::span<const kv::SeqId> batch) {  // [seqs][kv_heads][head_dim]
    k_buffer.assign(batch.size() * std::size_t(num_kv_heads * head_dim), 0.0f);
    v_buffer = k_buffer;
    for (std::size_t k = 0; k < batch.size(); ++k)
      for (int32_t h = 0; h < num_kv_heads; ++h) {
        const std::size_t at = (k * std::size_t(num_kv_heads) + std::size_t(h)) * std::size_t(head_dim);
        k_buffer[at] = float(step_pos);
        k_buffer[at + 1] = float(100 * int32_t(k) + 10 * layer + h);
        v_buffer[at] = -k_buffer[at];
        v_buffer[at + 1] = -k_buffer[at + 1];
      }
    return kv::KvSource{k_buffer.data(), v_buffer.data(), kv::DType::f32, 0, head_dim * 4, 0};
  }
  // As attention(), for every (sequence, kv-head) row of the batch.
  void attention_batch(int32_t layer, std::size_t num_seqs, std::span<const int32_t> ptr, std::span<const int32_t> idx,
                       std::span<const int32_t> last) {
    const int64_t end = step_pos + 1;
    for (int32_t r = 0; r < int32_t(num_seqs) * num_kv_heads; ++r) {
      const auto k = std::size_t(r / num_kv_heads);
      const int32_t h = r % num_kv_heads, pages = ptr[std::size_t(r + 1)] - ptr[std::size_t(r)];
      const int32_t len = pages == 0 ? 0 : (pages - 1) * block + last[std::size_t(r)];
      std::vector<int64_t> held;
      for (int32_t j = 0; j < len; ++j) {
        const int32_t b = idx[std::size_t(ptr[std::size_t(r)] + j / block)];
        const float* kr = reinterpret_cast<const float*>(pool.row(b, 0, 0, j % block, 0));
        const float* vr = reinterpret_cast<const float*>(pool.row(b, 0, 1, j % block, 0));
        wrong += kr[1] != float(100 * int32_t(k) + 10 * layer + h) || vr[0] != -kr[0] ? 1 : 0;
        held.push_back(int64_t(kr[0]));
      }
      std::sort(held.begin(), held.end());
      std::vector<int64_t> want;
      for (int64_t p = 0; p < end; ++p)
        if (p >= end - W || batch_gate(k, layer, h, p) >= 0.1f) want.push_back(p);
      wrong += held == want ? 0 : 1;
      ++rows_read;
    }
    if (layer == num_layers - 1) ++step_pos;
  }

  // The no-host-sync snippet's side: "device" buffers (host memory here),
  // each layer's next position, and the gates it copies back.
  int32_t steps = 300;
  std::vector<int32_t> ring_start = std::vector<int32_t>(num_kv_heads), ring_len = ring_start;
  std::vector<int32_t> rows = std::vector<int32_t>(std::size_t(num_kv_heads * row_blocks));
  std::vector<int32_t> rows_buffer = rows, start_buffer = ring_start, len_buffer = ring_start;
  std::vector<int32_t> global_len_buffer = std::vector<int32_t>(std::size_t(num_layers * num_kv_heads));
  std::vector<std::uint8_t> bits_buffer = std::vector<std::uint8_t>(std::size_t(num_layers * num_kv_heads * W));
  int32_t* rows_dev = rows_buffer.data();
  int32_t* start_dev = start_buffer.data();
  int32_t* len_dev = len_buffer.data();
  int32_t* global_len_dev = global_len_buffer.data();
  std::uint8_t* bits_dev = bits_buffer.data();
  std::vector<std::vector<float>> gates_back =
      std::vector<std::vector<float>>(num_layers, std::vector<float>(num_kv_heads));
  std::vector<int64_t> layer_pos = std::vector<int64_t>(num_layers, 0);
  cudaStream_t stream{};
  const float* device_gates(int32_t layer, int32_t n) {
    const int64_t saved = written;
    written = layer_pos[std::size_t(layer)];
    gate_scores(layer, n);
    written = saved;
    return gate_buffer.data();
  }
  kv::KvSource device_kv(int32_t layer, int32_t n) {
    const int64_t saved = written;
    written = layer_pos[std::size_t(layer)];
    const kv::KvSource src = layer_kv(layer, n);
    written = saved;
    layer_pos[std::size_t(layer)] += n;
    return src;
  }
};
// Quest: 2 layers, 2 kv-heads (4 query heads), head_dim 8, block 16, f32;
// three prompts, then decode steps. write_kv stores random keys at the
// slots; attention() keeps each layer's last selection (with the queries it
// answered) for the test to check against a selection from the keys themselves.
struct QuestEngine {
  static constexpr int32_t num_layers = 2, kv_heads = 2, q_heads = 4, head_dim = 8, block = 16, num_blocks = 64;
  kv::Geometry geometry = kv::Geometry::make({.num_layers = num_layers, .num_kv_heads = kv_heads, .head_dim = head_dim,
                                              .block_size = block, .dtype = kv::DType::f32})
                              .value();
  std::vector<float> memory = std::vector<float>(std::size_t(geometry.pool_bytes(num_blocks).value() / 4));
  kv::PoolView pool = kv::make_pool_view(geometry, memory.data(), num_blocks).value();
  std::vector<int32_t> prompt_lens{150, 90, 40};
  int32_t steps = 30;
  std::mt19937 rng{20261123};
  std::vector<std::vector<float>> last_queries = std::vector<std::vector<float>>(num_layers);
  std::vector<std::vector<int32_t>> last_indptr = std::vector<std::vector<int32_t>>(num_layers);
  std::vector<std::vector<int32_t>> last_indices = last_indptr;
  int64_t attention_calls = 0;

  void write_kv(int32_t layer, std::span<const int32_t> slots) {
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    std::vector<float> kv_rows(slots.size() * std::size_t(kv_heads * head_dim));
    for (auto& x : kv_rows) x = u(rng);
    const int64_t row = int64_t{kv_heads} * head_dim * 4;
    kv::ScatterParams p{pool, {kv_rows.data(), kv_rows.data(), kv::DType::f32, 0, row, head_dim * 4},
                        kv::TokenAddress{slots.data()}, int64_t(slots.size()), layer};
    if (!kv::scatter_host(p)) throw std::runtime_error("scatter");
  }
  std::span<const float> queries(int32_t layer) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    auto& q = last_queries[std::size_t(layer)];
    q.resize(prompt_lens.size() * std::size_t(q_heads * head_dim));
    for (auto& x : q) x = u(rng);
    return q;
  }
  void attention(int32_t layer, std::span<const int32_t> indptr, std::span<const int32_t> indices) {
    last_indptr[std::size_t(layer)].assign(indptr.begin(), indptr.end());
    last_indices[std::size_t(layer)].assign(indices.begin(), indices.begin() + indptr.back());
    ++attention_calls;
  }
};

}  // namespace readme
