// Selection that reads every page: the default (dense attention).
#pragma once

#include <cstdint>
#include <span>

#include "kvcache/config.hpp"
#include "kvcache/policy.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Selection that reads every page (the default; the cache never consults it yet).
struct SelectAll {
  static constexpr Signals required_signals = no_signals;  ///< Reads no score signal.
  /// Writes every page index 0..num_pages-1 to out; returns num_pages.
  std::int32_t select(const SelectionQuery& q, std::span<std::int32_t> out) const noexcept {
    const std::int32_t n = q.num_pages < std::int32_t(out.size()) ? q.num_pages : std::int32_t(out.size());
    for (std::int32_t p = 0; p < n; ++p) out[std::size_t(p)] = p;
    return n;
  }
};
static_assert(SelectionPolicy<SelectAll>);

KVCACHE_END_NAMESPACE
