// Dense sequence (stream) handles with a generation counter: O(1) lookup
// without hashing, and a stale or freed handle is detected, never aliased.
// Every cache keeps its handles' state beside its rows (a decode step reads
// them in one line), but checks a handle, refuses a new one and keeps its
// free slots with the same code here, so the errors are the same words on
// every cache.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvcache/config.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// A sequence handle: row index plus generation, so a freed handle never aliases a new one.
struct SeqId {
  std::uint32_t index = UINT32_MAX;  ///< slot in the table
  std::uint32_t generation = 0;  ///< bumped each time the slot is freed
  friend constexpr bool operator==(const SeqId&, const SeqId&) = default;
};

/// A handle slot as a cache keeps it: in use (a sequence, or an import in
/// flight), sealed (an import in flight: named by no call until it lands), and its generation.
struct HandleSlot {
  bool in_use = false;  ///< The slot holds a sequence.
  bool sealed = false;  ///< ... an import's row, not handed out yet.
  std::uint32_t generation = 0;  ///< The slot's generation now.
};

/// Every cache's check of handle s among `slots` slots (slot_of(index) ->
/// HandleSlot): unknown_sequence naming the index past the slots, or the
/// stale generation (with the slot's own), or a sealed row.
template <class SlotOf>
constexpr Status check_handle(SeqId s, std::uint32_t slots, SlotOf&& slot_of) noexcept {
  if (s.index >= slots) return Status{Errc::unknown_sequence, "seq.index", s.index, slots};
  const HandleSlot x = slot_of(s.index);
  if (!x.in_use || x.generation != s.generation) return Status{Errc::unknown_sequence, "seq.generation", s.generation, x.generation};
  if (x.sealed) return Status{Errc::unknown_sequence, "seq (an import in flight)", s.index, 0};
  return {};
}

/// Every cache's refusal of a new sequence when all `max_sequences` handles are in use.
constexpr Status no_free_handle(std::int64_t max_sequences) noexcept {
  return Status{Errc::capacity_exceeded, "max_sequences", max_sequences + 1, max_sequences};
}

/// Every cache's free handle slots: a stack sized once (no allocation after
/// construction), handing out slot 0 first and the last one given back next.
class FreeHandles {
 public:
  FreeHandles() = default;
  /// All of `slots` slots free.
  explicit FreeHandles(std::int32_t slots) : free_(std::size_t(slots > 0 ? slots : 0)), size_(std::int32_t(free_.size())) {
    for (std::int32_t i = 0; i < size_; ++i) free_[std::size_t(i)] = std::uint32_t(size_ - 1 - i);
  }
  /// Slots free now.
  std::int32_t size() const noexcept { return size_; }
  /// No slot is free.
  bool empty() const noexcept { return size_ == 0; }
  /// A free slot, now in use; no_free_handle when none is (the error every cache gives).
  Result<std::uint32_t> take() noexcept {
    if (size_ == 0) return no_free_handle(std::int64_t(free_.size()));
    return free_[std::size_t(--size_)];
  }
  /// The slot take() hands out next, left free; no_free_handle when none is.
  Result<std::uint32_t> next() const noexcept {
    if (size_ == 0) return no_free_handle(std::int64_t(free_.size()));
    return free_[std::size_t(size_ - 1)];
  }
  /// Slot i (taken, and ended by its cache) is free again.
  void give(std::uint32_t i) noexcept { free_[std::size_t(size_++)] = i; }
  /// The free slots are the same, in the same order.
  friend bool operator==(const FreeHandles& a, const FreeHandles& b) noexcept {
    return a.size_ == b.size_ && a.free_.size() == b.free_.size() &&
           std::equal(a.free_.begin(), a.free_.begin() + a.size_, b.free_.begin());
  }

 private:
  std::vector<std::uint32_t> free_;  // [0, size_): the free slots, the next one last
  std::int32_t size_ = 0;
};

/// A page-table row's blocks are copied before a write into a shared block.
struct BlockCopy {
  std::int32_t src = -1;  ///< Block to copy from.
  std::int32_t dst = -1;  ///< Block to copy to.
  friend constexpr bool operator==(const BlockCopy&, const BlockCopy&) = default;
};

/// What every cache's reserve() and advance() return. copy.src < 0: nothing
/// to copy. Otherwise the engine copies block src to dst before writing the
/// new tokens (copy-on-write of a shared tail block; a layer-group row never
/// shares one, so HybridCache's is always none).
struct ReserveInfo {
  std::int32_t new_blocks = 0;  ///< Blocks allocated for this reservation (over every group).
  BlockCopy copy{};  ///< Copy-on-write command to run before writing (src < 0: none).
};

/// What a batched reserve did (reserve_batch(), advance_batch(); every cache's).
struct BatchInfo {
  std::int32_t slots = 0;  ///< slots written (a group's, on layer groups; the rest of the buffer is -1)
  std::int32_t copies = 0;  ///< copy commands written
};

KVCACHE_END_NAMESPACE
