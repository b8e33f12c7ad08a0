// The README's prefix-cache snippets, each run in a fixture that supplies the
// engine's names, then checked against what the snippet promises.
#include <catch2/catch.hpp>

#include <kvcache/kvcache.hpp>

#include <cstdint>
#include <span>
#include <vector>

namespace kv = kvcache;

namespace {

kv::CacheConfig small(bool on_reserve = false, int32_t blocks = 64) {
  return {.geometry = kv::Geometry::make({.num_layers = 1, .num_kv_heads = 1, .head_dim = 8, .block_size = 16}).value(),
          .num_blocks = blocks, .max_sequences = 8, .max_blocks_per_sequence = 48, .event_capacity = 64,
          .publish_on_reserve = on_reserve};
}

std::vector<int32_t> text(std::size_t n, int32_t from) {
  std::vector<int32_t> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = from + int32_t(i);
  return t;
}

struct Admit {
  kv::Cache<> cache{small()};
  std::vector<int32_t> prompt = text(40, 1), slots = std::vector<int32_t>(64);
  std::uint64_t tenant_id = 7;
  std::int64_t max_new = 100;
  int32_t prefilled_from = -1, prefilled = -1;
  void prefill(kv::SeqId, int32_t first, int32_t n) {
    prefilled_from = first;
    prefilled = n;
  }
  Admit() {  // an earlier request of the tenant published the prompt's first 32 tokens
    auto a = cache.admit(std::span(prompt).first(33), slots, {.key = {.salt = tenant_id}}).value();
    REQUIRE(cache.publish(a.seq, std::span(prompt).first(32)).value() == 2);
  }
};

struct PublishOnReserve {
  kv::Cache<> cache{small(true)};
  std::vector<kv::SeqId> seqs;
  std::vector<int32_t> counts, input_ids, slots = std::vector<int32_t>(64);
  std::vector<kv::BlockCopy> copies = std::vector<kv::BlockCopy>(4);
  PublishOnReserve() {
    for (int32_t k = 0; k < 3; ++k) {  // prompts of 15 tokens: the next token fills their first block
      seqs.push_back(cache.admit(text(15, 100 * k), slots).value().seq);
      counts.push_back(1);
      input_ids.push_back(100 * k + 15);
    }
  }
};

struct Multimodal {
  kv::Cache<> cache{small(false, 128)};
  std::vector<int32_t> prompt = text(600, 1), slots = std::vector<int32_t>(600);
  std::uint64_t tenant_id = 3, image_hash = 0xfeed;
};

struct Router {
  std::vector<std::vector<int32_t>> blocks;
  void stored(const kv::BlockEvent& e, std::span<const int32_t> ids) {
    REQUIRE(e.num_tokens == int32_t(ids.size()));
    blocks.emplace_back(ids.begin(), ids.end());
  }
};

struct RouterEvents {
  kv::Cache<> cache{small()};
  Router router;
  std::vector<int32_t> prompt = text(33, 50), slots = std::vector<int32_t>(33);
  RouterEvents() {
    auto a = cache.admit(prompt, slots).value();
    REQUIRE(cache.publish(a.seq, prompt).value() == 2);
  }
};

}  // namespace

TEST_CASE_METHOD(Admit, "README admit: the hit and the rest of the prompt in one call with a promise") {
#include "snippets/admit.inc"
  REQUIRE(prefilled_from == 32);  // two cached blocks
  REQUIRE(prefilled == 8);
  REQUIRE(cache.promised_blocks() == (40 + 100 + 15) / 16 - 3);  // ceil(140 / 16) = 9 promised, 3 held
  REQUIRE(cache.prefix_stats().hit_tokens == 32);
  REQUIRE(cache.check_invariants().ok());
}

TEST_CASE_METHOD(PublishOnReserve, "README publish on reserve: a decode step publishes the blocks it fills") {
  REQUIRE(cache.pool().num_published() == 0);
#include "snippets/publish_on_reserve.inc"
  REQUIRE(r.ok());
  REQUIRE(cache.pool().num_published() == 3);  // each sequence's first block, full now
  std::vector<kv::BlockId> hit(2);
  auto next = text(17, 100);
  REQUIRE(cache.match_prefix(next, {}, hit) == 1);
}

TEST_CASE_METHOD(Multimodal, "README multimodal: the text before the image is shared") {
  const kv::ExtraKey other[] = {{.begin = 32, .end = 608, .key = 1}};  // the same text around another image
  auto first = cache.admit(prompt, slots, {.key = {.salt = tenant_id}, .extras = other}).value();
  REQUIRE(cache.publish(first.seq, prompt, other).ok());
#include "snippets/multimodal.inc"
  REQUIRE(a.ok());
  REQUIRE(a->cached_tokens == 32);  // the 32 tokens of text before the image
  REQUIRE(cache.publish(a->seq, prompt, image).ok());
  std::vector<kv::BlockId> hit(40);
  REQUIRE(*cache.match_prefix(prompt, {.salt = tenant_id}, hit, image) == 37);  // (600 - 1) / 16
  REQUIRE(*cache.match_prefix(prompt, {.salt = tenant_id + 1}, hit, image) == 0);  // another tenant
}

TEST_CASE_METHOD(RouterEvents, "README router events: stored blocks with their token ids, and the counters") {
#include "snippets/router_events.inc"
  REQUIRE(n.value() == 2);
  REQUIRE(router.blocks.size() == 2);
  REQUIRE(router.blocks[1] == std::vector<int32_t>(prompt.begin() + 16, prompt.begin() + 32));
  REQUIRE(st.queries == 1);
  REQUIRE(st.query_tokens == 33);
  REQUIRE(st.hashes == 2);
}

