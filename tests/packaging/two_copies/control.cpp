// The control: a copy of the same major that is NOT renamed (patch + 9, in
// kvcache::vX) merges with the library's own copy at link time, one engine
// silently running the other's code. The test passes when the merge is seen,
// which shows main.cpp's check can fail (and why KVCACHE_INLINE_NAMESPACE exists).
#include <cstdio>
#include <cstring>

#include "engine.hpp"

int main() {
  const EngineReport a = engine_a(), d = engine_d();
  const bool merged = a.version_fn == d.version_fn && std::strcmp(a.version, d.version) == 0;
  std::printf("engine_a: %s, engine_d (built as another patch): %s: %s\n", a.version, d.version,
              merged ? "merged, as expected without a namespace of its own" : "NOT merged");
  return merged ? 0 : 1;
}
