// Block events for KV-aware routers (vLLM's BlockStored / BlockRemoved /
// AllBlocksCleared, TensorRT-LLM's stored data). A router keeps, per worker,
// the set of hashes it can hit: `stored` when a hash enters the cache (its
// first copy), `removed` when it leaves (its last copy is recycled or
// invalidated). Copies of a hash already cached emit nothing.
//
// Queued in a fixed ring the caller drains in batches, with each stored
// block's token ids; when the ring is full new events are counted as
// dropped, so a router knows to resync.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/core/block_hash.hpp"
#include "kvcache/config.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// What happened to a block: its hash entered the cache (stored), left it (removed), or the whole prefix cache was dropped.
enum class EventKind : std::uint8_t { stored, removed, all_cleared };

/// Where the pool's blocks live (routers weigh a hit by its tier).
enum class Medium : std::uint8_t { gpu, cpu, disk };

/// One block event for KV-aware routers.
struct BlockEvent {
  EventKind kind = EventKind::stored;  ///< stored, removed or all_cleared.
  std::int32_t block = -1;  ///< The block (-1 for all_cleared).
  BlockHash hash{};  ///< The block's hash (stored / removed).
  BlockHash parent{};  ///< stored: the hash the chain continues; the sequence's chain root when `first`.
  bool first = false;  ///< stored: the first block of its chain (no parent block).
  PrefixKey key{};  ///< stored: the sequence's salt (tenant, cache salt) and extra (LoRA id).
  std::uint64_t block_extra = 0;  ///< stored: the extra key hashed into this block: key.extra with its multimodal keys folded in.
  std::int32_t block_size = 0;  ///< stored: tokens per block.
  std::int32_t num_tokens = 0;  ///< stored: token ids copied to the drain buffer (block_size, or 0 when none were kept).
  Medium medium = Medium::gpu;  ///< The pool's tier.
  /// The layer group whose block it is (a HybridCache's pool; its hash is
  /// already keyed by the group), or -1: a single-group cache's.
  std::int32_t group = -1;
  friend constexpr bool operator==(const BlockEvent&, const BlockEvent&) = default;
};

/// Fixed-capacity ring of block events with the token ids of stored blocks; overflow drops new events and counts them.
class EventQueue {
 public:
  EventQueue() = default;
  /// A ring of `capacity` events (0: events off), each with room for
  /// `tokens_per_event` token ids; throws ConfigError when either is negative or too large.
  explicit EventQueue(std::int32_t capacity, std::int32_t tokens_per_event = 0, Medium medium = Medium::gpu)
      : ring_(checked(capacity, tokens_per_event)),
        ids_(ring_.size() * static_cast<std::size_t>(tokens_per_event)),
        tokens_(tokens_per_event),
        medium_(medium) {}

  /// Events the ring holds at most.
  std::int32_t capacity() const noexcept { return static_cast<std::int32_t>(ring_.size()); }
  /// Token ids kept per stored event (the block size; 0: none).
  std::int32_t tokens_per_event() const noexcept { return tokens_; }
  /// Events waiting to be drained.
  std::int32_t size() const noexcept { return size_; }
  /// Events lost to overflow since construction: a router that sees it grow must resync.
  std::int64_t dropped() const noexcept { return dropped_; }

  /// Appends e with the stored block's token ids (the first tokens_per_event()
  /// are kept); when full, e is dropped and counted.
  void push(BlockEvent e, std::span<const std::int32_t> tokens = {}) noexcept {
    if (ring_.empty()) return;  // events disabled
    if (size_ == capacity()) {
      ++dropped_;
      return;
    }
    const std::size_t at = static_cast<std::size_t>((head_ + size_) % capacity());
    const std::size_t n = std::min(tokens.size(), static_cast<std::size_t>(tokens_));
    std::copy_n(tokens.begin(), n, ids_.begin() + static_cast<std::ptrdiff_t>(at * static_cast<std::size_t>(tokens_)));
    e.num_tokens = static_cast<std::int32_t>(n);
    e.medium = medium_;
    ring_[at] = e;
    ++size_;
  }

  /// Moves up to out.size() oldest events into out; returns how many (token ids are not copied: num_tokens 0).
  std::int32_t drain(std::span<BlockEvent> out) noexcept { return move_out(out, {}); }
  /// drain() with token ids: event i's go to token_ids[i * tokens_per_event(), ...),
  /// so token_ids must hold out.size() * tokens_per_event() (buffer_too_small,
  /// and nothing moves, otherwise).
  Result<std::int32_t> drain(std::span<BlockEvent> out, std::span<std::int32_t> token_ids) noexcept {
    const std::size_t need = out.size() * static_cast<std::size_t>(tokens_);
    if (token_ids.size() < need)
      return Status{Errc::buffer_too_small, "token_ids", std::int64_t(token_ids.size()), std::int64_t(need)};
    return move_out(out, token_ids);
  }

  friend bool operator==(const EventQueue&, const EventQueue&) = default;

 private:
  static std::size_t checked(std::int32_t capacity, std::int32_t tokens) {
    if (capacity < 0) throw ConfigError("kvcache::EventQueue", Status{Errc::invalid_argument, "event_capacity", capacity, 0});
    if (tokens < 0) throw ConfigError("kvcache::EventQueue", Status{Errc::invalid_argument, "tokens_per_event", tokens, 0});
    return checked_elements("kvcache::EventQueue", "event_capacity", capacity, capacity,
                            static_cast<std::int64_t>(sizeof(BlockEvent)) + 4 * std::int64_t{tokens});
  }

  std::int32_t move_out(std::span<BlockEvent> out, std::span<std::int32_t> token_ids) noexcept {
    const std::size_t per = static_cast<std::size_t>(tokens_);
    std::int32_t n = 0;
    while (n < size_ && static_cast<std::size_t>(n) < out.size()) {
      const std::size_t at = static_cast<std::size_t>((head_ + n) % capacity()), i = static_cast<std::size_t>(n);
      out[i] = ring_[at];
      if (token_ids.empty()) out[i].num_tokens = 0;
      else std::copy_n(ids_.begin() + static_cast<std::ptrdiff_t>(at * per), per, token_ids.begin() + static_cast<std::ptrdiff_t>(i * per));
      ++n;
    }
    if (n > 0) {
      head_ = (head_ + n) % capacity();
      size_ -= n;
    }
    return n;
  }

  std::vector<BlockEvent> ring_;
  std::vector<std::int32_t> ids_;  // [capacity][tokens_per_event]
  std::int32_t tokens_ = 0;
  Medium medium_ = Medium::gpu;
  std::int32_t head_ = 0;
  std::int32_t size_ = 0;
  std::int64_t dropped_ = 0;
};

KVCACHE_END_NAMESPACE
