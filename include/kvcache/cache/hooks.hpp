// The hooks a cache calls on its participants. A cache method makes its own
// edit (the page table's, or the head-paged admission's) and then tells every
// participant what happened, in one loop, as vLLM's coordinator loops over
// its managers: the prefix state, the eviction state with its bound ledger,
// the selection's stale pages, the global region. A participant defines the
// hooks it cares about and nothing else; a hook it lacks costs nothing.
//
// Per-sequence rows (token-paged caches), `rows` = RowsRef:
//   forked(rows, parent, child)                 a fork shares parent's blocks
//   freed(rows, s)                              s ended; its handle died
//   reserved(rows, s, n, copy)                  n tokens appended (copy-on-write in copy)
//   reserved_batch(rows, seqs, counts, copies)  reserve_batch() of a step
//   truncated(rows, s, n)                       a rollback of n tokens
//   imported(rows, s, n)                        an import's n received tokens landed (commit)
//   adopted(rows, s, hits)                      a new row of s took `hits` published blocks (a prefix hit)
//   evicted(rows, s, result)                    the eviction policy ran on s
// Head rows (head-paged caches), `heads` = HeadsRef:
//   forked(heads, parent, child), freed(heads, s), truncated(heads, s)
//   written(heads, seqs, first_layer, last_layer, copies)  writes; copies: copy-on-write
//   reconciled(heads, s, layer, n)              a deferred write of n tokens replayed
//   region_compacted(heads, row, first_page)    a head row's pages from first_page on were rewritten
// Every hook runs after the edit succeeded, and none can fail: whatever can
// fail is checked before the edit.
#pragma once

#include <cstdint>
#include <span>

#include "kvcache/config.hpp"
#include "kvcache/core/sequence_id.hpp"

KVCACHE_BEGIN_NAMESPACE

/// What a participant sees of a token-paged cache when a hook runs.
template <class Table, class Pool>
struct RowsRef {
  const Table& table;  ///< The page table, after the edit.
  const Pool& pool;    ///< The block pool, after the edit.
};

/// What a participant sees of a head-paged cache when a hook runs.
template <class Table, class Pool, class Admission>
struct HeadsRef {
  const Table& table;          ///< The page table of head rows, after the edit.
  const Pool& pool;            ///< The block pool, after the edit.
  const Admission& admission;  ///< The head-paged admission that owns the rows.
};

// Each hook is a tag: Hook::call(part, args...) runs part.hook(args...) when
// the part defines it, and nothing otherwise. A cache's notify(hook, ...)
// passes the same arguments to each of its participants in turn.
namespace hooks {

#define KVCACHE_HOOK(name)                                            \
  struct name##_t {                                                   \
    template <class Part, class... Args>                              \
    static void call(Part& part, const Args&... args) noexcept {      \
      if constexpr (requires { part.name(args...); }) part.name(args...); \
    }                                                                 \
  };                                                                  \
  inline constexpr name##_t name {}
KVCACHE_HOOK(forked);
KVCACHE_HOOK(freed);
KVCACHE_HOOK(reserved);
KVCACHE_HOOK(reserved_batch);
KVCACHE_HOOK(truncated);
KVCACHE_HOOK(imported);
KVCACHE_HOOK(adopted);
KVCACHE_HOOK(evicted);
KVCACHE_HOOK(written);
KVCACHE_HOOK(reconciled);
KVCACHE_HOOK(region_compacted);
#undef KVCACHE_HOOK

}  // namespace hooks

KVCACHE_END_NAMESPACE
