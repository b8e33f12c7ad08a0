#include <catch2/catch.hpp>

#include <kvcache/core/block_hash.hpp>
#include <kvcache/core/events.hpp>
#include <kvcache/pool/hash_index.hpp>
#include <kvcache/groups/group_hits.hpp>

#include <array>
#include <cstring>
#include <random>
#include <unordered_map>
#include <vector>

using namespace kvcache;

namespace {
BlockHash from_bytes(const std::array<std::uint8_t, 16>& b) {
  BlockHash h;
  std::memcpy(&h.lo, b.data(), 8);
  std::memcpy(&h.hi, b.data() + 8, 8);
  return h;
}
}  // namespace

TEST_CASE("SipHash-2-4-128 matches the reference vectors") {
  // vectors_sip128[0..2] of the SipHash reference: key 00..0f, message 00..len-1.
  const std::array<std::array<std::uint8_t, 16>, 3> want = {{
      {0xa3, 0x81, 0x7f, 0x04, 0xba, 0x25, 0xa8, 0xe6, 0x6d, 0xf6, 0x72, 0x14, 0xc7, 0x55, 0x02, 0x93},
      {0xda, 0x87, 0xc1, 0xd8, 0x6b, 0x99, 0xaf, 0x44, 0x34, 0x76, 0x59, 0x11, 0x9b, 0x22, 0xfc, 0x45},
      {0x81, 0x77, 0x22, 0x8d, 0xa4, 0xa4, 0x5d, 0xc7, 0xfc, 0xa3, 0x8b, 0xde, 0xf6, 0x0a, 0xff, 0xe4},
  }};
  const std::uint8_t msg[] = {0, 1};
  for (std::size_t n = 0; n < want.size(); ++n)
    CHECK(SipHasher128::bytes(0x0706050403020100ULL, 0x0f0e0d0c0b0a0908ULL, msg, n) == from_bytes(want[n]));
}

TEST_CASE("SipHasher128 hashes the documented byte string") {
  std::mt19937_64 rng(Catch::rngSeed());
  for (int trial = 0; trial < 50; ++trial) {
    const std::uint64_t k0 = rng(), k1 = rng();
    std::vector<std::int32_t> tokens(rng() % 40);
    for (auto& t : tokens) t = static_cast<std::int32_t>(rng());
    const BlockHash parent{rng(), rng()};
    const std::uint64_t extra = rng();
    std::vector<std::uint8_t> bytes(24 + 4 * tokens.size());
    std::memcpy(bytes.data(), &parent.lo, 8);
    std::memcpy(bytes.data() + 8, &parent.hi, 8);
    std::memcpy(bytes.data() + 16, &extra, 8);
    if (!tokens.empty()) std::memcpy(bytes.data() + 24, tokens.data(), 4 * tokens.size());
    CHECK(SipHasher128(k0, k1)(parent, tokens, extra) == SipHasher128::bytes(k0, k1, bytes.data(), bytes.size()));
  }
}

template <class H>
void check_sensitivity(const H& hasher) {
  std::mt19937_64 rng(Catch::rngSeed());
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<std::int32_t> tokens(16);
    for (auto& t : tokens) t = static_cast<std::int32_t>(rng() % 50000);
    const BlockHash parent{rng(), rng()};
    const std::uint64_t extra = rng();
    const BlockHash h = hasher(parent, tokens, extra);
    CHECK(hasher(parent, tokens, extra) == h);  // deterministic
    auto t2 = tokens;
    t2[rng() % t2.size()] ^= 1 << (rng() % 16);
    CHECK_FALSE(hasher(parent, t2, extra) == h);
    CHECK_FALSE(hasher(BlockHash{parent.lo ^ 1, parent.hi}, tokens, extra) == h);
    CHECK_FALSE(hasher(parent, tokens, extra + 1) == h);
    CHECK_FALSE(hasher(parent, std::span(tokens).first(15), extra) == h);
  }
}

TEST_CASE("block hashers react to every input") {
  check_sensitivity(FastBlockHasher{});
  check_sensitivity(SipHasher128{1, 2});
  CHECK_FALSE(chain_root({.salt = 1}) == chain_root({.salt = 2}));
}

TEST_CASE("HashIndex agrees with std::unordered_map under churn") {
  std::mt19937_64 rng(Catch::rngSeed());
  HashIndex index(64);
  std::unordered_map<std::uint64_t, std::int32_t> ref;  // keyed by a small id
  auto key_of = [](std::uint64_t id) { return BlockHash{id * 7, id % 3}; };  // shared lo bits stress probing
  for (int op = 0; op < 200000; ++op) {
    const std::uint64_t id = rng() % 150;
    const int what = static_cast<int>(rng() % 3);
    if (what == 0 && ref.size() < 64) {
      const bool fresh = ref.find(id) == ref.end();
      REQUIRE(index.insert(key_of(id), static_cast<std::int32_t>(id)) == fresh);
      if (fresh) ref[id] = static_cast<std::int32_t>(id);
    } else if (what == 1) {
      REQUIRE(index.erase(key_of(id)) == (ref.erase(id) == 1));
    } else {
      auto it = ref.find(id);
      REQUIRE(index.find(key_of(id)) == (it == ref.end() ? -1 : it->second));
    }
    REQUIRE(index.size() == static_cast<std::int32_t>(ref.size()));
  }
  std::size_t seen = 0;
  index.for_each([&](const IndexKey&, std::int32_t v) {
    ++seen;
    REQUIRE(ref.count(static_cast<std::uint64_t>(v)) == 1);
  });
  CHECK(seen == ref.size());
}

TEST_CASE("a block's group keys are distinct and keep the chain hash's placement in the index") {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 1000; ++trial) {
    const BlockHash h{rng(), trial % 2 ? rng() : 0};  // FastBlockHasher leaves hi 0; SipHasher128 fills both
    const auto placed = [](const BlockHash& k) { return k.lo ^ (k.hi * HashIndex::kHiMix); };
    std::vector<BlockHash> keys{h};
    for (std::int32_t g = 0; g < 8; ++g) {
      const BlockHash k = group_key(h, g);
      CHECK(placed(k) == placed(h));  // one neighborhood for every group's copy
      for (const BlockHash& o : keys) CHECK_FALSE(o == k);
      keys.push_back(k);
    }
  }
}

TEST_CASE("EventQueue is FIFO, bounded, and counts what it drops") {
  EventQueue q(3);
  for (int b = 1; b <= 5; ++b) q.push(BlockEvent{EventKind::stored, b, {}, {}});
  CHECK(q.size() == 3);
  CHECK(q.dropped() == 2);
  std::array<BlockEvent, 2> out{};
  REQUIRE(q.drain(out) == 2);
  CHECK(out[0].block == 1);
  CHECK(out[1].block == 2);
  q.push(BlockEvent{EventKind::removed, 9, {}, {}});
  std::array<BlockEvent, 8> rest{};
  REQUIRE(q.drain(rest) == 2);
  CHECK(rest[0].block == 3);
  CHECK(rest[1].kind == EventKind::removed);
  EventQueue off(0);
  off.push(BlockEvent{});
  CHECK(off.size() == 0);
  CHECK(off.dropped() == 0);
}
