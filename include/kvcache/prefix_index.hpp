// The cached content of a block pool: which blocks hold which chained hash,
// kept prefix-closed.
//
// Blocks that hold the same hash form one group (a ring of copies); the index
// maps the hash to one member. Two identical prompts, or n > 1 sampling, make
// copies: every copy is a member, so when the copy a lookup found goes, the
// next one serves the hit instead of its tokens silently dropping out of the
// cache.
//
// Every hashed block is also linked into a ring of children hanging from one
// block of its parent hash (usually its own row's previous block, which the
// publisher names: no lookup). When a copy leaves its group its children move
// to another copy; when the last copy of a hash goes, its children can no
// longer be reached by a prefix walk, so they lose their hashes too, and
// theirs in turn: no block is ever indexed while its parent is not. The
// cascade visits each dropped block once, with an explicit stack sized at
// construction (no allocation, no recursion).
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
  /// What insert() is told about b's parent: a block holding it (>= 0),
  /// unknown (look the hash up), or the chain's root (a salt, never a block).
  static constexpr std::int32_t kUnknownParent = -1, kChainRoot = -2;

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
        up_(ix(capacity), -1),
        kids_(ix(capacity), -1),
        groups_(capacity),
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
  /// indexed, a chain root otherwise; parent_block saves the lookup when the
  /// caller knows (the row's previous block, or kChainRoot). Returns -1 when h
  /// was not indexed yet (a new group: routers hear of it), else the member b
  /// joined as a copy.
  std::int32_t insert(std::int32_t b, const BlockHash& h, const BlockHash& parent,
                      std::int32_t parent_block = kUnknownParent) noexcept {
    hash_[ix(b)] = h;
    parent_[ix(b)] = parent;
    std::int32_t up = parent_block >= 0 && has(parent_block) && hash_[ix(parent_block)] == parent ? parent_block : -1;
    if (up < 0 && parent_block != kChainRoot) up = groups_.find(parent);
    if (up >= 0) {
      state_[ix(b)] = kChild;
      up_[ix(b)] = up;
      if (kids_[ix(up)] >= 0) link(kid_next_, kid_prev_, kids_[ix(up)], b);
      else kids_[ix(up)] = kid_next_[ix(b)] = kid_prev_[ix(b)] = b;
    } else {
      state_[ix(b)] = kRoot;
    }
    ++members_;
    const std::int32_t member = groups_.find_or_insert(h, b);
    if (member >= 0) link(copy_next_, copy_prev_, member, b);
    else copy_next_[ix(b)] = copy_prev_[ix(b)] = b;
    return member;
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
      const bool gone = alone(x);
      const std::int32_t kid = kids_[ix(x)];
      kids_[ix(x)] = -1;
      if (gone) {
        (void)groups_.erase(hash_[ix(x)]);
        // Every child of the hash is dropped below: its ring is abandoned whole.
        if (kid >= 0) {
          std::int32_t k = kid;
          do {
            stack_[top++] = k;
            state_[ix(k)] = kOrphan;  // its ring is gone: do not unlink it
            k = kid_next_[ix(k)];
          } while (k != kid);
        }
      } else {
        const std::int32_t heir = copy_next_[ix(x)];
        if (groups_.find(hash_[ix(x)]) == x) (void)groups_.assign(hash_[ix(x)], heir);
        unlink(copy_next_, copy_prev_, x);
        if (kid >= 0) adopt_kids(heir, kid);  // the hash stays: its children hang from another copy
      }
      state_[ix(x)] = kNone;
      --members_;
      dropped(x, gone);
    }
  }

  /// Forgets everything.
  void clear() noexcept {
    groups_.clear();
    for (auto& s : state_) s = kNone;
    for (auto& k : kids_) k = -1;
    members_ = 0;
  }

  /// Groups, rings and the closure, O(capacity). ref(b) gives b's holders:
  /// a free block (0 holders) with a hash must be its hash's only copy.
  template <class Ref>
  Status check(Ref&& ref) const {
    std::int32_t members = 0, hashed = 0;
    for (std::int32_t b = 0; b < std::int32_t(state_.size()); ++b) {
      if (!has(b)) {
        if (kids_[ix(b)] != -1) return Status{Errc::invariant_violated, "kids_of_unhashed", b, kids_[ix(b)]};
        continue;
      }
      ++hashed;
      const std::int32_t m = groups_.find(hash_[ix(b)]);
      if (m < 0 || !has(m) || !(hash_[ix(m)] == hash_[ix(b)])) return Status{Errc::invariant_violated, "group", b, m};
      if (m == b) ++members;
      if (copy_prev_[ix(copy_next_[ix(b)])] != b || !(hash_[ix(copy_next_[ix(b)])] == hash_[ix(b)]))
        return Status{Errc::invariant_violated, "copy_ring", b, copy_next_[ix(b)]};
      if (ref(b) == 0 && !alone(b)) return Status{Errc::invariant_violated, "free_copy", b, copy_next_[ix(b)]};
      if (state_[ix(b)] == kChild) {
        // Prefix-closed: b hangs from a block holding its parent hash.
        const std::int32_t up = up_[ix(b)];
        if (up < 0 || !has(up) || !(hash_[ix(up)] == parent_[ix(b)])) return Status{Errc::invariant_violated, "orphan", b, up};
        const std::int32_t anchor = kids_[ix(up)];
        std::int32_t k = anchor, n = 0;
        while (k >= 0 && k != b && n <= std::int32_t(state_.size())) {
          k = kid_next_[ix(k)];
          ++n;
          if (k == anchor) k = -1;
        }
        if (k != b || kid_prev_[ix(kid_next_[ix(b)])] != b) return Status{Errc::invariant_violated, "kid_ring", b, anchor};
      } else if (state_[ix(b)] != kRoot) {
        return Status{Errc::invariant_violated, "kid_state", b, state_[ix(b)]};
      }
    }
    if (members != groups_.size()) return Status{Errc::invariant_violated, "groups", groups_.size(), members};
    if (hashed != members_) return Status{Errc::invariant_violated, "members", members_, hashed};
    return {};
  }

  friend bool operator==(const PrefixIndex& a, const PrefixIndex& b) {
    if (a.members_ != b.members_ || a.state_ != b.state_ || a.kids_ != b.kids_ || !(a.groups_ == b.groups_)) return false;
    for (std::size_t i = 0; i < a.state_.size(); ++i) {
      if (a.state_[i] == kNone) continue;
      if (!(a.hash_[i] == b.hash_[i]) || !(a.parent_[i] == b.parent_[i]) || a.copy_next_[i] != b.copy_next_[i] ||
          a.kid_next_[i] != b.kid_next_[i] || a.up_[i] != b.up_[i])
        return false;
    }
    return true;
  }

 private:
  // kChild: linked into its parent block's children ring. kRoot: the chain
  // starts at a salt. kOrphan: transient, during a cascade.
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
    const std::int32_t up = up_[ix(b)];
    if (kids_[ix(up)] == b) kids_[ix(up)] = kid_next_[ix(b)] == b ? -1 : kid_next_[ix(b)];
    unlink(kid_next_, kid_prev_, b);
  }
  // The ring starting at `kid` now hangs from `heir` (a copy of the same hash):
  // each child names its new parent block (O(children)), then the rings splice.
  void adopt_kids(std::int32_t heir, std::int32_t kid) noexcept {
    std::int32_t k = kid;
    do {
      up_[ix(k)] = heir;
      k = kid_next_[ix(k)];
    } while (k != kid);
    const std::int32_t a = kids_[ix(heir)];
    if (a < 0) {
      kids_[ix(heir)] = kid;
      return;
    }
    const std::int32_t a_last = kid_prev_[ix(a)], k_last = kid_prev_[ix(kid)];
    kid_next_[ix(a_last)] = kid;
    kid_prev_[ix(kid)] = a_last;
    kid_next_[ix(k_last)] = a;
    kid_prev_[ix(a)] = k_last;
  }

  std::vector<BlockHash> hash_, parent_;
  std::vector<std::uint8_t> state_;
  std::vector<std::int32_t> copy_next_, copy_prev_, kid_next_, kid_prev_;
  std::vector<std::int32_t> up_;    // the block whose children ring holds b
  std::vector<std::int32_t> kids_;  // a child of b (its ring's anchor), or -1
  HashIndex groups_;  // hash -> a member
  std::vector<std::int32_t> stack_;  // the cascade's work list (scratch)
  std::int32_t members_ = 0;
};

KVCACHE_END_NAMESPACE
