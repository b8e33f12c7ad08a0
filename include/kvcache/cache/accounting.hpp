// What a scheduler asks of any cache before it admits a request: the checks
// on the lengths it names, shared by both modes. What a request needs is the
// eviction state's answer (eviction/row_eviction.hpp for per-sequence rows,
// the admission's max_blocks_held for head rows); the cache adds the pool's
// free blocks and the blocks it promised (prefix_cache.hpp's ledger).
#pragma once

#include <cstdint>

#include "kvcache/config.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Longest prompt_len + max_new accounting accepts (2^62: no overflow below).
inline constexpr std::int64_t max_request_length = std::int64_t{1} << 62;

/// blocks_needed()'s arguments: lengths in [0, max_request_length] whose sum
/// fits it, a chunk >= 0. The error names the value and the bound it broke
/// (the lower one for a negative value).
inline Status check_request_lengths(std::int64_t prompt_len, std::int64_t max_new, std::int64_t prefill_chunk) noexcept {
  if (prompt_len < 0) return Status{Errc::invalid_argument, "prompt_len", prompt_len, 0};
  if (prompt_len > max_request_length) return Status{Errc::invalid_argument, "prompt_len", prompt_len, max_request_length};
  if (max_new < 0) return Status{Errc::invalid_argument, "max_new", max_new, 0};
  if (max_new > max_request_length - prompt_len)
    return Status{Errc::invalid_argument, "max_new", max_new, max_request_length - prompt_len};
  if (prefill_chunk < 0) return Status{Errc::invalid_argument, "prefill_chunk", prefill_chunk, 0};
  return {};
}

KVCACHE_END_NAMESPACE
