// The example engine over the token-paged cache: Scheduler (scheduler.hpp,
// continuous batching, chunked prefill, preemption) running PagedBackend
// (paged_backend.hpp, a row per request, the eviction policy fed from the
// attention the forward pass computes). gated.hpp runs the same scheduler
// over Write-Gated KV's head-paged cache.
#pragma once

#include <kvcache/kvcache.hpp>

#include "engine_types.hpp"
#include "paged_backend.hpp"
#include "scheduler.hpp"

namespace engine {

template <class Policy, class Selection = kvcache::SelectAll>
class Engine : public Scheduler<PagedBackend<Policy, Selection>> {
 public:
  using Backend = PagedBackend<Policy, Selection>;
  using Cache = typename Backend::Cache;

  Engine(const Model& m, const EngineConfig& cfg, Policy policy) : Scheduler<Backend>(m, cfg, std::move(policy)) {}

  const Cache& cache() const { return this->backend().cache(); }
  // What r holds, read through the page table (PagedBackend::view).
  PagedKv<Cache> view(const Request& r) { return this->kv().view(r); }
  std::int64_t held(const Request& r) const { return this->backend().held(r); }
  std::int32_t group_of(std::int32_t layer, std::int32_t head) const { return this->backend().group_of(layer, head); }
  kvcache::Result<std::int64_t> blocks_needed(std::int64_t tokens, std::int64_t new_tokens, std::int64_t chunk) const {
    return this->backend().blocks_needed(tokens, new_tokens, chunk);
  }
};

}  // namespace engine
