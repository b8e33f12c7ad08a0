// Integration guide: a FlashInfer-style engine on kvcache, with a sliding
// window and chunked prefill.
//
// Every step runs one ragged batch: each sequence's next prefill chunk (up to
// kChunk tokens) or its decode token. The engine's side of a step:
//   1. reserve_batch(seqs, counts, slots, copies): the batch's slot mapping;
//   2. on the stream: the model writes the chunk's K/V by slot
//      (append_paged_kv_cache, or scatter here);
//   3. evict(seq, {}, n) for each sequence, n = its queries this step: the
//      window keeps W - 1 + n tokens, what the chunk's earliest query needs;
//      blocks left with no live token go back to the pool (no byte moves);
//   4. export_csr(seqs, indptr, indices, last_page_len): FlashInfer's
//      paged_kv_indptr / paged_kv_indices / paged_kv_last_page_len, with
//      qo_indptr from the counts; plan() once per step, run() per layer with
//      causal = true and window_left = W - 1. The first page can keep up to
//      B - 1 dead slots before the window (table().front(seq)); the CSR
//      counts them, and the window mask is what hides them.
// Queries are rotated by their absolute position (tokens appended so far),
// not by their index in the kv range: the window's keys keep theirs.
//
// Here the "GPU" is the host backend and the attention is a reference of
// FlashInfer's masking rule: for each query, the keys the mask lets through
// must be exactly the W positions before and at it, read from the pages the
// CSR names. The pool is the sum of blocks_needed(prompt, new, chunk): the
// chunked-prefill bound, which the run must never exceed.
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kvcache.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "toy_model.hpp"

namespace kv = kvcache;

namespace {
constexpr std::int32_t kHeads = 2, kDim = 4, kB = 4, kW = 12, kChunk = 8, kNew = 10, kRowBlocks = 16;
using WindowCache = kv::Cache<kv::BlockPool, kv::PageTable, kv::AdmitAll, kv::SelectAll, kv::SlidingWindow>;

struct Stream {
  kv::SeqId seq;
  std::int32_t prompt_len, appended = 0;  // tokens written so far (absolute positions 0 .. appended)
  std::int32_t token(std::int32_t pos) const { return 1 + (pos * 7 + prompt_len) % 200; }
  bool done() const { return appended >= prompt_len + kNew; }
};

struct Checked {
  std::int64_t queries = 0, keys = 0, masked_dead = 0;
};

// FlashInfer's rule for a causal query i of qo_len in a kv range of kv_len:
// it sits at kv index kv_len - qo_len + i and sees key j when j is at or
// before it and at most window_left before it.
bool visible(std::int32_t j, std::int32_t i, std::int32_t qo_len, std::int32_t kv_len, std::int32_t window_left) {
  const std::int32_t qi = kv_len - qo_len + i;
  return j <= qi && qi - j <= window_left;
}
}  // namespace

int main() {
  try {
    const auto geometry = *kv::Geometry::make(
        {.num_layers = 1, .num_kv_heads = kHeads, .head_dim = kDim, .block_size = kB, .dtype = kv::DType::f32});
    const std::vector<std::int32_t> prompts{23, 9, 30};
    // The pool: what the three need at their chunked-prefill peak, and not a block more.
    const kv::SlidingWindow window(kW);
    std::int32_t num_blocks = 1;  // the null block
    {
      WindowCache probe({.geometry = geometry, .num_blocks = 2, .max_sequences = 1, .max_blocks_per_sequence = kRowBlocks},
                        {}, {}, window);
      for (const std::int32_t p : prompts) num_blocks += std::int32_t(probe.blocks_needed(p, kNew, kChunk).value());
    }
    std::vector<std::byte> memory(std::size_t(*geometry.pool_bytes(num_blocks)));
    const kv::PoolView pool = *kv::make_pool_view(geometry, memory.data(), num_blocks);
    WindowCache cache({.geometry = geometry, .num_blocks = num_blocks, .max_sequences = 4,
                       .max_blocks_per_sequence = kRowBlocks},
                      {}, {}, window);
    std::vector<Stream> streams;
    for (const std::int32_t p : prompts) streams.push_back({cache.add_sequence().value(), p});

    Checked checked;
    std::vector<kv::SeqId> seqs;
    std::vector<std::int32_t> counts, qo_indptr, slots, indptr, indices, last_page_len;
    std::vector<kv::BlockCopy> copies(8);
    std::vector<float> k, v;
    std::int32_t steps = 0, peak_blocks = 0;
    while (std::any_of(streams.begin(), streams.end(), [](const Stream& s) { return !s.done(); })) {
      ++steps;
      seqs.clear(), counts.clear(), qo_indptr.assign(1, 0);
      std::vector<Stream*> batch;
      for (auto& s : streams)
        if (!s.done()) {
          batch.push_back(&s);
          seqs.push_back(s.seq);
          counts.push_back(s.appended < s.prompt_len ? std::min(kChunk, s.prompt_len - s.appended) : 1);
          qo_indptr.push_back(qo_indptr.back() + counts.back());
        }
      // 1. The batch's slots.
      slots.assign(std::size_t(qo_indptr.back()), -1);
      auto r = cache.reserve_batch(seqs, counts, slots, copies);
      toy::expect(r.ok(), "reserve_batch within blocks_needed: " + r.status().message());
      peak_blocks = std::max(peak_blocks, num_blocks - 1 - cache.free_blocks());
      // 2. The model's K/V for the batch, by slot (K carries the token and its absolute position).
      k.assign(slots.size() * kHeads * kDim, 0.0f);
      v.assign(k.size(), 0.0f);
      for (std::size_t b = 0; b < batch.size(); ++b)
        for (std::int32_t t = 0; t < counts[b]; ++t)
          for (std::int32_t h = 0; h < kHeads; ++h)
            for (std::int32_t d = 0; d < kDim; ++d) {
              const std::int32_t pos = batch[b]->appended + t;
              const auto at = std::size_t(((qo_indptr[b] + t) * kHeads + h) * kDim + d);
              k[at] = toy::k_value(batch[b]->token(pos), pos, 0, h);
              v[at] = -k[at];
            }
      const std::int64_t f = sizeof(float);
      toy::expect(kv::scatter_host({pool, {k.data(), v.data(), kv::DType::f32, 0, kHeads * kDim * f, kDim * f},
                                    kv::TokenAddress{slots.data()}, std::int64_t(slots.size())})
                      .ok(),
                  "scatter");
      // 3. Trim before attention, naming the queries still to run.
      for (std::size_t b = 0; b < batch.size(); ++b)
        toy::expect(cache.evict(seqs[b], {}, counts[b]).ok(), "evict");
      // 4. The CSR attention reads, then the reference of the kernel's masking.
      indptr.assign(seqs.size() + 1, 0);
      indices.assign(seqs.size() * kRowBlocks, 0);
      last_page_len.assign(seqs.size(), 0);
      toy::expect(cache.export_csr(seqs, indptr, indices, last_page_len).ok(), "export_csr");
      for (std::size_t b = 0; b < batch.size(); ++b) {
        const std::int32_t pages = indptr[b + 1] - indptr[b];
        const std::int32_t kv_len = (pages - 1) * kB + last_page_len[b], qo_len = counts[b];
        const std::int32_t front = cache.table().front(seqs[b]).value();
        for (std::int32_t i = 0; i < qo_len; ++i) {
          const std::int32_t q = batch[b]->appended + i;  // the query's absolute position (its RoPE position)
          std::vector<std::int32_t> seen;
          for (std::int32_t j = 0; j < kv_len; ++j) {
            if (!visible(j, i, qo_len, kv_len, kW - 1)) {
              checked.masked_dead += j < front;
              continue;
            }
            toy::expect(j >= front, fmt::format("query {} sees the dead slot {} before the window", q, j));
            for (std::int32_t h = 0; h < kHeads; ++h) {
              float key;
              std::memcpy(&key, pool.row(indices[std::size_t(indptr[b] + j / kB)], 0, 0, j % kB, h), sizeof key);
              const std::int32_t pos = std::int32_t(key) % 2048;
              toy::expect(key == toy::k_value(batch[b]->token(pos), pos, 0, h), "the key's token");
              if (h == 0) seen.push_back(pos);
            }
          }
          std::vector<std::int32_t> want;
          for (std::int32_t p = std::max(0, q - kW + 1); p <= q; ++p) want.push_back(p);
          toy::expect(seen == want, fmt::format("query at {} sees positions {}..{} ({} keys)", q,
                                                seen.empty() ? -1 : seen.front(), seen.empty() ? -1 : seen.back(),
                                                seen.size()));
          ++checked.queries, checked.keys += std::int64_t(seen.size());
        }
        batch[b]->appended += qo_len;
      }
      toy::expect(cache.check_invariants().ok(), "invariants");
    }
    for (const auto& s : streams) toy::expect(cache.free(s.seq).ok(), "free");
    fmt::print("FlashInfer-style engine: prompts of {}, {} and {} tokens in chunks of {}, {} new tokens each, a window "
               "of {} (window_left = {}), block size {}\n",
               prompts[0], prompts[1], prompts[2], kChunk, kNew, kW, kW - 1, kB);
    fmt::print("  {} steps, {} queries: each saw exactly its window ({} keys read); {} dead front slots masked; "
               "peak {} of {} blocks (the sum of blocks_needed)\n",
               steps, checked.queries, checked.keys, checked.masked_dead, peak_blocks, num_blocks - 1);
    toy::expect(checked.masked_dead > 0, "the window mask hid dead front slots");
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}\n", e.what());
    return 1;
  }
}
