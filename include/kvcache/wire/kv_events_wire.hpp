// Block events on the wire, as vLLM publishes them for KV-aware routers
// (vllm/distributed/kv_events.py; Dynamo's and llm-d's routers read it):
//   payload  msgpack [ts, [event, ...], dp_rank]   (msgspec array_like, tagged)
//            ["BlockStored", [hash, ...], parent | nil, [token, ...], block_size,
//             lora_id | nil, medium, lora_name (nil), extra_keys (nil), group_idx | nil]
//            ["BlockRemoved", [hash, ...], medium, group_idx | nil]
//            ["AllBlocksCleared"]
//   frames   topic, 8-byte big-endian sequence number, payload (ZMQ multipart on a PUB socket)
//   replay   a subscriber that missed frames asks for every batch from a sequence
//            number on; the answer ends with sequence number -1 and an empty payload.
// Hashes are 64-bit integers: a 128-bit hash's halves folded (lo ^ hi; a
// 64-bit hasher's value as it is). Consecutive stored events of one chain
// become one BlockStored, as vLLM batches a request's blocks; consecutive
// removals one BlockRemoved. No socket here: the engine sends the frames.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "kvcache/core/block_hash.hpp"
#include "kvcache/config.hpp"
#include "kvcache/core/events.hpp"
#include "kvcache/status.hpp"
#include "kvcache/wire/msgpack.hpp"

KVCACHE_BEGIN_NAMESPACE

/// The 64-bit integer a router sees for a block hash.
constexpr std::uint64_t external_hash(const BlockHash& h) noexcept { return h.lo ^ h.hi; }

/// vLLM's medium names: "GPU", "CPU", "DISK".
constexpr std::string_view medium_name(Medium m) noexcept {
  switch (m) {
    case Medium::gpu: return "GPU";
    case Medium::cpu: return "CPU";
    case Medium::disk: return "DISK";
  }
  return "GPU";
}

/// What a batch says besides its events.
struct KvEventBatchInfo {
  double ts = 0;  ///< Seconds since the epoch (the engine's clock).
  std::int32_t dp_rank = 0;  ///< Data-parallel rank of the engine.
  /// The events' KV-cache group (group_idx) where an event names none (a
  /// single-group cache's; a HybridCache's events name their own); -1: omitted (nil).
  std::int32_t group = -1;
};

/// Appends a batch of drained events (with `token_ids` as drain() filled
/// them: tokens_per_event ids per event, or empty) as vLLM's msgpack
/// KVEventBatch to `out`. Returns the number of wire events (runs merged).
/// invalid_argument when token_ids is neither empty nor events × tokens_per_event.
inline Result<std::int32_t> encode_kv_events(std::span<const BlockEvent> events, std::span<const std::int32_t> token_ids,
                                             std::int32_t tokens_per_event, const KvEventBatchInfo& info,
                                             std::vector<std::uint8_t>& out) {
  if (tokens_per_event < 0) return Status{Errc::invalid_argument, "tokens_per_event", tokens_per_event, 0};
  const std::size_t per = std::size_t(tokens_per_event);
  if (!token_ids.empty() && token_ids.size() != events.size() * per)
    return Status{Errc::invalid_argument, "token_ids.size", std::int64_t(token_ids.size()), std::int64_t(events.size() * per)};
  // Runs: [i, j) of one kind that become one wire event.
  const auto run_end = [&](std::size_t i) {
    std::size_t j = i + 1;
    const BlockEvent& a = events[i];
    if (a.kind == EventKind::all_cleared) return j;
    for (; j < events.size(); ++j) {
      const BlockEvent &p = events[j - 1], &e = events[j];
      if (e.kind != a.kind || e.medium != a.medium || e.group != a.group) break;
      if (a.kind == EventKind::stored && (e.first || e.parent != p.hash || e.key != a.key || e.block_size != a.block_size)) break;
    }
    return j;
  };
  std::uint32_t runs = 0;
  for (std::size_t i = 0; i < events.size(); i = run_end(i)) ++runs;
  MsgpackWriter w(out);
  w.array(3);
  w.float64(info.ts);
  w.array(runs);
  for (std::size_t i = 0; i < events.size();) {
    const std::size_t j = run_end(i);
    const BlockEvent& a = events[i];
    const auto group = [&] {
      const std::int32_t g = a.group >= 0 ? a.group : info.group;
      g < 0 ? w.nil() : w.sint(g);
    };
    if (a.kind == EventKind::all_cleared) {
      w.array(1), w.str("AllBlocksCleared");
    } else if (a.kind == EventKind::removed) {
      w.array(4), w.str("BlockRemoved");
      w.array(std::uint32_t(j - i));
      for (std::size_t k = i; k < j; ++k) w.uint(external_hash(events[k].hash));
      w.str(medium_name(a.medium)), group();
    } else {
      w.array(10), w.str("BlockStored");
      w.array(std::uint32_t(j - i));
      for (std::size_t k = i; k < j; ++k) w.uint(external_hash(events[k].hash));
      a.first ? w.nil() : w.uint(external_hash(a.parent));
      std::uint32_t ntok = 0;
      if (!token_ids.empty())
        for (std::size_t k = i; k < j; ++k) ntok += std::uint32_t(events[k].num_tokens);
      w.array(ntok);
      if (!token_ids.empty())
        for (std::size_t k = i; k < j; ++k)
          for (std::size_t t = 0; t < std::size_t(events[k].num_tokens); ++t) w.sint(token_ids[k * per + t]);
      w.sint(a.block_size);
      a.key.extra == 0 ? w.nil() : w.uint(a.key.extra);  // lora_id
      w.str(medium_name(a.medium));
      w.nil(), w.nil();  // lora_name, extra_keys
      group();
    }
    i = j;
  }
  w.sint(info.dp_rank);
  return std::int32_t(runs);
}

/// A sequence number as its 8-byte big-endian frame (-1: the replay's end).
constexpr std::array<std::uint8_t, 8> sequence_frame(std::int64_t seq) noexcept {
  std::array<std::uint8_t, 8> b{};
  for (int i = 0; i < 8; ++i) b[std::size_t(i)] = std::uint8_t(std::uint64_t(seq) >> (56 - 8 * i));
  return b;
}
/// The sequence number an 8-byte big-endian frame carries; invalid_argument for another size.
inline Result<std::int64_t> read_sequence_frame(std::span<const std::uint8_t> frame) noexcept {
  if (frame.size() != 8) return Status{Errc::invalid_argument, "sequence frame (bytes)", std::int64_t(frame.size()), 8};
  std::uint64_t v = 0;
  for (const std::uint8_t b : frame) v = (v << 8) | b;
  return std::int64_t(v);
}

/// The last `capacity` payloads published, by sequence number (0, 1, ...), for
/// replay to a subscriber that missed some. Storage is reused: after warm-up a
/// payload no longer than earlier ones allocates nothing.
class EventReplay {
 public:
  /// Keeps `capacity` batches (>= 1); throws ConfigError otherwise.
  explicit EventReplay(std::int32_t capacity) : ring_(checked(capacity)) {}

  /// Stores a payload; returns its sequence number (the frame to send with it).
  std::int64_t push(std::span<const std::uint8_t> payload) {
    Slot& s = ring_[std::size_t(next_ % std::int64_t(ring_.size()))];
    s.seq = next_;
    s.bytes.assign(payload.begin(), payload.end());
    return next_++;
  }
  /// The sequence number the next push() gets.
  std::int64_t next_sequence() const noexcept { return next_; }
  /// The oldest sequence number still kept (next_sequence() when none).
  std::int64_t oldest() const noexcept { return std::max<std::int64_t>(0, next_ - std::int64_t(ring_.size())); }
  /// Calls f(seq, payload) for every kept batch from `from` on, oldest first
  /// (batches before oldest() are gone: the subscriber resyncs). Returns how many.
  template <class F>
  std::int32_t replay(std::int64_t from, F&& f) const {
    std::int32_t n = 0;
    for (std::int64_t q = std::max(from, oldest()); q < next_; ++q, ++n) {
      const Slot& s = ring_[std::size_t(q % std::int64_t(ring_.size()))];
      f(s.seq, std::span<const std::uint8_t>(s.bytes));
    }
    return n;
  }

 private:
  struct Slot {
    std::int64_t seq = -1;
    std::vector<std::uint8_t> bytes;
  };
  static std::size_t checked(std::int32_t capacity) {
    if (capacity < 1) throw ConfigError("kvcache::EventReplay", Status{Errc::invalid_argument, "capacity", capacity, 1});
    return std::size_t(capacity);
  }
  std::vector<Slot> ring_;
  std::int64_t next_ = 0;
};

KVCACHE_END_NAMESPACE
