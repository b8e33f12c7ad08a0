// An admission policy on per-sequence rows (a token-paged cache's
// participant): how reserve() and reserve_batch() take room. A pass-through
// policy (AdmitAll) is never consulted: the table reserves every token. A
// per-token policy says which tokens are written at all: room is taken for
// the admitted ones only, the others get slot -1 (the scatter skips them),
// and the row's positions advance over every token.
//
// Rows that skip positions are not prefixes of their prompts, so a per-token
// admission excludes prefix caching (publish_on_reserve is a ConfigError,
// publish() an error, and no prefix hit can exist), and a rollback is refused
// (which held tokens the last n positions left is the policy's business).
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/config.hpp"
#include "kvcache/table/page_table.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// A per-token admission: admits(seq, position) says whether the token at
/// `position` of seq is written. It must answer the same for the same
/// question while the call runs (the cache asks twice: to count, then to place).
template <class P>
concept TokenAdmission = AdmissionPolicy<P> && P::kind == AdmissionKind::per_token &&
                         requires(const P& cp, SeqId s, std::int64_t position) {
                           { cp.admits(s, position) } -> std::convertible_to<bool>;
                         };

/// A pass-through admission: the table reserves every token.
template <AdmissionPolicy A>
class RowAdmission {
 public:
  RowAdmission() = default;
  /// Takes the policy.
  explicit RowAdmission(A policy) : a_(std::move(policy)) {}
  /// Nothing to size; every cache option is allowed.
  void bind(std::int32_t, bool) noexcept {}
  const A& policy() const noexcept { return a_; }  ///< The policy.
  /// table.reserve().
  template <class Table, class Pool>
  Result<ReserveInfo> reserve(Table& t, Pool& pool, SeqId s, std::int32_t n, std::span<std::int32_t> slots) noexcept {
    return t.reserve(pool, s, n, slots);
  }
  /// table.reserve_batch().
  template <class Table, class Pool>
  Result<BatchInfo> reserve_batch(Table& t, Pool& pool, std::span<const SeqId> seqs, std::span<const std::int32_t> counts,
                                  std::span<std::int32_t> slots, std::span<BlockCopy> copies) noexcept {
    return t.reserve_batch(pool, seqs, counts, slots, copies);
  }
  /// Rows are prefixes: they may be published.
  Status check_prefix() const noexcept { return {}; }
  /// Any rollback the table allows.
  Status check_truncate() const noexcept { return {}; }
  friend bool operator==(const RowAdmission&, const RowAdmission&) { return true; }

 private:
  [[no_unique_address]] A a_{};
};

/// A per-token admission: room for the admitted tokens, slot -1 for the others.
template <AdmissionPolicy A>
  requires(A::kind == AdmissionKind::per_token)
class RowAdmission<A> {
  static_assert(TokenAdmission<A>, "kvcache::Cache: a per_token admission policy must model TokenAdmission "
                                   "(admission/row_admission.hpp): bool admits(SeqId, int64_t position) const");

 public:
  RowAdmission() = default;
  /// Takes the policy.
  explicit RowAdmission(A policy) : a_(std::move(policy)) {}
  /// Sizes the batch scratch for `streams` sequences; publishing on reserve is a ConfigError.
  void bind(std::int32_t streams, bool publish_on_reserve) {
    if (publish_on_reserve)
      throw ConfigError("kvcache::Cache", Status{Errc::invalid_argument, "publish_on_reserve (a per-token admission's rows are not prefixes)", 1, 0});
    kept_.assign(std::size_t(streams > 0 ? streams : 0), 0);
  }
  const A& policy() const noexcept { return a_; }  ///< The policy.

  /// Reserves the admitted ones of n tokens of s: slots[k] is token k's slot,
  /// or -1 when the policy did not admit it. All or nothing.
  template <class Table, class Pool>
  Result<ReserveInfo> reserve(Table& t, Pool& pool, SeqId s, std::int32_t n, std::span<std::int32_t> slots) noexcept {
    if (auto st = t.validate(s); !st) return st;
    if (n < 0) return Status{Errc::invalid_argument, "n_tokens", n, 0};
    if (std::int64_t(slots.size()) < n) return Status{Errc::buffer_too_small, "slots", std::int64_t(slots.size()), n};
    const std::int64_t first = t.appended_unchecked(s);
    const std::int32_t k = admitted(s, first, n);
    auto r = t.reserve(pool, s, k, slots.first(std::size_t(k)));
    if (!r) return r;
    spread(s, first, n, k, slots.data());
    (void)t.skip(s, n - k);  // validated: cannot fail
    return r;
  }
  /// reserve_batch() of the admitted tokens: slots packed as the counts say,
  /// -1 for every token not admitted and past the batch. All or nothing.
  template <class Table, class Pool>
  Result<BatchInfo> reserve_batch(Table& t, Pool& pool, std::span<const SeqId> seqs, std::span<const std::int32_t> counts,
                                  std::span<std::int32_t> slots, std::span<BlockCopy> copies) noexcept {
    if (counts.size() != seqs.size()) return t.reserve_batch(pool, seqs, counts, slots, copies);  // the table names it
    if (seqs.size() > kept_.size())
      return Status{Errc::capacity_exceeded, "seqs.size", std::int64_t(seqs.size()), std::int64_t(kept_.size())};
    const std::size_t n = seqs.size();
    std::int64_t total = 0;
    for (std::size_t k = 0; k < n; ++k) {  // a bad handle or count keeps its count: the table names it
      kept_[k] = counts[k];
      if (counts[k] > 0 && t.live(seqs[k])) kept_[k] = admitted(seqs[k], t.appended_unchecked(seqs[k]), counts[k]);
      total += counts[k] > 0 ? counts[k] : 0;
    }
    if (std::int64_t(slots.size()) < total) return Status{Errc::buffer_too_small, "slots", std::int64_t(slots.size()), total};
    auto r = t.reserve_batch(pool, seqs, std::span<const std::int32_t>(kept_.data(), n), slots, copies);
    if (!r) return r;
    // Spread each entry's packed slots to its own range, last entry first:
    // a destination never lies below its source, so nothing unread is overwritten.
    std::int64_t src = r->slots, dst = total;
    for (std::size_t k = n; k-- > 0;) {
      src -= kept_[k], dst -= counts[k];
      const std::int64_t first = t.appended_unchecked(seqs[k]) - kept_[k];
      std::copy_backward(slots.begin() + src, slots.begin() + src + kept_[k], slots.begin() + dst + kept_[k]);
      spread(seqs[k], first, counts[k], kept_[k], slots.data() + dst);
      (void)t.skip(seqs[k], counts[k] - kept_[k]);
    }
    return BatchInfo{std::int32_t(total), r->copies};
  }
  /// Rows skip positions: they are not prefixes.
  Status check_prefix() const noexcept {
    return Status{Errc::invalid_argument, "publish (a per-token admission's rows are not prefixes)", 1, 0};
  }
  /// A rollback of positions would not say which held tokens leave: refused.
  Status check_truncate() const noexcept {
    return Status{Errc::invalid_argument, "truncate (a per-token admission's rows skip positions)", 1, 0};
  }
  friend bool operator==(const RowAdmission&, const RowAdmission&) { return true; }

 private:
  // Tokens admitted among positions [first, first + n) of s.
  std::int32_t admitted(SeqId s, std::int64_t first, std::int32_t n) const noexcept {
    std::int32_t k = 0;
    for (std::int32_t j = 0; j < n; ++j) k += a_.admits(s, first + j) ? 1 : 0;
    return k;
  }
  // slots[0..k) hold the admitted tokens' slots in order: move them to their
  // tokens' places in slots[0..n) and mark the rest -1. Backwards: token j's
  // place is at or after its admitted index.
  void spread(SeqId s, std::int64_t first, std::int32_t n, std::int32_t k, std::int32_t* slots) const noexcept {
    for (std::int32_t j = n; j-- > 0;) slots[j] = a_.admits(s, first + j) ? slots[--k] : -1;
  }

  [[no_unique_address]] A a_{};
  std::vector<std::int32_t> kept_;  // reserve_batch: each entry's admitted count (scratch)
};

KVCACHE_END_NAMESPACE
