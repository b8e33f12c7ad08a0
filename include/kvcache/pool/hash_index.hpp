// Fixed-capacity map (block hash, layer group) -> block id for the prefix cache. Open
// addressing with linear probing and backward-shift deletion (no tombstones),
// so it never allocates after construction and never degrades with churn.
#pragma once

#include <bit>
#include <cstdint>
#include <vector>

#include "kvcache/core/block_hash.hpp"
#include "kvcache/config.hpp"

KVCACHE_BEGIN_NAMESPACE

/// What the prefix index is keyed by: a block's chained hash and its layer
/// group. Every layer shares one group today (0); hybrid models that keep
/// full-attention and sliding-window groups in one pool index each group's
/// blocks under its own id, so one token prefix can be cached per group.
struct IndexKey {
  BlockHash hash{};  ///< The block's chained hash.
  std::uint32_t group = 0;  ///< Layer group (0: the one group of a uniform model).
  constexpr IndexKey() = default;
  /// A key in group `g` (implicit from a hash: group 0).
  constexpr IndexKey(const BlockHash& h, std::uint32_t g = 0) noexcept : hash(h), group(g) {}  // NOLINT(google-explicit-constructor)
  friend constexpr bool operator==(const IndexKey&, const IndexKey&) = default;
};

/// Open-addressing map from block hash to block id, sized once (no allocation after construction).
/// Key and value share a slot: a probe that misses the CPU cache costs one line, not two.
class HashIndex {
 public:
  HashIndex() = default;
  /// Room for max_entries keys at a load factor of at most 1/2.
  explicit HashIndex(std::int32_t max_entries)
      : slots_(std::bit_ceil(static_cast<std::uint64_t>(max_entries < 1 ? 1 : max_entries) * 2)),
        mask_(slots_.size() - 1) {}

  /// How a key's high half enters its placement: bucket(k) mixes lo ^ hi * kHiMix (and the group).
  static constexpr std::uint64_t kHiMix = 0x9e3779b97f4a7c15ULL;

  /// Hashes indexed.
  std::int32_t size() const noexcept { return size_; }

  /// Block registered under `key`, or -1.
  std::int32_t find(const IndexKey& key) const noexcept {
    for (std::uint64_t i = bucket(key);; i = (i + 1) & mask_) {
      if (slots_[i].value == kEmpty) return -1;
      if (slots_[i].holds(key)) return slots_[i].value;
    }
  }

  /// Inserts if absent; returns false (and changes nothing) if the key is present.
  bool insert(const IndexKey& key, std::int32_t value) noexcept { return find_or_insert(key, value) == kEmpty; }

  /// The value under `key`; when absent, inserts `value` and returns -1 (one probe for both).
  std::int32_t find_or_insert(const IndexKey& key, std::int32_t value) noexcept {
    std::uint64_t i = bucket(key);
    for (; slots_[i].value != kEmpty; i = (i + 1) & mask_)
      if (slots_[i].holds(key)) return slots_[i].value;
    slots_[i] = Slot{key, value};
    ++size_;
    return kEmpty;
  }

  /// Starts loading the slot `key` probes first: a batch of inserts overlaps its cache misses.
  void prefetch(const IndexKey& key) const noexcept { __builtin_prefetch(slots_.data() + bucket(key), 1); }

  /// Replaces the value under `key`; false (and nothing changes) when absent.
  bool assign(const IndexKey& key, std::int32_t value) noexcept {
    for (std::uint64_t i = bucket(key);; i = (i + 1) & mask_) {
      if (slots_[i].value == kEmpty) return false;
      if (slots_[i].holds(key)) {
        slots_[i].value = value;
        return true;
      }
    }
  }

  /// Removes `key` if present.
  bool erase(const IndexKey& key) noexcept {
    std::uint64_t i = bucket(key);
    for (; slots_[i].value != kEmpty; i = (i + 1) & mask_) {
      if (!(slots_[i].holds(key))) continue;
      // Backward shift: pull later entries of the probe run into the hole
      // whenever their home bucket does not lie cyclically in (hole, j].
      std::uint64_t hole = i;
      for (std::uint64_t j = (i + 1) & mask_; slots_[j].value != kEmpty; j = (j + 1) & mask_) {
        const std::uint64_t home = bucket(slots_[j].key());
        const bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
        if (stays) continue;
        slots_[hole] = slots_[j];
        hole = j;
      }
      slots_[hole] = Slot{};
      --size_;
      return true;
    }
    return false;
  }

  /// Removes every entry.
  void clear() noexcept {
    for (auto& s : slots_) s = Slot{};
    size_ = 0;
  }

  /// Calls f(key, block) for every entry.
  template <class F>
  void for_each(F&& f) const {
    for (const Slot& s : slots_)
      if (s.value != kEmpty) f(s.key(), s.value);
  }

  friend bool operator==(const HashIndex&, const HashIndex&) = default;

 private:
  static constexpr std::int32_t kEmpty = -1;
  // 24 bytes: the key's fields and the value, without the padding a nested IndexKey would add.
  struct Slot {
    BlockHash hash{};
    std::uint32_t group = 0;
    std::int32_t value = kEmpty;
    Slot() = default;
    Slot(const IndexKey& k, std::int32_t v) noexcept : hash(k.hash), group(k.group), value(v) {}
    IndexKey key() const noexcept { return {hash, group}; }
    bool holds(const IndexKey& k) const noexcept { return hash == k.hash && group == k.group; }
    friend bool operator==(const Slot&, const Slot&) = default;
  };
  std::uint64_t bucket(const IndexKey& k) const noexcept {
    const std::uint64_t x = k.hash.lo ^ (k.hash.hi * kHiMix) ^ (std::uint64_t{k.group} << 32);
    return (x * 0xbf58476d1ce4e5b9ULL >> 17) & mask_;
  }
  std::vector<Slot> slots_;
  std::uint64_t mask_ = 0;
  std::int32_t size_ = 0;
};

KVCACHE_END_NAMESPACE
