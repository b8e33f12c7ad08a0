// Integration guide: a CPU engine in the style of llama.cpp, with a
// score-based eviction policy (H2O) and compaction.
//
// Two sequences (llama-server's parallel slots) share an f16 pool in host
// memory. Each step feeds every sequence its next prompt ubatch (up to
// kUbatch tokens) or its decode token; per step the engine:
//   1. reserve_batch(seqs, counts, slots, copies): the batch's slots;
//   2. scatter_host: the new K/V into the pool (f32 in, f16 stored);
//   3. per layer: export_csr + gather_host of the batch's K/V into dense f32
//      rows, and attention on the CPU; the causal mask uses each kept
//      token's original position, since compaction reorders rows: the
//      positions the policy tracks (eviction().positions(seq, group)), then
//      the step's new tokens, appended in order;
//   4. observe(seq, head_attention_sums): per (layer, kv-head) group, the
//      attention each held token got from the step's queries (the q-heads of
//      the kv-head summed);
//   5. evict(seq, {moves, group_moves}), then compaction_host for each
//      group's moves on its layer and kv-head, before the next write.
// With -fopenmp the host launchers of scatter, gather and block copy run
// their outer loops on threads; the library starts none of its own.
//
// Every group keeps its own tokens (H2O: heavy hitters + recent); after each
// compaction the engine checks that each (layer, kv-head) row holds exactly
// the positions the policy tracks, in that order, and that no sequence holds
// more than the policy's bound.
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/gather.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kvcache.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "toy_model.hpp"

namespace kv = kvcache;

namespace {
constexpr std::int32_t kLayers = 2, kHeads = 2, kQPerKv = 2, kDim = 8, kB = 16, kUbatch = 32, kNew = 64;
constexpr std::int32_t kGroups = kLayers * kHeads, kHeavy = 24, kRecent = 8, kRowBlocks = 8;
using H2OCache = kv::Cache<kv::BlockPool, kv::PageTable, kv::AdmitAll, kv::SelectAll, kv::H2OEviction>;

// The toy model's vectors: element 0 of K is the token's position (exact in
// f16), and q's element 0 is 0 so the tag never enters a score.
float unit(std::uint32_t x) {
  x ^= x >> 16, x *= 0x7feb352du, x ^= x >> 15, x *= 0x846ca68bu, x ^= x >> 16;
  return float(x & 0xffffu) / 32768.0f - 1.0f;
}
float key(std::int32_t pos, std::int32_t layer, std::int32_t head, std::int32_t d) {
  return d == 0 ? float(pos) : unit(std::uint32_t(((pos * kLayers + layer) * kHeads + head) * kDim + d));
}
float query(std::int32_t pos, std::int32_t layer, std::int32_t qhead, std::int32_t d) {
  return d == 0 ? 0.0f : 2.0f * unit(0x9e3779b9u ^ std::uint32_t(((pos * kLayers + layer) * 8 + qhead) * kDim + d));
}

struct Slot {
  kv::SeqId seq;
  std::int32_t prompt_len, appended = 0;
  bool done() const { return appended >= prompt_len + kNew; }
};
}  // namespace

int main() {
  try {
    const auto geometry = *kv::Geometry::make(
        {.num_layers = kLayers, .num_kv_heads = kHeads, .head_dim = kDim, .block_size = kB, .dtype = kv::DType::f16});
    const std::int32_t num_blocks = 1 + 2 * kRowBlocks;
    std::vector<std::byte> memory(std::size_t(*geometry.pool_bytes(num_blocks)));  // host memory: the CPU engine's pool
    const kv::PoolView pool = *kv::make_pool_view(geometry, memory.data(), num_blocks);
    H2OCache cache({.geometry = geometry, .num_blocks = num_blocks, .max_sequences = 2, .max_blocks_per_sequence = kRowBlocks},
                   {}, {}, kv::H2OEviction({.heavy = kHeavy, .recent = kRecent, .groups = kGroups}));
    std::vector<Slot> slots_of{{cache.add_sequence().value(), 40}, {cache.add_sequence().value(), 56}};

    std::vector<kv::SeqId> seqs;
    std::vector<std::int32_t> counts, first, slots, indptr, indices, last_page_len, lengths, rows, group_moves(kGroups + 1);
    std::vector<kv::BlockCopy> copies(2);
    std::vector<kv::SlotMove> moves(std::size_t(kGroups * kRowBlocks * kB));
    std::vector<float> k_new, v_new, k_rows, v_rows, sums, logits;
    std::int64_t steps = 0, evicted = 0, move_count = 0, checks = 0;
    double output_checksum = 0.0;
    while (std::any_of(slots_of.begin(), slots_of.end(), [](const Slot& s) { return !s.done(); })) {
      ++steps;
      std::vector<Slot*> batch;
      seqs.clear(), counts.clear(), first.assign(1, 0);
      for (auto& s : slots_of)
        if (!s.done()) {
          batch.push_back(&s), seqs.push_back(s.seq);
          counts.push_back(s.appended < s.prompt_len ? std::min(kUbatch, s.prompt_len - s.appended) : 1);
          first.push_back(first.back() + counts.back());
        }
      // 1-2. Slots, then the new K/V (f32 from the model, f16 in the pool).
      slots.assign(std::size_t(first.back()), -1);
      toy::expect(cache.reserve_batch(seqs, counts, slots, copies).ok(), "reserve_batch");
      k_new.assign(std::size_t(kLayers * first.back() * kHeads * kDim), 0.0f);
      v_new.assign(k_new.size(), 0.0f);
      for (std::size_t b = 0; b < batch.size(); ++b)
        for (std::int32_t t = 0; t < counts[b]; ++t)
          for (std::int32_t l = 0; l < kLayers; ++l)
            for (std::int32_t h = 0; h < kHeads; ++h)
              for (std::int32_t d = 0; d < kDim; ++d) {
                const auto at = std::size_t(((l * first.back() + first[b] + t) * kHeads + h) * kDim + d);
                k_new[at] = key(batch[b]->appended + t, l, h, d);
                v_new[at] = unit(std::uint32_t(at) * 2654435761u);
              }
      const std::int64_t f = sizeof(float);
      toy::expect(kv::scatter_host({pool,
                                    {k_new.data(), v_new.data(), kv::DType::f32, first.back() * kHeads * kDim * f,
                                     kHeads * kDim * f, kDim * f},
                                    kv::TokenAddress{slots.data()}, first.back(), 0, kLayers})
                      .ok(),
                  "scatter");

      // 3. The batch's rows, dense, per layer; attention on the CPU.
      indptr.assign(seqs.size() + 1, 0), indices.assign(seqs.size() * kRowBlocks, 0);
      last_page_len.assign(seqs.size(), 0), lengths.assign(seqs.size(), 0), rows.assign(seqs.size() + 1, 0);
      toy::expect(cache.export_csr(seqs, indptr, indices, last_page_len).ok(), "export_csr");
      toy::expect(cache.export_lengths(seqs, lengths).ok(), "export_lengths");
      for (std::size_t b = 0; b < seqs.size(); ++b) rows[b + 1] = rows[b] + lengths[b];
      std::vector<std::vector<float>> seq_sums(seqs.size());
      for (std::size_t b = 0; b < seqs.size(); ++b) seq_sums[b].assign(std::size_t(kGroups * lengths[b]), 0.0f);
      for (std::int32_t l = 0; l < kLayers; ++l) {
        k_rows.assign(std::size_t(rows.back() * kHeads * kDim), 0.0f), v_rows.assign(k_rows.size(), 0.0f);
        kv::GatherParams gp{pool, l, indptr.data(), indices.data(), rows.data(), std::int32_t(seqs.size()), rows.back(),
                            k_rows.data(), v_rows.data(), kv::DType::f32, kHeads * kDim * f, kDim * f};
        toy::expect(kv::gather_host(gp).ok(), "gather");
        for (std::size_t b = 0; b < seqs.size(); ++b) {
          const std::int32_t held = lengths[b];
          for (std::int32_t h = 0; h < kHeads; ++h) {
            const std::int32_t g = l * kHeads + h;
            // Original positions in row order: what the policy tracks, then this step's tokens appended.
            const auto tracked = cache.eviction().positions(seqs[b].index, g);
            std::vector<std::int32_t> pos(tracked.begin(), tracked.end());
            while (std::int32_t(pos.size()) < held) pos.push_back(batch[b]->appended + std::int32_t(pos.size() - tracked.size()));
            for (std::int32_t j = 0; j < held; ++j)  // the toy K's tag agrees
              toy::expect(k_rows[std::size_t(((rows[b] + j) * kHeads + h) * kDim)] == float(pos[std::size_t(j)]), "row position");
            for (std::int32_t t = 0; t < counts[b]; ++t)
              for (std::int32_t qh = h * kQPerKv; qh < (h + 1) * kQPerKv; ++qh) {
                const std::int32_t qpos = batch[b]->appended + t;
                logits.assign(std::size_t(held), -INFINITY);
                float top = -INFINITY;
                for (std::int32_t j = 0; j < held; ++j) {
                  if (pos[std::size_t(j)] > qpos) continue;  // causal, by original position
                  const float* kr = &k_rows[std::size_t(((rows[b] + j) * kHeads + h) * kDim)];
                  float dot = 0.0f;
                  for (std::int32_t d = 0; d < kDim; ++d) dot += query(qpos, l, qh, d) * kr[d];
                  logits[std::size_t(j)] = dot / std::sqrt(float(kDim));
                  top = std::max(top, logits[std::size_t(j)]);
                }
                double norm = 0.0;
                for (float& x : logits) norm += (x = std::exp(x - top));
                for (std::int32_t j = 0; j < held; ++j) {
                  const float p = float(logits[std::size_t(j)] / norm);
                  seq_sums[b][std::size_t(g * held + j)] += p;  // the attention each token got, per group
                  output_checksum += p * v_rows[std::size_t(((rows[b] + j) * kHeads + h) * kDim + 1)];
                }
              }
          }
        }
      }
      // 4-5. Scores in, moves out; compaction per (layer, kv-head) group.
      for (std::size_t b = 0; b < seqs.size(); ++b) {
        toy::expect(cache.observe(seqs[b], kv::Scores{kv::ScoreKind::head_attention_sums, seq_sums[b], kGroups}).ok(),
                    "observe");
        auto e = cache.evict(seqs[b], kv::EvictionSpans{.moves = moves, .group_moves = group_moves});
        toy::expect(e.ok(), "evict: " + e.status().message());
        for (std::int32_t g = 0; g < kGroups; ++g) {
          kv::CompactionParams cp{pool, moves.data() + group_moves[std::size_t(g)],
                                  group_moves[std::size_t(g + 1)] - group_moves[std::size_t(g)],
                                  /*first_layer*/ g / kHeads, /*num_layers*/ 1, /*first_head*/ g % kHeads, /*num_heads*/ 1};
          toy::expect(kv::compaction_host(cp).ok(), "compaction");
        }
        evicted += e->tokens, move_count += e->moves;
        batch[b]->appended += counts[b];
        // Each (layer, kv-head) row holds the positions the policy tracks, in its order.
        const auto row = cache.table().blocks(seqs[b]).value();
        const auto held = std::int32_t(cache.tokens_held(seqs[b]).value());
        toy::expect(held <= kHeavy + kRecent, "within H2O's bound (heavy + recent) after evict");
        for (std::int32_t g = 0; g < kGroups; ++g) {
          const auto pos = cache.eviction().positions(seqs[b].index, g);
          for (std::int32_t j = 0; j < held; ++j) {
            const float tag = kv::load_elem(kv::DType::f16, pool.row(row[std::size_t(j / kB)], g / kHeads, 0, j % kB, g % kHeads), 0);
            toy::expect(tag == float(pos[std::size_t(j)]), fmt::format("group {} row {}: position {} (tracked {})", g, j, tag,
                                                                      pos[std::size_t(j)]));
            ++checks;
          }
        }
      }
      toy::expect(cache.check_invariants().ok(), "invariants");
    }
    const std::int64_t held0 = cache.tokens_held(slots_of[0].seq).value(), held1 = cache.tokens_held(slots_of[1].seq).value();
    fmt::print("llama.cpp-style CPU engine: 2 parallel slots (prompts 40 and 56 tokens, ubatch {}), {} new tokens each, "
               "f16 pool, H2O per (layer, kv-head): {} heavy + {} recent\n",
               kUbatch, kNew, kHeavy, kRecent);
    fmt::print("  {} steps: {} tokens evicted, {} compaction moves; holding {} and {} tokens of {} and {}; {} rows checked "
               "against the tracked positions (attention output checksum {:.3f})\n",
               steps, evicted, move_count, held0, held1, 40 + kNew, 56 + kNew, checks, output_checksum);
    toy::expect(held0 == kHeavy + kRecent && held1 == kHeavy + kRecent && evicted > 0 && move_count > 0,
                "both slots at the budget after evicting");
    for (const auto& s : slots_of) toy::expect(cache.free(s.seq).ok(), "free");
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}\n", e.what());
    return 1;
  }
}
