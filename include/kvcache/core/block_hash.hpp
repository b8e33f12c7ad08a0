// Chained hashes of full blocks of token ids, for prefix sharing.
// hash(block i) = H(hash(block i-1), tokens of block i, extra); the chain root
// is the sequence's salt, so tenants with different salts never share blocks.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <span>

#include "kvcache/config.hpp"

KVCACHE_BEGIN_NAMESPACE

/// 128-bit chained hash of one full block (FastBlockHasher fills only `lo`).
struct BlockHash {
  std::uint64_t lo = 0;  ///< Low 64 bits.
  std::uint64_t hi = 0;  ///< High 64 bits (0 for 64-bit hashers).
  friend constexpr bool operator==(const BlockHash&, const BlockHash&) = default;
};

/// What a sequence mixes into its chain: `salt` seeds the root (cache_salt,
/// tenant id); `extra` enters every block (LoRA adapter id, multimodal key).
struct PrefixKey {
  std::uint64_t salt = 0;  ///< Root of the sequence's hash chain: a tenant or cache-namespace key.
  std::uint64_t extra = 0;  ///< Mixed into every block: LoRA id, multimodal content key, ...
  friend constexpr bool operator==(const PrefixKey&, const PrefixKey&) = default;
};

/// The hash a sequence's chain starts from: its salt.
constexpr BlockHash chain_root(const PrefixKey& key) noexcept { return BlockHash{key.salt, ~key.salt}; }

/// A multimodal input (an image, an audio clip) whose placeholder tokens sit
/// at positions [begin, end) of the sequence, with its content hash. The key
/// enters only the blocks the range overlaps, so the text before the input
/// stays shareable and two prompts with different images never share a block
/// of placeholders.
struct ExtraKey {
  std::int64_t begin = 0;  ///< First placeholder position.
  std::int64_t end = 0;  ///< One past the last placeholder position.
  std::uint64_t key = 0;  ///< The input's content hash.
  friend constexpr bool operator==(const ExtraKey&, const ExtraKey&) = default;
};

/// acc with one more extra key folded in (order matters, as in a chain).
constexpr std::uint64_t fold_extra(std::uint64_t acc, std::uint64_t key) noexcept {
  std::uint64_t x = (acc ^ 0x9e3779b97f4a7c15ULL) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 31) ^ key) * 0x94d049bb133111ebULL;
  return x ^ (x >> 29);
}

/// The extra a block covering positions [lo, hi) hashes: `base` (the
/// sequence's extra, e.g. its LoRA id) with the key of every range in
/// `extras` that overlaps the block folded in, in the given order. Without
/// overlapping ranges it is `base` itself.
constexpr std::uint64_t block_extra(std::uint64_t base, std::span<const ExtraKey> extras, std::int64_t lo,
                                    std::int64_t hi) noexcept {
  for (const ExtraKey& e : extras)
    if (e.begin < hi && e.end > lo) base = fold_extra(base, e.key);
  return base;
}

template <class H>
concept BlockHasher = requires(const H& h, const BlockHash& parent, std::span<const std::int32_t> tokens,
                               std::uint64_t extra) {
  { h(parent, tokens, extra) } -> std::same_as<BlockHash>;
};

namespace detail {
constexpr std::uint64_t rotl64(std::uint64_t x, int r) noexcept { return (x << r) | (x >> (64 - r)); }
constexpr std::uint64_t pack_tokens(std::int32_t a, std::int32_t b) noexcept {
  return std::uint64_t{static_cast<std::uint32_t>(a)} | (std::uint64_t{static_cast<std::uint32_t>(b)} << 32);
}
}  // namespace detail

/// Default: a fast 64-bit multiply-rotate hash (a few ns per 16-token block).
/// Fine when one tenant owns the cache; an attacker who can choose prompts can
/// search for collisions, so shared multi-tenant caches should use SipHasher128
/// with a secret key, or plug in a cryptographic hash through BlockHasher.
struct FastBlockHasher {
  /// Hash of one block: its parent's hash, its tokens, and `extra`.
  BlockHash operator()(const BlockHash& parent, std::span<const std::int32_t> tokens,
                       std::uint64_t extra) const noexcept {
    constexpr std::uint64_t k1 = 0x9e3779b97f4a7c15ULL, k2 = 0xc2b2ae3d27d4eb4fULL;
    std::uint64_t h = parent.lo ^ detail::rotl64(parent.hi, 29) ^ (extra * k2) ^ (tokens.size() * k1);
    std::size_t i = 0;
    for (; i + 1 < tokens.size(); i += 2) {
      h ^= detail::pack_tokens(tokens[i], tokens[i + 1]) * k2;
      h = detail::rotl64(h, 31) * k1;
    }
    if (i < tokens.size()) h = detail::rotl64(h ^ (static_cast<std::uint32_t>(tokens[i]) * k2), 31) * k1;
    // Final avalanche (murmur3 fmix64 constants).
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return BlockHash{h, 0};
  }
};

/// SipHash-2-4 with 128-bit output, keyed. The input is the little-endian byte
/// string parent.lo | parent.hi | extra | tokens (int32 each). With a secret
/// key, crafting colliding prompts needs the key; a 128-bit output makes
/// accidental collisions negligible. Costs a few times FastBlockHasher.
class SipHasher128 {
 public:
  /// A hasher keyed with a secret 128-bit key (k0, k1).
  constexpr SipHasher128(std::uint64_t k0, std::uint64_t k1) noexcept : k0_(k0), k1_(k1) {}

  /// Hash of one block: its parent's hash, its tokens, and `extra`.
  BlockHash operator()(const BlockHash& parent, std::span<const std::int32_t> tokens,
                       std::uint64_t extra) const noexcept {
    State s(k0_, k1_);
    s.word(parent.lo);
    s.word(parent.hi);
    s.word(extra);
    std::size_t i = 0;
    for (; i + 1 < tokens.size(); i += 2) s.word(detail::pack_tokens(tokens[i], tokens[i + 1]));
    const std::uint64_t len = 24 + 4 * tokens.size();
    const std::uint64_t tail = i < tokens.size() ? std::uint64_t{static_cast<std::uint32_t>(tokens[i])} : 0;
    return s.finish((len << 56) | tail);
  }

  /// Plain SipHash-2-4-128 over bytes; checks the core against published vectors.
  static BlockHash bytes(std::uint64_t k0, std::uint64_t k1, const std::uint8_t* p, std::size_t n) noexcept {
    State s(k0, k1);
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      std::uint64_t m = 0;
      for (std::size_t b = 0; b < 8; ++b) m |= std::uint64_t{p[i + b]} << (8 * b);
      s.word(m);
    }
    std::uint64_t last = std::uint64_t{n} << 56;
    for (std::size_t b = 0; i + b < n; ++b) last |= std::uint64_t{p[i + b]} << (8 * b);
    return s.finish(last);
  }

 private:
  struct State {
    std::uint64_t v0, v1, v2, v3;
    constexpr State(std::uint64_t k0, std::uint64_t k1) noexcept
        : v0(0x736f6d6570736575ULL ^ k0),
          v1(0x646f72616e646f6dULL ^ k1 ^ 0xee),
          v2(0x6c7967656e657261ULL ^ k0),
          v3(0x7465646279746573ULL ^ k1) {}
    constexpr void round() noexcept {
      using detail::rotl64;
      v0 += v1; v1 = rotl64(v1, 13); v1 ^= v0; v0 = rotl64(v0, 32);
      v2 += v3; v3 = rotl64(v3, 16); v3 ^= v2;
      v0 += v3; v3 = rotl64(v3, 21); v3 ^= v0;
      v2 += v1; v1 = rotl64(v1, 17); v1 ^= v2; v2 = rotl64(v2, 32);
    }
    constexpr void word(std::uint64_t m) noexcept {
      v3 ^= m;
      round();
      round();
      v0 ^= m;
    }
    constexpr BlockHash finish(std::uint64_t last) noexcept {
      word(last);
      v2 ^= 0xee;
      for (int r = 0; r < 4; ++r) round();
      const std::uint64_t lo = v0 ^ v1 ^ v2 ^ v3;
      v1 ^= 0xdd;
      for (int r = 0; r < 4; ++r) round();
      return BlockHash{lo, v0 ^ v1 ^ v2 ^ v3};
    }
  };
  std::uint64_t k0_, k1_;
};

static_assert(BlockHasher<FastBlockHasher>);
static_assert(BlockHasher<SipHasher128>);

/// One hash of a whole prompt under `key`, its extras folded in: what an
/// import keeps so that its commit can check it names the same tokens (as
/// strong as the hasher's block names: a different prompt passes only on a
/// hash collision).
template <BlockHasher H>
BlockHash prompt_digest(const H& hasher, std::span<const std::int32_t> tokens, const PrefixKey& key,
                        std::span<const ExtraKey> extras = {}) noexcept {
  std::uint64_t extra = fold_extra(key.extra, std::uint64_t(tokens.size()));
  for (const ExtraKey& e : extras)
    extra = fold_extra(fold_extra(fold_extra(extra, std::uint64_t(e.begin)), std::uint64_t(e.end)), e.key);
  return hasher(chain_root(key), tokens, extra);
}

/// The hashes of the full blocks of `tokens` (block_size tokens each, at most
/// out.size()), chained from chain_root(key) with each block's extras folded
/// in: the names the prefix cache publishes those blocks under, and the chain
/// a lower tier looks a prompt up by. Returns how many were written.
template <BlockHasher H>
std::int32_t hash_chain(const H& hasher, std::span<const std::int32_t> tokens, std::int32_t block_size, const PrefixKey& key,
                        std::span<BlockHash> out, std::span<const ExtraKey> extras = {}) noexcept {
  if (block_size < 1) return 0;
  const std::int64_t n = std::min<std::int64_t>(std::int64_t(tokens.size()) / block_size, std::int64_t(out.size()));
  BlockHash parent = chain_root(key);
  for (std::int64_t b = 0; b < n; ++b) {
    const std::int64_t lo = b * block_size;
    parent = hasher(parent, tokens.subspan(std::size_t(lo), std::size_t(block_size)), block_extra(key.extra, extras, lo, lo + block_size));
    out[std::size_t(b)] = parent;
  }
  return std::int32_t(n);
}

KVCACHE_END_NAMESPACE
