// Selection that reads every page: the default (dense attention).
#pragma once

#include "kvcache/config.hpp"
#include "kvcache/policy.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Selection that reads every page (the default): the cache never calls it and it takes no space.
struct SelectAll {
  static constexpr Signals required_signals = no_signals;  ///< Reads no score signal.
  static constexpr SelectionKind kind = SelectionKind::dense;  ///< Never consulted.
};
static_assert(SelectionPolicy<SelectAll>);

KVCACHE_END_NAMESPACE
