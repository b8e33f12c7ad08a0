// Jobs in flight by id, in a fixed number of slots: what a two-phase
// registry (plan, then complete exactly once) keeps. An id is a 32-bit
// serial that names its slot (serial - 1 modulo the capacity) and is never
// given twice: a slot's next serial is its last plus the capacity. So an id
// completed, or never given, is found by no lookup, and nothing is
// allocated per job: a slot's entry is reused, and the vectors in it keep
// their capacity.
#pragma once

#include <cstdint>
#include <vector>

#include "kvcache/config.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Up to capacity() entries in flight, each under an id no other entry had.
template <class Entry>
class JobTable {
 public:
  JobTable() = default;
  /// Room for `capacity` entries in flight (ConfigError past the bookkeeping limit).
  explicit JobTable(std::int32_t capacity)
      : entries_(checked_elements("kvcache::JobTable", "capacity", capacity, capacity, std::int64_t(sizeof(Entry)) + 12)),
        serial_(std::size_t(capacity)),
        used_(std::size_t(capacity), 0) {
    for (std::int32_t s = capacity - 1; s >= 0; --s) free_.push_back(s), serial_[std::size_t(s)] = std::uint32_t(s) + 1;
  }

  std::int32_t capacity() const noexcept { return std::int32_t(entries_.size()); }  ///< Entries in flight at most.
  std::int32_t size() const noexcept { return capacity() - std::int32_t(free_.size()); }  ///< Entries in flight.
  bool full() const noexcept { return free_.empty(); }  ///< No room for another.

  /// A slot for a new entry (the caller checked !full()): its id; entry(id)
  /// is the slot's entry as its last job left it (the caller resets it).
  std::uint32_t add() noexcept {
    const std::int32_t s = free_.back();
    free_.pop_back();
    used_[std::size_t(s)] = 1;
    return serial_[std::size_t(s)];
  }
  /// The entry of id in flight, or null.
  Entry* find(std::uint32_t id) noexcept { return slot(id) < 0 ? nullptr : &entries_[std::size_t(slot(id))]; }
  /// The entry of id in flight, or null (read only).
  const Entry* find(std::uint32_t id) const noexcept { return slot(id) < 0 ? nullptr : &entries_[std::size_t(slot(id))]; }
  /// Entry id (in flight) is done: its slot's next id is a new one.
  void remove(std::uint32_t id) noexcept {
    const std::int32_t s = slot(id);
    if (s < 0) return;
    used_[std::size_t(s)] = 0;
    const auto cap = std::uint32_t(capacity());
    std::uint32_t& next = serial_[std::size_t(s)];
    next = next > UINT32_MAX - cap ? std::uint32_t(s) + 1 : next + cap;  // after 2^32 ids an id may come again
    free_.push_back(s);
  }
  /// Every entry in flight is done.
  void clear() noexcept {
    for (std::int32_t s = 0; s < capacity(); ++s)
      if (used_[std::size_t(s)]) remove(serial_[std::size_t(s)]);
  }
  /// f(id, entry) for each entry in flight, in slot order.
  template <class F>
  void for_each(F&& f) const {
    for (std::int32_t s = 0; s < capacity(); ++s)
      if (used_[std::size_t(s)]) f(serial_[std::size_t(s)], entries_[std::size_t(s)]);
  }
  /// f(id, entry) for each entry in flight, in slot order, the entry writable.
  template <class F>
  void for_each(F&& f) {
    for (std::int32_t s = 0; s < capacity(); ++s)
      if (used_[std::size_t(s)]) f(serial_[std::size_t(s)], entries_[std::size_t(s)]);
  }

  /// The same ids in flight with equal entries, and the same ids to come.
  friend bool operator==(const JobTable& a, const JobTable& b) {
    if (a.serial_ != b.serial_ || a.used_ != b.used_ || a.free_ != b.free_) return false;
    for (std::size_t s = 0; s < a.used_.size(); ++s)
      if (a.used_[s] && !(a.entries_[s] == b.entries_[s])) return false;
    return true;
  }

 private:
  std::int32_t slot(std::uint32_t id) const noexcept {
    if (id == 0 || entries_.empty()) return -1;
    const auto s = std::int32_t((id - 1) % std::uint32_t(capacity()));
    return used_[std::size_t(s)] && serial_[std::size_t(s)] == id ? s : -1;
  }

  std::vector<Entry> entries_;
  std::vector<std::uint32_t> serial_;  // [slot]: the id of its entry in flight, or of its next
  std::vector<char> used_;             // [slot]: an entry is in flight
  std::vector<std::int32_t> free_;     // free slots, the next at the back
};

KVCACHE_END_NAMESPACE
