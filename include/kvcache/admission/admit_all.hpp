// Admission that persists every token: the default, and free.
#pragma once

#include "kvcache/config.hpp"
#include "kvcache/policy.hpp"

KVCACHE_BEGIN_NAMESPACE

struct AdmitAll {
  static constexpr Signals required_signals = no_signals;
  constexpr bool admit(const AdmissionQuery&) const noexcept { return true; }
};
static_assert(AdmissionPolicy<AdmitAll>);

KVCACHE_END_NAMESPACE
