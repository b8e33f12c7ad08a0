// The sender's side of a disaggregated prefill: a finished prompt's blocks
// stay pinned until every consumer (each decode rank that reads them) says it
// has read them, or a deadline passes (a consumer that died or never came).
// A transfer hold is a cache hold (pool/block_holds.hpp), so the blocks are
// neither recycled nor rewritten while held, and the sequence itself can be
// freed at once. The library keeps no clock and no thread: the engine passes
// each notification to consumed() and its clock to expire().
//
// The holds in flight are a sorted array (the cache's hold ids grow, so a
// new one appends) whose room is taken at construction, from the cache's own
// room for holds: holding and releasing allocate nothing in a running engine.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/config.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Holds on finished prefills' blocks, each until its consumers have read or its deadline.
class TransferHolds {
 public:
  static constexpr std::int32_t max_consumers = 64;  ///< Readers per hold (tensor-parallel decode ranks).

  /// One hold in flight.
  struct Entry {
    std::int32_t consumers = 0;  ///< Readers expected.
    std::uint64_t read = 0;  ///< Bit i: consumer i has read.
    std::int64_t deadline = 0;  ///< The engine's clock value past which the hold expires.
  };

  /// No room taken: the first holds allocate, later ones reuse the room.
  TransferHolds() = default;
  /// Room for max_holds holds in flight, taken now; past it the array grows (a hold never fails for bookkeeping).
  explicit TransferHolds(std::int32_t max_holds) { holds_.reserve(std::size_t(std::max(max_holds, 0))); }
  /// Room for as many holds as `cache` keeps room for (its holds().room_holds()): the setting given once, to the cache.
  template <class Cache>
    requires requires(const Cache& c) { c.holds().room_holds(); }
  explicit TransferHolds(const Cache& cache) : TransferHolds(cache.holds().room_holds()) {}

  /// Holds `blocks` of `cache` (any cache with hold / release_hold) for
  /// `consumers` readers (1 .. max_consumers) until `deadline` (the engine's
  /// clock, any unit). Returns the hold's id (the cache's), which a consumer's
  /// notification names. Errors name the value and change nothing.
  template <class Cache>
  Result<std::uint64_t> hold(Cache& cache, std::span<const std::int32_t> blocks, std::int32_t consumers, std::int64_t deadline) {
    if (consumers < 1 || consumers > max_consumers) return Status{Errc::invalid_argument, "consumers", consumers, max_consumers};
    auto id = cache.hold(blocks);
    if (!id) return id.status();
    add(*id, Entry{consumers, 0, deadline});
    return *id;
  }
  /// hold() of sequence s's blocks (the cache's hold(SeqId): a token-paged
  /// row, or every group's live blocks of a hybrid cache).
  template <class Cache>
  Result<std::uint64_t> hold(Cache& cache, SeqId s, std::int32_t consumers, std::int64_t deadline) {
    if (consumers < 1 || consumers > max_consumers) return Status{Errc::invalid_argument, "consumers", consumers, max_consumers};
    auto id = cache.hold(s);
    if (!id) return id.status();
    add(*id, Entry{consumers, 0, deadline});
    return *id;
  }

  /// Consumer `consumer` (0 .. consumers - 1) has read hold `id`: true when
  /// it was the last, and the hold is released. unknown_job for an id not
  /// held (released, expired, never given); invalid_argument for a consumer
  /// out of range or one that already read.
  template <class Cache>
  Result<bool> consumed(Cache& cache, std::uint64_t id, std::int32_t consumer) noexcept {
    const auto it = at(holds_, id);
    if (it == holds_.end()) return Status{Errc::unknown_job, "transfer hold", std::int64_t(id & INT64_MAX), 0};
    Entry& e = it->entry;
    if (consumer < 0 || consumer >= e.consumers) return Status{Errc::invalid_argument, "consumer", consumer, e.consumers - 1};
    const std::uint64_t bit = std::uint64_t{1} << consumer;
    if (e.read & bit) return Status{Errc::invalid_argument, "consumer (already read)", consumer, e.consumers - 1};
    e.read |= bit;
    if (std::popcount(e.read) < e.consumers) return false;
    (void)cache.release_hold(id);
    holds_.erase(it);
    return true;
  }

  /// Releases every hold whose deadline is at or before `now`; their ids go
  /// to out (as many as fit). Returns how many expired.
  template <class Cache>
  std::int32_t expire(Cache& cache, std::int64_t now, std::span<std::uint64_t> out = {}) noexcept {
    std::int32_t n = 0;
    std::size_t kept = 0;  // the holds still in flight close up, in id order
    for (const Held& h : holds_) {
      if (h.entry.deadline > now) {
        holds_[kept++] = h;
        continue;
      }
      (void)cache.release_hold(h.id);
      if (std::size_t(n) < out.size()) out[std::size_t(n)] = h.id;
      ++n;
    }
    holds_.resize(kept);
    return n;
  }

  /// Holds in flight.
  std::int32_t size() const noexcept { return std::int32_t(holds_.size()); }
  /// Hold `id`'s state, or unknown_job.
  Result<Entry> find(std::uint64_t id) const noexcept {
    const auto it = at(holds_, id);
    if (it == holds_.end()) return Status{Errc::unknown_job, "transfer hold", std::int64_t(id & INT64_MAX), 0};
    return it->entry;
  }
  /// Holds there is room for without allocating.
  std::int32_t room() const noexcept { return std::int32_t(holds_.capacity()); }

 private:
  struct Held {
    std::uint64_t id = 0;
    Entry entry;
  };
  // holds_ is sorted by id: a binary search, and an insert at the end for a growing id.
  static bool before(const Held& h, std::uint64_t id) noexcept { return h.id < id; }
  template <class Holds>  // the array, or the const one
  static auto at(Holds& holds, std::uint64_t id) noexcept -> decltype(holds.begin()) {
    const auto it = std::lower_bound(holds.begin(), holds.end(), id, before);
    return it != holds.end() && it->id == id ? it : holds.end();
  }
  // A cache never gives an id twice; one held again (another cache's hold) replaces its entry, as a map's slot would.
  void add(std::uint64_t id, const Entry& e) {
    const auto it = std::lower_bound(holds_.begin(), holds_.end(), id, before);
    if (it != holds_.end() && it->id == id) it->entry = e;
    else holds_.insert(it, Held{id, e});
  }

  std::vector<Held> holds_;  // the holds in flight, by id
};

KVCACHE_END_NAMESPACE
