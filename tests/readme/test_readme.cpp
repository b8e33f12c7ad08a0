// Every ```cpp block of the README, compiled and run as written (the build
// extracts them into snippets/NAME.inc; a block without a test fails the
// build). Each runs inside a fixture that supplies the engine's names, then
// the test checks what the snippet did: results, bounds, invariants, and for
// the token policies the memory the snippet's compaction left behind.
#include <catch2/catch.hpp>
#include <kvcache/kernels/gather.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kvcache.hpp>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "gate_testing.hpp"
#include "readme/engine.hpp"

namespace kv = kvcache;
using std::int32_t;
using std::int64_t;

// The README declares its custom policy at namespace scope.
#include "snippets/custom_policy.inc"

namespace readme {
namespace {
// A snippet that returns early (its error branch) fails the test that runs it:
// the guard is destroyed before `done` is set.
struct MustComplete {
  bool done = false;
  ~MustComplete() { CHECK(done); }
};

struct QuickStart {
  std::vector<int32_t> prompt = std::vector<int32_t>(40, 7);
};

struct PrefixHit {
  kv::Cache<> cache{{.geometry = kv::Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = 8,
                                                    .block_size = 16}).value(),
                     .num_blocks = 16, .max_sequences = 4, .max_blocks_per_sequence = 8}};
  std::vector<int32_t> prompt = std::vector<int32_t>(40, 3);
  std::vector<int32_t> slots = std::vector<int32_t>(40);
  std::uint64_t tenant_id = 42;
  PrefixHit() {  // an earlier request of the same tenant computed and published the prompt
    auto first = cache.add_sequence(prompt, {.salt = tenant_id}).value();
    REQUIRE(cache.reserve(first.seq, 40, slots).ok());
    REQUIRE(cache.publish(first.seq, prompt).value() == 2);
  }
};

struct Sip {
  kv::CacheConfig cfg{.geometry = kv::Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = 8,
                                                     .block_size = 16}).value(),
                      .num_blocks = 16, .max_sequences = 4, .max_blocks_per_sequence = 8};
  std::uint64_t key0 = 0x0706050403020100, key1 = 0x0f0e0d0c0b0a0908;
};

// One H2O sequence after a 2,000-token prefill, scores observed.
struct EvictStep : PolicyEngine {
  kv::Cache<kv::BlockPool, kv::PageTable, kv::AdmitAll, kv::SelectAll, kv::H2OEviction> cache{
      cfg, {}, {}, kv::H2OEviction({.heavy = 1024, .recent = 256, .groups = num_kv_heads})};
  kv::SeqId seq = cache.add_sequence().value();
  int32_t num_groups = num_kv_heads;
  EvictStep() {
    REQUIRE(cache.reserve(seq, 2000, slots).ok());
    attention(num_groups, 2000, sums);
  }
};

// Token i of the row is at this slot (the dead front of a window included).
template <class C>
int32_t slot_of(const C& cache, kv::SeqId seq, int32_t i) {
  const auto row = cache.table().blocks(seq).value();
  return row[std::size_t(i / PolicyEngine::block)] * PolicyEngine::block + i % PolicyEngine::block;
}

// After a token policy's snippet: K of every head, read through the row, is
// the position the policy tracks for the head's group.
template <class C>
void require_memory_is_policy(PolicyEngine& e, const C& cache, kv::SeqId seq) {
  const auto held = int32_t(cache.tokens_held(seq).value());
  const int32_t heads_per_group = PolicyEngine::num_kv_heads / cache.eviction().groups();
  for (int32_t h = 0; h < PolicyEngine::num_kv_heads; ++h) {
    const auto tracked = cache.eviction().positions(seq.index, h / heads_per_group);
    REQUIRE(int32_t(tracked.size()) == held);
    for (int32_t j = 0; j < held; ++j) REQUIRE(int64_t(*e.key(slot_of(cache, seq, j), h)) == tracked[std::size_t(j)]);
  }
}

// Every chunk went through (no `break`), and the cache is consistent.
template <class C>
void require_ran_clean(const PolicyEngine& e, const C& cache, kv::SeqId seq) {
  REQUIRE(e.written == e.total_tokens());
  REQUIRE(cache.check_invariants().ok());
  REQUIRE(cache.tokens_held(seq).value() <= cache.max_tokens_after_eviction());
}

}  // namespace

namespace custom_admission_snippet {
namespace kv = kvcache;
const kv::CacheConfig cfg{.geometry = *kv::Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = 4, .block_size = 4}),
                          .num_blocks = 16, .max_sequences = 2, .max_blocks_per_sequence = 8};
#include "snippets/custom_admission.inc"
}  // namespace custom_admission_snippet

TEST_CASE("Composing: an admission of one's own composes with the unchanged cache") {
  using namespace custom_admission_snippet;
  REQUIRE(r.ok());
  CHECK(slots[1] == -1);
  CHECK(slots[3] == -1);
  CHECK(slots[2] == slots[0] + 1);
  CHECK(slots[4] == slots[0] + 2);
  CHECK(cache.tokens_held(seq).value() == 3);
  CHECK(cache.table().appended(seq).value() == 5);
}

TEST_CASE("README front page: reserve, scatter, export the CSR and gather back what was written") {
  bool completed = false;  // the snippet returns early on an error: that must fail the test
  [&] {
#include "snippets/front_page.inc"
    REQUIRE(st.ok());
    REQUIRE(pages.value() == 2);  // 6 tokens in blocks of 4
    CHECK(indptr == std::vector<int32_t>{0, 2});
    CHECK(last_page_len[0] == 2);
    CHECK(k_out == k);  // every token's K and V came back from the slots the cache handed out
    CHECK(v_out == v);
    CHECK(cache.tokens_held(seq).value() == 6);
    CHECK(cache.check_invariants().ok());
    completed = true;
  }();
  REQUIRE(completed);
}

TEST_CASE_METHOD(QuickStart, "README quick start: geometry, pool size, reserve, publish") {
#include "snippets/quickstart.inc"
  REQUIRE(bytes.value() == int64_t{4096} * 32 * 2 * 16 * 8 * 128 * 2);  // blocks x layers x K,V x tokens x heads x dims x fp16
  REQUIRE(r.ok());
  REQUIRE(r->new_blocks == 3);
  REQUIRE(r->copy.src < 0);
  REQUIRE(shared.value() == 2);  // 40 tokens: two full blocks
  REQUIRE(cache.tokens_held(*seq).value() == 40);
  REQUIRE(cache.check_invariants().ok());
}

TEST_CASE_METHOD(PrefixHit, "README prefix sharing: a hit reserves only what is not cached") {
#include "snippets/prefix_hit.inc"
  REQUIRE(hit->cached_tokens == 32);
  REQUIRE(r.ok());
  REQUIRE(r->new_blocks == 1);
  REQUIRE(cache.tokens_held(hit->seq).value() == 40);
  REQUIRE(cache.check_invariants().ok());
}

TEST_CASE_METHOD(Sip, "README hashers: a cache with SipHash-2-4 shares prefixes") {
#include "snippets/sip_hasher.inc"
  std::vector<int32_t> prompt(33, 5), slots(33);
  auto a = cache.add_sequence(prompt, {.salt = 1}).value();
  REQUIRE(cache.reserve(a.seq, 33, slots).ok());
  REQUIRE(cache.publish(a.seq, prompt).value() == 2);
  REQUIRE(cache.add_sequence(prompt, {.salt = 1}).value().cached_tokens == 32);
  REQUIRE(cache.add_sequence(prompt, {.salt = 2}).value().cached_tokens == 0);  // another tenant's salt
}

TEST_CASE("README custom policy: a cache composes it and holds it to its bound") {
  kv::Cache<kv::BlockPool, kv::PageTable, kv::AdmitAll, kv::SelectAll, MyEviction> cache(
      {.geometry = kv::Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = 8, .block_size = 16}).value(),
       .num_blocks = 16, .max_sequences = 2, .max_blocks_per_sequence = 8});
  std::vector<int32_t> slots(50);
  auto seq = cache.add_sequence().value();
  REQUIRE(cache.reserve(seq, 50, slots).ok());
  REQUIRE(cache.blocks_needed(50, 10).value() == 4);
  REQUIRE(cache.check_invariants().ok());
}

TEST_CASE_METHOD(EvictStep, "README eviction step: observe, then evict with every span") {
#include "snippets/evict_step.inc"
  REQUIRE(r.ok());
  REQUIRE(r->tokens == 2000 - 1280);
  REQUIRE(r->moves == group_moves[std::size_t(num_groups)]);
  REQUIRE(cache.tokens_held(seq).value() == 1280);
  REQUIRE(cache.check_invariants().ok());
}

TEST_CASE_METHOD(PolicyEngine, "README sliding window: every chunk evicted before attention keeps what it needs") {
  window = 4096;
#include "snippets/sliding_window.inc"
  require_ran_clean(*this, cache, seq);
  REQUIRE(keys_missing == 0);  // every query found its W - 1 keys before it
  const auto held = int32_t(cache.tokens_held(seq).value());
  REQUIRE(held == 4096);  // the last evict had one pending query: exactly W
  const int32_t front = cache.table().front(seq).value();
  for (int32_t j = 0; j < held; ++j)  // the live tokens are the last W, in order, after the dead front
    REQUIRE(int64_t(*key(slot_of(cache, seq, front + j), 0)) == written - held + j);
}

TEST_CASE_METHOD(PolicyEngine, "README sinks + window: the stream stays within its bound") {
#include "snippets/sink_window.inc"
  require_ran_clean(*this, cache, seq);
  REQUIRE(cache.tokens_held(seq).value() > 2048);
  for (int32_t j = 0; j < 16; ++j)  // the sinks' block stays first
    REQUIRE(int64_t(*key(slot_of(cache, seq, j), 0)) == j);
}

TEST_CASE_METHOD(PolicyEngine, "README block scores: observe, evict and re-rotate the moved blocks") {
  REQUIRE(kv::make_rope_table(10000.0, head_dim, max_delta, cos_on_device, sin_on_device).ok());
#include "snippets/block_scores.inc"
  require_ran_clean(*this, cache, seq);
  REQUIRE(cache.tokens_held(seq).value() >= 32 + 128);
  for (int32_t j = 0; j < 32; ++j)  // the start area never moves, so it is never rotated
    REQUIRE(int64_t(*key(slot_of(cache, seq, j), 0)) == j);
}

TEST_CASE_METHOD(PolicyEngine, "README H2O: memory compacted per head matches the policy's tokens") {
#include "snippets/h2o.inc"
  require_ran_clean(*this, cache, seq);
  REQUIRE(cache.tokens_held(seq).value() == 1280);
  require_memory_is_policy(*this, cache, seq);
}

TEST_CASE_METHOD(PolicyEngine, "README TOVA: memory compacted for every head matches the policy's tokens") {
#include "snippets/tova.inc"
  require_ran_clean(*this, cache, seq);
  REQUIRE(cache.tokens_held(seq).value() == 2048);
  require_memory_is_policy(*this, cache, seq);
}

TEST_CASE_METHOD(PolicyEngine, "README SnapKV: one compression after the prompt") {
#include "snippets/snapkv.inc"
  REQUIRE(r.ok());
  REQUIRE(r->tokens == prompt_len - (1024 + 32));
  REQUIRE(cache.tokens_held(seq).value() == 1024 + 32);
  REQUIRE(cache.check_invariants().ok());
}

TEST_CASE_METHOD(PolicyEngine, "README average attention: chunked prefill and decode stay below the budget") {
#include "snippets/average_attention.inc"
  require_ran_clean(*this, cache, seq);
  REQUIRE(cache.tokens_held(seq).value() < 2048);
  REQUIRE(cache.blocks_held(seq).value() <= need.value());
  require_memory_is_policy(*this, cache, seq);
}

TEST_CASE_METHOD(KernelEngine, "README kernels: scatter a fused QKV slice, copy a block, re-rotate keys") {
#include "snippets/pool_view.inc"
#include "snippets/kernels.inc"
  const kv::GeometrySpec& g = geometry.spec();
  auto cached = [&](int64_t blk, int32_t l, int32_t kvp, int32_t tok, int32_t h, int32_t d) {
    return kv::load_elem(kv::DType::f16, pool->row(blk, l, kvp, tok, h), d);
  };
  auto input = [&](int32_t l, int32_t kvp, int64_t t, int32_t h, int32_t d) {
    const auto* base = static_cast<const std::byte*>(kvp == 0 ? k_ptr : v_ptr);
    return kv::load_elem(kv::DType::f16, base + l * per_layer_bytes + t * qkv_token_stride + h * head_bytes, d);
  };
  for (int32_t l = 0; l < g.num_layers; ++l)
    for (int32_t h = 0; h < g.num_kv_heads; ++h)
      for (int32_t d = 0; d < g.head_dim; ++d)
        for (int64_t t = 0; t < num_tokens; ++t) {
          const int64_t blk = 1 + t / 16;
          const int32_t off = int32_t(t % 16);
          REQUIRE(cached(blk, l, 1, off, h, d) == input(l, 1, t, h, d));     // V as written
          if (blk == 1) {
            REQUIRE(cached(1, l, 0, off, h, d) == input(l, 0, t, h, d));      // K as written
            REQUIRE(cached(3, l, 0, off, h, d) == cached(1, l, 0, off, h, d));  // the copy-on-write copy
            REQUIRE(cached(3, l, 1, off, h, d) == cached(1, l, 1, off, h, d));
          } else if (d < g.head_dim / 2) {  // block 2's keys rotated by -5 positions (NeoX pairs d, d + D/2)
            const double angle = -5.0 * std::pow(500000.0, -2.0 * d / g.head_dim);
            const double x = input(l, 0, t, h, d), y = input(l, 0, t, h, d + g.head_dim / 2);
            REQUIRE(cached(2, l, 0, off, h, d) == Approx(x * std::cos(angle) - y * std::sin(angle)).margin(1e-2));
            REQUIRE(cached(2, l, 0, off, h, d + g.head_dim / 2) ==
                    Approx(y * std::cos(angle) + x * std::sin(angle)).margin(1e-2));
          }
        }
}

TEST_CASE_METHOD(KernelEngine, "README write gate: one layer's gates from its pre- and post-RoPE keys") {
#include "snippets/write_gate.inc"
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int32_t h = 0; h < kv_heads; ++h) {
      std::vector<float> pre(head_dim), post(head_dim);
      for (int32_t d = 0; d < head_dim; ++d) {
        pre[std::size_t(d)] = kv::load_elem(kv::DType::f16, static_cast<const std::byte*>(k_pre_ptr) + t * qkv_token_stride + h * head_bytes, d);
        post[std::size_t(d)] = kv::load_elem(kv::DType::f16, static_cast<const std::byte*>(k_ptr) + t * qkv_token_stride + h * head_bytes, d);
      }
      REQUIRE(gates_dev[t * kv_heads + h] == Approx(kvtest::reference_gate(w, pre.data(), post.data(), h)).margin(2e-5));
    }
  const auto [lo, hi] = std::minmax_element(gate_buffer.begin(), gate_buffer.end());
  REQUIRE(*hi - *lo > 0.05f);  // the fixture's gates differ: a constant output would pass the loop above
}

TEST_CASE_METHOD(KernelEngine, "README Quest: bounds of the written pages then each row's pages under the budget") {
  MustComplete guard;
  {
#include "snippets/pool_view.inc"
#include "snippets/page_select.inc"
  }
  guard.done = true;
  // The reference: bounds from the keys themselves; sequence 0's middle pages (1..4) ranked, the best 2 kept.
  const auto key = [&](int32_t b, int32_t t, int32_t h, int32_t d) {
    return kv::load_elem(kv::DType::f16, static_cast<const std::byte*>(kv_memory) +
                                             geometry.strides(num_blocks)->offset(b, layer, 0, t, h), d);
  };
  const int32_t group = q_heads / kv_heads;
  REQUIRE(out_indptr_buffer == std::vector<int32_t>{0, 4, 8, 9, 10});
  for (int32_t h = 0; h < kv_heads; ++h) {
    std::vector<std::pair<float, int32_t>> ranked;
    for (int32_t j = 1; j < 5; ++j) {
      float best = -INFINITY;
      for (int32_t g = 0; g < group; ++g) {
        float lane[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // the bound's order: lane d % 4, then (s0 + s1) + (s2 + s3)
        for (int32_t d = 0; d < head_dim; ++d) {
          float mx = -FLT_MAX, mn = FLT_MAX;
          for (int32_t t = 0; t < 16; ++t) mx = std::max(mx, key(1 + j, t, h, d)), mn = std::min(mn, key(1 + j, t, h, d));
          const float q = query_buffer[std::size_t((h * group + g) * head_dim + d)];
          lane[d % 4] += std::max(q * mx, q * mn);
        }
        const float sum = (lane[0] + lane[1]) + (lane[2] + lane[3]);
        best = std::max(best, sum);
      }
      ranked.emplace_back(best, j);
    }
    std::stable_sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    REQUIRE(ranked[1].first > ranked[2].first);  // the fixture's pages differ where the budget cuts
    std::vector<int32_t> want{0, ranked[0].second, ranked[1].second, 5};
    std::sort(want.begin(), want.end());
    for (auto& j : want) j = index_buffer[std::size_t(j)];
    CHECK(std::vector<int32_t>(out_index_buffer.begin() + 4 * h, out_index_buffer.begin() + 4 * h + 4) == want);
    CHECK(out_index_buffer[std::size_t(8 + h)] == 7);  // the one-page sequence reads its page
  }
}

TEST_CASE_METHOD(QuestEngine, "README Quest: every layer reads the pages a selection from the keys themselves picks") {
  MustComplete guard;
#include "snippets/quest.inc"
  guard.done = true;
  REQUIRE(attention_calls == int64_t(steps) * num_layers);
  REQUIRE(cache.check_invariants().ok());
  // The reference: each page's bounds from its live keys in the pool (not the
  // snippet's store), the bound with page_select's sum order, the best pages
  // with ties to the lower one, the first and last always; layer 0 is dense.
  for (int32_t layer = 0; layer < num_layers; ++layer) {
    const auto& q = last_queries[std::size_t(layer)];
    std::vector<int32_t> want;
    for (std::size_t k = 0; k < seqs.size(); ++k) {
      const auto blocks = *cache.table().blocks(seqs[k]);
      const auto held = int32_t(*cache.tokens_held(seqs[k]));
      const auto n = int32_t(blocks.size());
      for (int32_t h = 0; h < kv_heads; ++h) {
        std::vector<std::pair<float, int32_t>> ranked;
        for (int32_t j = 1; j + 1 < n; ++j) {
          float kmax[head_dim], kmin[head_dim];
          std::fill_n(kmax, head_dim, -FLT_MAX);
          std::fill_n(kmin, head_dim, FLT_MAX);
          for (int32_t t = 0; t < std::min(block, held - j * block); ++t)
            for (int32_t d = 0; d < head_dim; ++d) {
              const float x = *reinterpret_cast<const float*>(pool.row(blocks[std::size_t(j)], layer, 0, t, h) + 4 * d) + 0.0f;
              kmax[d] = std::max(kmax[d], x), kmin[d] = std::min(kmin[d], x);
            }
          float best = -INFINITY;
          for (int32_t g = 0; g < q_heads / kv_heads; ++g) {
            const float* qv = q.data() + ((k * kv_heads + std::size_t(h)) * (q_heads / kv_heads) + std::size_t(g)) * head_dim;
            float lane[4] = {};
            for (int32_t d = 0; d < head_dim; ++d) lane[d % 4] += std::max(qv[d] * kmax[d], qv[d] * kmin[d]);
            best = std::max(best, (lane[0] + lane[1]) + (lane[2] + lane[3]));
          }
          ranked.emplace_back(-best, j);
        }
        std::sort(ranked.begin(), ranked.end());
        std::vector<int32_t> pick{0, n - 1};
        for (std::size_t c = 0; c < ranked.size(); ++c)
          if (layer == 0 || n <= 4 || c < 2) pick.push_back(ranked[c].second);
        std::sort(pick.begin(), pick.end());
        for (const int32_t j : pick) want.push_back(blocks[std::size_t(j)]);
      }
    }
    CHECK(last_indices[std::size_t(layer)] == want);
  }
}

TEST_CASE_METHOD(GateEngine, "README composing the three: admitted then evicted global regions and Quest's reads") {
  MustComplete guard;
#include "snippets/compose.inc"
  guard.done = true;
  REQUIRE(written == 600);
  REQUIRE(cache.check_invariants().ok());
  for (int32_t l = 0; l < num_layers; ++l)
    for (int32_t h = 0; h < num_kv_heads; ++h) {
      const auto st = *cache.admission().head_state(seq, l, h);
      REQUIRE(st.ring == W);
      REQUIRE(st.global <= 48);  // H2O's heavy hitters
      REQUIRE(st.global >= 40);  // admitted tokens well past 48 were there to choose from
    }
  // The sparse layer read its ring and at most 2 global pages of each row; the dense one, every page.
  REQUIRE(chosen_keys < row_keys);
  REQUIRE(most_read == W / block + 2);
}

TEST_CASE_METHOD(GateEngine, "README Write-Gated KV: every head row holds its ring and its admitted tokens") {
#include "snippets/write_gate_cache.inc"
  REQUIRE(written == 600);
  REQUIRE(rows_read == 204 * num_layers * num_kv_heads);
  REQUIRE(wrong == 0);
  int64_t held = 0;
  for (int32_t l = 0; l < num_layers; ++l)
    for (int32_t h = 0; h < num_kv_heads; ++h)
      for (int64_t p = 0; p < 600; ++p) held += kept(l, h, p, 600) ? 1 : 0;
  REQUIRE(cache.tokens_held(seq).value() == held);
  REQUIRE(held < 4 * 600 / 2);  // the point: well under half of the dense cache
  REQUIRE(cache.check_invariants().ok());
}


TEST_CASE_METHOD(GateEngine, "README Write-Gated KV decode step: one write_batch per layer for the whole batch") {
  MustComplete guard;
#include "snippets/write_gate_batch.inc"
  guard.done = true;
  REQUIRE(step_pos == steps);
  REQUIRE(rows_read == int64_t(steps) * num_layers * 4 * num_kv_heads);
  REQUIRE(wrong == 0);
  for (std::size_t k = 0; k < batch.size(); ++k) {
    int64_t held = 0;
    for (int32_t l = 0; l < num_layers; ++l)
      for (int32_t h = 0; h < num_kv_heads; ++h)
        for (int64_t p = 0; p < steps; ++p) held += p >= steps - W || batch_gate(k, l, h, p) >= 0.1f ? 1 : 0;
    REQUIRE(cache.tokens_held(batch[k]).value() == held);
  }
  REQUIRE(cache.check_invariants().ok());
}

TEST_CASE_METHOD(GateEngine, "README Write-Gated KV without a host sync: the host catches up with the device") {
  MustComplete guard;
#include "snippets/write_gate_deferred.inc"
  guard.done = true;
  REQUIRE(layer_pos[0] == steps);
  for (int32_t l = 0; l < num_layers; ++l) {  // the snippet leaves its last step pending
    REQUIRE(cache.admission().pending(seq, l).value() == 1);
    REQUIRE(cache.reconcile(seq, l, gates_back[std::size_t(l)]).ok());
  }
  for (int32_t l = 0; l < num_layers; ++l)
    for (int32_t h = 0; h < num_kv_heads; ++h) {
      const auto held = cache.admission().positions(seq, l, h).value();
      std::vector<int64_t> got(held.begin(), held.end()), want;
      std::sort(got.begin(), got.end());
      for (int64_t p = 0; p < steps; ++p)
        if (kept(l, h, p, steps)) want.push_back(p);
      REQUIRE(got == want);
      REQUIRE(cache.admission().head_state(seq, l, h)->global == global_len_buffer[std::size_t(l * num_kv_heads + h)]);
      REQUIRE(cache.tokens_held(seq, l, h).value() == int64_t(want.size()));
    }
  for (int32_t l = 0; l < num_layers; ++l) {  // the device's writes: each row slot holds its token's K/V
    REQUIRE(cache.export_heads_csr(batch, l, indptr, indices, last_page_len).ok());
    for (int32_t h = 0; h < num_kv_heads; ++h) {
      const auto held = cache.admission().positions(seq, l, h).value();
      for (std::size_t j = 0; j < held.size(); ++j) {
        const int32_t b = indices[std::size_t(indptr[std::size_t(h)]) + j / block];
        const float* k = reinterpret_cast<const float*>(pool.row(b, 0, 0, int32_t(j % block), 0));
        REQUIRE(k[0] == float(held[j]));
        REQUIRE(k[1] == float(10 * l + h));
      }
    }
  }
  REQUIRE(cache.check_invariants().ok());
}
}  // namespace readme
