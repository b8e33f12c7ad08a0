// Admission that persists every token: the default, and free.
#pragma once

#include "kvcache/config.hpp"
#include "kvcache/policy.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Admission that persists every token (the default; the cache never consults it yet).
struct AdmitAll {
  static constexpr Signals required_signals = no_signals;  ///< Reads no score signal.
  /// Always true: every token's K/V is written.
  constexpr bool admit(const AdmissionQuery&) const noexcept { return true; }
};
static_assert(AdmissionPolicy<AdmitAll>);

KVCACHE_END_NAMESPACE
