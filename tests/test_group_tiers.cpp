// Tiers under a hybrid cache (tiers/group_tiers.hpp): multi-turn
// conversations over a device pool that forgets them, each group's blocks
// offloaded to host memory (and behind it to a disk file of sealed slots)
// and onboarded through an import (and, in half the runs, written back by
// the write-back policy just before the pool recycles it). Every page is
// modelled: a slot holds a value that depends on its group, its position
// and every token before it (as K/V does), so a block served under another
// prompt's name, from the wrong group, or at the wrong place reads back
// wrong. After every turn the values every group's last query reads are the
// prompt's, and the cache's and the tiers' invariants hold; onboards fail
// now and then (recomputed).
#include <catch2/catch.hpp>

#include <kvcache/cache/hybrid.hpp>
#include <kvcache/tiers/group_tiers.hpp>
#include <kvcache/tiers/write_policy.hpp>

#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

using namespace kvcache;

// Fails the test with the status' message (which names the value) when it is not ok.
#define REQUIRE_OK(x)                                   \
  do {                                                  \
    const auto& r_ = (x);                               \
    if (!r_.ok()) FAIL(#x << ": " << message_of(r_));   \
  } while (0)

namespace {

std::string message_of(const Status& s) { return s.message(); }
template <class T>
std::string message_of(const Result<T>& r) {
  return r.status().message();
}

// Three layouts: full + window in pages of one size; full in pages of 8 and
// a window in pages of 4 (two chains); full + chunked local attention.
struct TwoGroups {
  std::vector<std::int32_t> l0{0}, l1{1};
  LayerGroupSpec specs[2];
  LayerGroups lg;
  explicit TwoGroups(int kind) {
    specs[0] = {.kind = AttentionKind::full, .layers = l0, .num_kv_heads = 1, .head_dim = 8};
    specs[1] = {.kind = kind == 2 ? AttentionKind::chunked_local : AttentionKind::sliding_window, .layers = l1,
                .num_kv_heads = kind == 1 ? 2 : 1, .head_dim = 8, .window = kind == 2 ? 0 : 10, .chunk = kind == 2 ? 8 : 0};
    lg = *LayerGroups::make({.groups = specs, .block_size = 4});
  }
};

// What group g's slot of position p of `tokens` holds: a value of every token up to p.
std::int64_t kv_value(std::int32_t g, std::span<const std::int32_t> tokens, std::int64_t p) {
  std::uint64_t h = 1469598103934665603ull ^ std::uint64_t(g + 1) * 0x9e3779b97f4a7c15ull;
  for (std::int64_t i = 0; i <= p; ++i) h = (h ^ std::uint64_t(tokens[std::size_t(i)])) * 1099511628211ull;
  return std::int64_t(h >> 1);
}

constexpr std::int32_t kChunk = 16;  // the engine's prefill chunk

struct World {
  TwoGroups layout;
  std::int32_t P;  // words a page holds: the largest group block size
  HybridCache<> cache;
  GroupTiers<HybridCache<>> tiers;
  DiskLayout disk_layout;
  std::vector<std::int64_t> dev, host;
  std::vector<std::byte> disk;
  std::mt19937 rng{7};
  std::int64_t onboarded = 0, staged = 0, aborted = 0, refused = 0, written_back = 0;
  std::optional<WritePolicy> write_back;  // when set, what the pool is about to recycle goes to host memory first
  std::vector<Offload> recycled = std::vector<Offload>(40);

  World(int kind, std::int32_t host_blocks, std::int32_t disk_blocks)
      : layout(kind),
        P(std::max(layout.lg.block_size(0), layout.lg.block_size(1))),
        cache({.groups = layout.lg, .num_blocks = 40, .max_sequences = 1, .max_tokens = 96, .prefill_chunk = kChunk}),
        tiers(cache, {.host_blocks = host_blocks, .disk_blocks = disk_blocks, .event_capacity = 4096}),
        disk_layout(*DiskLayout::make(std::int64_t(P) * 8, std::max(disk_blocks, 1), 0x51, 64)),
        dev(std::size_t(40 * P), -1),
        host(std::size_t(host_blocks * P), -1),
        disk(std::size_t(disk_layout.file_bytes())) {}

  std::int64_t& at(std::vector<std::int64_t>& mem, std::int32_t g, std::int32_t slot) {
    const std::int32_t B = layout.lg.block_size(g);
    return mem[std::size_t(slot / B * P + slot % B)];
  }
  static void copy_page(const std::vector<std::int64_t>& from, std::int32_t a, std::vector<std::int64_t>& to, std::int32_t b,
                        std::int32_t P) {
    std::copy_n(from.begin() + std::ptrdiff_t(a) * P, P, to.begin() + std::ptrdiff_t(b) * P);
  }
  // The forward pass of tokens [from, from + n): writes each group's slots (stride n).
  void write(std::span<const std::int32_t> tokens, std::int64_t from, std::int32_t n, std::span<const std::int32_t> slots) {
    for (std::int32_t g = 0; g < cache.groups(); ++g)
      for (std::int32_t i = 0; i < n; ++i) at(dev, g, slots[std::size_t(g * n + i)]) = kv_value(g, tokens, from + i);
  }
  // What every group's query at the last position reads holds the prompt's values.
  void check_reads(SeqId s, std::span<const std::int32_t> tokens) {
    const auto len = std::int64_t(tokens.size());
    for (std::int32_t g = 0; g < cache.groups(); ++g) {
      const GroupRule r = GroupRule::of(layout.lg, g);
      const auto row = *cache.blocks(s, g);
      for (std::int64_t p = r.first_read(len - 1); p < len; ++p) {
        const BlockId b = row[std::size_t(r.div(p))];
        REQUIRE(b != BlockPool::null_block);
        INFO("group " << g << " position " << p << " of " << len);
        REQUIRE(dev[std::size_t(b * P + r.mod(p))] == kv_value(g, tokens, p));
      }
    }
  }
  void check() {
    if (auto st = cache.check_invariants(); !st) FAIL(st.message());
    if (auto st = tiers.tiers().check_invariants(); !st) FAIL(st.message());
  }

  // Write-back before a call that may allocate: the cached blocks its
  // allocations would recycle are copied to host memory now, each under its
  // group's name (a store host memory cannot take is skipped: all or nothing).
  void before_allocating() {
    if (!write_back) return;
    const std::int32_t n = write_back->before_allocate(cache.pool(), kChunk / 4 + 2, recycled);
    if (n == 0) return;
    auto job = tiers.tiers().plan_store(Tier::device, Tier::host, std::span(recycled).first(std::size_t(n)));
    if (!job) return;
    for (const BlockMove& m : job->moves) copy_page(dev, m.src, host, m.dst, P);
    REQUIRE_OK(tiers.tiers().complete(job->id));
    written_back += std::int64_t(job->moves.size());
  }

  // Stages the import's disk blocks into host memory: one read a slot, verified by the library.
  void stage(std::uint64_t import) {
    auto job = tiers.plan_stage(import);
    REQUIRE_OK(job);
    std::vector<std::vector<std::byte>> tails;
    for (const BlockMove& m : job->moves) {
      const auto off = std::size_t(disk_layout.offset(m.src));
      std::memcpy(&host[std::size_t(m.dst * P)], &disk[off], std::size_t(P) * 8);
      tails.emplace_back(disk.begin() + std::ptrdiff_t(off) + P * 8, disk.begin() + std::ptrdiff_t(off + std::size_t(disk_layout.slot_bytes())));
    }
    std::size_t k = 0;
    auto landed = tiers.tiers().complete_disk_load(job->id, disk_layout, [&](const BlockMove& m) {
      return LandedSlot{std::as_bytes(std::span(host).subspan(std::size_t(m.dst * P), std::size_t(P))), tails[k++]};
    });
    REQUIRE_OK(landed);
    REQUIRE(*landed == std::int32_t(job->moves.size()));
    staged += *landed;
  }
  // Behind the host tier, to disk: each host block just stored, sealed in its slot.
  void write_behind(std::span<const std::int32_t> host_slots) {
    std::vector<BlockHash> keys;
    std::vector<std::int32_t> src;
    for (const std::int32_t s : host_slots) keys.push_back(tiers.tiers().host().hash(s)), src.push_back(s);
    auto job = tiers.tiers().plan_store(Tier::host, Tier::disk, keys, src);
    if (!job) return;  // the disk cannot take them all now
    for (const BlockMove& m : job->moves) {
      const auto off = std::size_t(disk_layout.offset(m.dst));
      const auto payload = std::as_bytes(std::span(host).subspan(std::size_t(m.src * P), std::size_t(P)));
      std::memcpy(&disk[off], payload.data(), payload.size());
      REQUIRE_OK(disk_layout.seal_tail(payload, std::span(disk).subspan(off + payload.size(), std::size_t(disk_layout.tail_bytes())),
                                    m.dst, keys[std::size_t(m.index)], tiers.tiers().host().group(m.src)));
    }
    REQUIRE_OK(tiers.tiers().complete(job->id));
  }

  // One turn: the hit onboarded (or recomputed), the rest computed, `decode` tokens generated, then offloaded.
  std::vector<std::int32_t> serve(std::vector<std::int32_t> tokens, std::int32_t decode, bool fail_some) {
    const auto len = std::int64_t(tokens.size());
    auto hit = tiers.lookup(tokens);
    REQUIRE_OK(hit);
    REQUIRE(hit->tokens >= hit->device_tokens);
    REQUIRE(hit->tokens < len);
    SeqId seq{};
    std::int64_t have = 0;
    before_allocating();
    if (hit->tokens > hit->device_tokens) {
      auto imp = cache.import(std::span(tokens).first(std::size_t(hit->tokens)));
      REQUIRE_OK(imp);
      if (hit->disk > 0) stage(imp->id);
      auto job = tiers.plan_onboard(imp->id);
      if (!job) {  // a hit evicted since the lookup: recompute it
        REQUIRE(job.status().code() == Errc::out_of_blocks);
        auto a = cache.abort_import(imp->id);
        REQUIRE_OK(a);
        seq = a->seq, have = a->cached_tokens, ++refused;
      } else {
        for (const BlockMove& m : job->moves) copy_page(host, m.src, dev, m.dst, P);
        std::vector<std::int32_t> failed;
        if (fail_some && !job->moves.empty() && rng() % 3 == 0) {
          failed.push_back(std::int32_t(rng() % job->moves.size()));
          for (std::int64_t w = 0; w < P; ++w) dev[std::size_t(job->moves[std::size_t(failed[0])].dst * P + w)] = -7;  // torn
        }
        auto done = tiers.complete_onboard(job->id, failed);
        REQUIRE_OK(done);
        CHECK(done->committed == failed.empty());
        seq = done->seq, have = done->tokens;
        if (done->committed) {
          onboarded += std::int64_t(job->moves.size());
          CHECK(have == hit->tokens);
        } else {
          ++aborted;
          CHECK(have <= hit->device_tokens);
        }
      }
    } else {
      std::vector<std::int32_t> slots(std::size_t(cache.groups()) * std::size_t(len));
      auto a = cache.admit(tokens, slots);
      REQUIRE_OK(a);
      REQUIRE(a->cached_tokens == hit->device_tokens);
      seq = a->seq, have = a->cached_tokens + a->reserved;
      const auto n = a->reserved;
      std::vector<std::int32_t> dense(std::size_t(cache.groups()) * std::size_t(n));
      for (std::int32_t g = 0; g < cache.groups(); ++g)
        std::copy_n(slots.begin() + std::ptrdiff_t(g) * len, n, dense.begin() + std::ptrdiff_t(g) * n);
      write(tokens, a->cached_tokens, n, dense);
      REQUIRE_OK(cache.computed(seq, have));
    }
    while (have < len) {  // the rest of the prompt, a chunk at a time
      const auto n = std::int32_t(std::min<std::int64_t>(len - have, kChunk));
      std::vector<std::int32_t> slots(std::size_t(cache.groups()) * std::size_t(n));
      before_allocating();
      REQUIRE_OK(cache.reserve(seq, std::span(tokens).subspan(std::size_t(have), std::size_t(n)), slots));
      write(tokens, have, n, slots);
      have += n;
      REQUIRE_OK(cache.computed(seq, have));
    }
    check();
    check_reads(seq, tokens);
    for (std::int32_t d = 0; d < decode; ++d) {  // the model's answer: a token of everything before it
      tokens.push_back(std::int32_t(kv_value(0, tokens, std::int64_t(tokens.size()) - 1) % 50000));
      std::vector<std::int32_t> slots(std::size_t(cache.groups()));
      before_allocating();
      REQUIRE_OK(cache.reserve(seq, std::span(tokens).last(1), slots));
      write(tokens, std::int64_t(tokens.size()) - 1, 1, slots);
      REQUIRE_OK(cache.computed(seq, std::int64_t(tokens.size())));
    }
    check_reads(seq, tokens);
    // The request ends: offload what its continuation reads, holding the sources until the copy completes.
    auto job = tiers.plan_offload(seq, tokens);
    std::vector<std::int32_t> stored;
    std::vector<BlockId> sources;
    if (job) {
      for (const BlockMove& m : job->moves) copy_page(dev, m.src, host, m.dst, P), stored.push_back(m.dst), sources.push_back(m.src);
    } else {
      REQUIRE(job.status().code() == Errc::out_of_blocks);
    }
    auto hold = cache.hold(sources);
    REQUIRE_OK(hold);
    REQUIRE_OK(cache.free(seq));
    if (job) REQUIRE_OK(tiers.tiers().complete(job->id));
    REQUIRE_OK(cache.release_hold(*hold));
    if (tiers.tiers().has(Tier::disk) && !stored.empty()) write_behind(stored);
    check();
    return tokens;
  }
};

std::vector<std::int32_t> fresh(std::mt19937& rng, std::int32_t n) {
  std::vector<std::int32_t> v(static_cast<std::size_t>(n));
  for (auto& t : v) t = std::int32_t(rng() % 50000);
  return v;
}

}  // namespace

TEST_CASE("group tiers: conversations the device forgets come back from host memory and disk, every group's reads exact") {
  const int kind = GENERATE(0, 1, 2);
  const std::int32_t disk_blocks = GENERATE(0, 64);
  const bool write_back = GENERATE(false, true);  // also write-back: blocks offloaded just before the pool recycles them
  INFO("layout " << kind << ", disk " << disk_blocks << ", write-back " << write_back);
  World w(kind, /*host_blocks=*/disk_blocks > 0 ? 24 : 48, disk_blocks);
  if (write_back) w.write_back.emplace(WritePolicyConfig{.mode = WriteMode::write_back});
  std::mt19937 rng(11 + kind);
  std::vector<std::vector<std::int32_t>> convo(5);
  for (std::int32_t turn = 0; turn < 5; ++turn)
    for (auto& c : convo) {
      auto msg = fresh(rng, turn == 0 ? 17 + std::int32_t(rng() % 8) : 3 + std::int32_t(rng() % 9));
      c.insert(c.end(), msg.begin(), msg.end());
      c = w.serve(c, 4, /*fail_some=*/true);
    }
  CHECK(w.onboarded > 0);
  CHECK(w.aborted > 0);
  if (disk_blocks > 0) CHECK(w.staged > 0);
  CHECK((w.written_back > 0) == write_back);
  // The tiers' events name each block's group and its size.
  // A block stored behind to disk, or staged back from it, keeps its group.
  for (const Tier t : {Tier::host, Tier::disk}) {
    if (!w.tiers.tiers().has(t)) continue;
    std::vector<BlockEvent> ev(4096);
    const std::int32_t n = w.tiers.tiers().drain_events(t, ev);
    REQUIRE(n > 0);
    for (std::int32_t e = 0; e < n; ++e) {
      const std::int32_t g = ev[std::size_t(e)].group;
      REQUIRE((g == 0 || g == 1));
      CHECK(ev[std::size_t(e)].medium == (t == Tier::host ? Medium::cpu : Medium::disk));
      if (ev[std::size_t(e)].kind == EventKind::stored) CHECK(ev[std::size_t(e)].block_size == w.layout.lg.block_size(g));
    }
  }
}

TEST_CASE("group tiers: a restarted engine serves its disk blocks again, each in its group") {
  const int kind = GENERATE(0, 1);
  INFO("layout " << kind);
  World w(kind, 24, 64);
  std::mt19937 rng(21 + kind);
  std::vector<std::vector<std::int32_t>> convo(4);
  for (auto& c : convo) c = w.serve(fresh(rng, 20 + std::int32_t(rng() % 8)), 2, false);
  // The engine restarts: a new cache and new tiers over the same file. It
  // reads every slot's trailer and restores the disk tier, groups included.
  World r(kind, 24, 64);
  r.disk = w.disk;
  std::vector<std::int32_t> slots, groups;
  std::vector<BlockHash> hashes;
  for (std::int32_t s = 0; s < r.disk_layout.num_blocks(); ++s) {
    const auto found = r.disk_layout.sealed(std::span(r.disk).subspan(std::size_t(r.disk_layout.offset(s)),
                                                                      std::size_t(r.disk_layout.slot_bytes())), s);
    if (!found) continue;
    slots.push_back(s), hashes.push_back(found->hash), groups.push_back(found->group);
    REQUIRE((found->group == 0 || found->group == 1));
  }
  REQUIRE(!slots.empty());
  REQUIRE_OK(r.tiers.tiers().restore_disk(slots, hashes, groups));
  std::vector<BlockEvent> ev(4096);
  const std::int32_t restored = r.tiers.tiers().drain_events(Tier::disk, ev);
  REQUIRE(restored == std::int32_t(slots.size()));
  for (std::int32_t e = 0; e < restored; ++e) {
    const BlockEvent& x = ev[std::size_t(e)];
    REQUIRE((x.group == 0 || x.group == 1));
    CHECK(x.block_size == w.layout.lg.block_size(x.group));
  }
  // Each conversation's next turn comes back from disk, every group's reads exact.
  std::int32_t from_disk = 0;
  for (auto& c : convo) {
    c.push_back(std::int32_t(rng() % 50000));
    const auto hit = *r.tiers.lookup(c);
    from_disk += hit.disk;
    c = r.serve(c, 1, false);
  }
  CHECK(from_disk > 0);
  CHECK(r.staged > 0);
  const std::int32_t n = r.tiers.tiers().drain_events(Tier::host, ev);
  REQUIRE(n > 0);
  for (std::int32_t e = 0; e < n; ++e) CHECK((ev[std::size_t(e)].group == 0 || ev[std::size_t(e)].group == 1));
}

TEST_CASE("group tiers: the write policies choose a hybrid's blocks, each named and stored in its group") {
  const WriteMode mode = GENERATE(WriteMode::write_through, WriteMode::write_through_reused, WriteMode::write_back);
  INFO("mode " << int(mode));
  TwoGroups layout(1);  // a full group in pages of 8 tokens, a window of 10 in pages of 4
  HybridCache<> cache({.groups = layout.lg, .num_blocks = 24, .max_sequences = 2, .max_tokens = 64, .event_capacity = 256});
  GroupTiers<HybridCache<>> tiers(cache, {.host_blocks = 64, .event_capacity = 256});
  WritePolicy policy({.mode = mode});
  std::mt19937 rng(9);
  const auto prompt = fresh(rng, 40);
  // Which group names each hash of the prompt (the names lookups and imports use).
  std::vector<std::vector<BlockHash>> names(2, std::vector<BlockHash>(10));
  for (std::int32_t g = 0; g < 2; ++g) names[std::size_t(g)].resize(std::size_t(*cache.hash_chain(g, prompt, {}, names[std::size_t(g)])));
  const auto group_naming = [&](const BlockHash& h) {
    for (std::int32_t g = 0; g < 2; ++g)
      if (std::find(names[std::size_t(g)].begin(), names[std::size_t(g)].end(), h) != names[std::size_t(g)].end()) return g;
    return -1;
  };
  std::vector<Offload> out(64);
  std::vector<BlockEvent> ev(256);
  std::int32_t chosen = 0;
  const auto offload = [&](std::int32_t n) {  // plan, copy (nothing to copy here: names only), complete
    for (std::int32_t i = 0; i < n; ++i) CHECK(out[std::size_t(i)].group == group_naming(out[std::size_t(i)].hash));
    auto job = tiers.tiers().plan_store(Tier::device, Tier::host, std::span(out).first(std::size_t(n)));
    REQUIRE_OK(job);
    REQUIRE_OK(tiers.tiers().complete(job->id));
    chosen += n;
  };
  std::vector<std::int32_t> slots(2 * 40);
  for (int use = 0; use < 2; ++use) {  // the prompt served twice: the second time a hit
    auto a = cache.admit(prompt, slots);
    REQUIRE_OK(a);
    REQUIRE_OK(cache.computed(a->seq, 40));
    const std::int32_t n = cache.drain_events(ev);
    if (auto k = policy.on_stored(std::span(ev).first(std::size_t(n)), out); k && *k > 0) offload(*k);  // write_through
    std::vector<BlockId> used;
    for (std::int32_t g = 0; g < 2; ++g)
      for (const BlockId b : *cache.blocks(a->seq, g))
        if (b != BlockPool::null_block) used.push_back(b);
    if (auto k = policy.on_use(cache.pool(), used, out); k && *k > 0) offload(*k);  // write_through_reused, on the second use
    REQUIRE_OK(cache.free(a->seq));
  }
  // Another prompt takes the pool: write_back offloads what its allocations recycle, just before.
  const auto other = fresh(rng, 40);
  const std::int32_t k = policy.before_allocate(cache.pool(), cache.pool().num_free(), out);
  if (k > 0) offload(k);
  auto b = cache.admit(other, slots);
  REQUIRE_OK(b);
  REQUIRE_OK(cache.free(b->seq));
  CHECK(chosen > 0);
  // Every mode brought the prompt to host memory, each block under its group's name: it comes back from there.
  auto next = prompt;
  next.push_back(7);
  const auto hit = *tiers.lookup(next);
  CHECK(hit.device_tokens < 40);  // the other prompt took some of its blocks
  CHECK(hit.tokens == 40);
  CHECK(hit.host > 0);
  const std::int32_t n = tiers.tiers().drain_events(Tier::host, ev);
  REQUIRE(n > 0);
  for (std::int32_t e = 0; e < n; ++e) {
    const BlockEvent& x = ev[std::size_t(e)];
    if (x.kind != EventKind::stored) continue;
    REQUIRE((x.group == 0 || x.group == 1));
    CHECK(x.block_size == layout.lg.block_size(x.group));
  }
  CHECK(tiers.tiers().check_invariants().ok());
}

TEST_CASE("group tiers: a window group moves only its last window, a full group every block") {
  World w(0, 64, 0);  // full + a window of 10 in pages of 4
  std::mt19937 rng(3);
  auto c = fresh(rng, 40);
  c = w.serve(c, 0, false);  // 40 tokens: full 10 blocks, window blocks of positions 30..39
  // Forget the device: another conversation fills the pool.
  (void)w.serve(fresh(rng, 90), 0, false);
  c.push_back(5);
  const auto hit = *w.tiers.lookup(c);
  CHECK(hit.device_tokens == 0);
  CHECK(hit.tokens == 40);
  // An import of 40 tokens receives the full group's 10 blocks and the window's blocks of positions 31..39 (7 .. 9).
  CHECK(hit.host == 10 + 3);
  CHECK(hit.disk == 0);
}

TEST_CASE("group tiers: bad calls are typed errors that change nothing") {
  World w(0, 16, 0);
  std::mt19937 rng(5);
  auto c = w.serve(fresh(rng, 30), 0, false);
  const Tiers before = w.tiers.tiers();
  CHECK(w.tiers.lookup(std::span<const std::int32_t>{}).status() == Status{Errc::invalid_argument, "prompt.size", 0, 1});
  const std::vector<std::int32_t> too_long(97, 1);  // admit()'s words: past max_tokens (96)
  CHECK(w.tiers.lookup(too_long).status() == Status{Errc::capacity_exceeded, "n_tokens", 97, 96});
  CHECK(w.tiers.plan_onboard(12345).status().code() == Errc::unknown_job);
  CHECK(w.tiers.plan_stage(12345).status().code() == Errc::unknown_job);
  CHECK(w.tiers.complete_onboard(12345).status().code() == Errc::unknown_job);
  CHECK(w.tiers.plan_offload(SeqId{0, 99}, c).status().code() == Errc::unknown_sequence);
  CHECK(w.tiers.tiers() == before);

  // An import whose length is not whole blocks has a block without a name: refused, nothing changes.
  (void)w.serve(fresh(rng, 90), 0, false);
  auto imp = w.cache.import(std::span(c).first(30));
  REQUIRE_OK(imp);
  CHECK(w.tiers.plan_onboard(imp->id).status().code() == Errc::invalid_argument);
  CHECK(w.tiers.tiers() == before);
  auto aborted = w.cache.abort_import(imp->id);
  REQUIRE_OK(aborted);
  REQUIRE_OK(w.cache.free(aborted->seq));
  {  // Offloading under tokens that are not the sequence's is refused, naming the block: nothing is stored.
    const std::vector<std::int32_t> mine(c.begin(), c.begin() + 30);
    std::vector<std::int32_t> slots(std::size_t(w.cache.groups()) * 30);
    auto a = w.cache.admit(mine, slots, {.reserve = 16});
    REQUIRE_OK(a);
    REQUIRE_OK(w.cache.computed(a->seq, 16));
    REQUIRE_OK(w.cache.reserve(a->seq, std::span(mine).subspan(16), slots));
    REQUIRE_OK(w.cache.computed(a->seq, 30));
    std::vector<std::int32_t> other = mine;
    other[5] += 1;
    const auto wrong = w.tiers.plan_offload(a->seq, other);
    CHECK(wrong.status().code() == Errc::invalid_argument);
    CHECK(wrong.status().message().find("not this sequence's") != std::string::npos);
    CHECK(w.tiers.plan_offload(a->seq, std::span(mine).first(3)).status().code() == Errc::invalid_argument);
    CHECK(w.tiers.tiers() == before);
    REQUIRE_OK(w.cache.free(a->seq));
  }

  // A hit evicted since the lookup: out_of_blocks naming how many host memory still holds.
  c.push_back(9);
  const auto hit = *w.tiers.lookup(c);
  REQUIRE(hit.tokens == 28);
  auto imp2 = w.cache.import(std::span(c).first(28));
  REQUIRE_OK(imp2);
  GroupTiers small(w.cache, {.host_blocks = 1});
  CHECK(small.plan_onboard(imp2->id).status().code() == Errc::out_of_blocks);
  // A bad failed index changes nothing, and the job completes after.
  auto job = w.tiers.plan_onboard(imp2->id);
  REQUIRE_OK(job);
  const std::int32_t bad[] = {std::int32_t(job->moves.size())};
  CHECK(w.tiers.complete_onboard(job->id, bad).status().code() == Errc::invalid_argument);
  auto done = w.tiers.complete_onboard(job->id);
  REQUIRE_OK(done);
  CHECK(done->committed);
  CHECK(w.tiers.complete_onboard(job->id).status().code() == Errc::unknown_job);
  // An onboard completed behind GroupTiers' back (tiers().complete) is forgotten, and its import is the engine's to abort.
  REQUIRE_OK(w.cache.free(done->seq));
  auto imp3 = w.cache.import(std::span(c).first(28));
  REQUIRE_OK(imp3);
  auto job3 = w.tiers.plan_onboard(imp3->id);
  REQUIRE_OK(job3);
  REQUIRE_OK(w.tiers.tiers().complete(job3->id));
  CHECK(w.tiers.complete_onboard(job3->id).status().code() == Errc::unknown_job);
  CHECK(w.tiers.complete_onboard(job3->id).status().code() == Errc::unknown_job);
  auto ab = w.cache.abort_import(imp3->id);
  REQUIRE_OK(ab);
  REQUIRE_OK(w.cache.free(ab->seq));
  w.check();
  auto imp4 = w.cache.import(std::span(c).first(28));  // the forgotten entry took no room: the next onboard plans
  REQUIRE_OK(imp4);
  auto job4 = w.tiers.plan_onboard(imp4->id);
  REQUIRE_OK(job4);
  auto done4 = w.tiers.complete_onboard(job4->id);
  REQUIRE_OK(done4);
  CHECK(done4->committed);
  done = done4;
  // The received blocks are published under the names the load found them by.
  for (std::int32_t g = 0; g < w.cache.groups(); ++g) {
    std::vector<BlockHash> keys(32);
    const auto n = *w.cache.hash_chain(g, std::span(c).first(28), {}, keys);
    const auto row = *w.cache.blocks(done->seq, g);
    for (std::int32_t j = 0; j < n; ++j)
      if (row[std::size_t(j)] != BlockPool::null_block) CHECK(w.cache.pool().hash(row[std::size_t(j)]) == keys[std::size_t(j)]);
  }
  REQUIRE_OK(w.cache.free(done->seq));
  w.check();
}

TEST_CASE("group tiers: the cache's names and their errors") {
  TwoGroups m(0);
  HybridCache<> off({.groups = m.lg, .num_blocks = 20, .max_sequences = 1, .max_tokens = 32, .prefix_caching = false});
  CHECK_THROWS_AS(GroupTiers<HybridCache<>>(off, {.host_blocks = 4}), ConfigError);
  HybridCache<> c({.groups = m.lg, .num_blocks = 20, .max_sequences = 1, .max_tokens = 32});
  CHECK_THROWS_AS(GroupTiers<HybridCache<>>(c, {.host_blocks = -1}), ConfigError);
  const std::vector<std::int32_t> p(13, 4);
  std::vector<BlockHash> out(8);
  CHECK(c.hash_chain(2, p, {}, out).status().code() == Errc::invalid_argument);
  CHECK(*c.hash_chain(0, p, {}, out) == 3);
  std::vector<BlockHash> w(8);
  CHECK(*c.hash_chain(1, p, {}, w) == 3);
  CHECK(!(out[0] == w[0]));  // the same tokens, two groups: two names
  // One chain before the keys, shared by both groups (one block size): each group's names are its keys of it.
  std::vector<BlockHash> chain(8);
  REQUIRE(*c.block_chain(1, p, {}, chain) == 3);
  CHECK((c.chain_owner(0) == 0 && c.chain_owner(1) == 0));  // one block size: group 0 hashes for both
  for (std::size_t j = 0; j < 3; ++j) CHECK((group_key(chain[j], 0) == out[j] && group_key(chain[j], 1) == w[j]));
  CHECK(c.block_chain(2, p, {}, chain).status().code() == Errc::invalid_argument);
  auto imp = c.import(p);
  REQUIRE_OK(imp);
  std::vector<BlockHash> one(1);
  CHECK(c.import_keys(imp->id, 0, one).status().code() == Errc::buffer_too_small);
  CHECK(c.import_keys(imp->id, 5, out).status().code() == Errc::invalid_argument);
  CHECK(c.import_keys(imp->id + 1, 0, out).status().code() == Errc::unknown_job);
  REQUIRE(*c.import_keys(imp->id, 0, out) == 3);  // 13 tokens: 3 whole blocks named, the 4th partial
  for (std::int32_t j = 0; j < 3; ++j) {
    std::vector<BlockHash> names(8);
    (void)c.hash_chain(0, p, {}, names);
    CHECK(out[std::size_t(j)] == names[std::size_t(j)]);
  }
  auto imp_off = off.import(p);
  REQUIRE_OK(imp_off);
  CHECK(off.import_keys(imp_off->id, 0, out).status().code() == Errc::invalid_argument);
}
