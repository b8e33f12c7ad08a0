// What an eviction policy is fed: the checks every observe() runs before a
// policy sees a score, for per-sequence rows and head rows alike.
#pragma once

#include <cstdint>
#include <span>

#include "kvcache/config.hpp"
#include "kvcache/policy.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Scores of `kind` for policy E: a kind outside ScoreKind or one E does not
/// read, rows < 1, a size other than `want`, or a value that is NaN,
/// infinite or negative is invalid_argument naming it.
template <class E>
Status check_scores(ScoreKind kind, std::int32_t rows, std::span<const float> values, std::int64_t want) noexcept {
  if (!valid_kind(kind) || !E::required_signals.covers(signal_of(kind)))
    return Status{Errc::invalid_argument, "scores.kind", std::int64_t(kind), std::int64_t(E::required_signals.bits)};
  if (rows < 1) return Status{Errc::invalid_argument, "scores.rows", rows, 1};
  if (std::int64_t(values.size()) != want) return Status{Errc::invalid_argument, "scores.size", std::int64_t(values.size()), want};
  if (const std::int64_t bad = first_outside(values, 0.0f, kMaxScore); bad >= 0)
    return Status{Errc::invalid_argument, "scores_at", bad, 0};
  return {};
}

KVCACHE_END_NAMESPACE
