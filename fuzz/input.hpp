// The fuzzer's bytes read as a stream of small integers (0 past the end);
// each target adds the readers it needs on top.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace fuzz_input {
struct Bytes {
  const std::uint8_t* p;
  std::size_t n;
  std::uint32_t byte() { return n ? (--n, *p++) : 0u; }
  /// A value in [0, m): what the shared test harnesses draw with.
  std::int32_t pick(std::int32_t m) { return std::int32_t(byte() % std::uint32_t(m)); }
};

/// The harnesses' need(ok, what) for a fuzz target: prints `target: what` and aborts when ok is false.
inline auto need_for(const char* target) {
  return [target](bool ok, const char* what) {
    if (ok) return;
    std::fprintf(stderr, "%s: %s\n", target, what);
    std::abort();
  };
}
}  // namespace fuzz_input
