// libFuzzer target: random operation sequences through the public API under
// every eviction policy, with a shadow of every sequence's KV. The pool is
// real memory: the K element of (slot, head) holds the position of the token
// written there, copy-on-write and compaction moves run through the host
// kernels, and after every operation each live sequence's row must read back
// a legal set of positions for its policy. A failed call must leave the
// cache exactly as it was; check_invariants() must hold after every call.
// The prefix cache is driven through add_sequence(prompt), admit() with any
// options, reserve and reserve_batch with ids (publishing on reserve or not),
// publish with multimodal extra keys, promises, and drained events with token
// ids; check_invariants() includes the index being prefix-closed.
// Write-Gated KV's head-paged cache has its own run (gate_run.hpp). With
// Quest's selection the run also keeps the page bounds as an engine does
// (page_bounds_update after every write; stale pages recomputed after every
// call), and then every live key must lie within its page's bounds; select()
// and select_params() get any queries and buffers.
#include <kvcache/cache.hpp>
#include <kvcache/eviction/average_attention.hpp>
#include <kvcache/eviction/block_scores.hpp>
#include <kvcache/eviction/h2o.hpp>
#include <kvcache/eviction/sink_window.hpp>
#include <kvcache/eviction/sliding_window.hpp>
#include <kvcache/eviction/snapkv.hpp>
#include <kvcache/eviction/tova.hpp>
#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/page_bounds.hpp>
#include <kvcache/selection/quest.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "gate_run.hpp"
#include "input.hpp"

namespace kv = kvcache;

namespace {
constexpr std::int32_t B = 4, G = 2, kBlocks = 32, kSeqs = 4, kPerSeq = 16;

[[noreturn]] void fail(const char* what, const std::string& detail = "") {
  std::fprintf(stderr, "fuzz_cache: %s %s\n", what, detail.c_str());
  std::abort();
}

// Reads the fuzzer's bytes as a stream of small integers (0 past the end).
struct Input : fuzz_input::Bytes {
  std::int32_t upto(std::int32_t m) { return std::int32_t(byte() % std::uint32_t(m + 1)); }
  std::int64_t wide() {  // extreme values for accounting
    switch (byte() % 4) {
      case 0: return std::numeric_limits<std::int64_t>::max();
      case 1: return -std::int64_t(byte());
      case 2: return std::int64_t(byte()) << (byte() % 62);
      default: return byte();
    }
  }
  float score() {
    switch (byte() % 16) {
      case 0: return std::numeric_limits<float>::quiet_NaN();
      case 1: return std::numeric_limits<float>::infinity();
      case 2: return -1.0f;
      default: return float(byte()) / 64.0f;
    }
  }
};

template <class Policy, class Selection = kv::SelectAll>
struct Run {
  using C = kv::Cache<kv::BlockPool, kv::PageTable, kv::AdmitAll, Selection, Policy>;
  static constexpr bool quest = C::selects;
  kv::GeometrySpec spec{.num_layers = 1, .num_kv_heads = G, .head_dim = 1, .block_size = B, .dtype = kv::DType::f32};
  std::vector<float> bounds = std::vector<float>(quest ? std::size_t(kBlocks * G * 2) : 0);
  C cache;
  // [block][K,V][token][head], NHD, head_dim 1: K of (slot, head) holds a position.
  std::vector<float> mem = std::vector<float>(std::size_t(kBlocks * 2 * B * G), -1.0f);
  kv::PoolView pool = *kv::make_pool_view(*kv::Geometry::make(spec), mem.data(), kBlocks);
  std::vector<kv::SeqId> live;
  std::vector<std::uint64_t> holds;  // transfers' holds not yet released
  struct Import {
    std::uint64_t id;
    std::vector<std::int32_t> prompt;
    std::int32_t cached;
    std::vector<kv::BlockId> blocks;
    std::vector<kv::ExtraKey> extras;  // as imported: the commit must name the same
  };
  std::vector<Import> imports;  // imports not yet committed or aborted

  Run(Policy p, Input& in)
      : cache({.geometry = *kv::Geometry::make(spec), .num_blocks = kBlocks, .max_sequences = kSeqs,
               .max_blocks_per_sequence = kPerSeq, .event_capacity = 8, .publish_on_reserve = in.byte() % 2 == 1},
              {}, selection(in), std::move(p)) {}

  // The "text" is token id = position; an image may cover any range.
  static std::vector<std::int32_t> text(std::int64_t first, std::size_t n) {
    std::vector<std::int32_t> t(n);
    std::iota(t.begin(), t.end(), std::int32_t(first));
    return t;
  }
  std::vector<kv::ExtraKey> extras(Input& in) {
    std::vector<kv::ExtraKey> e(std::size_t(in.byte() % 4 == 0 ? in.upto(2) : 0));
    for (auto& x : e) x = {.begin = in.upto(40) - 1, .end = in.upto(40), .key = in.byte() % 3};
    return e;
  }
  typename kv::SelectionArg<Selection>::type selection(Input& in) {
    if constexpr (quest) {
      const std::int32_t first = in.upto(1);
      return kv::QuestConfig{.token_budget = B * (1 + first + in.upto(4)), .first_pages = first, .last_pages = 1,
                             .dense_layers = in.upto(1), .query_group = 1 + in.upto(2), .bounds = bounds};
    } else {
      return {};
    }
  }

  float& at(std::int32_t slot, std::int32_t head) { return mem[std::size_t((slot / B) * 2 * B * G + (slot % B) * G + head)]; }
  std::int32_t groups() const {
    if constexpr (kv::TokenEviction<Policy>) return cache.eviction().groups();
    else return 1;
  }

  void write(std::span<const std::int32_t> slots, const kv::BlockCopy copy, std::int64_t first_pos) {
    if (copy.src >= 0 && !kv::block_copy_host({pool, pool, &copy, 1}).ok()) fail("block_copy");
    for (std::size_t i = 0; i < slots.size(); ++i)
      for (std::int32_t h = 0; h < G; ++h) at(slots[i], h) = float(first_pos + std::int64_t(i));
    if constexpr (quest)
      if (!kv::page_bounds_update_host({pool, 0, slots.data(), std::int64_t(slots.size()), bounds.data()}).ok())
        fail("page_bounds_update");
  }

  // Quest: recompute the stale pages (as an engine does before selecting),
  // then every live key lies within its page's bounds.
  void check_bounds() {
    std::vector<std::int32_t> pages(std::size_t(kSeqs * kPerSeq)), fill(pages.size());
    auto n = cache.stale_pages(live, {pages, fill});
    if (!n) fail("stale_pages", n.status().message());
    if (!kv::page_bounds_host({pool, 0, pages.data(), fill.data(), *n, bounds.data()}).ok()) fail("page_bounds");
    for (const kv::SeqId s : live) {
      const auto blocks = *cache.table().blocks(s);
      const std::int32_t front = *cache.table().front(s), held = std::int32_t(*cache.tokens_held(s));
      for (std::int32_t j = front; j < front + held; ++j)
        for (std::int32_t h = 0; h < G; ++h) {
          const std::int32_t page = blocks[std::size_t(j / B)];
          const float k = at(page * B + j % B, h), hi = bounds[std::size_t((page * G + h) * 2)], lo = bounds[std::size_t((page * G + h) * 2 + 1)];
          if (!(lo <= k && k <= hi) && std::getenv("KVCACHE_FUZZ_TRACE"))
            std::fprintf(stderr, "seq %u row pos %d key %g bounds [%g, %g]\n", s.index, j, double(k), double(lo), double(hi));
          if (!(lo <= k && k <= hi))
            fail("a live key outside its page's bounds", "page " + std::to_string(page) + " slot " + std::to_string(j % B));
        }
    }
  }

  // Quest: select() and select_params() with any queries and buffers; what
  // they write is a legal selection of each row's pages.
  void select(Input& in) {
    std::vector<kv::SeqId> seqs = live;
    if (in.byte() % 8 == 0) seqs.push_back(kv::SeqId{in.byte() % 8, in.byte()});  // maybe stale
    const auto& q = cache.selection().config();
    const std::int64_t want = std::int64_t(seqs.size()) * G * q.query_group;
    std::vector<float> queries(std::size_t(std::max<std::int64_t>(0, want + in.upto(2) - 1)));
    for (auto& x : queries) x = in.byte() % 32 == 0 ? std::numeric_limits<float>::quiet_NaN() : float(in.byte()) / 32.0f - 4.0f;
    std::vector<std::int32_t> indptr(std::size_t(in.upto(12))), indices(std::size_t(in.upto(80)));
    auto r = cache.select(seqs, 0, queries, {indptr, indices});
    if (r) {
      const std::int32_t budget = q.token_budget / B;
      for (std::size_t k = 0; k < seqs.size(); ++k) {
        const auto blocks = *cache.table().blocks(seqs[k]);
        const auto n = std::int32_t(blocks.size());
        for (std::int32_t h = 0; h < G; ++h) {
          const std::size_t row = k * G + std::size_t(h);
          const std::int32_t lo = indptr[row], hi = indptr[row + 1];
          if (hi - lo != (q.dense_layers > 0 ? n : std::min(n, budget))) fail("select: row length");
          std::int32_t j = 0;
          for (std::int32_t c = lo; c < hi; ++c, ++j) {  // the row's pages, in logical order
            while (j < n && blocks[std::size_t(j)] != indices[std::size_t(c)]) ++j;
            if (j == n) fail("select: a page not in the row, or out of order");
          }
          if (hi > lo && indices[std::size_t(hi - 1)] != blocks.back()) fail("select: the last page left out");
        }
      }
    }
    std::vector<std::int32_t> a(std::size_t(in.upto(6))), b(std::size_t(in.upto(40))), c(std::size_t(in.upto(12)));
    (void)cache.select_params(seqs, in.upto(1), {a, b, c});
  }

  // Every live row reads back positions that are distinct, older than the
  // next one, and what the policy says it keeps.
  void check() {
    if (auto st = cache.check_invariants(); !st) fail("check_invariants", st.message());
    if constexpr (quest) check_bounds();
    for (const kv::SeqId s : live) {
      const auto blocks = *cache.table().blocks(s);
      const std::int32_t front = *cache.table().front(s), held = std::int32_t(*cache.tokens_held(s));
      const std::int64_t appended = *cache.table().appended(s);
      for (std::int32_t h = 0; h < G; ++h) {
        std::vector<std::int64_t> pos;
        for (std::int32_t j = front; j < front + held; ++j)
          pos.push_back(std::int64_t(at(blocks[std::size_t(j / B)] * B + j % B, h)));
        if constexpr (kv::TokenEviction<Policy>) {
          const auto tracked = cache.eviction().positions(s.index, h / (G / groups()));
          for (std::size_t j = 0; j < std::min(pos.size(), tracked.size()); ++j)
            if (tracked[j] != pos[j]) fail("position differs from the policy's", std::to_string(j));
          std::sort(pos.begin(), pos.end());
        }
        for (std::size_t j = 0; j < pos.size(); ++j) {
          if (pos[j] < 0 || pos[j] >= appended) fail("position out of range", std::to_string(pos[j]));
          if (j > 0 && pos[j] <= pos[j - 1]) {
            std::string row;
            for (auto x : pos) row += std::to_string(x) + " ";
            fail("positions not ascending/distinct:", row + "(seq " + std::to_string(s.index) + ")");
          }
        }
        if constexpr (kv::WindowEviction<Policy> || std::is_same_v<Policy, kv::KeepAll>)
          if (!pos.empty() && pos.front() != appended - held) fail("window or keep-all is not the newest tokens");
      }
    }
  }

  void step(Input& in) {
    const auto before = cache;
    const auto mem_before = mem;
    kv::Status st{};
    const kv::SeqId s = live.empty() ? kv::SeqId{in.byte() % 8, 0} : live[in.byte() % live.size()];
    const std::uint32_t op = in.byte() % 12;
    if (std::getenv("KVCACHE_FUZZ_TRACE")) std::fprintf(stderr, "op %u seq %u\n", op, s.index);
    switch (op) {
      case 0: {
        auto r = cache.add_sequence();
        if (r) live.push_back(*r);
        st = r.status();
        break;
      }
      case 1: {  // prefix add, or an atomic admission with any options
        const auto prompt = text(0, std::size_t(in.upto(40)));
        const auto ex = extras(in);
        const kv::PrefixKey key{.salt = in.byte() % 2, .extra = in.byte() % 2};
        if (const std::uint32_t how = in.byte() % 4; how >= 2) {  // a peer's prompt: import, commit or abort one
          if (how == 3 && !imports.empty()) {
            const std::size_t i = in.byte() % imports.size();
            const Import im = imports[i];
            if (in.byte() % 3 == 0) {
              auto r = cache.abort_import(in.byte() % 8 == 0 ? im.id + 99 : im.id);
              st = r.status();
              if (r) {
                if (r->cached_tokens != im.cached) fail("abort: cached tokens", std::to_string(r->cached_tokens));
                imports.erase(imports.begin() + std::ptrdiff_t(i));
                live.push_back(r->seq);
              }
              break;
            }
            // Now and then a wrong commit: a shorter prompt, one token changed, or the fresh extras.
            const std::uint32_t wrong = in.byte() % 16;
            auto named = im.prompt;
            if (wrong == 1) named[in.byte() % named.size()] ^= 1 + std::int32_t(in.byte());
            auto r = cache.commit_import(im.id, wrong == 0 ? std::span(named).first(named.size() - 1) : std::span(named),
                                         wrong == 2 ? ex : im.extras);
            if (r && wrong == 1) fail("commit: another token accepted", std::to_string(im.id));
            if (r && wrong == 2 && ex != im.extras) fail("commit: other extras accepted", std::to_string(im.id));
            st = r.status();
            if (r) {
              std::vector<std::int32_t> slots;  // the transfer wrote the received positions
              for (std::int32_t p = im.cached; p < std::int32_t(im.prompt.size()); ++p)
                slots.push_back(im.blocks[std::size_t((p - im.cached) / B)] * B + p % B);
              write(slots, {}, im.cached);
              imports.erase(imports.begin() + std::ptrdiff_t(i));
              live.push_back(r->seq);
            }
            break;
          }
          std::vector<kv::BlockId> blocks(std::size_t(in.upto(12)));
          auto r = cache.import(prompt, blocks, {.key = key, .extras = ex, .max_new = in.byte() % 2 ? -1 : in.wide()});
          st = r.status();
          if (r) imports.push_back({r->id, prompt, r->cached_tokens, blocks, {ex.begin(), ex.end()}});
          break;
        }
        if (in.byte() % 2) {
          auto r = cache.add_sequence(prompt, key, ex);
          if (r) live.push_back(r->seq);
          st = r.status();
          break;
        }
        const kv::AdmitOptions opt{.key = key, .extras = ex, .max_new = in.byte() % 2 ? -1 : in.wide(),
                                   .prefill_chunk = in.upto(8), .reserve = in.byte() % 2 ? INT32_MAX : in.upto(12) - 1};
        std::vector<std::int32_t> slots(std::size_t(in.upto(44)));
        const auto plan = cache.plan_admission(prompt, opt);
        auto r = cache.admit(prompt, slots, opt);
        if (plan.ok() != r.ok() && !(plan.ok() && r.status().code() == kv::Errc::buffer_too_small))
          fail("plan_admission and admit disagree", r.status().message());
        st = r.status();
        if (r) {
          live.push_back(r->seq);
          if (std::getenv("KVCACHE_FUZZ_TRACE")) {
            std::fprintf(stderr, "  admit %zu cached %d reserved %d:", prompt.size(), r->cached_tokens, r->reserved);
            for (std::int32_t i = 0; i < r->reserved; ++i) std::fprintf(stderr, " %d", slots[std::size_t(i)]);
            std::fprintf(stderr, "\n");
          }
          write(std::span(slots).first(std::size_t(r->reserved)), {}, r->cached_tokens);
        }
        break;
      }
      case 2:
      case 3: {
        const std::int32_t n = in.upto(12) - 1;
        std::vector<std::int32_t> slots(std::size_t(in.upto(12)));
        const std::int64_t first = cache.table().appended(s).value_or(0);
        const auto ids = text(first, std::size_t(std::max(n, 0)));
        const bool with_ids = in.byte() % 2;
        auto r = with_ids ? cache.reserve(s, ids, slots, extras(in)) : cache.reserve(s, n, slots);
        const std::int32_t count = with_ids ? std::int32_t(ids.size()) : n;
        st = r.status();
        if (r && std::getenv("KVCACHE_FUZZ_TRACE")) {
          std::fprintf(stderr, "  reserve %d first %ld copy %d -> %d:", count, long(first), r->copy.src, r->copy.dst);
          for (std::int32_t i = 0; i < count; ++i) std::fprintf(stderr, " %d", slots[std::size_t(i)]);
          std::fprintf(stderr, "\n");
        }
        if (r) write(std::span(slots).first(std::size_t(count)), r->copy, first);
        break;
      }
      case 4: {  // a batch over every live sequence
        std::vector<std::int32_t> counts(live.size()), firsts(live.size()), slots(std::size_t(in.upto(40)));
        std::vector<kv::BlockCopy> copies(std::size_t(in.upto(4)));
        std::vector<kv::SeqId> seqs = live;
        if (!seqs.empty() && in.byte() % 8 == 0) seqs.back() = seqs.front();  // a duplicate
        const bool decode = in.byte() % 3 == 0;  // every count 1: the decode step's own pass
        for (std::size_t i = 0; i < seqs.size(); ++i) {
          counts[i] = decode ? 1 : in.upto(5);
          firsts[i] = std::int32_t(cache.table().appended(seqs[i]).value_or(0));
        }
        std::vector<std::int32_t> ids;
        for (std::size_t i = 0; i < seqs.size(); ++i) {
          const auto t = text(firsts[i], std::size_t(counts[i]));
          ids.insert(ids.end(), t.begin(), t.end());
        }
        if (!ids.empty() && in.byte() % 16 == 0) ids.pop_back();  // a wrong id count
        auto r = in.byte() % 2 ? cache.reserve_batch(seqs, counts, ids, slots, copies) : cache.reserve_batch(seqs, counts, slots, copies);
        st = r.status();
        if (r && std::getenv("KVCACHE_FUZZ_TRACE")) {
          for (std::size_t i = 0; i < seqs.size(); ++i) std::fprintf(stderr, "  seq %u count %d first %d\n", seqs[i].index, counts[i], firsts[i]);
          for (std::int32_t c = 0; c < r->copies; ++c) std::fprintf(stderr, "  copy %d -> %d\n", copies[std::size_t(c)].src, copies[std::size_t(c)].dst);
          for (auto x : slots) std::fprintf(stderr, " %d", x);
          std::fprintf(stderr, "\n");
        }
        if (r) {
          for (std::int32_t c = 0; c < r->copies; ++c)
            if (!kv::block_copy_host({pool, pool, &copies[std::size_t(c)], 1}).ok()) fail("block_copy");
          std::size_t o = 0;
          for (std::size_t i = 0; i < seqs.size(); o += std::size_t(counts[i]), ++i)
            write(std::span(slots).subspan(o, std::size_t(counts[i])), {}, firsts[i]);
        }
        break;
      }
      case 5: {
        auto r = cache.fork(s);
        if (r) live.push_back(*r);
        st = r.status();
        break;
      }
      case 6: st = cache.truncate(s, in.upto(6) - 1); break;
      case 7:  // free, sometimes holding the blocks for a transfer first; holds of any ids; releases
        if (const std::uint32_t how = in.byte() % 4; how == 0 && !holds.empty()) {
          st = cache.release_hold(holds.back());
          holds.pop_back();
          break;
        } else if (how == 1) {
          std::vector<kv::BlockId> b(std::size_t(in.upto(3)));
          for (auto& x : b) x = in.upto(cache.pool().capacity()) - 1;
          if (in.byte() % 8) {
            auto r = cache.hold(b);
            if (r) holds.push_back(*r);
            st = r.status();
          } else {  // any id: one never given (or released) is unknown_job and changes nothing
            const std::uint64_t id = in.byte();
            st = cache.release_hold(id);
            if (st) std::erase(holds, id);
          }
          break;
        } else if (how == 2 && cache.table().blocks(s)) {
          auto r = cache.hold(*cache.table().blocks(s));
          if (!r) fail("hold of a live sequence's blocks", r.status().message());
          holds.push_back(*r);
        }
        st = cache.free(s);
        if (st) std::erase(live, s);
        break;
      case 8: {
        const auto tokens = text(0, std::size_t(in.upto(40)));
        if (in.byte() % 4 == 0) {
          st = cache.promise(s, in.wide());
          break;
        }
        st = cache.publish(s, tokens, extras(in)).status();
        break;
      }
      case 9:
        if constexpr (kv::ObservingEviction<Policy>) {
          const std::int32_t held = std::int32_t(cache.tokens_held(s).value_or(0));
          const auto kind = kv::ScoreKind(in.byte() % 4);
          const std::int32_t rows = in.upto(3);
          std::vector<float> v(std::size_t(std::max(0, rows * held + in.upto(2) - 1)));
          const bool clean = in.byte() % 2;
          for (auto& x : v) x = clean ? float(in.byte()) / 64.0f : in.score();
          st = cache.observe(s, kv::Scores{kind, v, rows});
        }
        break;
      case 10: {
        std::vector<std::int32_t> blocks(std::size_t(in.upto(16))), group_moves(std::size_t(in.upto(4)));
        std::vector<kv::BlockRotation> rotations(std::size_t(in.upto(16)));
        std::vector<kv::SlotMove> moves(std::size_t(in.upto(80)));
        const std::int32_t pending = kv::WindowEviction<Policy> ? in.upto(8) : (in.byte() % 16 == 0);
        auto r = cache.evict(s, kv::EvictionSpans{blocks, rotations, moves, group_moves}, pending);
        st = r.status();
        if (r && kv::TokenEviction<Policy>) {
          const std::int32_t gs = groups(), heads = G / gs;
          for (std::int32_t g = 0; g < gs; ++g) {
            kv::CompactionParams p{.cache = pool, .moves = moves.data() + group_moves[std::size_t(g)],
                                   .num_moves = group_moves[std::size_t(g + 1)] - group_moves[std::size_t(g)],
                                   .first_head = g * heads, .num_heads = heads};
            if (!kv::compaction_host(p).ok()) fail("compaction");
          }
        }
        break;
      }
      default: {  // exports into buffers of any size, accounting with extreme values
        std::vector<std::int32_t> a(std::size_t(in.upto(20))), b(std::size_t(in.upto(40))), c(std::size_t(in.upto(6)));
        std::vector<kv::SeqId> seqs = live;
        if (in.byte() % 8 == 0) seqs.push_back(kv::SeqId{in.byte() % 8, in.byte()});  // maybe stale
        (void)cache.export_csr(seqs, a, b, c);
        (void)cache.export_block_table(seqs, b, in.upto(20) - 1);
        (void)cache.export_lengths(seqs, c);
        (void)cache.blocks_needed(in.wide(), in.wide(), in.wide());
        (void)cache.can_admit(in.wide(), in.wide());
        {
          const auto prompt = text(0, std::size_t(in.upto(40)));
          const auto ex = extras(in);
          const kv::AdmitOptions opt{.extras = ex, .max_new = in.wide(), .prefill_chunk = in.wide(), .reserve = in.upto(40) - 1};
          if (cache.can_admit(prompt, opt) != cache.plan_admission(prompt, opt).ok()) fail("can_admit and plan_admission disagree");
          std::vector<kv::BlockId> hit(std::size_t(in.upto(12)));
          (void)cache.match_prefix(prompt, {}, hit, ex);
          const kv::PrefixStats ps = cache.prefix_stats();
          if (ps.used_hashed + ps.used_plain + ps.free_cached + ps.free_plain != kBlocks - 1) fail("prefix_stats: block states");
          if (cache.promised_blocks() < 0) fail("promised_blocks");
        }
        (void)cache.shared_excess();
        if constexpr (quest) select(in);
        std::vector<kv::BlockEvent> ev(std::size_t(in.upto(4)));
        std::vector<std::int32_t> ids(std::size_t(in.upto(20)));
        const bool with_ids = in.byte() % 2;
        if (with_ids) (void)cache.drain_events(ev, ids);
        else (void)cache.drain_events(ev);
        if (!(cache == before)) {  // draining events changes the pool: compare everything else by re-draining
          auto copy = before;
          std::vector<kv::BlockEvent> ev2(ev.size());
          std::vector<std::int32_t> ids2(ids.size());
          if (with_ids) (void)copy.drain_events(ev2, ids2);
          else (void)copy.drain_events(ev2);
          if (!(cache == copy)) fail("a read-only call changed the cache");
        }
        return check();
      }
    }
    fuzz_checks::failed_call_changed_nothing(st, cache, before, mem, mem_before, [](const char* what, const std::string& d) { fail(what, d); });
    check();
  }
};

template <class Run>
void gate_steps(Run&& r, Input& in) {
  for (int ops = 0; ops < 400 && in.n > 0; ++ops) r.step(in);
}

template <class Policy, class Selection = kv::SelectAll>
void run(Policy p, Input& in) {
  Run<Policy, Selection> r(std::move(p), in);
  for (int ops = 0; ops < 400 && in.n > 0; ++ops) r.step(in);
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in{{data, size}};
  switch (in.byte() % 10) {
    case 0: run(kv::KeepAll{}, in); break;
    case 1: run(kv::SlidingWindow(1 + in.upto(12)), in); break;
    case 2: run(kv::SinkWindowEviction({.sinks = in.upto(6), .window = 1 + in.upto(12)}), in); break;
    case 3: run(kv::BlockScoreEviction({.start = B, .recent = B, .max = 3 * B + B * in.upto(3),
                                        .aggregation = kv::Aggregation(in.byte() % 2), .pool_window = 1 + in.upto(2)}),
                in);
      break;
    case 4: run(kv::H2OEviction({.heavy = 1 + in.upto(6), .recent = in.upto(6), .groups = in.byte() % 2 ? G : 1}), in); break;
    case 5: run(kv::TovaEviction({.budget = 1 + in.upto(12)}), in); break;
    case 6: run(kv::SnapKVEviction({.capacity = 1 + in.upto(8), .window = 1 + in.upto(4), .kernel = 1 + 2 * in.upto(2),
                                    .groups = in.byte() % 2 ? G : 1}),
                in);
      break;
    case 8: {  // Write-Gated KV alone, with Quest, with H2O on the global regions, or all three
      const auto f = [](const char* what, const std::string& d = "") { fail(what, d); };
      using F = decltype(f);
      switch (in.byte() % 4) {
        case 0: gate_steps(fuzz_gate::GateRun<Input, F>(in, f), in); break;
        case 1: gate_steps(fuzz_gate::GateRun<Input, F, kv::QuestSelection>(in, f), in); break;
        case 2: {
          kv::H2OEviction h2o({.heavy = 1 + in.upto(4), .recent = in.upto(3)});
          gate_steps(fuzz_gate::GateRun<Input, F, kv::SelectAll, kv::H2OEviction>(in, f, h2o), in);
          break;
        }
        default: {
          kv::H2OEviction h2o({.heavy = 1 + in.upto(4), .recent = in.upto(3)});
          gate_steps(fuzz_gate::GateRun<Input, F, kv::QuestSelection, kv::H2OEviction>(in, f, h2o), in);
        }
      }
      break;
    }
    case 9:  // Quest over each kind of eviction
      switch (in.byte() % 4) {
        case 0: run<kv::KeepAll, kv::QuestSelection>(kv::KeepAll{}, in); break;
        case 1: run<kv::SlidingWindow, kv::QuestSelection>(kv::SlidingWindow(1 + in.upto(12)), in); break;
        case 2:
          run<kv::BlockScoreEviction, kv::QuestSelection>(
              kv::BlockScoreEviction({.start = B, .recent = B, .max = 3 * B + B * in.upto(3)}), in);
          break;
        default:
          run<kv::H2OEviction, kv::QuestSelection>(kv::H2OEviction({.heavy = 1 + in.upto(6), .recent = in.upto(6), .groups = in.byte() % 2 ? G : 1}), in);
      }
      break;
    default: {
      const std::int32_t budget = 2 + in.upto(12);
      run(kv::AverageAttentionEviction({.budget = budget, .step = 1 + in.upto(budget - 2), .groups = in.byte() % 2 ? G : 1}), in);
    }
  }
  return 0;
}
