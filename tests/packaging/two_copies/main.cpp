// Two engines in one program, each with its own copy of kvcache: a copy of
// another major (kvcache::v1) and a vendored copy of the same major
// (KVCACHE_INLINE_NAMESPACE) link beside the library's own copy, and each
// keeps its own code. Exit 0 when every copy reports itself.
#include <cstdio>
#include <cstring>

#include "engine.hpp"

namespace {
bool check(const char* name, const EngineReport& r, const char* version, int number) {
  const bool ok = std::strcmp(r.version, version) == 0 && r.version_number == number && r.cache_works;
  std::printf("%s: kvcache %s (%d), cache %s: %s\n", name, r.version, r.version_number,
              r.cache_works ? "works" : "FAILS", ok ? "ok" : "WRONG COPY");
  return ok;
}
}  // namespace

int main() {
  const EngineReport a = engine_a(), b = engine_b(), c = engine_c();
  // The expected versions come from CMake (the library's, and the two it made up).
  bool ok = check("engine_a", a, VERSION_A, NUMBER_A) && check("engine_b", b, VERSION_B, NUMBER_B) &&
            check("engine_c", c, VERSION_C, NUMBER_C);
  ok = ok && a.version_fn != b.version_fn && a.version_fn != c.version_fn && b.version_fn != c.version_fn;
  std::printf("three copies, %s symbols\n", ok ? "three sets of" : "SHARED");
  return ok ? 0 : 1;
}
