// Block events for KV-aware routers (vLLM BlockStored / BlockRemoved /
// AllBlocksCleared). Queued in a fixed ring the caller drains; when the ring
// is full new events are counted as dropped, so a router knows to resync.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/block_hash.hpp"
#include "kvcache/config.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// What happened to a block: published (stored), recycled (removed), or the whole prefix cache dropped.
enum class EventKind : std::uint8_t { stored, removed, all_cleared };

/// One block event for KV-aware routers.
struct BlockEvent {
  EventKind kind = EventKind::stored;  ///< stored, removed or all_cleared.
  std::int32_t block = -1;  ///< -1 for all_cleared
  BlockHash hash{};  ///< the block's hash (stored / removed)
  BlockHash parent{};  ///< the chain parent (stored only)
  friend constexpr bool operator==(const BlockEvent&, const BlockEvent&) = default;
};

/// Fixed-capacity ring of block events; overflow drops the oldest and counts it.
class EventQueue {
 public:
  EventQueue() = default;
  /// A ring of `capacity` events (0: events off); throws ConfigError when negative or too large.
  explicit EventQueue(std::int32_t capacity) : ring_(checked(capacity)) {}

  /// Events the ring holds at most.
  std::int32_t capacity() const noexcept { return static_cast<std::int32_t>(ring_.size()); }
  /// Events waiting to be drained.
  std::int32_t size() const noexcept { return size_; }
  /// Events lost to overflow since construction: a router that sees it grow must resync.
  std::int64_t dropped() const noexcept { return dropped_; }

  /// Appends e, dropping the oldest when full.
  void push(const BlockEvent& e) noexcept {
    if (ring_.empty()) return;  // events disabled
    if (size_ == capacity()) {
      ++dropped_;
      return;
    }
    ring_[static_cast<std::size_t>((head_ + size_) % capacity())] = e;
    ++size_;
  }

  /// Moves up to out.size() oldest events into out; returns how many.
  std::int32_t drain(std::span<BlockEvent> out) noexcept {
    std::int32_t n = 0;
    while (n < size_ && static_cast<std::size_t>(n) < out.size()) {
      out[static_cast<std::size_t>(n)] = ring_[static_cast<std::size_t>((head_ + n) % capacity())];
      ++n;
    }
    if (n > 0) {
      head_ = (head_ + n) % capacity();
      size_ -= n;
    }
    return n;
  }

  friend bool operator==(const EventQueue&, const EventQueue&) = default;

 private:
  static std::size_t checked(std::int32_t capacity) {
    if (capacity < 0) throw ConfigError("kvcache::EventQueue", Status{Errc::invalid_argument, "event_capacity", capacity, 0});
    return checked_elements("kvcache::EventQueue", "event_capacity", capacity, capacity, static_cast<std::int64_t>(sizeof(BlockEvent)));
  }

  std::vector<BlockEvent> ring_;
  std::int32_t head_ = 0;
  std::int32_t size_ = 0;
  std::int64_t dropped_ = 0;
};

KVCACHE_END_NAMESPACE
