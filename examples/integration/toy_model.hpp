// What the integration guides use in place of a model: K/V whose every
// element says which token, at which position, in which layer and head it
// belongs to, so an engine loop can read back through the tables it exports
// and prove each row holds what it should. Shared by the three guides.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace toy {

// K of (token id < 256, position < 2048, layer < 4, head < 4) as an f32 that
// is exact (at most 23 significant bits) and unique; V is its negation.
inline float k_value(std::int32_t token, std::int32_t pos, std::int32_t layer, std::int32_t head) {
  return float(token * 2048 + pos) + 0.25f * float(layer) + 0.0625f * float(head);
}

// A guide fails loudly: the test that runs it sees a non-zero exit.
inline void expect(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("integration check failed: " + what);
}

}  // namespace toy
