// What each copy of the library reports to main: its version as it sees it,
// the address of its version function (one symbol per copy when the copies'
// namespaces differ; one merged symbol when they do not), and whether its
// cache handed out the slots it should.
#pragma once

struct EngineReport {
  const char* version;
  int version_number;
  const void* version_fn;
  bool cache_works;
};

// With the library at X.Y.Z (kvcache::vX):
EngineReport engine_a();  // the library as it is: X.Y.Z, kvcache::vX
EngineReport engine_b();  // the next major: (X+1).0.0, kvcache::v(X+1)
EngineReport engine_c();  // the same major, vendored: X.Y.(Z+9), KVCACHE_INLINE_NAMESPACE=vX_vendored
EngineReport engine_d();  // the same major, not renamed: X.Y.(Z+9), kvcache::vX (the control)
