// kvcache, prefix sharing: a server's view. Requests share a system prompt;
// admission is atomic (the prefix hit plus the uncached prompt, all or
// nothing) and promises each request its lifetime blocks; full blocks are
// published as reserve() is given their token ids; a request forks for
// parallel sampling (copy-on-write), one is preempted and comes back as a
// prefix hit from free-but-cached blocks, one is aborted. Every sequence is
// read back through the exported CSR after each phase, and the block events a
// router would consume are counted.
#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kernels/gather.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kvcache.hpp>

#include <fmt/format.h>

#include <cstdint>
#include <map>
#include <vector>

namespace kv = kvcache;

namespace {
constexpr std::int32_t B = 4, D = 4, kBlocks = 48;
// A token's K is a function of its id and position only, so a shared block holds every holder's K.
float key(std::int32_t id, std::int64_t pos) { return float(id) * 1000.0f + float(pos); }

struct Server {
  kv::Geometry g = kv::Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = D, .block_size = B,
                                       .dtype = kv::DType::f32}).value();
  std::vector<std::byte> memory = std::vector<std::byte>(std::size_t(g.pool_bytes(kBlocks).value()));
  kv::PoolView pool = kv::make_pool_view(g, memory.data(), kBlocks).value();
  kv::Cache<> cache{{.geometry = g, .num_blocks = kBlocks, .max_sequences = 8, .max_blocks_per_sequence = 16,
                     .event_capacity = 256, .publish_on_reserve = true}};
  std::map<std::uint32_t, std::vector<std::int32_t>> tokens;  // per sequence index: every token id it holds

  // The model's K/V for ids written at `slots`: scatter them (V = -K).
  bool write(std::span<const std::int32_t> ids, std::span<const std::int32_t> slots, std::int64_t first_pos) {
    std::vector<float> k, v;
    for (std::size_t i = 0; i < ids.size(); ++i)
      for (std::int32_t d = 0; d < D; ++d) k.push_back(key(ids[i], first_pos + std::int64_t(i))), v.push_back(-k.back());
    const kv::KvSource src{.k = k.data(), .v = v.data(), .dtype = kv::DType::f32, .token_stride = D * 4, .head_stride = D * 4};
    return kv::scatter_host({.cache = pool, .src = src, .addr = {.slots = slots.data()}, .num_tokens = std::int64_t(ids.size())}).ok();
  }
  // Admits a prompt: the hit is shared, the rest reserved and written.
  kv::SeqId admit(const std::vector<std::int32_t>& prompt, std::int32_t max_new, std::int32_t* cached = nullptr) {
    std::vector<std::int32_t> slots(prompt.size());
    auto a = cache.admit(prompt, slots, {.max_new = max_new});
    if (!a) return fmt::print("admit: {}\n", a.status().message()), kv::SeqId{};
    if (cached) *cached = a->cached_tokens;
    const auto rest = std::span(prompt).subspan(std::size_t(a->cached_tokens), std::size_t(a->reserved));
    if (!write(rest, std::span(slots).first(rest.size()), a->cached_tokens)) return {};
    tokens[a->seq.index] = prompt;
    return a->seq;
  }
  // One decode step for every sequence: one token id each, reserved as a batch, copies first.
  bool step(const std::vector<kv::SeqId>& seqs, std::int32_t id) {
    std::vector<std::int32_t> counts(seqs.size(), 1), ids(seqs.size(), id), slots(seqs.size());
    std::vector<kv::BlockCopy> copies(seqs.size());
    auto r = cache.reserve_batch(seqs, counts, ids, slots, copies);
    if (!r || !kv::block_copy_host({.src = pool, .dst = pool, .pairs = copies.data(), .num_pairs = r->copies})) return false;
    for (std::size_t k = 0; k < seqs.size(); ++k) {
      auto& t = tokens[seqs[k].index];
      if (!write(std::span(&ids[k], 1), std::span(&slots[k], 1), std::int64_t(t.size()))) return false;
      t.push_back(id);
    }
    return true;
  }
  // Reads every live sequence back through the CSR: each row's K must be its token's.
  bool verify(const std::vector<kv::SeqId>& seqs) {
    std::vector<std::int32_t> indptr(seqs.size() + 1), indices(seqs.size() * 16), last(seqs.size()), out_indptr{0};
    if (!cache.export_csr(seqs, indptr, indices, last)) return false;
    for (const kv::SeqId s : seqs) out_indptr.push_back(out_indptr.back() + std::int32_t(tokens[s.index].size()));
    std::vector<float> k(std::size_t(out_indptr.back() * D)), v(k.size());
    if (!kv::gather_host({.cache = pool, .indptr = indptr.data(), .indices = indices.data(), .out_indptr = out_indptr.data(),
                          .num_seqs = std::int32_t(seqs.size()), .num_rows = out_indptr.back(), .k_out = k.data(),
                          .v_out = v.data(), .out_dtype = kv::DType::f32, .token_stride = D * 4, .head_stride = D * 4}))
      return false;
    for (std::size_t q = 0; q < seqs.size(); ++q)
      for (std::size_t p = 0; p < tokens[seqs[q].index].size(); ++p)
        if (k[std::size_t(out_indptr[q] + std::int32_t(p)) * D] != key(tokens[seqs[q].index][p], std::int64_t(p))) return false;
    return cache.check_invariants().ok();
  }
};
}  // namespace

int main() {
  Server srv;
  std::vector<std::int32_t> system(17);  // a 17-token system prompt: 4 full blocks to share
  for (std::size_t i = 0; i < system.size(); ++i) system[i] = 100 + std::int32_t(i);
  auto prompt = [&](std::int32_t user) { auto p = system; p.insert(p.end(), {user, user + 1, user + 2}); return p; };

  std::int32_t cached = -1;
  const kv::SeqId a = srv.admit(prompt(1), 8, &cached);  // the first request writes everything
  if (cached != 0) return 1;
  const kv::SeqId b = srv.admit(prompt(7), 8, &cached);  // the second hits the system prompt's 4 blocks
  if (cached != 16) return fmt::print("expected a 16-token hit, got {}\n", cached), 1;
  if (!srv.verify({a, b})) return fmt::print("read-back after admission\n"), 1;

  auto fork = srv.cache.fork(a);  // parallel sampling: a's blocks shared, the tail copied on the next write
  if (!fork) return 1;
  srv.tokens[fork->index] = srv.tokens[a.index];
  for (std::int32_t t = 0; t < 6; ++t)
    if (!srv.step({a, b, *fork}, 500 + t)) return fmt::print("decode step {}\n", t), 1;
  if (!srv.verify({a, b, *fork})) return fmt::print("read-back after decode\n"), 1;

  // Preempt b (its blocks stay cached), abort the fork; b comes back as a prefix hit.
  const auto b_tokens = srv.tokens[b.index];
  if (!srv.cache.free(b) || !srv.cache.free(*fork)) return 1;
  std::vector<std::int32_t> resume(b_tokens.begin(), b_tokens.end());
  const kv::SeqId b2 = srv.admit(resume, 2, &cached);
  if (cached < 16) return fmt::print("the preempted request should hit its cached blocks, got {}\n", cached), 1;
  if (!srv.step({a, b2}, 900) || !srv.verify({a, b2})) return fmt::print("read-back after resume\n"), 1;

  std::vector<kv::BlockEvent> events(256);
  const std::int32_t n = srv.cache.drain_events(events);
  std::int32_t stored = 0;
  for (std::int32_t i = 0; i < n; ++i) stored += events[std::size_t(i)].kind == kv::EventKind::stored ? 1 : 0;
  const auto st = srv.cache.prefix_stats();
  fmt::print("prefix hits: {} of {} prompt tokens; {} blocks stored (events), {} cached free, promised {} blocks; "
             "every sequence read back\n", st.hit_tokens, st.query_tokens, stored, st.free_cached, srv.cache.promised_blocks());
}
