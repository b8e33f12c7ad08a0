// The wire formats: the msgpack writer against the specification's byte
// forms (msgpack.org/spec), the reader on what the writer wrote and on every
// malformed input, vLLM's KV-event batches (field order, run merging, hashes
// as 64-bit integers), the three-frame sequence numbers and the replay
// buffer. python/tests/test_scale_out.py decodes the same bytes with msgpack.
#include <catch2/catch.hpp>

#include <kvcache/cache.hpp>
#include <kvcache/wire/kv_events_wire.hpp>

#include <random>
#include <string>
#include <vector>

#include "device_cache_testing.hpp"

using namespace kvcache;
using Bytes = std::vector<std::uint8_t>;

namespace {

template <class F>
Bytes write(F&& f) {
  Bytes out;
  MsgpackWriter w(out);
  f(w);
  return out;
}

}  // namespace

TEST_CASE("msgpack: the writer picks the specification's shortest forms") {
  CHECK(write([](auto& w) { w.nil(); }) == Bytes{0xc0});
  CHECK(write([](auto& w) { w.boolean(true); }) == Bytes{0xc3});
  CHECK(write([](auto& w) { w.uint(127); }) == Bytes{0x7f});
  CHECK(write([](auto& w) { w.uint(128); }) == Bytes{0xcc, 0x80});
  CHECK(write([](auto& w) { w.uint(256); }) == Bytes{0xcd, 0x01, 0x00});
  CHECK(write([](auto& w) { w.uint(65536); }) == Bytes{0xce, 0x00, 0x01, 0x00, 0x00});
  CHECK(write([](auto& w) { w.uint(1ull << 32); }) == Bytes{0xcf, 0, 0, 0, 1, 0, 0, 0, 0});
  CHECK(write([](auto& w) { w.sint(-1); }) == Bytes{0xff});
  CHECK(write([](auto& w) { w.sint(-32); }) == Bytes{0xe0});
  CHECK(write([](auto& w) { w.sint(-33); }) == Bytes{0xd0, 0xdf});
  CHECK(write([](auto& w) { w.sint(-129); }) == Bytes{0xd1, 0xff, 0x7f});
  CHECK(write([](auto& w) { w.sint(INT64_MIN); }) == Bytes{0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0});
  CHECK(write([](auto& w) { w.float64(1.0); }) == Bytes{0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0});
  CHECK(write([](auto& w) { w.str("GPU"); }) == Bytes{0xa3, 'G', 'P', 'U'});
  CHECK(write([](auto& w) { w.str(std::string(40, 'x')); }).size() == 42);  // str 8
  CHECK(write([](auto& w) { w.array(3); }) == Bytes{0x93});
  CHECK(write([](auto& w) { w.array(16); }) == Bytes{0xdc, 0x00, 0x10});
  const Bytes b{1, 2};
  CHECK(write([&](auto& w) { w.bin(b); }) == Bytes{0xc4, 2, 1, 2});
}

TEST_CASE("msgpack: the reader reads what the writer wrote, and refuses the rest in place") {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 500; ++trial) {
    const auto u = rng() >> (rng() % 64);
    const auto s = std::int64_t(rng()) >> (rng() % 64);
    const Bytes bytes = write([&](auto& w) { w.array(4), w.uint(u), w.sint(s), w.str(std::string(rng() % 300, 'a')), w.nil(); });
    MsgpackReader r(bytes);
    CHECK(*r.array("a") == 4);
    CHECK(*r.uint("u") == u);
    CHECK(*r.sint("s") == s);
    CHECK(r.str("str").ok());
    CHECK(r.nil());
    CHECK(r.done());
  }
  const Bytes neg = write([](auto& w) { w.sint(-5); });
  MsgpackReader r(neg);
  const auto st = r.uint("count").status();
  CHECK(st.code() == Errc::invalid_argument);
  CHECK(std::string(st.what()) == "count");
  CHECK(r.offset() == 0);  // nothing consumed
  CHECK(*r.sint("count") == -5);
  const Bytes big = write([](auto& w) { w.uint(UINT64_MAX); });
  MsgpackReader rb(big);
  CHECK_FALSE(rb.sint("v").ok());
  CHECK(*rb.uint("v") == UINT64_MAX);
  const Bytes s40 = write([](auto& w) { w.str(std::string(40, 'x')); });
  for (std::size_t n = 0; n < s40.size(); ++n) CHECK_FALSE(MsgpackReader(std::span(s40).first(n)).str("s").ok());
}

TEST_CASE("kv events: a drained batch in vLLM's array form, chains merged into one BlockStored") {
  Cache<> cache(kvtest::device_config(9, 32));
  const auto toks = kvtest::prompt(12);
  const SeqId s = kvtest::add_published(cache, toks);  // 3 stored events, one chain
  REQUIRE(cache.free(s).ok());
  REQUIRE(cache.reset_prefix_cache().ok());  // 3 removed, then all_cleared
  std::vector<BlockEvent> ev(16);
  std::vector<std::int32_t> ids(16 * 4);
  const std::int32_t n = *cache.drain_events(ev, ids);
  REQUIRE(n >= 4);
  Bytes out;
  const auto wire = encode_kv_events(std::span(ev).first(std::size_t(n)), std::span(ids).first(std::size_t(n) * 4), 4,
                                     {.ts = 1.5, .dp_rank = 2, .group = 0}, out);
  REQUIRE(wire.ok());

  MsgpackReader r(out);
  CHECK(*r.array("batch") == 3);
  CHECK(*r.float64("ts") == 1.5);
  const auto events = *r.array("events");
  CHECK(events == std::uint32_t(*wire));
  // BlockStored: all three blocks of the chain, in order.
  CHECK(*r.array("stored") == 10);
  CHECK(*r.str("tag") == "BlockStored");
  CHECK(*r.array("hashes") == 3);
  for (int i = 0; i < 3; ++i) CHECK(*r.uint("hash") == external_hash(ev[std::size_t(i)].hash));
  CHECK(r.nil());  // the chain's first block has no parent
  CHECK(*r.array("token_ids") == 12);
  for (const std::int32_t t : toks) CHECK(*r.sint("token") == t);
  CHECK(*r.sint("block_size") == 4);
  CHECK(r.nil());  // lora_id
  CHECK(*r.str("medium") == "GPU");
  CHECK(r.nil());
  CHECK(r.nil());
  CHECK(*r.sint("group_idx") == 0);
  // Then the removals, merged, and the clear.
  for (std::uint32_t e = 1; e < events; ++e) {
    const auto fields = *r.array("event");
    const auto tag = *r.str("tag");
    if (tag == "AllBlocksCleared") {
      CHECK(fields == 1);
      continue;
    }
    CHECK(tag == "BlockRemoved");
    CHECK(fields == 4);
    const auto hashes = *r.array("hashes");
    for (std::uint32_t i = 0; i < hashes; ++i) CHECK(r.uint("hash").ok());
    CHECK(*r.str("medium") == "GPU");
    CHECK(*r.sint("group_idx") == 0);
  }
  CHECK(*r.sint("dp_rank") == 2);
  CHECK(r.done());

  // Token ids of the wrong size: an error naming them, nothing written.
  Bytes none;
  CHECK(encode_kv_events(std::span(ev).first(2), std::span(ids).first(3), 4, {}, none).status().what() == std::string("token_ids.size"));
  CHECK(none.empty());
}

TEST_CASE("kv events: sequence frames and the replay buffer") {
  CHECK(sequence_frame(1) == std::array<std::uint8_t, 8>{0, 0, 0, 0, 0, 0, 0, 1});
  CHECK(sequence_frame(-1) == std::array<std::uint8_t, 8>{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff});
  const auto f = sequence_frame(0x0102030405060708);
  CHECK(*read_sequence_frame(f) == 0x0102030405060708);
  CHECK(read_sequence_frame(std::span(f).first(7)).status().code() == Errc::invalid_argument);

  EventReplay replay(3);
  CHECK(replay.next_sequence() == 0);
  for (std::uint8_t i = 0; i < 5; ++i) CHECK(replay.push(Bytes(i + 1u, i)) == i);
  CHECK(replay.oldest() == 2);  // 0 and 1 fell out of the ring
  std::vector<std::int64_t> seen;
  CHECK(replay.replay(0, [&](std::int64_t seq, std::span<const std::uint8_t> p) {
          seen.push_back(seq);
          CHECK(p.size() == std::size_t(seq + 1));
          CHECK(p[0] == seq);
        }) == 3);
  CHECK(seen == std::vector<std::int64_t>{2, 3, 4});
  CHECK(replay.replay(4, [](std::int64_t, std::span<const std::uint8_t>) {}) == 1);
  CHECK(replay.replay(9, [](std::int64_t, std::span<const std::uint8_t>) {}) == 0);
  CHECK_THROWS_AS(EventReplay(0), ConfigError);
}
