// One lower tier of KV memory (pinned host memory, a file): a pool of the
// caller's blocks named by the same content hashes as the device prefix
// cache, with its own least-recently-used queue.
//
// A block has one of four states. Free: in the queue, with or without a
// hash (a hash means it still serves lookups until a store recycles it).
// Filling: taken for a store in flight, its hash indexed but not visible to
// a lookup (a failed store never becomes visible). Ready: its hash visible,
// free to recycle. Pinned: read by a job in flight, out of the queue, so no
// store can recycle it.
//
// Why not the device's BlockPool: tier blocks are published unchained
// (evicting one never takes the blocks after it: the device may still hold
// the ones before), and a tier never holds two copies of a hash, so the
// pool's copy and child rings would be paid on every store for nothing. One
// hash -> slot index serves both the filling and the ready blocks: a store
// probes once to plan, once to take its slot and once to drop the hash it
// recycles; a slot's state says whether its hash is visible yet
// (docs/benchmarks.md, memory tiers).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/config.hpp"
#include "kvcache/core/block_hash.hpp"
#include "kvcache/core/events.hpp"
#include "kvcache/pool/hash_index.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Blocks of one lower tier; ids are the caller's slots 0 .. capacity()-1.
class TierPool {
 public:
  /// `num_blocks` blocks of `medium` (cpu: pinned host memory; disk: a file);
  /// event_capacity > 0 keeps stored/removed events naming the medium.
  /// ConfigError when num_blocks < 1 (or its bookkeeping is past max_bookkeeping_bytes).
  TierPool(Medium medium, std::int32_t num_blocks, std::int32_t event_capacity = 0)
      : slots_(checked(num_blocks) + 1),
        state_(slots_.size(), kPlain),
        index_(num_blocks + 1),  // a store inserts its hash before it drops the one it recycles
        events_(event_capacity, 0, medium),
        medium_(medium),
        num_free_(num_blocks) {
    const std::int32_t end = num_blocks;  // the queue's sentinel
    slots_[ix(end)].prev = slots_[ix(end)].next = end;
    for (std::int32_t s = 0; s < num_blocks; ++s) link_before(end, s);
  }

  Medium medium() const noexcept { return medium_; }  ///< The tier's medium.
  std::int32_t capacity() const noexcept { return std::int32_t(slots_.size()) - 1; }  ///< Blocks (slots) in the tier.
  /// Blocks a store can take now: plain free ones, then ready ones least recently used first.
  std::int32_t num_free() const noexcept { return num_free_; }
  /// Free blocks still holding a hash: what lookups find and stores recycle.
  std::int32_t num_ready() const noexcept { return num_ready_; }
  /// Blocks of stores in flight (taken, not visible).
  std::int32_t num_filling() const noexcept { return num_filling_; }
  /// Distinct ready or pinned blocks with a hash.
  std::int32_t num_published() const noexcept { return index_.size() - num_filling_; }
  /// Holders of slot s: 0 free or ready, 1 filling, the readers when pinned (a filling block has no reader).
  std::int32_t holders(std::int32_t s) const noexcept { return slots_[ix(s)].ref; }

  /// The slot holding `h`, ready or pinned; -1 when absent or still being filled. No side effects.
  std::int32_t find(const BlockHash& h) const noexcept {
    const std::int32_t s = index_.find(h);
    return s >= 0 && state_[ix(s)] == kHashed ? s : -1;
  }
  /// True while a store of `h` is in flight.
  bool filling(const BlockHash& h) const noexcept {
    const std::int32_t s = index_.find(h);
    return s >= 0 && state_[ix(s)] == kFilling;
  }
  /// find() and filling() in one probe: the slot (ready or pinned), -1 filling, -2 absent.
  std::int32_t state_of(const BlockHash& h) const noexcept {
    const std::int32_t s = index_.find(h);
    return s < 0 ? -2 : state_[ix(s)] == kHashed ? s : -1;
  }
  /// Slot s's hash (meaningful when find() returned s).
  const BlockHash& hash(std::int32_t s) const noexcept { return slots_[ix(s)].hash; }
  /// The layer group of the block slot s holds (-1: none named): what its events name.
  std::int32_t group(std::int32_t s) const noexcept { return slots_[ix(s)].group; }

  /// Moves up to out.size() pending events into out (block = the slot + 1), oldest first.
  std::int32_t drain_events(std::span<BlockEvent> out) noexcept { return events_.drain(out); }

  /// Every invariant, O(capacity): the queue holds exactly the blocks without
  /// holders, its counts agree, each indexed hash names a slot holding it
  /// (filling with one holder, or hashed), and no slot holds a hash the index
  /// does not. Who holds the others is the coordinator's to check
  /// (Tiers::check_invariants: one hold per job).
  Status check() const {
    const std::int32_t end = capacity();
    std::vector<char> queued(slots_.size(), 0);
    std::int32_t n = 0, ready = 0;
    for (std::int32_t s = slots_[ix(end)].next; s != end; s = slots_[ix(s)].next) {
      if (s < 0 || s >= end || queued[ix(s)] || slots_[ix(slots_[ix(s)].next)].prev != s || n > end)
        return Status{Errc::invariant_violated, "queue_link", s, n};
      queued[ix(s)] = 1, ++n;
      if (slots_[ix(s)].ref != 0) return Status{Errc::invariant_violated, "queued_ref", s, slots_[ix(s)].ref};
      if (state_[ix(s)] == kFilling) return Status{Errc::invariant_violated, "queued_filling", s, 0};
      ready += state_[ix(s)] == kHashed;
    }
    if (n != num_free_) return Status{Errc::invariant_violated, "num_free", num_free_, n};
    if (ready != num_ready_) return Status{Errc::invariant_violated, "num_ready", num_ready_, ready};
    std::int32_t indexed = 0, filling = 0;
    for (std::int32_t s = 0; s < end; ++s) {
      const Slot& x = slots_[ix(s)];
      const State st = state_[ix(s)];
      if ((x.ref == 0) != bool(queued[ix(s)]) || x.ref < 0) return Status{Errc::invariant_violated, "ref_count", s, x.ref};
      if (st == kFilling && x.ref != 1) return Status{Errc::invariant_violated, "filling", s, x.ref};
      if (st != kPlain && index_.find(x.hash) != s) return Status{Errc::invariant_violated, "index", s, index_.find(x.hash)};
      indexed += st != kPlain, filling += st == kFilling;
    }
    if (indexed != index_.size()) return Status{Errc::invariant_violated, "index size", index_.size(), indexed};
    if (filling != num_filling_) return Status{Errc::invariant_violated, "num_filling", num_filling_, filling};
    return {};
  }
  friend bool operator==(const TierPool&, const TierPool&) = default;

  /// Rebuilds an unused tier from what survived a restart: slots[i] holds
  /// hashes[i] of layer group groups[i] (a disk file's intact trailers;
  /// groups empty: none named), ready to be found; the other slots are free.
  /// A hash listed twice is kept in its first slot only. Their stored events
  /// name the group and its tokens: group_block_sizes[g] when the tier's
  /// blocks have groups (a group must then be one of them), else
  /// `block_size`. blocks_in_use unless the tier was never used;
  /// invalid_argument naming a slot outside it or listed twice, a list of
  /// another length, or a group outside -1 .. the last. Changes nothing on error.
  Status restore(std::span<const std::int32_t> slots, std::span<const BlockHash> hashes, std::span<const std::int32_t> groups = {},
                 std::span<const std::int32_t> group_block_sizes = {}, std::int32_t block_size = 0) {
    if (slots.size() != hashes.size()) return Status{Errc::invalid_argument, "hashes (one per slot)", std::int64_t(hashes.size()), std::int64_t(slots.size())};
    if (!groups.empty() && groups.size() != slots.size())
      return Status{Errc::invalid_argument, "groups (one per slot, or none)", std::int64_t(groups.size()), std::int64_t(slots.size())};
    const std::int64_t last = group_block_sizes.empty() ? INT16_MAX : std::int64_t(group_block_sizes.size()) - 1;
    for (const std::int32_t g : groups)
      if (g < -1 || g > last) return Status{Errc::invalid_argument, "groups", g, last};
    if (used_) return Status{Errc::blocks_in_use, "tier (restore needs an unused one)", capacity() - num_free_, 0};
    std::vector<char> seen(std::size_t(capacity()), 0);
    for (const std::int32_t s : slots) {
      if (s < 0 || s >= capacity()) return Status{Errc::invalid_argument, "slots", s, capacity() - 1};
      if (seen[std::size_t(s)]++) return Status{Errc::invalid_argument, "slots (listed twice)", s, 0};
    }
    used_ = !slots.empty();  // restoring nothing leaves the tier unused
    for (std::size_t i = 0; i < slots.size(); ++i) {
      if (!index_.insert(hashes[i], slots[i])) continue;
      const std::int32_t g = groups.empty() ? -1 : groups[i];
      const std::int32_t tokens = g >= 0 && std::size_t(g) < group_block_sizes.size() ? group_block_sizes[std::size_t(g)] : block_size;
      Slot& x = slots_[ix(slots[i])];
      x.hash = hashes[i], x.group = std::int16_t(g), state_[ix(slots[i])] = kHashed, ++num_ready_;
      stored(slots[i], BlockHash{}, tokens);
    }
    for (std::int32_t s = 0; s < capacity(); ++s)  // ready blocks queue behind the plain ones, by slot
      if (state_[ix(s)] == kHashed) unlink(s), link_before(capacity(), s);
    return {};
  }

  // The coordinator's steps (tiers.hpp), each after its own checks: a store
  // takes a block for h (recycling the least recently used ready block) and
  // publishes or abandons it; a read pins a ready block and unpins it.

  /// A block for a store of h, or -1 (nothing taken) when h is already
  /// indexed: ready, pinned or filling (a hash listed twice in one plan).
  /// The caller checked num_free() > 0.
  std::int32_t begin_store(const BlockHash& h) noexcept {
    const std::int32_t s = slots_[ix(capacity())].next;  // the queue's front
    if (index_.find_or_insert(h, s) != -1) return -1;
    Slot& x = slots_[ix(s)];
    if (state_[ix(s)] == kHashed) {  // recycling a ready block: its hash leaves the tier
      (void)index_.erase(x.hash);
      --num_ready_;
      events_.push(BlockEvent{.kind = EventKind::removed, .block = s + 1, .hash = x.hash, .group = x.group});
    }
    unlink(s), --num_free_;
    x.hash = h, x.ref = 1, state_[ix(s)] = kFilling, ++num_filling_;
    used_ = true;
    return s;
  }
  /// The store of h into slot s completed: h becomes visible, the block
  /// ready (most recently used); its events name `group` and its `block_size` tokens.
  void commit_store(std::int32_t s, const BlockHash& /*h*/, const BlockHash& parent, std::int32_t group = -1,
                    std::int32_t block_size = 0) noexcept {
    slots_[ix(s)].group = std::int16_t(group);
    state_[ix(s)] = kHashed, --num_filling_;  // visible from now on
    stored(s, parent, block_size);
    unpin(s);
  }
  /// The store of h into slot s failed or was abandoned: the block goes back free, never visible.
  void abort_store(std::int32_t s, const BlockHash& h) noexcept {
    (void)index_.erase(h);
    state_[ix(s)] = kPlain, --num_filling_;
    unpin(s);
  }
  /// A reader holds slot s (ready or already pinned): no store recycles it.
  void pin(std::int32_t s) noexcept {
    Slot& x = slots_[ix(s)];
    if (x.ref++ == 0) unlink(s), --num_free_, num_ready_ -= state_[ix(s)] == kHashed;
  }
  /// A reader is done with slot s: at no holders it is most recently used (a
  /// block with a hash) or the next to be taken (one without).
  void unpin(std::int32_t s) noexcept {
    Slot& x = slots_[ix(s)];
    if (--x.ref != 0) return;
    ++num_free_;
    if (state_[ix(s)] == kHashed) link_before(capacity(), s), ++num_ready_;
    else link_before(slots_[ix(capacity())].next, s);
  }
  /// A reader could not read slot s intact: its hash is dropped (the caller then unpins it).
  void forget(std::int32_t s) noexcept {
    Slot& x = slots_[ix(s)];
    if (state_[ix(s)] != kHashed) return;
    (void)index_.erase(x.hash);
    state_[ix(s)] = kPlain;
    events_.push(BlockEvent{.kind = EventKind::removed, .block = s + 1, .hash = x.hash, .group = x.group});
  }
  /// Marks ready slots used, the last first, so a chain's head is the most
  /// recent and evicted last (a pinned or filling slot is out of the queue, a
  /// plain one stays where stores take it first).
  void touch(std::span<const std::int32_t> slots) noexcept {
    for (auto it = slots.rbegin(); it != slots.rend(); ++it)
      if (slots_[ix(*it)].ref == 0 && state_[ix(*it)] == kHashed) unlink(*it), link_before(capacity(), *it);
  }

 private:
  // A slot's state: what it holds (the index maps its hash to it unless plain).
  enum State : std::uint8_t { kPlain, kFilling, kHashed };
  struct Slot {  // 32 bytes: what a store touches of a block, in one line
    BlockHash hash{};
    std::int32_t prev = 0, next = 0;  // the queue (free blocks only)
    std::int32_t ref = 0;             // holders
    std::int16_t group = -1;          // the layer group its events name
    friend bool operator==(const Slot&, const Slot&) = default;
  };
  static constexpr std::size_t ix(std::int32_t s) noexcept { return static_cast<std::size_t>(s); }
  static std::size_t checked(std::int32_t n) {
    if (n < 1 || n == INT32_MAX) throw ConfigError("kvcache::TierPool", Status{Errc::invalid_argument, "num_blocks", n, 1});
    // the slot, its state and two index entries of 24 bytes a block
    return checked_elements("kvcache::TierPool", "num_blocks", n, n, std::int64_t(sizeof(Slot)) + 49);
  }
  void link_before(std::int32_t at, std::int32_t s) noexcept {
    const std::int32_t p = slots_[ix(at)].prev;
    slots_[ix(p)].next = s, slots_[ix(s)].prev = p, slots_[ix(s)].next = at, slots_[ix(at)].prev = s;
  }
  void unlink(std::int32_t s) noexcept {
    slots_[ix(slots_[ix(s)].prev)].next = slots_[ix(s)].next;
    slots_[ix(slots_[ix(s)].next)].prev = slots_[ix(s)].prev;
  }
  void stored(std::int32_t s, const BlockHash& parent, std::int32_t block_size) noexcept {
    const Slot& x = slots_[ix(s)];
    events_.push(BlockEvent{.kind = EventKind::stored, .block = s + 1, .hash = x.hash, .parent = parent, .first = true,
                            .block_size = block_size, .group = x.group});
  }

  std::vector<Slot> slots_;    // [slot]; the last is the queue's sentinel
  std::vector<State> state_;   // [slot], apart: a lookup reads a byte of 1 per block, not a line of 32
  HashIndex index_;            // hash -> slot, filling or hashed
  EventQueue events_;
  Medium medium_;
  std::int32_t num_free_ = 0, num_ready_ = 0, num_filling_ = 0;
  bool used_ = false;  // a block was ever taken or restored (restore needs a fresh tier)
};

KVCACHE_END_NAMESPACE
