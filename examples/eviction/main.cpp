// kvcache, eviction: every eviction policy on the same synthetic workload.
// Four sequences prefill a 192-token prompt in chunks and decode 320 tokens
// into a real host pool (2 kv-heads). A stand-in attention model gives each
// token a heavy-tailed importance per head, so policies have something to
// find. The engine's part is all here: observe() with the score form the
// policy reads, evict(), the compaction kernel per head for token policies,
// and a read-back of every held token through the page table.
//
//   kvcache_eviction                  all policies, one table row each
//   kvcache_eviction --policy h2o     one policy, with its trace
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kvcache.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace kv = kvcache;

namespace {
constexpr std::int32_t kB = 16, kHeads = 2, kSeqs = 4, kPrompt = 192, kDecode = 320, kChunk = 32, kBudget = 160;
constexpr std::int32_t kBlocks = kSeqs * 40 + 1, kPerSeq = 40;

// Importance of token p for head h: heavy-tailed, with attention sinks at the front.
struct AttentionModel {
  std::vector<float> w[kSeqs][kHeads];
  explicit AttentionModel(std::uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    for (auto& seq : w)
      for (auto& head : seq) {
        head.resize(kPrompt + kDecode);
        for (std::size_t p = 0; p < head.size(); ++p) head[p] = (p < 4 ? 20.0f : 1.0f) / (u(rng) * u(rng) + 0.02f);
      }
  }
  // Unnormalized attention of the query at position t to the token at p.
  float at(int seq, int h, std::int64_t t, std::int64_t p) const {
    return w[seq][h][std::size_t(p)] * (0.3f + std::exp(-float(t - p) / 32.0f));
  }
};

struct Outcome {
  std::int64_t peak_blocks = 0, evicted = 0, moves = 0, rotations = 0;
  double mass = 0.0;  // attention mass the held tokens carry, averaged over steps, heads, sequences
  double decide_us = 0.0;
  bool intact = true;
};

template <class E>
std::int32_t groups_of(const E& e) {
  if constexpr (kv::TokenEviction<E>) return e.groups();
  else return 1;
}

template <class E>
Outcome run(E policy, bool trace) {
  using C = kv::Cache<kv::BlockPool, kv::PageTable, kv::AdmitAll, kv::SelectAll, E>;
  const kv::GeometrySpec spec{.num_layers = 1, .num_kv_heads = kHeads, .head_dim = 4, .block_size = kB,
                              .dtype = kv::DType::f32};
  const auto geometry = *kv::Geometry::make(spec);
  std::vector<std::byte> memory(std::size_t(*geometry.pool_bytes(kBlocks)));
  const kv::PoolView pool = *kv::make_pool_view(geometry, memory.data(), kBlocks);
  C cache({.geometry = geometry, .num_blocks = kBlocks, .max_sequences = kSeqs, .max_blocks_per_sequence = kPerSeq},
          {}, {}, policy);
  const AttentionModel model(7);
  Outcome out;
  std::vector<kv::SeqId> seqs;
  for (int i = 0; i < kSeqs; ++i) seqs.push_back(*cache.add_sequence());
  std::vector<std::int32_t> slots(kChunk), blocks(kPerSeq), offsets(kHeads + 1);
  std::vector<kv::BlockRotation> rotations(kPerSeq);
  std::vector<kv::SlotMove> moves(std::size_t(kHeads * kPerSeq * kB));
  std::vector<float> scores;
  std::int64_t steps = 0;

  auto position_at = [&](kv::SeqId s, std::int32_t j, int h) {  // K element 0 holds the token's position
    const auto row = *cache.table().blocks(s);
    const std::int32_t at = *cache.table().front(s) + j;
    float v;
    std::memcpy(&v, pool.row(row[std::size_t(at / kB)], 0, 0, at % kB, h), sizeof v);
    return std::int64_t(v);
  };
  for (std::int64_t t = 0; t < kPrompt + kDecode;) {
    const std::int32_t n = t < kPrompt ? kChunk : 1;  // chunked prefill, then decode
    for (int i = 0; i < kSeqs; ++i) {
      const kv::SeqId s = seqs[std::size_t(i)];
      auto r = cache.reserve(s, n, slots);
      if (!r) throw std::runtime_error("reserve: " + r.status().message());
      for (std::int32_t k = 0; k < n; ++k)
        for (int h = 0; h < kHeads; ++h) {
          const float pos = float(t + k);
          std::memcpy(pool.row(slots[std::size_t(k)] / kB, 0, 0, slots[std::size_t(k)] % kB, h), &pos, sizeof pos);
        }
      out.peak_blocks = std::max<std::int64_t>(out.peak_blocks, *cache.blocks_held(s));
      const auto held = std::int32_t(*cache.tokens_held(s));
      const std::int64_t q = t + n - 1;  // the step's last query
      // The engine's attention over the held tokens yields the scores the policy reads.
      double mass = 0.0;
      for (int h = 0; h < kHeads; ++h) {
        double all = 0.0, kept = 0.0;
        for (std::int64_t p = 0; p <= q; ++p) all += model.at(i, h, q, p);
        for (std::int32_t j = 0; j < held; ++j) kept += model.at(i, h, q, position_at(s, j, h));
        mass += kept / all / kHeads;
      }
      if (t >= kPrompt) out.mass += mass, ++steps;
      auto t0 = std::chrono::steady_clock::now();
      // SnapKV compresses once: it observes the prompt's last chunk (its observation window).
      const bool skip = std::is_same_v<E, kv::SnapKVEviction> && t + n < kPrompt;
      if constexpr (kv::ObservingEviction<E>) {
        const bool per_head = groups_of(policy) == kHeads;
        const bool last_query = E::required_signals.covers(kv::Signals{kv::Signals::last_query_attention});
        const std::int32_t rows = per_head || last_query ? kHeads : 1;
        scores.assign(std::size_t(rows) * std::size_t(held), 0.0f);
        for (int h = 0; h < kHeads && !skip; ++h)
          for (std::int64_t qq = last_query ? q : t; qq <= q; ++qq) {  // the step's queries, causal
            double norm = 0.0;
            for (std::int32_t j = 0; j < held; ++j)
              if (position_at(s, j, h) <= qq) norm += model.at(i, h, qq, position_at(s, j, h));
            for (std::int32_t j = 0; j < held; ++j)
              if (position_at(s, j, h) <= qq)
                scores[std::size_t((rows == 1 ? 0 : h) * held + j)] += float(model.at(i, h, qq, position_at(s, j, h)) / norm);
          }
        const auto kind = last_query ? kv::ScoreKind::last_query_attention
                          : per_head ? kv::ScoreKind::head_attention_sums
                                     : kv::ScoreKind::attention_sums;
        t0 = std::chrono::steady_clock::now();  // time the library, not the stand-in attention
        if (auto st = skip ? kv::Status{} : cache.observe(s, kv::Scores{kind, scores, rows}); !st)
          throw std::runtime_error("observe: " + st.message());
      }
      auto e = skip ? kv::Result<kv::EvictionResult>(kv::EvictionResult{})
                    : cache.evict(s, kv::EvictionSpans{blocks, rotations, moves, offsets});
      out.decide_us += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      if (!e) throw std::runtime_error("evict: " + e.status().message());
      if constexpr (kv::TokenEviction<E>)  // the engine runs the compaction kernel, one head range per group
        for (std::int32_t g = 0; g < policy.groups() && e->moves > 0; ++g) {
          const std::int32_t groups = policy.groups();
          kv::CompactionParams p{.cache = pool, .moves = moves.data() + offsets[std::size_t(g)],
                                 .num_moves = offsets[std::size_t(g + 1)] - offsets[std::size_t(g)],
                                 .first_head = groups == 1 ? 0 : g, .num_heads = groups == 1 ? 0 : 1};
          if (auto st = kv::compaction_host(p); !st) throw std::runtime_error("compaction: " + st.message());
        }
      out.evicted += e->tokens;
      out.moves += e->moves;
      out.rotations += e->rotations;
      if constexpr (kv::TokenEviction<E>) {  // memory agrees with what the policy tracks
        for (std::int32_t g = 0; g < policy.groups(); ++g) {
          const auto tracked = cache.eviction().positions(s.index, g);
          for (std::int32_t j = 0; j < std::int32_t(tracked.size()); ++j)
            out.intact &= tracked[std::size_t(j)] == position_at(s, j, policy.groups() == 1 ? 0 : g);
        }
      }
      if (trace && i == 0 && (t < kPrompt || (t - kPrompt) % 64 == 0))
        fmt::print("  pos {:>4}: seq 0 holds {:>3} tokens in {:>2} blocks, evicted {:>3}, attention mass kept {:.3f}\n",
                   t + n, *cache.tokens_held(s), *cache.blocks_held(s), e->tokens, mass);
    }
    t += n;
  }
  for (auto s : seqs) out.intact &= *cache.tokens_held(s) <= cache.eviction().max_tokens_held(kPrompt + kDecode);
  out.intact &= cache.check_invariants().ok();
  out.mass /= double(steps);
  out.decide_us /= double(kSeqs) * double(kPrompt / kChunk + kDecode);
  return out;
}

template <class F>
bool dispatch(const std::string& name, F&& f) {
  if (name == "keep_all") return f(kv::KeepAll{});
  if (name == "sliding_window") return f(kv::SlidingWindow(kBudget));
  if (name == "sink_window") return f(kv::SinkWindowEviction({.sinks = 4, .window = kBudget - kB}));
  if (name == "block_scores")
    return f(kv::BlockScoreEviction({.start = 16, .recent = 32, .max = kBudget - kB}));
  if (name == "h2o") return f(kv::H2OEviction({.heavy = kBudget - 32, .recent = 32, .groups = kHeads}));
  if (name == "tova") return f(kv::TovaEviction({.budget = kBudget}));
  if (name == "snapkv") return f(kv::SnapKVEviction({.capacity = kBudget - 32, .window = 32, .kernel = 7, .groups = kHeads}));
  if (name == "average_attention") return f(kv::AverageAttentionEviction({.budget = kBudget, .step = 16}));
  return false;
}
}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> all{"keep_all", "sliding_window", "sink_window", "block_scores",
                                     "h2o",      "tova",           "snapkv",      "average_attention"};
  std::vector<std::string> chosen = all;
  if (argc == 3 && std::string(argv[1]) == "--policy") chosen = {argv[2]};
  else if (argc != 1)
    return fmt::print(stderr, "usage: {} [--policy {}]\n", argv[0], fmt::join(all, "|")), 2;
  fmt::print("{} sequences: {}-token prompt in chunks of {}, then {} decode steps; block {}, {} kv-heads; "
             "budget about {} tokens per sequence\n\n",
             kSeqs, kPrompt, kChunk, kDecode, kB, kHeads, kBudget);
  bool ok = true;
  std::vector<std::string> rows;
  for (const auto& name : chosen) {
    const bool known = dispatch(name, [&](auto policy) {
      if (chosen.size() == 1) fmt::print("{}:\n", name);
      const Outcome o = run(policy, chosen.size() == 1);
      ok &= o.intact;
      rows.push_back(fmt::format("| {} | {} | {} | {} | {} | {:.3f} | {:.2f} | {} |", name, o.peak_blocks, o.evicted,
                                 o.moves, o.rotations, o.mass, o.decide_us, o.intact ? "ok" : "MISMATCH"));
      return true;
    });
    if (!known) return fmt::print(stderr, "unknown policy '{}'; one of: {}\n", name, fmt::join(all, ", ")), 2;
  }
  fmt::print("\n| policy | peak blocks / seq | tokens evicted | compaction moves | block rotations | attention mass "
             "kept (decode) | observe + evict µs / call | memory == policy |\n| --- | ---: | ---: | ---: | ---: | ---: | "
             "---: | --- |\n");
  for (const auto& r : rows) fmt::print("{}\n", r);
  return ok ? 0 : 1;
}
