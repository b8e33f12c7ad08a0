// After construction, no cache operation touches the heap: global operator
// new is counted while a mixed workload (hits, misses, errors) runs, on the
// token-paged cache with each kind of policy and on a hybrid cache, holds
// included (BlockHolds and TransferHolds take their room at construction).
#include <kvcache/cache.hpp>
#include <kvcache/cache/hybrid.hpp>
#include <kvcache/eviction/block_scores.hpp>
#include <kvcache/eviction/h2o.hpp>
#include <kvcache/eviction/sliding_window.hpp>
#include <kvcache/selection/quest.hpp>
#include <kvcache/transfer/transfer_holds.hpp>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <vector>

namespace {
long g_allocations = 0;
}

void* operator new(std::size_t n) {
  ++g_allocations;
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

int main() {
  using namespace kvcache;
  auto g = *Geometry::make({.num_layers = 4, .num_kv_heads = 8, .head_dim = 128, .block_size = 16});
  Cache<> cache({.geometry = g, .num_blocks = 512, .max_sequences = 32, .max_blocks_per_sequence = 64,
                 .event_capacity = 1024});
  std::vector<std::int32_t> prompt(600), slots(1024), counts(32, 1), dense(32 * 64), indptr(33), indices(32 * 64),
      last(32);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<std::int32_t>(i % 97);
  std::vector<SeqId> seqs(32);
  std::vector<BlockCopy> copies(32);
  std::vector<BlockEvent> events(1024);
  TransferHolds transfers(cache);  // room for as many holds as the cache has
  std::uint64_t expired[4];

  const long before = g_allocations;
  long bad = 0;
  for (int round = 0; round < 200; ++round) {
    std::size_t n = 0;
    for (; n < 8; ++n) {
      auto hit = cache.add_sequence(prompt);
      if (!hit) break;
      seqs[n] = hit->seq;
      const auto rest = static_cast<std::int32_t>(prompt.size()) - hit->cached_tokens;
      if (!cache.reserve(seqs[n], rest, slots).ok()) ++bad;
      if (!cache.publish(seqs[n], prompt).ok()) ++bad;
    }
    seqs[n] = *cache.fork(seqs[0]);
    ++n;
    for (int step = 0; step < 20; ++step) {
      if (!cache.reserve_batch(std::span(seqs).first(n), std::span(counts).first(n), slots, copies).ok()) ++bad;
      if (!cache.export_csr(std::span(seqs).first(n), indptr, indices, last).ok()) ++bad;
      if (!cache.export_block_table(std::span(seqs).first(n), dense, 64).ok()) ++bad;
    }
    if (!cache.truncate(seqs[1], 5).ok()) ++bad;
    if (cache.reserve(seqs[1], 100000, slots).ok()) ++bad;  // must fail, without allocating
    (void)cache.drain_events(events);
    // A transfer holds two rows past their frees, and lets go in the other order.
    const auto held0 = cache.hold(seqs[0]), held1 = cache.hold(seqs[1]);
    if (!held0 || !held1) ++bad;
    // A prefill's blocks held for two decode ranks (both read), and one for a reader that never comes (expires).
    const auto sent = transfers.hold(cache, seqs[2], 2, round + 10), lost = transfers.hold(cache, seqs[3], 1, round);
    if (!sent || !lost) ++bad;
    if (sent && (!transfers.consumed(cache, *sent, 1).ok() || !*transfers.consumed(cache, *sent, 0))) ++bad;
    if (transfers.expire(cache, round, expired) != 1 || transfers.size() != 0) ++bad;
    for (std::size_t i = 0; i < n; ++i)
      if (!cache.free(seqs[i]).ok()) ++bad;
    if (cache.free(seqs[0]).ok()) ++bad;  // stale handle
    if (held0 && !cache.release_hold(*held0).ok()) ++bad;
    if (held1 && !cache.release_hold(*held1).ok()) ++bad;
    if (held1 && cache.release_hold(*held1).ok()) ++bad;  // released already
  }
  const long during_core = g_allocations - before;
  // Eviction: per-head H2O (scores, choice, compaction moves) and a sliding window.
  using H2O = Cache<BlockPool, PageTable, AdmitAll, SelectAll, H2OEviction>;
  using Window = Cache<BlockPool, PageTable, AdmitAll, SelectAll, SlidingWindow>;
  const CacheConfig ecfg{.geometry = g, .num_blocks = 256, .max_sequences = 4, .max_blocks_per_sequence = 64};
  H2O h2o(ecfg, {}, {}, H2OEviction({.heavy = 200, .recent = 40, .groups = 8}));
  Window window(ecfg, {}, {}, SlidingWindow(100));
  std::vector<float> scores(8 * 1024, 0.25f);
  std::vector<SlotMove> moves(8 * 1024);
  std::vector<std::int32_t> group_moves(9);
  const long before_eviction = g_allocations;
  for (int round = 0; round < 20; ++round) {
    const SeqId a = *h2o.add_sequence(), b = *window.add_sequence();
    for (int step = 0; step < 300; ++step) {
      const std::int32_t n = step < 10 ? 32 : 1;
      if (!h2o.reserve(a, n, slots).ok() || !window.reserve(b, n, slots).ok()) ++bad;
      const auto held = static_cast<std::size_t>(*h2o.tokens_held(a));
      scores[held % scores.size()] = float(step % 7);
      if (!h2o.observe(a, Scores{ScoreKind::head_attention_sums, std::span(scores).first(8 * held), 8}).ok()) ++bad;
      if (!h2o.evict(a, EvictionSpans{.moves = moves, .group_moves = group_moves}).ok()) ++bad;
      if (!window.evict(b, EvictionSpans{}).ok()) ++bad;
    }
    if (h2o.observe(a, Scores{ScoreKind::last_query_attention, scores, 8}).ok()) ++bad;  // must fail, without allocating
    if (!h2o.free(a).ok() || !window.free(b).ok()) ++bad;
  }
  const long during_eviction = g_allocations - before_eviction;
  // Selection: Quest with H2O, select for a batch every step (its scratch is sized at construction).
  std::vector<float> store(std::size_t(QuestSelection::bounds_floats(g, 256)));
  using Quest = Cache<BlockPool, PageTable, AdmitAll, QuestSelection, H2OEviction>;
  Quest quest(ecfg, {}, {.token_budget = 128, .dense_layers = 1, .query_group = 4, .bounds = store},
              H2OEviction({.heavy = 200, .recent = 40, .groups = 8}));
  std::vector<float> queries(4 * 8 * 4 * 128, 0.5f);
  std::vector<std::int32_t> sel_indptr(4 * 8 + 1), sel_indices(4 * 8 * 64), stale(4 * 64), fill(4 * 64);
  const long before_selection = g_allocations;
  for (int round = 0; round < 10; ++round) {
    std::array<SeqId, 4> batch{};
    for (auto& q : batch) q = *quest.add_sequence();
    for (int step = 0; step < 100; ++step) {
      const std::int32_t n = step < 10 ? 32 : 1;
      for (const SeqId q : batch) {
        if (!quest.reserve(q, n, slots).ok()) ++bad;
        const auto held = static_cast<std::size_t>(*quest.tokens_held(q));
        if (!quest.observe(q, Scores{ScoreKind::head_attention_sums, std::span(scores).first(8 * held), 8}).ok()) ++bad;
        if (!quest.evict(q, EvictionSpans{.moves = moves, .group_moves = group_moves}).ok()) ++bad;
      }
      if (!quest.stale_pages(batch, {stale, fill}).ok()) ++bad;
      for (std::int32_t layer = 0; layer < 4; ++layer)
        if (!quest.select(batch, layer, queries, {sel_indptr, sel_indices}).ok()) ++bad;
    }
    if (quest.select(batch, 4, queries, {sel_indptr, sel_indices}).ok()) ++bad;  // must fail, without allocating
    for (const SeqId q : batch)
      if (!quest.free(q).ok()) ++bad;
  }
  const long during_selection = g_allocations - before_selection;
  // Prefix cache: atomic admission with promises, publishing on reserve (a
  // decode step with ids), copies, recycling that cascades, events with ids.
  Cache<> pc({.geometry = g, .num_blocks = 64, .max_sequences = 8, .max_blocks_per_sequence = 64,
              .event_capacity = 64, .publish_on_reserve = true});
  std::vector<std::int32_t> ids(32), event_ids(64 * 16);
  const ExtraKey image[] = {{.begin = 40, .end = 60, .key = 7}};
  const long before_prefix = g_allocations;
  for (int round = 0; round < 50; ++round) {
    std::size_t n = 0;
    for (; n < 4; ++n) {
      const AdmitOptions opt{.extras = n % 2 ? std::span<const ExtraKey>(image) : std::span<const ExtraKey>{},
                             .max_new = 20, .reserve = 128};
      const auto p = std::span(prompt).subspan(std::size_t(round % 3), 200 + 50 * n);  // varies: misses, recycling
      (void)pc.plan_admission(p, opt);
      auto a = pc.admit(p, slots, opt);
      if (!a) break;
      seqs[n] = a->seq;
    }
    for (int step = 0; step < 20; ++step) {
      for (std::size_t k = 0; k < n; ++k) ids[k] = round * 100 + step;
      if (!pc.reserve_batch(std::span(seqs).first(n), std::span(counts).first(n), std::span(ids).first(n), slots, copies).ok()) ++bad;
    }
    if (pc.can_admit(std::span(prompt).first(600), {.max_new = 100000})) ++bad;  // must refuse, without allocating
    (void)pc.prefix_stats();
    (void)pc.promised_blocks();
    (void)pc.drain_events(events, event_ids);
    for (std::size_t i = 0; i < n; ++i)
      if (!pc.free(seqs[i]).ok()) ++bad;
  }
  const long during_prefix = g_allocations - before_prefix;
  if (pc.prefix_stats().hit_tokens == 0 || pc.prefix_stats().pool.recycled == 0) ++bad;  // hits and recycling ran
  // A hybrid cache (Gemma's full + sliding-window groups, two block sizes):
  // admission with hits, chunked prefill, decode steps that publish and free
  // what left the window, rollback, exports, Quest on the full layers,
  // events with ids, imports.
  const std::vector<std::int32_t> hl0{0, 2}, hl1{1, 3};
  const LayerGroupSpec hspec[] = {
      {.kind = AttentionKind::full, .layers = hl0, .num_kv_heads = 2, .head_dim = 64},
      {.kind = AttentionKind::sliding_window, .layers = hl1, .num_kv_heads = 4, .head_dim = 64, .window = 48}};
  const LayerGroups hlg = *LayerGroups::make({.groups = hspec, .block_size = 8});
  // Quest on its full layers: stale pages listed, a decode query's pages selected.
  std::vector<float> hbounds(std::size_t(QuestSelection::bounds_floats(*global_geometry(hlg), 400)), 0.0f);
  HybridCache<FastBlockHasher, QuestSelection> hy(
      {.groups = hlg, .num_blocks = 400, .max_sequences = 8, .max_tokens = 512, .prefill_chunk = 64, .event_capacity = 256},
      QuestConfig{.token_budget = 64, .dense_layers = 0, .bounds = hbounds});
  std::vector<std::int32_t> hslots(2 * 512), hindptr(9), hindices(8 * 64), hfirst(8), hids(events.size() * std::size_t(hy.tokens_per_event()));
  std::vector<std::int32_t> hstale(8 * 64), hfill(8 * 64), qindptr(8 * 2 + 1), qindices(8 * 2 * 64);
  std::vector<float> hqueries(8 * 2 * 64, 0.5f);
  TransferHolds htransfers(hy);
  std::vector<SeqId> hseqs(8);
  // Block scores on the same layout's full layers: scores observed, blocks evicted as holes, the rows exported.
  HybridCache<FastBlockHasher, SelectAll, BlockScoreEviction> he(
      {.groups = hlg, .num_blocks = 400, .max_sequences = 8, .max_tokens = 512, .prefill_chunk = 64}, {},
      BlockScoreEviction({.start = 32, .recent = 64, .max = 160}));
  std::vector<float> hscores(512, 1.0f);
  std::vector<std::int32_t> hevicted(64);
  std::int64_t hevictions = 0;
  const long before_hybrid = g_allocations;
  for (int round = 0; round < 40; ++round) {
    std::size_t n = 0;
    for (; n < 4; ++n) {
      const auto p = std::span(prompt).subspan(std::size_t(round % 2), 150 + 40 * n);  // shared stems: hits and misses
      auto a = hy.admit(p, hslots);
      if (!a) break;
      hseqs[n] = a->seq;
      for (std::int64_t done = a->cached_tokens + a->reserved; done < std::int64_t(p.size());) {  // the prompt, chunk by chunk
        const auto chunk = std::min<std::int64_t>(64, std::int64_t(p.size()) - done);
        if (!hy.advance(a->seq, p.subspan(std::size_t(done), std::size_t(chunk)), hslots).ok()) ++bad;
        done += chunk;
      }
    }
    for (int step = 0; step < 30; ++step)
      for (std::size_t k = 0; k < n; ++k) {
        const std::int32_t next[] = {round * 100 + step};
        if (!hy.advance(hseqs[k], next, hslots).ok()) ++bad;
      }
    std::int32_t ones[8] = {1, 1, 1, 1, 1, 1, 1, 1}, batch_ids[8];
    for (int step = 0; step < 10; ++step) {  // the decode step as one batch
      for (std::size_t k = 0; k < n; ++k) batch_ids[k] = round * 100 + 50 + step;
      if (!hy.advance_batch(std::span(hseqs).first(n), std::span(ones).first(n), std::span(batch_ids).first(n), hslots).ok()) ++bad;
    }
    const SeqId twice[] = {hseqs[0], hseqs[0]};  // refused: one sequence twice
    if (hy.advance_batch(twice, std::span(ones).first(2), std::span(batch_ids).first(2), hslots).ok()) ++bad;
    if (hy.prefix_stats().queries == 0) ++bad;
    for (std::int32_t group = 0; group < 2; ++group)
      if (!hy.export_group_csr(group, std::span(hseqs).first(n), hindptr, hindices, hfirst).ok()) ++bad;
    if (!hy.stale_pages(std::span(hseqs).first(n), {hstale, hfill}).ok()) ++bad;
    for (const std::int32_t layer : hl0)
      if (!hy.select(std::span(hseqs).first(n), layer, std::span(hqueries).first(n * 2 * 64), {qindptr, qindices}).ok()) ++bad;
    if (hy.select(std::span(hseqs).first(n), 1, std::span(hqueries).first(n * 2 * 64), {qindptr, qindices}).ok()) ++bad;  // a window layer
    if (n > 1 && !hy.truncate(hseqs[1], 1).ok()) ++bad;
    if (hy.advance(hseqs[0], std::span(prompt).first(100), hslots).ok()) ++bad;  // past prefill_chunk: must fail, without allocating
    if (!hy.drain_events(events, hids).ok()) ++bad;
    const auto held = hy.hold(hseqs[0]);  // an offload in flight past the free
    if (!held) ++bad;
    const auto sent = htransfers.hold(hy, hseqs[0], 2, round);  // a prefill's blocks for two decode ranks, one of which never reads
    if (!sent || !htransfers.consumed(hy, *sent, 0).ok() || htransfers.expire(hy, round, expired) != 1) ++bad;
    for (std::size_t k = 0; k < n; ++k)
      if (!hy.free(hseqs[k]).ok()) ++bad;
    if (held && !hy.release_hold(*held).ok()) ++bad;
    // A peer's prefill of a prompt with no hit: imported, then committed or aborted.
    const auto fresh = std::span(prompt).subspan(300, 100);
    auto imp = hy.import(fresh, {.key = {.salt = std::uint64_t(round) + 1}});
    if (!imp) {
      ++bad;
      continue;
    }
    SeqId imported{};
    if (round % 2) {
      auto c = hy.commit_import(imp->id, fresh);
      c ? imported = c->seq : (++bad, imported);
    } else {
      auto c = hy.abort_import(imp->id);
      c ? imported = c->seq : (++bad, imported);
    }
    if (!hy.free(imported).ok()) ++bad;
  }
  // The same run with block scores on the full layers (blocks evicted as holes).
  for (int round = 0; round < 10; ++round) {
    std::size_t n = 0;
    for (; n < 4; ++n) {
      const auto p = std::span(prompt).subspan(std::size_t(round % 2), 150 + 40 * n);
      auto a = he.admit(p, hslots);
      if (!a) break;
      hseqs[n] = a->seq;
      for (std::int64_t done = a->cached_tokens + a->reserved; done < std::int64_t(p.size());) {
        const auto chunk = std::min<std::int64_t>(64, std::int64_t(p.size()) - done);
        if (!he.advance(a->seq, p.subspan(std::size_t(done), std::size_t(chunk)), hslots).ok()) ++bad;
        done += chunk;
      }
    }
    for (int step = 0; step < 30; ++step)
      for (std::size_t k = 0; k < n; ++k) {
        const std::int32_t next[] = {round * 100 + step};
        if (!he.advance(hseqs[k], next, hslots).ok()) ++bad;
        const auto held_tokens = he.tokens_held(hseqs[k], 0);
        if (!held_tokens || !he.observe(hseqs[k], 0, {ScoreKind::attention_sums, std::span(hscores).first(std::size_t(*held_tokens)), 1}).ok()) ++bad;
        auto r = he.evict(hseqs[k], {.blocks = hevicted});
        r ? hevictions += r->evicted : ++bad;
      }
    for (std::int32_t group = 0; group < 2; ++group)
      if (!he.export_group_csr(group, std::span(hseqs).first(n), hindptr, hindices, hfirst).ok()) ++bad;
    for (std::size_t k = 0; k < n; ++k)
      if (!he.free(hseqs[k]).ok()) ++bad;
  }
  const long during_hybrid = g_allocations - before_hybrid;
  if (!hy.check_invariants().ok() || hy.free_sequences() != 8 || hy.pool().counters().stored == 0) ++bad;  // it ran, and ends clean
  if (!he.check_invariants().ok() || he.free_sequences() != 8 || hevictions == 0) ++bad;
  const long during = during_core + during_eviction + during_selection + during_prefix + during_hybrid;
  std::printf("heap allocations during the workload: %ld (eviction part: %ld, selection part: %ld, prefix part: %ld, "
              "hybrid part: %ld); unexpected results: %ld\n",
              during, during_eviction, during_selection, during_prefix, during_hybrid, bad);
  return during == 0 && bad == 0 ? 0 : 1;
}
