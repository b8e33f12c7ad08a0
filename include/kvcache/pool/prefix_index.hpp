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

#include "kvcache/core/block_hash.hpp"
#include "kvcache/config.hpp"
#include "kvcache/pool/hash_index.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Hash groups of copies, parent -> children rings, and the cascade that keeps the cache prefix-closed.
class PrefixIndex {
 public:
  // What insert() is told about b's parent: a block holding it (>= 0), or one of these.
  static constexpr std::int32_t kUnknownParent = -1;  ///< Unknown: insert() looks the parent hash up.
  static constexpr std::int32_t kChainRoot = -2;  ///< The chain's root: a salt, never a block.

  PrefixIndex() = default;
  /// Room for block ids [0, capacity).
  explicit PrefixIndex(std::int32_t capacity)
      : n_(ix(capacity)),
        state_(ix(capacity), kNone),
        groups_(capacity),
        stack_(ix(capacity)) {}

  /// Distinct hashes indexed.
  std::int32_t size() const noexcept { return groups_.size(); }
  /// Blocks holding a hash (every copy).
  std::int32_t members() const noexcept { return members_; }
  /// True when b holds a hash (it is a member of that hash's group).
  bool has(std::int32_t b) const noexcept { return state_[ix(b)] != kNone; }
  /// b's hash (meaningful when has(b)).
  const BlockHash& hash(std::int32_t b) const noexcept { return n_[ix(b)].hash; }
  /// The hash b's chain continues (meaningful when has(b) and !is_root(b)).
  const BlockHash& parent(std::int32_t b) const noexcept { return n_[ix(b)].parent; }
  /// True when b's parent is a chain root (a sequence's salt), not a block.
  bool is_root(std::int32_t b) const noexcept { return state_[ix(b)] == kRoot; }
  /// True when b is the only block holding its hash.
  bool alone(std::int32_t b) const noexcept { return n_[ix(b)].copy_next == b; }
  /// A block holding `key`, or -1.
  std::int32_t find(const IndexKey& key) const noexcept { return groups_.find(key); }
  /// Starts loading the index slot of `key` (batched publishes overlap their misses).
  void prefetch(const IndexKey& key) const noexcept { groups_.prefetch(key); }
  /// Another copy of b's hash, or b itself when alone.
  std::int32_t next_copy(std::int32_t b) const noexcept { return n_[ix(b)].copy_next; }

  /// b (holding no hash) takes hash h. Its parent is `parent` when that hash is
  /// indexed, a chain root otherwise; parent_block saves the lookup when the
  /// caller knows (the row's previous block, or kChainRoot). Returns -1 when h
  /// was not indexed yet (a new group: routers hear of it), else the member b
  /// joined as a copy.
  std::int32_t insert(std::int32_t b, const BlockHash& h, const BlockHash& parent,
                      std::int32_t parent_block = kUnknownParent) noexcept {
    n_[ix(b)].hash = h;
    n_[ix(b)].parent = parent;
    std::int32_t up = parent_block >= 0 && has(parent_block) && n_[ix(parent_block)].hash == parent ? parent_block : -1;
    if (up < 0 && parent_block != kChainRoot) up = groups_.find(parent);
    if (up >= 0) {
      state_[ix(b)] = kChild;
      n_[ix(b)].up = up;
      if (n_[ix(up)].kids >= 0) link<&Node::kid_next, &Node::kid_prev>(n_[ix(up)].kids, b);
      else n_[ix(up)].kids = n_[ix(b)].kid_next = n_[ix(b)].kid_prev = b;
    } else {
      state_[ix(b)] = kRoot;
    }
    ++members_;
    const std::int32_t member = groups_.find_or_insert(h, b);
    if (member >= 0) link<&Node::copy_next, &Node::copy_prev>(member, b);
    else n_[ix(b)].copy_next = n_[ix(b)].copy_prev = b;
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
      const std::int32_t kid = n_[ix(x)].kids;
      n_[ix(x)].kids = -1;
      if (gone) {
        (void)groups_.erase(n_[ix(x)].hash);
        // Every child of the hash is dropped below: its ring is abandoned whole.
        if (kid >= 0) {
          std::int32_t k = kid;
          do {
            stack_[top++] = k;
            state_[ix(k)] = kOrphan;  // its ring is gone: do not unlink it
            k = n_[ix(k)].kid_next;
          } while (k != kid);
        }
      } else {
        const std::int32_t heir = n_[ix(x)].copy_next;
        if (groups_.find(n_[ix(x)].hash) == x) (void)groups_.assign(n_[ix(x)].hash, heir);
        unlink<&Node::copy_next, &Node::copy_prev>(x);
        if (kid >= 0) adopt_kids(heir, kid);  // the hash stays: its children hang from another copy
      }
      state_[ix(x)] = kNone;
      --members_;
      dropped(x, gone);
    }
  }

  /// Calls f(x) for every block that loses its hash with b when b, its hash's
  /// only copy, loses it: every block chained from b, transitively (erase()'s
  /// cascade less b itself; every copy of a child hash hangs from b then).
  /// Changes nothing: a pool predicts with it what a recycle will drop.
  template <class F>
  void for_each_chained(std::int32_t b, F&& f) const noexcept {
    std::size_t top = 0;
    const auto push_kids = [&](std::int32_t x) {
      if (const std::int32_t kid = n_[ix(x)].kids; kid >= 0) {
        std::int32_t k = kid;
        do {
          stack_[top++] = k;
          k = n_[ix(k)].kid_next;
        } while (k != kid);
      }
    };
    push_kids(b);
    while (top > 0) {
      const std::int32_t x = stack_[--top];
      f(x);
      push_kids(x);
    }
  }

  /// Forgets everything.
  void clear() noexcept {
    groups_.clear();
    for (auto& n : n_) n.kids = -1;
    for (auto& st : state_) st = kNone;
    members_ = 0;
  }

  /// Groups, rings and the closure, O(capacity). ref(b) gives b's holders:
  /// a free block (0 holders) with a hash must be its hash's only copy.
  template <class Ref>
  Status check(Ref&& ref) const {
    std::int32_t members = 0, hashed = 0;
    for (std::int32_t b = 0; b < std::int32_t(n_.size()); ++b) {
      if (!has(b)) {
        if (n_[ix(b)].kids != -1) return Status{Errc::invariant_violated, "kids_of_unhashed", b, n_[ix(b)].kids};
        continue;
      }
      ++hashed;
      const std::int32_t m = groups_.find(n_[ix(b)].hash);
      if (m < 0 || !has(m) || !(n_[ix(m)].hash == n_[ix(b)].hash)) return Status{Errc::invariant_violated, "group", b, m};
      if (m == b) ++members;
      if (n_[ix(n_[ix(b)].copy_next)].copy_prev != b || !(n_[ix(n_[ix(b)].copy_next)].hash == n_[ix(b)].hash))
        return Status{Errc::invariant_violated, "copy_ring", b, n_[ix(b)].copy_next};
      if (ref(b) == 0 && !alone(b)) return Status{Errc::invariant_violated, "free_copy", b, n_[ix(b)].copy_next};
      if (state_[ix(b)] == kChild) {
        // Prefix-closed: b hangs from a block holding its parent hash.
        const std::int32_t up = n_[ix(b)].up;
        if (up < 0 || !has(up) || !(n_[ix(up)].hash == n_[ix(b)].parent)) return Status{Errc::invariant_violated, "orphan", b, up};
        const std::int32_t anchor = n_[ix(up)].kids;
        std::int32_t k = anchor, n = 0;
        while (k >= 0 && k != b && n <= std::int32_t(n_.size())) {
          k = n_[ix(k)].kid_next;
          ++n;
          if (k == anchor) k = -1;
        }
        if (k != b || n_[ix(n_[ix(b)].kid_next)].kid_prev != b) return Status{Errc::invariant_violated, "kid_ring", b, anchor};
      } else if (state_[ix(b)] != kRoot) {
        return Status{Errc::invariant_violated, "kid_state", b, state_[ix(b)]};
      }
    }
    if (members != groups_.size()) return Status{Errc::invariant_violated, "groups", groups_.size(), members};
    if (hashed != members_) return Status{Errc::invariant_violated, "members", members_, hashed};
    return {};
  }

  friend bool operator==(const PrefixIndex& a, const PrefixIndex& b) {
    if (a.members_ != b.members_ || a.n_.size() != b.n_.size() || !(a.groups_ == b.groups_)) return false;
    for (std::size_t i = 0; i < a.n_.size(); ++i) {
      const Node &x = a.n_[i], &y = b.n_[i];
      if (a.state_[i] != b.state_[i] || x.kids != y.kids) return false;
      if (a.state_[i] == kNone) continue;
      if (!(x.hash == y.hash) || !(x.parent == y.parent) || x.copy_next != y.copy_next || x.kid_next != y.kid_next || x.up != y.up)
        return false;
    }
    return true;
  }

 private:
  // kChild: linked into its parent block's children ring. kRoot: the chain
  // starts at a salt. kOrphan: transient, during a cascade.
  static constexpr std::uint8_t kNone = 0, kRoot = 1, kChild = 2, kOrphan = 3;
  static constexpr std::size_t ix(std::int32_t i) noexcept { return static_cast<std::size_t>(i); }

  struct Node;
  // Rings are circular doubly linked lists over block ids (Next, Prev: which ring).
  template <std::int32_t Node::*Next, std::int32_t Node::*Prev>
  void link(std::int32_t at, std::int32_t b) noexcept {
    const std::int32_t n = n_[ix(at)].*Next;
    n_[ix(at)].*Next = b;
    n_[ix(b)].*Prev = at;
    n_[ix(b)].*Next = n;
    n_[ix(n)].*Prev = b;
  }
  template <std::int32_t Node::*Next, std::int32_t Node::*Prev>
  void unlink(std::int32_t b) noexcept {
    n_[ix(n_[ix(b)].*Prev)].*Next = n_[ix(b)].*Next;
    n_[ix(n_[ix(b)].*Next)].*Prev = n_[ix(b)].*Prev;
    n_[ix(b)].*Next = n_[ix(b)].*Prev = b;
  }
  void unlink_kid(std::int32_t b) noexcept {
    const std::int32_t up = n_[ix(b)].up;
    if (n_[ix(up)].kids == b) n_[ix(up)].kids = n_[ix(b)].kid_next == b ? -1 : n_[ix(b)].kid_next;
    unlink<&Node::kid_next, &Node::kid_prev>(b);
  }
  // The ring starting at `kid` now hangs from `heir` (a copy of the same hash):
  // each child names its new parent block (O(children)), then the rings splice.
  void adopt_kids(std::int32_t heir, std::int32_t kid) noexcept {
    std::int32_t k = kid;
    do {
      n_[ix(k)].up = heir;
      k = n_[ix(k)].kid_next;
    } while (k != kid);
    const std::int32_t a = n_[ix(heir)].kids;
    if (a < 0) {
      n_[ix(heir)].kids = kid;
      return;
    }
    const std::int32_t a_last = n_[ix(a)].kid_prev, k_last = n_[ix(kid)].kid_prev;
    n_[ix(a_last)].kid_next = kid;
    n_[ix(kid)].kid_prev = a_last;
    n_[ix(k_last)].kid_next = a;
    n_[ix(a)].kid_prev = k_last;
  }

  // Everything else about one block in one cache line: a publish touches the
  // block's and its parent's, and one slot of the hash index.
  struct Node {
    BlockHash hash{}, parent{};
    std::int32_t copy_next = -1, copy_prev = -1;  // the ring of copies of `hash`
    std::int32_t kid_next = -1, kid_prev = -1;    // the ring of children b is in
    std::int32_t up = -1;                          // the block whose children ring holds b
    std::int32_t kids = -1;                        // a child of b (its ring's anchor), or -1
  };
  std::vector<Node> n_;
  // Apart from the nodes: has() is read for every tail on the decode step's
  // fast path, and 16 KB of states stay cached where 1 MB of nodes would not.
  std::vector<std::uint8_t> state_;
  HashIndex groups_;  // hash -> a member
  mutable std::vector<std::int32_t> stack_;  // the cascade's work list (scratch; for_each_chained's too)
  std::int32_t members_ = 0;
};

KVCACHE_END_NAMESPACE
