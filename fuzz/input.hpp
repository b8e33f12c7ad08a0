// The fuzzer's bytes read as a stream of small integers (0 past the end);
// each target adds the readers it needs on top.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fuzz_input {
struct Bytes {
  const std::uint8_t* p;
  std::size_t n;
  std::uint32_t byte() { return n ? (--n, *p++) : 0u; }
};
}  // namespace fuzz_input
