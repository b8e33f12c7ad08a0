// Admission that persists every token: the default, and free.
#pragma once

#include "kvcache/config.hpp"
#include "kvcache/policy.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Admission that persists every token where reserve() puts it (the default):
/// the cache never calls it, so it costs nothing.
struct AdmitAll {
  static constexpr Signals required_signals = no_signals;  ///< Reads no score signal.
  static constexpr AdmissionKind kind = AdmissionKind::pass_through;  ///< Never consulted.
};
static_assert(AdmissionPolicy<AdmitAll>);

KVCACHE_END_NAMESPACE
