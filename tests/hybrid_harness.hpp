// A randomized harness for HybridCache, shared by the property test (a seeded
// generator, Catch's REQUIRE) and the fuzzer (its bytes, abort): groups of
// several kinds and block sizes over one small pool, with prompts drawn from
// a few shared stems so prefix hits are common and cached blocks are
// recycled. Every slot a reserve hands out is "written" with the hash of the
// prefix ending at its position; after every operation the invariants hold,
// every hit's blocks hold exactly the prompt's prefix, every live position of
// every sequence reads back its own prefix, and a failed call leaves the
// cache equal to a copy taken before it. A freed sequence's blocks are
// sometimes held (a transfer still copying them): until the hold is released
// no reserve hands out a slot in them. Imports (a peer's prefill) are
// committed or aborted later; their blocks are "written" only at commit,
// so a pending block that any lookup or row exposed would read back wrong.
// pick(n) gives a value in [0, n); need(ok, what) fails the run when ok is false.
#pragma once

#include <kvcache/cache/hybrid.hpp>

#include <algorithm>
#include <cstdint>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kvtest {

template <class Pick, class Need>
class HybridHarness {
 public:
  HybridHarness(Pick pick, Need need, const kvcache::HybridConfig& cfg)
      : pick_(pick), need_(need), cache_(cfg), max_(cfg.max_tokens), chunk_(cfg.prefill_chunk) {
    for (auto& stem : stems_) {
      stem.resize(std::size_t(max_));
      for (auto& t : stem) t = pick_(1000);
    }
  }
  // Four groups: full (4 tokens a page), a window of 6 (2), a chunk of 8 (2), cross-attention (4).
  static kvcache::HybridConfig default_config() {
    using kvcache::AttentionKind;
    static const std::vector<std::int32_t> l0{0}, l1{1, 2}, l2{3}, l3{4};
    static const kvcache::LayerGroupSpec g[] = {
        {.kind = AttentionKind::full, .layers = l0, .num_kv_heads = 1, .head_dim = 8},
        {.kind = AttentionKind::sliding_window, .layers = l1, .num_kv_heads = 1, .head_dim = 8, .window = 6},
        {.kind = AttentionKind::chunked_local, .layers = l2, .num_kv_heads = 1, .head_dim = 16, .chunk = 8},
        {.kind = AttentionKind::cross, .layers = l3, .num_kv_heads = 1, .head_dim = 8, .encoder_len = 5}};
    return {.groups = *kvcache::LayerGroups::make({.groups = g, .block_size = 2}), .num_blocks = 48, .max_sequences = 5,
            .max_tokens = 48};
  }
  // Groups of one rule side by side, as a Gemma-shaped model's window layers
  // split over groups: two full groups and two windows of one shape each.
  // The cache keeps their token ids once per rule (HybridPrefix::keeper), so
  // every hit and publish here reads a twin's ids.
  static kvcache::HybridConfig twin_config() {
    using kvcache::AttentionKind;
    static const std::vector<std::int32_t> l0{0}, l1{1}, l2{2}, l3{3};
    static const kvcache::LayerGroupSpec g[] = {
        {.kind = AttentionKind::sliding_window, .layers = l0, .num_kv_heads = 1, .head_dim = 8, .window = 6},
        {.kind = AttentionKind::full, .layers = l1, .num_kv_heads = 1, .head_dim = 8},
        {.kind = AttentionKind::sliding_window, .layers = l2, .num_kv_heads = 1, .head_dim = 8, .window = 6},
        {.kind = AttentionKind::full, .layers = l3, .num_kv_heads = 1, .head_dim = 8}};
    return {.groups = *kvcache::LayerGroups::make({.groups = g, .block_size = 2}), .num_blocks = 48, .max_sequences = 5,
            .max_tokens = 48};
  }
  // The same four kinds, quantized: int8 in 16-groups (full), fp8 with
  // engine-held per-head scales (window), int4 in 16-groups with a minimum
  // (chunk), f16 (cross). Each group's entries change its tokens a page.
  static kvcache::HybridConfig quantized_config() {
    using kvcache::AttentionKind;
    using kvcache::DType;
    using kvcache::Scales;
    static const std::vector<std::int32_t> l0{0}, l1{1, 2}, l2{3}, l3{4};
    constexpr kvcache::SideFormat g16{.scales = Scales::group, .group = 16}, head{.scales = Scales::head},
        g16_min{.scales = Scales::group, .group = 16, .minimum = true};
    static const kvcache::LayerGroupSpec g[] = {
        {.kind = AttentionKind::full, .layers = l0, .num_kv_heads = 2, .head_dim = 16, .dtype = DType::int8,
         .format = {g16, g16}},
        {.kind = AttentionKind::sliding_window, .layers = l1, .num_kv_heads = 1, .head_dim = 16, .window = 6,
         .dtype = DType::fp8_e4m3, .format = {head, head}},
        {.kind = AttentionKind::chunked_local, .layers = l2, .num_kv_heads = 1, .head_dim = 32, .chunk = 8,
         .dtype = DType::int4, .format = {g16_min, g16}},
        {.kind = AttentionKind::cross, .layers = l3, .num_kv_heads = 1, .head_dim = 8, .encoder_len = 5}};
    return {.groups = *kvcache::LayerGroups::make({.groups = g, .block_size = 2, .max_padding_permille = 999}),
            .num_blocks = 48, .max_sequences = 5, .max_tokens = 48, .prefill_chunk = 12};
  }
  std::int64_t ops = 0, failures = 0, hits = 0, hit_tokens = 0, admits = 0, imports = 0, commits = 0, aborts = 0;

  void step() {
    ++ops;
    const auto before = cache_;
    bool failed = false;
    switch (pick(11)) {
      case 0: case 1: failed = admit(); break;
      case 2: case 3: case 4: failed = reserve(); break;
      case 5: case 6: compute(); break;
      case 7: failed = truncate(); break;
      case 8: pick(3) == 0 ? release_one() : free_one(); break;
      case 9: failed = pending_.empty() || pick(2) == 0 ? import() : (settle(), false); break;
      default: failed = pick(2) == 0 ? promise() : bad_call(); break;
    }
    if (failed) {
      ++failures;
      need(cache_ == before, "a failed call changed the cache");
    }
    need(cache_.check_invariants().ok(), "check_invariants");
    for (auto& [index, s] : seqs_) read_back(s);
  }

 private:
  struct Seq {
    kvcache::SeqId id;
    std::vector<std::int32_t> tokens;  // every token the sequence has (reserved) or will have (the prompt's rest)
    std::vector<std::uint64_t> prefix;  // [p]: hash of tokens 0 .. p
    std::int64_t reserved = 0, computed = 0;
    std::int64_t ahead = 0;  // the most tokens it may hold reserved and not computed (the chunk, or its prompt's length)
  };
  std::int32_t pick(std::int32_t n) { return pick_(n); }
  void need(bool ok, const char* what) { need_(ok, what); }
  static std::uint64_t extend(std::uint64_t h, std::int32_t t) { return (h ^ std::uint64_t(t + 1)) * 0x100000001b3ULL + 7; }
  void append(Seq& s, std::int32_t t) {
    s.prefix.push_back(extend(s.prefix.empty() ? 0xcbf29ce484222325ULL : s.prefix.back(), t));
  }
  // Model the forward pass's write: each group's slot of each new position holds its prefix.
  void write(const Seq& s, std::int64_t from, std::int32_t n, const std::vector<std::int32_t>& slots, std::int32_t stride) {
    for (std::int32_t g = 0; g < cache_.groups(); ++g)
      for (std::int32_t t = 0; t < n; ++t) {
        const std::int32_t slot = slots[std::size_t(g * stride + t)];
        if (cache_.layer_groups().spec(g).kind == kvcache::AttentionKind::cross) need(slot == -1, "a cross group's decoder slot");
        else {
          const std::int32_t page = slot / kvcache::GroupRule::of(cache_.layer_groups(), g).block_size;
          need(!held_.contains(page), "a reserve handed out a slot in a held block");
          content_[key(g, slot)] = s.prefix[std::size_t(from + t)];
        }
      }
  }
  static std::int64_t key(std::int32_t g, std::int32_t slot) { return std::int64_t(g) << 32 | std::uint32_t(slot); }
  // What a group's slot holds: the prefix hash written there, or 0 when none was.
  std::uint64_t content(std::int32_t g, std::int32_t slot) const {
    const auto it = content_.find(key(g, slot));
    return it == content_.end() ? 0 : it->second;
  }
  void read_back(const Seq& s) {
    for (std::int32_t g = 0; g < cache_.groups(); ++g) {
      const auto rule = kvcache::GroupRule::of(cache_.layer_groups(), g);
      if (!rule.caches()) continue;
      const std::int64_t from = s.reserved - *cache_.tokens_held(s.id, g);
      need(from <= rule.first_read(s.computed), "a block a query still reads was freed");
      std::vector<std::int32_t> slots(std::size_t(s.reserved - from));
      need(cache_.slot_mapping(g, s.id, from, s.reserved, slots).ok(), "slot_mapping of live positions");
      for (std::int64_t p = from; p < s.reserved; ++p)
        need(content(g, slots[std::size_t(p - from)]) == s.prefix[std::size_t(p)], "a live position reads another prefix");
    }
  }
  // What a scheduler is told (each group's lifetime bound for this length, with
  // the tokens now reserved past those computed in flight) bounds what the rows hold.
  void within_bound(const Seq& s) {
    std::int64_t sum = 0;
    for (std::int32_t g = 0; g < cache_.groups(); ++g) {
      const auto rule = kvcache::GroupRule::of(cache_.layer_groups(), g);
      const std::int64_t held = *cache_.blocks_held(s.id, g);
      need(held <= rule.max_blocks(s.reserved, s.reserved - s.computed), "a group holds more than its bound");
      need(held <= rule.max_blocks(max_, s.ahead), "a group holds more than admission assumed");
      sum += held;
    }
    need(sum == *cache_.blocks_held(s.id), "blocks_held is not the groups' sum");
  }
  // A prompt from the stems, its tail sometimes changed.
  Seq draw() {
    Seq s{};
    const auto& stem = stems_[std::size_t(pick(3))];
    const std::int32_t len = 1 + pick(max_ - max_ / 6);
    s.tokens.assign(stem.begin(), stem.begin() + len);
    for (std::int32_t i = pick(3) == 0 ? pick(len) : len; i < len; ++i) s.tokens[std::size_t(i)] = pick(1000);
    for (const auto t : s.tokens) append(s, t);
    return s;
  }
  Seq* any() {
    if (seqs_.empty()) return nullptr;
    auto it = seqs_.begin();
    std::advance(it, pick(std::int32_t(seqs_.size())));
    return &it->second;
  }

  bool admit() {
    Seq s = draw();
    const auto len = std::int32_t(s.tokens.size());
    // The default reserve (at most a chunk), or an explicit one: past the chunk now and then.
    const std::int32_t budget = pick(4) == 0 ? INT32_MAX : 1 + pick(chunk_ > 0 && pick(4) != 0 ? chunk_ : len);
    const std::int32_t stride = std::min(budget, len);
    std::vector<std::int32_t> slots(std::size_t(cache_.groups() * stride));
    auto r = cache_.admit(s.tokens, slots, {.reserve = budget});
    if (!r) {
      const bool past_chunk = chunk_ > 0 && budget != INT32_MAX && budget > chunk_;
      need(r.status().code() == kvcache::Errc::out_of_blocks || r.status().code() == kvcache::Errc::capacity_exceeded ||
               (past_chunk && r.status().code() == kvcache::Errc::invalid_argument),
           "admit failed otherwise");
      return true;
    }
    need(r->reserved <= (chunk_ > 0 ? chunk_ : len), "admit reserved past the chunk");
    s.ahead = chunk_ > 0 ? chunk_ : len;
    s.id = r->seq;
    ++admits;
    hits += r->cached_tokens > 0;
    hit_tokens += r->cached_tokens;
    // The hit's blocks hold this prompt's prefix, in every group, for every position a query still reads.
    for (std::int32_t g = 0; g < cache_.groups() && r->cached_tokens > 0; ++g) {
      const auto rule = kvcache::GroupRule::of(cache_.layer_groups(), g);
      if (!rule.caches()) continue;
      const std::int64_t from = rule.first_read(r->cached_tokens);
      std::vector<std::int32_t> hit_slots(std::size_t(r->cached_tokens - from));
      need(cache_.slot_mapping(g, s.id, from, r->cached_tokens, hit_slots).ok(), "slot_mapping of a hit");
      for (std::int64_t p = from; p < r->cached_tokens; ++p)
        need(content(g, hit_slots[std::size_t(p - from)]) == s.prefix[std::size_t(p)], "a hit serves another prefix");
    }
    s.reserved = r->cached_tokens + r->reserved;
    s.computed = r->cached_tokens;
    write(s, r->cached_tokens, r->reserved, slots, stride);
    within_bound(s);
    seqs_[s.id.index] = s;
    return false;
  }
  bool reserve() {
    Seq* s = any();
    if (!s) return false;
    const bool advance = pick(3) == 0;  // the one-call decode step: every reserved token computed first
    std::int32_t n = pick(6);
    // Mostly within what the sequence may hold ahead of its computed tokens (sometimes past it).
    const std::int64_t room = s->ahead - (advance ? 0 : s->reserved - s->computed);
    if (n > room && pick(4) != 0) n = std::int32_t(std::max<std::int64_t>(room, 0));
    if (s->reserved + n > max_) n = std::int32_t(max_ - s->reserved) + (pick(4) == 0);  // sometimes one too many
    const bool too_long = s->reserved + n > max_;
    const bool past_chunk = s->reserved + n - (advance ? s->reserved : s->computed) > s->ahead;
    std::vector<std::int32_t> toks;
    for (std::int32_t i = 0; i < n; ++i) {
      const auto p = std::size_t(s->reserved + i);
      toks.push_back(p < s->tokens.size() ? s->tokens[p] : pick(1000));
    }
    std::vector<std::int32_t> slots(std::size_t(cache_.groups() * n));
    kvcache::Result<kvcache::ReserveInfo> r = kvcache::ReserveInfo{};
    if (pick(4) == 0) {  // as a batch of one, padded by a slot a group: the same checks, the same slots, -1 past them
      const kvcache::SeqId one[] = {s->id};
      const std::int32_t count[] = {n};
      std::vector<std::int32_t> padded(std::size_t(cache_.groups() * (n + 1)), 5);
      auto b = advance ? cache_.advance_batch(one, count, toks, padded) : cache_.reserve_batch(one, count, toks, padded);
      if (!b) {
        need(std::all_of(padded.begin(), padded.end(), [](std::int32_t x) { return x == -1; }), "a refused batch leaves every slot -1");
        r = b.status();
      } else {
        need(b->slots == n && b->copies == 0, "a batch's counts");
        for (std::int32_t g = 0; g < cache_.groups(); ++g) {
          std::copy_n(padded.begin() + g * (n + 1), n, slots.begin() + g * n);
          need(padded[std::size_t(g * (n + 1) + n)] == -1, "a batch's padding");
        }
      }
    } else {
      r = advance ? cache_.advance(s->id, toks, slots) : cache_.reserve(s->id, toks, slots);
    }
    if (!r) {
      need(r.status().code() == (too_long     ? kvcache::Errc::capacity_exceeded  // Cache<>'s words, checked first
                                 : past_chunk ? kvcache::Errc::invalid_argument
                                              : kvcache::Errc::out_of_blocks),
           "reserve failed otherwise");
      need(std::string_view(r.status().what()).starts_with(too_long || past_chunk ? "n_tokens" : "n_blocks"),
           "reserve's refusal names the count");
      return true;
    }
    need(!too_long, "a reserve past max_tokens succeeded");
    need(!past_chunk, "a reserve past the chunk succeeded");
    if (advance) s->computed = s->reserved;
    need(*cache_.computed_tokens(s->id) == s->computed, "computed tokens after a reserve");
    s->tokens.resize(std::size_t(s->reserved));
    s->prefix.resize(std::size_t(s->reserved));
    for (const auto t : toks) s->tokens.push_back(t), append(*s, t);
    write(*s, s->reserved, n, slots, n);
    s->reserved += n;
    within_bound(*s);
    return false;
  }
  void compute() {
    Seq* s = any();
    if (!s) return;
    s->computed += pick(std::int32_t(s->reserved - s->computed) + 1);
    need(cache_.computed(s->id, s->computed).ok(), "computed");
  }
  bool truncate() {
    Seq* s = any();
    if (!s) return false;
    const auto n = std::int32_t(pick(std::int32_t(s->reserved - s->computed) + 2));
    if (!cache_.truncate(s->id, n).ok()) {
      need(n > s->reserved - s->computed, "truncate of uncomputed tokens refused");
      return true;
    }
    s->reserved -= n;
    s->tokens.resize(std::size_t(s->reserved));
    s->prefix.resize(std::size_t(s->reserved));
    return false;
  }
  void free_one() {
    Seq* s = any();
    if (!s) return;
    if (pick(2) == 0) {  // a transfer still reads its blocks: hold them, then free
      std::vector<kvcache::BlockId> blocks;
      const kvcache::SeqId one[] = {s->id};
      for (std::int32_t g = 0; g < cache_.groups(); ++g) {
        // A row may hold more entries than max_tokens (a group of small blocks, a window's edge): the rule's bound.
        const auto stride = std::int32_t(kvcache::GroupRule::of(cache_.layer_groups(), g).row_blocks(max_));
        std::vector<std::int32_t> row(static_cast<std::size_t>(stride));
        need(cache_.export_block_table(g, one, row, stride).ok(), "export of a live row");
        for (const std::int32_t b : row)
          if (b != kvcache::BlockPool::null_block) blocks.push_back(b);
      }
      auto h = cache_.hold(blocks);
      need(h.ok(), "hold of a live sequence's blocks");
      for (const auto b : blocks) ++held_[b];
      holds_.push_back(*h);
    }
    need(cache_.free(s->id).ok(), "free");
    seqs_.erase(s->id.index);
  }
  // The ledger (core/promise_ledger.hpp): a negative promise, or one past
  // what one sequence's rows can hold (every group's row at max_tokens), is
  // refused naming blocks and changes nothing; one within counts in
  // promised_blocks() what the sequence does not hold yet.
  bool promise() {
    Seq* s = any();
    if (!s) return false;
    std::int64_t most = 0;
    for (std::int32_t g = 0; g < cache_.groups(); ++g) most += kvcache::GroupRule::of(cache_.layer_groups(), g).row_blocks(max_);
    const std::int64_t held = *cache_.blocks_held(s->id);
    std::int64_t v = std::min<std::int64_t>(most, held + pick(4));
    switch (pick(5)) {
      case 0: v = -1 - pick(3); break;
      case 1: v = most + 1 + pick(3); break;
      case 2: v = most; break;
      default: break;
    }
    if (v < 0 || v > most) {
      need(cache_.promise(s->id, v) == kvcache::Status{kvcache::Errc::invalid_argument, "blocks", v, v < 0 ? 0 : most},
           "a promise out of range is refused naming blocks");
      return true;
    }
    need(cache_.promise(s->id, 0).ok(), "a promise withdrawn");
    const std::int64_t without = cache_.promised_blocks();
    need(cache_.promise(s->id, v).ok(), "a promise within range");
    need(cache_.promised_blocks() - without == std::max<std::int64_t>(0, v - held), "promised_blocks counts what is not held yet");
    if (v > held + 3) need(cache_.promise(s->id, 0).ok(), "a large promise withdrawn");  // the imports still find room
    return false;
  }
  // A peer's prefill arrives: the import's blocks stay pending (unwritten) until settle().
  bool import() {
    Pending p{0, draw(), 0};
    const auto len = std::int32_t(p.s.tokens.size());
    auto r = cache_.import(p.s.tokens, {.max_new = pick(2) == 0 ? -1 : pick(max_ - len + 1)});
    if (!r) {
      need(r.status().code() == kvcache::Errc::out_of_blocks || r.status().code() == kvcache::Errc::capacity_exceeded,
           "import failed otherwise");
      return true;
    }
    ++imports;
    p.id = r->id;
    p.cached = r->cached_tokens;
    // Each group's blocks, and the names a tier load would find them by: the
    // prompt's chain in the group, from the first block received (none
    // without prefix caching).
    std::int32_t blocks = 0;
    std::vector<kvcache::BlockHash> names(static_cast<std::size_t>(len)), chain(static_cast<std::size_t>(len));
    for (std::int32_t g = 0; g < cache_.groups(); ++g) {
      const auto gb = cache_.import_blocks(p.id, g);
      need(gb.ok(), "import_blocks");
      for (const auto b : gb->local) need(b != kvcache::BlockPool::null_block && !held_.contains(b), "an import block null or held");
      blocks += std::int32_t(gb->local.size());
      const auto n = cache_.import_keys(p.id, g, names);
      if (!cache_.config().prefix_caching) {
        need(n.status().code() == kvcache::Errc::invalid_argument, "import_keys without prefix caching");
        continue;
      }
      need(n.ok(), "import_keys");
      if (*n == 0) continue;
      const auto all = cache_.hash_chain(g, p.s.tokens, {}, chain);
      need(all.ok() && *all == gb->skip + *n && std::equal(names.begin(), names.begin() + *n, chain.begin() + gb->skip),
           "import_keys names the prompt's blocks");
    }
    need(blocks == r->num_blocks, "import_blocks lists num_blocks");
    pending_.push_back(std::move(p));
    return false;
  }
  // A pending import's transfer lands (its blocks written, then commit) or fails (abort).
  void settle() {
    const auto at = pending_.begin() + pick(std::int32_t(pending_.size()));
    Pending p = std::move(*at);
    pending_.erase(at);
    const auto len = std::int64_t(p.s.tokens.size());
    if (pick(3) == 0) {
      auto a = cache_.abort_import(p.id);
      need(a.ok() && a->cached_tokens == p.cached && a->recompute == len - p.cached, "abort_import");
      p.s.id = a->seq;
      p.s.reserved = p.s.computed = p.cached;
      ++aborts;
    } else {
      for (std::int32_t g = 0; g < cache_.groups(); ++g) {
        const auto rule = kvcache::GroupRule::of(cache_.layer_groups(), g);
        const auto gb = cache_.import_blocks(p.id, g);
        need(gb.ok(), "import_blocks");
        for (std::size_t i = 0; i < gb->local.size() && rule.caches(); ++i)
          for (std::int32_t o = 0; o < rule.block_size; ++o)
            if (const std::int64_t pos = (gb->skip + std::int64_t(i)) * rule.block_size + o; pos < len)
              content_[key(g, gb->local[i] * rule.block_size + o)] = p.s.prefix[std::size_t(pos)];
      }
      if (pick(4) == 0) {  // another prompt of the same length: refused, nothing changes
        auto other = p.s.tokens;
        other.back() += 1;
        const auto wrong = cache_.commit_import(p.id, other);
        need(wrong.status().code() == kvcache::Errc::invalid_argument &&
             std::string_view(wrong.status().what()) == "prompt (not the tokens imported)" && cache_.imports().find(p.id).ok(),
             "commit_import of another prompt");
      }
      auto c = cache_.commit_import(p.id, p.s.tokens);
      need(c.ok(), "commit_import");
      p.s.id = c->seq;
      p.s.reserved = p.s.computed = len;
      ++commits;
    }
    need(*cache_.tokens(p.s.id) == p.s.reserved && *cache_.computed_tokens(p.s.id) == p.s.computed, "a settled import's tokens");
    p.s.ahead = chunk_ > 0 ? chunk_ : len;
    within_bound(p.s);
    seqs_[p.s.id.index] = std::move(p.s);
  }
  void release_one() {
    if (holds_.empty()) return;
    const auto at = holds_.begin() + pick(std::int32_t(holds_.size()));
    for (const auto b : cache_.holds().blocks_of(*at))
      if (--held_[b] == 0) held_.erase(b);
    need(cache_.release_hold(*at).ok(), "release_hold");
    holds_.erase(at);
  }
  bool bad_call() {
    Seq* s = any();
    const kvcache::SeqId stale = s ? kvcache::SeqId{s->id.index, s->id.generation + 1} : kvcache::SeqId{0, 99};
    std::vector<std::int32_t> out(8);
    const kvcache::SeqId one[] = {stale};
    const std::uint64_t gone = 1000000;  // never given
    const kvcache::BlockId bad_blocks[] = {0, cache_.pool().capacity()};
    switch (pick(6)) {
      case 5: need(cache_.commit_import(gone, std::span<const std::int32_t>{}).status().code() == kvcache::Errc::unknown_job &&
                   cache_.abort_import(gone).status().code() == kvcache::Errc::unknown_job, "settling an unknown import"); break;
      case 3: need(cache_.release_hold(gone).code() == kvcache::Errc::unknown_job, "release of an unknown hold"); break;
      case 4: need(cache_.hold(std::span(bad_blocks).subspan(std::size_t(pick(2)), 1)).status().code() == kvcache::Errc::invalid_argument, "hold of an invalid block"); break;
      case 0: need(cache_.free(stale).code() == kvcache::Errc::unknown_sequence, "free of a stale handle"); break;
      case 1: need(cache_.export_block_table(0, one, out, 8).code() == kvcache::Errc::unknown_sequence, "export of a stale handle"); break;
      default:
        need(cache_.reserve(stale, std::span(out).first(1), out).status().code() == kvcache::Errc::unknown_sequence,
             "reserve of a stale handle");
    }
    return true;
  }

  Pick pick_;
  Need need_;
  kvcache::HybridCache<> cache_;
  std::int32_t max_, chunk_;
  std::vector<std::int32_t> stems_[3];
  std::unordered_map<std::uint32_t, Seq> seqs_;
  std::unordered_map<std::int64_t, std::uint64_t> content_;  // (group, slot) -> prefix hash written there
  std::vector<std::uint64_t> holds_;  // holds not yet released
  std::unordered_map<kvcache::BlockId, std::int32_t> held_;  // block -> holds on it
  struct Pending {
    std::uint64_t id;
    Seq s;  // its id unknown until settled
    std::int64_t cached;
  };
  std::vector<Pending> pending_;  // imports in flight
};

}  // namespace kvtest
