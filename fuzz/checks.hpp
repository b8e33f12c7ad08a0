// What every fuzz run asks of a call that failed: it names no broken
// invariant, and it changed neither the cache nor the pool's memory.
#pragma once

#include <kvcache/status.hpp>

namespace fuzz_checks {
template <class Cache, class Memory, class Fail>
void failed_call_changed_nothing(const kvcache::Status& st, const Cache& cache, const Cache& before, const Memory& mem,
                                 const Memory& mem_before, Fail&& fail) {
  if (st.ok()) return;
  if (st.code() == kvcache::Errc::invariant_violated) fail("invariant_violated from a call", st.message());
  if (!(cache == before)) fail("a failed call changed the cache", st.message());
  if (mem != mem_before) fail("a failed call wrote memory", st.message());
}
}  // namespace fuzz_checks
