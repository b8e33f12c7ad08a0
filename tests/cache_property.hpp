// The plain cache's randomized property harness (test_property.cpp): random
// operations (add, prefix add, atomic admit, reserve with and without ids,
// batch reserve, fork, truncate, free, publish, reset, invalid calls) against
// a reference model. The cache's slots are "written" into a simulated KV
// memory holding token ids, copy-on-write commands are executed, and after
// every operation every live sequence must read back exactly its model tokens
// through its page table; the prefix cache must be prefix-closed, every used
// block with a hash reachable, and (publishing on reserve) every full block
// whose ids were given published. A freed sequence's blocks are sometimes
// held first (a transfer still copying them, or a finished prefill waiting
// for its readers through TransferHolds, released by the last reader's
// notification or at its deadline): until the hold ends they keep exactly
// what they held. Prompts are also imported (a peer
// computes them): pending rows are never handed out, their received blocks
// stay unpublished and unshared, and each import commits (the "transfer"
// wrote them) or aborts (the rest is recomputed). Failed calls must leave
// the cache bit-for-bit as it was. With a quantized mirror, every write,
// copy-on-write and import also lands in a real quantized pool (int4, int2,
// int8 and fp4 with group scales, fp8 with an engine-held scale: the scatter
// and block copy kernels), and every live position must read back its token
// through its codes and entries.
#pragma once

#include <catch2/catch.hpp>

#include <kvcache/cache.hpp>
#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kernels/detail/quant_rows.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kernels/seal.hpp>
#include <kvcache/transfer/transfer_holds.hpp>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <optional>
#include <cmath>
#include <random>
#include <set>
#include <span>
#include <tuple>
#include <vector>

namespace kvtest {

using namespace kvcache;


constexpr std::int32_t kBlocks = 40, kSeqs = 8, kPerSeq = 10;

struct Seq {
  SeqId id;
  std::vector<std::int32_t> tokens;   // what the cache must hold
  std::vector<std::int32_t> pending;  // rest of the prompt, appended by later reserves
  PrefixKey key;
  std::size_t known = 0;              // leading tokens whose ids the cache was given (publish on reserve)
};

using Hash3 = std::tuple<std::uint64_t, std::uint64_t>;

// A real quantized pool beside the simulated memory: a token's bits are its
// K row (0 or 1 per value) and their negation its V row, in one of the
// formats below (head_dim 16, so a group of 16 is the whole row). Reads
// round the dequantized values back to bits; a block moved without its
// group entries would read other tokens. `scale` is the engine-held scale
// of fp8 per head (codes 0 and 1 / scale), passed to scatter as an array.
// KIVI's format (K per channel over the block) is written as its engine
// writes it: an open block's rows are held in full precision beside the
// pool and the block is sealed once all its slots are written; a write
// into a sealed block (copy-on-write, a rewrite after truncation) first
// reopens it from its own read-back, so a copy that dropped the channel
// entries would reopen other tokens.
struct MirrorFormat {
  const char* name;
  DType dtype;
  KvFormat format;
  float scale = 1.0f;
};
inline const MirrorFormat kMirrorFormats[] = {
    {"int4, groups of 16, K with a minimum", DType::int4,
     {{.scales = Scales::group, .group = 16, .minimum = true}, {.scales = Scales::group, .group = 16}}},
    {"int2, groups of 16 with a minimum", DType::int2,
     {{.scales = Scales::group, .group = 16, .minimum = true}, {.scales = Scales::group, .group = 16, .minimum = true}}},
    {"int8, groups of 16", DType::int8, {{.scales = Scales::group, .group = 16}, {.scales = Scales::group, .group = 16}}},
    {"fp4 e2m1, groups of 16", DType::fp4_e2m1, {{.scales = Scales::group, .group = 16}, {.scales = Scales::group, .group = 16}}},
    {"fp8 e4m3, an engine-held scale per head", DType::fp8_e4m3, {{.scales = Scales::head}, {.scales = Scales::head}}, 0.25f},
    {"int2 KIVI: K per channel, V groups of 16, both with a minimum", DType::int2,
     {{.scales = Scales::channel, .minimum = true}, {.scales = Scales::group, .group = 16, .minimum = true}}},
};

class QuantMirror {
 public:
  QuantMirror(std::int32_t block_size, const MirrorFormat& f)
      : g_(*Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = 16, .block_size = block_size, .dtype = f.dtype,
                            .format = f.format})),
        bytes_(std::size_t(*g_.pool_bytes(kBlocks))),
        view_(*make_pool_view(g_, bytes_.data(), kBlocks)),
        held_(f.format.k.scales == Scales::head),
        scale_(f.scale),
        channel_(f.format.k.scales == Scales::channel),
        open_(std::size_t(kBlocks) * std::size_t(block_size) * 32),
        written_(std::size_t(kBlocks), 0),
        sealed_(std::size_t(kBlocks), false) {}
  void write(std::int32_t slot, std::int32_t token) {
    float k[16], v[16];
    for (int d = 0; d < 16; ++d) k[d] = float((token >> d) & 1), v[d] = -k[d];
    if (channel_) return write_open(slot, k, v);
    ScatterParams p{view_, KvSource{k, v, DType::f32, 0, 64, 64}, TokenAddress{&slot}, 1};
    if (held_) p.k_scales = p.v_scales = &scale_;
    REQUIRE(scatter_host(p).ok());
  }
  void copy(const BlockCopy& c) {
    REQUIRE(block_copy_host({view_, view_, &c, 1}).ok());
    if (!channel_) return;
    const auto rows = std::ptrdiff_t(g_.block_size()) * 32;
    std::copy_n(open_.begin() + c.src * rows, rows, open_.begin() + c.dst * rows);
    written_[std::size_t(c.dst)] = written_[std::size_t(c.src)];
    sealed_[std::size_t(c.dst)] = sealed_[std::size_t(c.src)];
  }
  // The token at slot, or -1 - d when value d of K and V disagree or is not a bit.
  std::int32_t read(std::int32_t slot) const {
    float k[16], v[16];
    const std::int32_t b = slot / g_.block_size(), t = slot % g_.block_size();
    if (channel_ && !sealed_[std::size_t(b)]) {
      std::copy_n(open_.begin() + std::ptrdiff_t(slot) * 32, 16, k);
      std::copy_n(open_.begin() + std::ptrdiff_t(slot) * 32 + 16, 16, v);
    } else {
      load_row(b, t, k, v);
    }
    std::int32_t token = 0;
    for (int d = 0; d < 16; ++d) {
      const float s = held_ ? scale_ : 1.0f;  // the pool holds x / scale: the gather kernel's multiply
      const auto bit = std::int32_t(std::lround(k[d] * s));
      if ((bit != 0 && bit != 1) || bit != std::int32_t(std::lround(-v[d] * s))) return -1 - d;
      token |= bit << d;
    }
    return token;
  }

 private:
  void load_row(std::int32_t b, std::int32_t t, float* k, float* v) const {
    load_pool_span(view_, 0, view_.row(b, 0, 0, t, 0), row_entries(view_, b, 0, 0, t, 0), 0, 16, k);
    load_pool_span(view_, 1, view_.row(b, 0, 1, t, 0), row_entries(view_, b, 0, 1, t, 0), 0, 16, v);
  }
  // KIVI's write: a sealed block is reopened from its read-back, the row
  // lands in the open rows (K then V, 16 floats each), and a block whose
  // slots have all been written is sealed from them.
  void write_open(std::int32_t slot, const float* k, const float* v) {
    const std::int32_t B = g_.block_size(), b = slot / B;
    float* rows = open_.data() + std::ptrdiff_t(b) * B * 32;
    if (sealed_[std::size_t(b)])
      for (std::int32_t t = 0; t < B; ++t) load_row(b, t, rows + t * 32, rows + t * 32 + 16);
    sealed_[std::size_t(b)] = false;
    std::copy_n(k, 16, open_.begin() + std::ptrdiff_t(slot) * 32);
    std::copy_n(v, 16, open_.begin() + std::ptrdiff_t(slot) * 32 + 16);
    written_[std::size_t(b)] |= 1u << (slot % B);
    if (written_[std::size_t(b)] + 1 != 1u << B) return;
    REQUIRE(seal_blocks_host({view_, KvSource{rows, rows + 16, DType::f32, 0, 128, 64}, &b, 1}).ok());
    sealed_[std::size_t(b)] = true;
    std::fill_n(rows, B * 32, NAN);  // from here on the block is its codes alone
  }

  Geometry g_;
  std::vector<std::byte> bytes_;
  PoolView view_;
  bool held_;
  float scale_;
  bool channel_;                      // KIVI: open blocks held here, sealed when full
  std::vector<float> open_;           // per slot: K's 16 floats, then V's
  std::vector<std::uint32_t> written_;  // per block: the slots written since it was last reopened or copied
  std::vector<bool> sealed_;          // per block: its rows are in the pool's codes
};

// B: the block size. A power of two and not take different paths (masks, and
// specialized batch passes). Auto: the cache publishes on reserve.
template <std::int32_t B, bool Auto = false>
class Harness {
  static constexpr std::int32_t kMaxTokens = B * kPerSeq;

 public:
  // mirror: a real quantized pool that every write, copy and import also lands in.
  explicit Harness(std::uint64_t seed, const MirrorFormat* mirror = nullptr)
      : rng_(seed),
        cache_({.geometry = *Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = 8, .block_size = B}),
                .num_blocks = kBlocks,
                .max_sequences = kSeqs,
                .max_blocks_per_sequence = kPerSeq,
                .event_capacity = 256,
                .publish_on_reserve = Auto}),
        mem_(std::size_t(kBlocks) * B, -1) {
    if (mirror) mirror_.emplace(B, *mirror);
    for (auto& t : templates_) {
      t.resize(kMaxTokens);
      for (auto& x : t) x = std::int32_t(rng_() % 1000);
    }
  }

  void step() {
    ++clock_;
    before_ = cache_;
    const auto pick = rng_() % 100;
    if (pick < 8) op_add();
    else if (pick < 10) op_admit();
    else if (pick < 12) op_import();
    else if (pick < 40) op_reserve();
    else if (pick < 52) op_batch();
    else if (pick < 60) op_truncate();
    else if (pick < 67) op_fork();
    else if (pick < 76) op_free();
    else if (pick < 88) op_publish();
    else if (pick < 90) op_reset();
    else op_invalid();
    verify();
  }

  std::int64_t prefix_hits = 0, cows = 0, failures = 0, successes = 0, admits = 0, commits = 0, aborts = 0;

 private:
  // --- helpers ---------------------------------------------------------------
  std::int32_t rand_int(std::int32_t n) { return std::int32_t(rng_() % std::uint64_t(n)); }
  Seq* random_live() { return live_.empty() ? nullptr : &live_[std::size_t(rand_int(std::int32_t(live_.size())))]; }
  std::int32_t tail_ref(const Seq& s) const {
    const auto blocks = *cache_.table().blocks(s.id);
    return blocks.empty() ? 0 : cache_.pool().ref_count(blocks.back());
  }
  // Blocks a reserve of n tokens takes from the pool (copy-on-write included).
  std::int32_t blocks_for_reserve(const Seq& s, std::int32_t n) const {
    const auto t = std::int32_t(s.tokens.size());
    const std::int32_t fresh = (t + n + B - 1) / B - (t + B - 1) / B;
    const bool cow = n > 0 && t % B != 0 && tail_ref(s) > 1;
    return fresh + (cow ? 1 : 0);
  }
  std::int32_t next_token(Seq& s) {
    if (!s.pending.empty()) {
      const std::int32_t t = s.pending.front();
      s.pending.erase(s.pending.begin());
      return t;
    }
    return std::int32_t(rng_() % 1000);
  }
  void expect_failure(const Status& st, Errc want) {
    ++failures;
    INFO(op_ << ": expected " << to_string(want) << ", got " << st.message());
    REQUIRE(st.code() == want);
    REQUIRE(cache_ == before_);
  }
  void expect_ok(const Status& st) {
    ++successes;
    INFO(op_ << ": " << st.message());
    REQUIRE(st.ok());
  }
  void apply_copy(const BlockCopy& c) {
    ++cows;
    std::copy_n(mem_.begin() + std::ptrdiff_t(c.src) * B, B, mem_.begin() + std::ptrdiff_t(c.dst) * B);
    if (mirror_) mirror_->copy(c);
  }
  std::vector<std::int32_t> take(Seq& s, std::int32_t n) {
    std::vector<std::int32_t> t(std::size_t(std::max(n, 0)));
    for (auto& x : t) x = next_token(s);
    return t;
  }
  // The engine's scatter: toks at slots; `ids` when the cache was given them.
  void write(Seq& s, std::span<const std::int32_t> slots, std::span<const std::int32_t> toks, bool ids) {
    if (ids && s.known == s.tokens.size()) s.known += toks.size();
    for (std::size_t k = 0; k < slots.size(); ++k) {
      mem_[std::size_t(slots[k])] = toks[k];
      if (mirror_) mirror_->write(slots[k], toks[k]);
      s.tokens.push_back(toks[k]);
    }
  }
  std::vector<std::int32_t> random_prompt() {
    const auto& t = templates_[std::size_t(rand_int(3))];
    std::vector<std::int32_t> p(t.begin(), t.begin() + rand_int(kMaxTokens) + 1);
    for (std::int32_t k = rand_int(3); k > 0 && !p.empty(); --k) p[std::size_t(rand_int(std::int32_t(p.size())))] = 7;
    return p;
  }

  // --- operations ------------------------------------------------------------
  void op_add() {
    op_ = "add";
    const PrefixKey key{.salt = std::uint64_t(rand_int(2)), .extra = 0};
    const bool full = std::int32_t(live_.size() + imports_.size()) == kSeqs;
    if (rand_int(2) == 0) {
      auto r = cache_.add_sequence(key);
      if (full) return expect_failure(r.status(), Errc::capacity_exceeded);
      expect_ok(r.status());
      live_.push_back(Seq{*r, {}, random_prompt(), key});
      return;
    }
    auto prompt = random_prompt();
    auto r = cache_.add_sequence(prompt, key);
    if (full) return expect_failure(r.status(), Errc::capacity_exceeded);
    expect_ok(r.status());
    const std::int32_t cached = r->cached_tokens;
    REQUIRE(cached % B == 0);
    REQUIRE(cached <= std::int32_t(prompt.size()) - 1);
    prefix_hits += cached > 0;
    Seq s{r->seq, {prompt.begin(), prompt.begin() + cached}, {prompt.begin() + cached, prompt.end()}, key};
    live_.push_back(std::move(s));
  }

  // Atomic admission: hit + reserve of (part of) the rest, all or nothing.
  void op_admit() {
    op_ = "admit";
    auto prompt = random_prompt();
    const PrefixKey key{.salt = std::uint64_t(rand_int(2)), .extra = 0};
    AdmitOptions opt{.key = key};
    if (rand_int(3) == 0) opt.reserve = rand_int(2 * B);
    if (rand_int(3) == 0) opt.max_new = rand_int(3 * B);
    std::vector<BlockId> hit(kPerSeq);
    const std::int32_t m = cache_.match_prefix(prompt, key, hit);
    std::int32_t free_hits = 0;
    for (std::int32_t b = 0; b < m; ++b) free_hits += cache_.pool().ref_count(hit[std::size_t(b)]) == 0 ? 1 : 0;
    const std::int32_t cached = m * B, reserve = std::min(opt.reserve, std::int32_t(prompt.size()) - cached);
    const std::int32_t fresh = (cached + reserve + B - 1) / B - m;
    const std::int64_t life = std::max<std::int64_t>((std::int64_t(prompt.size()) + std::max<std::int64_t>(opt.max_new, 0) + B - 1) / B, m + fresh);
    const std::int64_t available = cache_.free_blocks() - cache_.promised_blocks();
    std::vector<std::int32_t> slots(std::size_t(rand_int(20) == 0 ? std::max(reserve - 1, 0) : reserve));
    REQUIRE(cache_.can_admit(prompt, opt) == cache_.plan_admission(prompt, opt).ok());
    const bool can = cache_.can_admit(prompt, opt);
    const std::int32_t free_before = cache_.free_blocks();
    auto r = cache_.admit(prompt, slots, opt);
    if (std::int32_t(live_.size() + imports_.size()) == kSeqs) return expect_failure(r.status(), Errc::capacity_exceeded);
    if (std::int32_t(slots.size()) < reserve) return expect_failure(r.status(), Errc::buffer_too_small);
    if (fresh > free_before - free_hits) return expect_failure(r.status(), Errc::out_of_blocks);
    if (opt.max_new >= 0 && life - (m - free_hits) > available) return expect_failure(r.status(), Errc::out_of_blocks);
    expect_ok(r.status());
    REQUIRE(can);
    ++admits;
    REQUIRE(r->cached_tokens == cached);
    REQUIRE(r->reserved == reserve);
    REQUIRE(r->promised == (opt.max_new >= 0 ? life : 0));
    prefix_hits += cached > 0;
    Seq s{r->seq, {prompt.begin(), prompt.begin() + cached}, {}, key, std::size_t(cached)};
    const std::vector<std::int32_t> toks(prompt.begin() + cached, prompt.begin() + cached + reserve);
    s.pending.assign(prompt.begin() + cached + reserve, prompt.end());
    write(s, std::span(slots).first(std::size_t(reserve)), toks, true);
    live_.push_back(std::move(s));
  }

  // A peer computed a prompt: import it, or settle an import in flight.
  void op_import() {
    op_ = "import";
    if (!imports_.empty() && rand_int(2) == 0) return settle(std::size_t(rand_int(std::int32_t(imports_.size()))));
    auto prompt = random_prompt();
    const PrefixKey key{.salt = std::uint64_t(rand_int(2)), .extra = 0};
    std::vector<BlockId> hit(kPerSeq);
    const std::int32_t m = cache_.match_prefix(prompt, key, hit);
    std::int32_t free_hits = 0;
    for (std::int32_t b = 0; b < m; ++b) free_hits += cache_.pool().ref_count(hit[std::size_t(b)]) == 0 ? 1 : 0;
    const std::int32_t fresh = (std::int32_t(prompt.size()) + B - 1) / B - m;
    std::vector<BlockId> blocks(std::size_t(rand_int(20) == 0 ? std::max(fresh - 1, 0) : fresh));
    const std::int32_t free_before = cache_.free_blocks();
    auto r = cache_.import(prompt, blocks, {.key = key});
    if (std::int32_t(live_.size() + imports_.size()) == kSeqs) return expect_failure(r.status(), Errc::capacity_exceeded);
    if (fresh > free_before - free_hits) return expect_failure(r.status(), Errc::out_of_blocks);
    if (std::int32_t(blocks.size()) < fresh) return expect_failure(r.status(), Errc::buffer_too_small);
    expect_ok(r.status());
    REQUIRE(r->cached_tokens == m * B);
    REQUIRE(r->num_blocks == fresh);
    imports_.push_back({r->id, std::move(prompt), key, r->cached_tokens, std::move(blocks)});
  }
  // The transfer of import i landed (its bytes are written, then commit) or failed (abort).
  void settle(std::size_t i) {
    Import im = std::move(imports_[i]);
    imports_.erase(imports_.begin() + std::ptrdiff_t(i));
    if (rand_int(3) != 0) {
      for (std::size_t p = std::size_t(im.cached); p < im.prompt.size(); ++p)
      {
        const std::size_t slot = std::size_t(im.blocks[(p - std::size_t(im.cached)) / B]) * B + p % B;
        mem_[slot] = im.prompt[p];
        if (mirror_) mirror_->write(std::int32_t(slot), im.prompt[p]);
      }
      if (rand_int(4) == 0) {  // another prompt of the same length: refused (it would publish this K/V under its hashes)
        auto other = im.prompt;
        other[std::size_t(rand_int(std::int32_t(other.size())))] += 1 + rand_int(5);
        const auto pending = cache_;  // (settle() may run after other changes of this operation)
        const Status st = cache_.commit_import(im.id, other).status();
        INFO(op_ << ": a commit under other tokens: " << st.message());
        REQUIRE(st.code() == Errc::invalid_argument);
        REQUIRE(cache_ == pending);
        ++failures;
      }
      auto r = cache_.commit_import(im.id, im.prompt);
      expect_ok(r.status());
      ++commits;
      live_.push_back(Seq{r->seq, im.prompt, {}, im.key, im.prompt.size()});
      return;
    }
    auto r = cache_.abort_import(im.id);
    expect_ok(r.status());
    ++aborts;
    REQUIRE(r->cached_tokens == im.cached);
    REQUIRE(r->recompute == std::int32_t(im.prompt.size()) - im.cached);
    const auto c = std::size_t(im.cached);
    live_.push_back(Seq{r->seq, {im.prompt.begin(), im.prompt.begin() + std::ptrdiff_t(c)},
                        {im.prompt.begin() + std::ptrdiff_t(c), im.prompt.end()}, im.key, c});
  }

  void op_reserve() {
    op_ = "reserve";
    Seq* s = random_live();
    if (!s) return;
    std::int32_t n = rand_int(10);
    if (rand_int(50) == 0) n = -1 - rand_int(3);
    if (rand_int(50) == 0) n = kMaxTokens;
    std::vector<std::int32_t> slots(std::size_t(std::max(n, 0)));
    const bool short_of_blocks = n >= 0 && blocks_for_reserve(*s, n) > cache_.free_blocks();
    // Publishing on reserve, most reserves give ids; the rest are drafts.
    const bool ids = Auto && n >= 0 && rand_int(5) != 0;
    const Seq saved = *s;
    auto toks = take(*s, n);
    auto r = ids ? cache_.reserve(s->id, toks, slots) : cache_.reserve(s->id, n, slots);
    if (!r) *s = saved;  // the model keeps its pending prompt
    if (n < 0) return expect_failure(r.status(), Errc::invalid_argument);
    if (std::int32_t(s->tokens.size()) + n > kMaxTokens) return expect_failure(r.status(), Errc::capacity_exceeded);
    if (short_of_blocks) return expect_failure(r.status(), Errc::out_of_blocks);
    expect_ok(r.status());
    if (r->copy.src >= 0) apply_copy(r->copy);
    write(*s, slots, toks, ids);
  }

  void op_batch() {
    op_ = "batch";
    if (live_.empty()) return;
    std::vector<std::size_t> idx(live_.size());
    for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = i;
    std::shuffle(idx.begin(), idx.end(), rng_);
    idx.resize(std::size_t(rand_int(std::int32_t(idx.size())) + 1));
    const bool dup = rand_int(20) == 0;
    const bool decode = rand_int(3) == 0;  // every count 1: the decode step's own pass
    if (dup) idx.push_back(idx.front());
    std::vector<SeqId> ids;
    std::vector<std::int32_t> counts;
    std::int32_t total = 0, blocks = 0, copies = 0;
    Errc want = Errc::ok;
    for (std::size_t k = 0; k < idx.size(); ++k) {
      const Seq& s = live_[idx[k]];
      ids.push_back(s.id);
      counts.push_back(decode ? 1 : rand_int(3));
      total += counts.back();
      if (dup && k + 1 == idx.size()) break;  // the duplicate is rejected before it is planned
      const auto t = std::int32_t(s.tokens.size());
      if (want == Errc::ok && t + counts.back() > kMaxTokens) want = Errc::capacity_exceeded;
      blocks += blocks_for_reserve(s, counts.back());
      copies += (counts.back() > 0 && t % B != 0 && tail_ref(s) > 1) ? 1 : 0;
    }
    if (dup && want == Errc::ok) want = Errc::duplicate_sequence;
    const std::int32_t pad = rand_int(3) - (rand_int(30) == 0 ? 3 : 0);
    std::vector<std::int32_t> slots(std::size_t(std::max(total + pad, 0)), 12345);
    std::vector<BlockCopy> cbuf(static_cast<std::size_t>(copies));
    const std::int32_t free_before = cache_.free_blocks();
    // Tokens drawn up front (the ids overload takes them); restored on failure.
    std::vector<Seq> saved(live_);
    std::vector<std::vector<std::int32_t>> toks(idx.size());
    std::vector<std::int32_t> packed;
    for (std::size_t k = 0; k < idx.size(); ++k) {
      toks[k] = take(live_[idx[k]], counts[k]);
      packed.insert(packed.end(), toks[k].begin(), toks[k].end());
    }
    const bool with_ids = Auto && rand_int(4) != 0;
    auto r = with_ids ? cache_.reserve_batch(ids, counts, packed, slots, cbuf) : cache_.reserve_batch(ids, counts, slots, cbuf);
    if (!r) live_ = saved;
    if (want != Errc::ok) return expect_failure(r.status(), want);
    if (std::int32_t(slots.size()) < total) return expect_failure(r.status(), Errc::buffer_too_small);
    if (blocks > free_before) return expect_failure(r.status(), Errc::out_of_blocks);
    expect_ok(r.status());
    REQUIRE(r->slots == total);
    // The engine runs every copy first, then the scatter.
    for (std::int32_t c = 0; c < r->copies; ++c) apply_copy(cbuf[std::size_t(c)]);
    std::size_t at = 0;
    for (std::size_t k = 0; k < idx.size(); ++k) {
      write(live_[idx[k]], std::span(slots).subspan(at, std::size_t(counts[k])), toks[k], with_ids);
      at += std::size_t(counts[k]);
    }
    for (; at < slots.size(); ++at) REQUIRE(slots[at] == -1);
  }

  void op_truncate() {
    op_ = "truncate";
    Seq* s = random_live();
    if (!s) return;
    const auto t = std::int32_t(s->tokens.size());
    const std::int32_t k = rand_int(t + 3);
    auto st = cache_.truncate(s->id, k);
    if (k > t) return expect_failure(st, Errc::truncate_too_many);
    expect_ok(st);
    s->tokens.resize(std::size_t(t - k));
    s->known = std::min(s->known, s->tokens.size());
    s->pending.clear();
  }

  void op_fork() {
    op_ = "fork";
    Seq* s = random_live();
    if (!s) return;
    auto r = cache_.fork(s->id);
    if (std::int32_t(live_.size() + imports_.size()) == kSeqs) return expect_failure(r.status(), Errc::capacity_exceeded);
    expect_ok(r.status());
    Seq child = *s;
    child.id = *r;
    live_.push_back(std::move(child));
  }

  void op_free() {
    op_ = "free";
    if (!holds_.empty() && rand_int(3) == 0) {  // a transfer completed: its hold ends
      const auto i = std::size_t(rand_int(std::int32_t(holds_.size())));
      if (holds_[i].consumers == 0) {
        expect_ok(cache_.release_hold(holds_[i].id));
        holds_.erase(holds_.begin() + std::ptrdiff_t(i));
        return;
      }
      return notify(i);
    }
    if (rand_int(8) == 0) return expire();
    if (live_.empty()) return;
    const auto i = std::size_t(rand_int(std::int32_t(live_.size())));
    if (rand_int(2) == 0) {  // a transfer still reads the blocks: hold them, then free
      const auto blocks = *cache_.table().blocks(live_[i].id);
      const std::int32_t consumers = rand_int(2) == 0 ? 0 : 1 + rand_int(3);  // 0: a plain hold, else a prefill's readers
      const std::int64_t deadline = clock_ + rand_int(200);
      auto h = consumers == 0 ? cache_.hold(blocks) : transfer_.hold(cache_, live_[i].id, consumers, deadline);
      expect_ok(h.status());
      Hold held{*h, {blocks.begin(), blocks.end()}, {}, consumers, 0, deadline};
      for (const BlockId b : blocks) held.content.insert(held.content.end(), mem_.begin() + std::ptrdiff_t(b) * B, mem_.begin() + std::ptrdiff_t(b + 1) * B);
      holds_.push_back(std::move(held));
    }
    expect_ok(cache_.free(live_[i].id));
    dead_.push_back(live_[i].id);
    live_.erase(live_.begin() + std::ptrdiff_t(i));
  }

  // A reader of transfer hold i notifies: a new one (the last releases it), or one that already read (refused).
  void notify(std::size_t i) {
    Hold& h = holds_[i];
    const std::int32_t c = rand_int(h.consumers);
    if (h.read & (1u << c)) return expect_failure(transfer_.consumed(cache_, h.id, c).status(), Errc::invalid_argument);
    const auto r = transfer_.consumed(cache_, h.id, c);
    expect_ok(r.status());
    h.read |= 1u << c;
    const bool last = std::popcount(h.read) == h.consumers;
    REQUIRE(*r == last);
    if (last) holds_.erase(holds_.begin() + std::ptrdiff_t(i));
  }
  // The engine's clock reaches now: transfer holds due by then end.
  void expire(std::int64_t now = -1) {
    now = now < 0 ? clock_ : now;
    std::vector<std::uint64_t> gone(holds_.size());
    const std::int32_t n = transfer_.expire(cache_, now, gone);
    std::vector<std::uint64_t> due;
    for (const Hold& h : holds_)
      if (h.consumers > 0 && h.deadline <= now) due.push_back(h.id);
    REQUIRE(std::vector<std::uint64_t>(gone.begin(), gone.begin() + n) == due);  // ids ascend in both
    std::erase_if(holds_, [&](const Hold& h) { return h.consumers > 0 && h.deadline <= now; });
    REQUIRE(transfer_.size() == std::int32_t(std::count_if(holds_.begin(), holds_.end(), [](const Hold& h) { return h.consumers > 0; })));
  }

  void op_publish() {
    op_ = "publish";
    Seq* s = random_live();
    if (!s) return;
    const auto t = std::int32_t(s->tokens.size());
    const std::int32_t len = rand_int(t + 3);
    std::vector<std::int32_t> tokens(s->tokens.begin(), s->tokens.begin() + std::min(len, t));
    tokens.resize(std::size_t(len), 1);
    auto r = cache_.publish(s->id, tokens);
    if (len > t) return expect_failure(r.status(), Errc::prefix_too_long);
    expect_ok(r.status());
    if (Auto) s->known = std::max(s->known, std::size_t(len));
  }

  void op_reset() {
    op_ = "reset";
    if (rand_int(4) == 0)  // sometimes empty the cache first, so the reset can succeed
      while (!live_.empty() || !imports_.empty()) {
        if (!imports_.empty()) {
          settle(imports_.size() - 1);
          continue;
        }
        expect_ok(cache_.free(live_.back().id));
        dead_.push_back(live_.back().id);
        live_.pop_back();
      }
    if (rand_int(2) == 0) {
      expire(INT64_MAX);  // every reader is done or late
      for (; !holds_.empty(); holds_.pop_back()) expect_ok(cache_.release_hold(holds_.back().id));
    }
    before_ = cache_;
    const bool busy = cache_.pool().num_used() > 0;
    auto st = cache_.reset_prefix_cache();
    if (busy) return expect_failure(st, Errc::blocks_in_use);
    expect_ok(st);
  }

  void op_invalid() {
    op_ = "invalid";
    std::vector<std::int32_t> slots(4);
    if (!dead_.empty() && rand_int(2) == 0) {
      const SeqId d = dead_[std::size_t(rand_int(std::int32_t(dead_.size())))];
      switch (rand_int(5)) {
        case 0: return expect_failure(cache_.reserve(d, 1, slots).status(), Errc::unknown_sequence);
        case 1: return expect_failure(cache_.fork(d).status(), Errc::unknown_sequence);
        case 2: return expect_failure(cache_.truncate(d, 0), Errc::unknown_sequence);
        case 3: return expect_failure(cache_.free(d), Errc::unknown_sequence);
        default: return expect_failure(cache_.publish(d, {}).status(), Errc::unknown_sequence);
      }
    }
    const BlockId bad[] = {BlockPool::null_block, kBlocks};
    switch (rand_int(4)) {
      case 0:
        if (rand_int(2) == 0) return expect_failure(cache_.commit_import(1u << 30, {}).status(), Errc::unknown_job);
        return expect_failure(cache_.release_hold(1u << 30), Errc::unknown_job);
      case 1: return expect_failure(cache_.hold(std::span(bad).subspan(std::size_t(rand_int(2)), 1)).status(), Errc::invalid_argument);
      case 2:
        for (BlockId b = 1; b < kBlocks; ++b)  // a plain free block has nothing to keep
          if (cache_.pool().ref_count(b) == 0 && !cache_.pool().is_cached(b)) {
            const BlockId one[] = {b};
            return expect_failure(cache_.hold(one).status(), Errc::not_allocated);
          }
        [[fallthrough]];
      default: expect_failure(cache_.reserve(SeqId{kSeqs + 3, 0}, 1, slots).status(), Errc::unknown_sequence);
    }
  }

  // --- the checks after every operation ---------------------------------------
  void verify() {
    {
      const Status st = cache_.check_invariants();
      INFO(st.message());
      REQUIRE(st.ok());
    }
    REQUIRE(cache_.table().num_streams() == std::int32_t(live_.size() + imports_.size()));
    REQUIRE(cache_.imports().size() == std::int32_t(imports_.size()));
    for (const Import& im : imports_)  // pending: unpublished, held by the import alone
      for (std::int32_t k = 0; k < (std::int32_t(im.prompt.size()) + B - 1) / B - im.cached / B; ++k) {
        REQUIRE(cache_.pool().ref_count(im.blocks[std::size_t(k)]) == 1);
        REQUIRE_FALSE(cache_.pool().has_hash(im.blocks[std::size_t(k)]));
      }
    REQUIRE(cache_.holds().size() == std::int32_t(holds_.size()));
    for (const Hold& h : holds_)  // a held block is never written: no reserve hands it out
      for (std::size_t k = 0; k < h.blocks.size(); ++k)
        REQUIRE(std::equal(h.content.begin() + std::ptrdiff_t(k) * B, h.content.begin() + std::ptrdiff_t(k + 1) * B,
                           mem_.begin() + std::ptrdiff_t(h.blocks[k]) * B));
    for (const Seq& s : live_) {
      const auto blocks = *cache_.table().blocks(s.id);
      REQUIRE(*cache_.tokens_held(s.id) == std::int64_t(s.tokens.size()));
      REQUIRE(std::int64_t(blocks.size()) <= *cache_.blocks_needed(std::int64_t(s.tokens.size()), 0));
      for (std::size_t p = 0; p < s.tokens.size(); ++p)
        if (mem_[std::size_t(blocks[p / B]) * B + p % B] != s.tokens[p]) {
          FAIL("after " << op_ << ": sequence " << s.id.index << " reads " << mem_[std::size_t(blocks[p / B]) * B + p % B]
                           << " at position " << p << ", model has " << s.tokens[p]);
        }
      if (mirror_)  // the real pool agrees, through its codes and group entries
        for (std::size_t p = 0; p < s.tokens.size(); ++p) {
          const std::int32_t got = mirror_->read(blocks[p / B] * B + std::int32_t(p % B));
          if (got != s.tokens[p])
            FAIL("after " << op_ << ": sequence " << s.id.index << " reads " << got << " from the quantized pool at position "
                          << p << ", model has " << s.tokens[p]);
        }
    }
    // Prefix-closed: no block holds a hash whose parent hash is not cached.
    const PrefixIndex& index = cache_.pool().prefix_index();
    for (BlockId b = 1; b < cache_.pool().capacity(); ++b) {
      if (!index.has(b)) continue;
      if (!index.is_root(b)) REQUIRE(cache_.pool().lookup(index.parent(b)) >= 0);
      REQUIRE(cache_.pool().lookup(index.hash(b)) >= 0);  // every copy is reachable by its hash
    }
    // Reachable: a live sequence's leading hashed blocks are hit by its own
    // tokens; publishing on reserve, so is every full block it gave ids for.
    for (const Seq& s : live_) {
      const auto blocks = *cache_.table().blocks(s.id);
      std::size_t hashed = 0;
      while (hashed < blocks.size() && cache_.pool().has_hash(blocks[hashed])) ++hashed;
      std::size_t want = std::min(hashed, s.tokens.empty() ? 0 : (s.tokens.size() - 1) / B);
      if (Auto) want = std::max(want, std::min(s.known, s.tokens.size() - (s.tokens.empty() ? 0 : 1)) / B);
      std::vector<BlockId> hit(kPerSeq);
      INFO("after " << op_ << ": sequence " << s.id.index << " with " << hashed << " hashed blocks, " << s.known << " ids known");
      REQUIRE(std::size_t(cache_.match_prefix(s.tokens, s.key, hit)) >= want);
    }
    // Events replay to exactly the set of published hashes.
    BlockEvent ev[64];
    for (std::int32_t n; (n = cache_.drain_events(ev)) > 0;)
      for (std::int32_t i = 0; i < n; ++i) {
        const Hash3 h{ev[i].hash.lo, ev[i].hash.hi};
        if (ev[i].kind == EventKind::stored) REQUIRE(published_.insert(h).second);
        else if (ev[i].kind == EventKind::removed) REQUIRE(published_.erase(h) == 1);
        else published_.clear();
      }
    REQUIRE(cache_.pool().events().dropped() == 0);
    REQUIRE(std::int32_t(published_.size()) == cache_.pool().num_published());
    for (const auto& [lo, hi] : published_) REQUIRE(cache_.pool().lookup(BlockHash{lo, hi}) >= 0);
  }

  const char* op_ = "";
  std::mt19937_64 rng_;
  Cache<> cache_;
  Cache<> before_{cache_};
  std::vector<std::int32_t> mem_;
  std::optional<QuantMirror> mirror_;
  std::vector<Seq> live_;
  std::vector<SeqId> dead_;
  struct Hold {
    std::uint64_t id;
    std::vector<BlockId> blocks;
    std::vector<std::int32_t> content;  // what the blocks held when the hold began
    std::int32_t consumers = 0;  // 0: a plain cache hold; else a transfer hold's readers
    std::uint32_t read = 0;  // the readers that have notified
    std::int64_t deadline = 0;
  };
  std::vector<Hold> holds_;
  TransferHolds transfer_;
  std::int64_t clock_ = 0;
  struct Import {
    std::uint64_t id;
    std::vector<std::int32_t> prompt;
    PrefixKey key;
    std::int32_t cached;
    std::vector<BlockId> blocks;  // received, from the first uncached block
  };
  std::vector<Import> imports_;
  std::vector<std::int32_t> templates_[3];
  std::set<Hash3> published_;
};

}  // namespace kvtest
