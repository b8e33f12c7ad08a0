// The cached content of a block pool: which blocks hold which chained hash,
// kept prefix-closed.
//
// Blocks that hold the same hash form one group (a ring of copies); the index
// maps the hash to one member. Two identical prompts, or n > 1 sampling, make
// copies: every copy is a member, so when the copy a lookup found goes, the
// next one serves the hit instead of its tokens silently dropping out of the
// cache.
//
// Every hashed block is also linked into its parent hash's ring of children
// (a second index maps the parent hash to one child). When the last copy of
// a hash goes, its children can no longer be reached by a prefix walk, so
// they lose their hashes too, and theirs in turn: no block is ever indexed
// while its parent is not. The cascade visits each dropped block once, with
// an explicit stack sized at construction (no allocation, no recursion).
#pragma once

#include <cstdint>
#include <vector>

#include "kvcache/block_hash.hpp"
#include "kvcache/config.hpp"
#include "kvcache/hash_index.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Hash groups of copies, parent -> children rings, and the cascade that keeps the cache prefix-closed.
class PrefixIndex {
 public:
  PrefixIndex() = default;
  /// Room for block ids [0, capacity).
  explicit PrefixIndex(std::int32_t capacity)
      : hash_(ix(capacity)),
        parent_(ix(capacity)),
        state_(ix(capacity), kNone),
        copy_next_(ix(capacity), -1),
        copy_prev_(ix(capacity), -1),
        kid_next_(ix(capacity), -1),
        kid_prev_(ix(capacity), -1),
        groups_(capacity),
        kids_(capacity),
        stack_(ix(capacity)) {}

  /// Distinct hashes indexed.
  std::int32_t size() const noexcept { return groups_.size(); }
  /// Blocks holding a hash (every copy).
  std::int32_t members() const noexcept { return members_; }
  /// True when b holds a hash (it is a member of that hash's group).
  bool has(std::int32_t b) const noexcept { return state_[ix(b)] != kNone; }
  /// b's hash (meaningful when has(b)).
  const BlockHash& hash(std::int32_t b) const noexcept { return hash_[ix(b)]; }
  /// The hash b's chain continues (meaningful when has(b) and !is_root(b)).
  const BlockHash& parent(std::int32_t b) const noexcept { return parent_[ix(b)]; }
  /// True when b's parent is a chain root (a sequence's salt), not a block.
  bool is_root(std::int32_t b) const noexcept { return state_[ix(b)] == kRoot; }
  /// True when b is the only block holding its hash.
  bool alone(std::int32_t b) const noexcept { return copy_next_[ix(b)] == b; }
  /// A block holding `key`, or -1.
  std::int32_t find(const IndexKey& key) const noexcept { return groups_.find(key); }
  /// Another copy of b's hash, or b itself when alone.
  std::int32_t next_copy(std::int32_t b) const noexcept { return copy_next_[ix(b)]; }

  /// b (holding no hash) takes hash h. Its parent is `parent` when that hash is
  /// indexed, a chain root otherwise. Returns true when h was not indexed yet
  /// (a new group: routers hear of it), false when b joins as a copy.
  bool insert(std::int32_t b, const BlockHash& h, const BlockHash& parent) noexcept {
    hash_[ix(b)] = h;
    parent_[ix(b)] = parent;
    if (const std::int32_t kid = kids_.find(parent); kid >= 0) {
      link(kid_next_, kid_prev_, kid, b);
      state_[ix(b)] = kChild;
    } else if (groups_.find(parent) >= 0) {
      kid_next_[ix(b)] = kid_prev_[ix(b)] = b;
      (void)kids_.insert(parent, b);
      state_[ix(b)] = kChild;
    } else {
      state_[ix(b)] = kRoot;
    }
    ++members_;
    const std::int32_t member = groups_.find(h);
    if (member >= 0) {
      link(copy_next_, copy_prev_, member, b);
      return false;
    }
    copy_next_[ix(b)] = copy_prev_[ix(b)] = b;
    (void)groups_.insert(h, b);
    return true;
  }

  /// b loses its hash. When it was its hash's last copy, every block whose
  /// chain continues from that hash loses its hash too, transitively.
  /// dropped(block, gone) runs for b and for each block of the cascade; `gone`
  /// is true when that block was its hash's last copy (the hash left the index).
  template <class F>
  void erase(std::int32_t b, F&& dropped) noexcept {
    if (state_[ix(b)] == kChild) unlink_kid(b);
    std::size_t top = 0;
    stack_[top++] = b;
    while (top > 0) {
      const std::int32_t x = stack_[--top];
      const BlockHash h = hash_[ix(x)];
      const bool gone = alone(x);
      if (gone) {
        (void)groups_.erase(h);
        // Every child of h is dropped below: its ring is abandoned whole.
        if (const std::int32_t kid = kids_.find(h); kid >= 0) {
          (void)kids_.erase(h);
          std::int32_t k = kid;
          do {
            stack_[top++] = k;
            state_[ix(k)] = kOrphan;  // its ring is gone: do not unlink it
            k = kid_next_[ix(k)];
          } while (k != kid);
        }
      } else {
        if (groups_.find(h) == x) (void)groups_.assign(h, copy_next_[ix(x)]);
        unlink(copy_next_, copy_prev_, x);
      }
      state_[ix(x)] = kNone;
      --members_;
      dropped(x, gone);
    }
  }

  /// Forgets everything.
  void clear() noexcept {
    groups_.clear();
    kids_.clear();
    for (auto& s : state_) s = kNone;
    members_ = 0;
  }

  /// Groups, rings and the closure, O(capacity). ref(b) gives b's holders:
  /// a free block (0 holders) with a hash must be its hash's only copy.
  template <class Ref>
  Status check(Ref&& ref) const {
    std::int32_t members = 0;
    for (std::int32_t b = 0; b < std::int32_t(state_.size()); ++b) {
      if (!has(b)) continue;
      const std::int32_t m = groups_.find(hash_[ix(b)]);
      if (m < 0 || !has(m) || !(hash_[ix(m)] == hash_[ix(b)])) return Status{Errc::invariant_violated, "group", b, m};
      if (groups_.find(hash_[ix(b)]) == b) ++members;
      if (copy_prev_[ix(copy_next_[ix(b)])] != b || !(hash_[ix(copy_next_[ix(b)])] == hash_[ix(b)]))
        return Status{Errc::invariant_violated, "copy_ring", b, copy_next_[ix(b)]};
      if (ref(b) == 0 && !alone(b)) return Status{Errc::invariant_violated, "free_copy", b, copy_next_[ix(b)]};
      if (state_[ix(b)] == kChild) {
        // Prefix-closed: the parent hash is indexed, and b is in its children's ring.
        if (groups_.find(parent_[ix(b)]) < 0) return Status{Errc::invariant_violated, "orphan", b, 0};
        const std::int32_t anchor = kids_.find(parent_[ix(b)]);
        std::int32_t k = anchor, n = 0;
        while (k >= 0 && k != b && n <= std::int32_t(state_.size())) {
          k = kid_next_[ix(k)];
          ++n;
          if (k == anchor) k = -1;
        }
        if (k != b) return Status{Errc::invariant_violated, "kid_ring", b, anchor};
      } else if (state_[ix(b)] != kRoot) {
        return Status{Errc::invariant_violated, "kid_state", b, state_[ix(b)]};
      }
    }
    if (members != groups_.size()) return Status{Errc::invariant_violated, "groups", groups_.size(), members};
    std::int32_t hashed = 0;
    for (std::int32_t b = 0; b < std::int32_t(state_.size()); ++b) hashed += has(b) ? 1 : 0;
    if (hashed != members_) return Status{Errc::invariant_violated, "members", members_, hashed};
    return {};
  }

  friend bool operator==(const PrefixIndex& a, const PrefixIndex& b) {
    if (a.members_ != b.members_ || a.state_ != b.state_ || !(a.groups_ == b.groups_) || !(a.kids_ == b.kids_)) return false;
    for (std::size_t i = 0; i < a.state_.size(); ++i) {
      if (a.state_[i] == kNone) continue;
      if (!(a.hash_[i] == b.hash_[i]) || !(a.parent_[i] == b.parent_[i]) || a.copy_next_[i] != b.copy_next_[i] ||
          a.kid_next_[i] != b.kid_next_[i])
        return false;
    }
    return true;
  }

 private:
  // kChild: linked into its parent's children ring. kRoot: the chain starts at
  // a salt. kOrphan: transient, during a cascade.
  static constexpr std::uint8_t kNone = 0, kRoot = 1, kChild = 2, kOrphan = 3;
  static constexpr std::size_t ix(std::int32_t i) noexcept { return static_cast<std::size_t>(i); }

  // Rings are circular doubly linked lists over block ids.
  static void link(std::vector<std::int32_t>& next, std::vector<std::int32_t>& prev, std::int32_t at,
                   std::int32_t b) noexcept {
    const std::int32_t n = next[ix(at)];
    next[ix(at)] = b;
    prev[ix(b)] = at;
    next[ix(b)] = n;
    prev[ix(n)] = b;
  }
  static void unlink(std::vector<std::int32_t>& next, std::vector<std::int32_t>& prev, std::int32_t b) noexcept {
    next[ix(prev[ix(b)])] = next[ix(b)];
    prev[ix(next[ix(b)])] = prev[ix(b)];
    next[ix(b)] = prev[ix(b)] = b;
  }
  void unlink_kid(std::int32_t b) noexcept {
    const BlockHash& p = parent_[ix(b)];
    if (kid_next_[ix(b)] == b) {
      (void)kids_.erase(p);
    } else {
      if (kids_.find(p) == b) (void)kids_.assign(p, kid_next_[ix(b)]);
      unlink(kid_next_, kid_prev_, b);
    }
  }

  std::vector<BlockHash> hash_, parent_;
  std::vector<std::uint8_t> state_;
  std::vector<std::int32_t> copy_next_, copy_prev_, kid_next_, kid_prev_;
  HashIndex groups_;  // hash -> a member
  HashIndex kids_;    // parent hash -> a child
  std::vector<std::int32_t> stack_;  // the cascade's work list (scratch)
  std::int32_t members_ = 0;
};

KVCACHE_END_NAMESPACE
