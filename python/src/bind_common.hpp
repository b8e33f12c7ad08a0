// What every compiled Cache binds the same way, token-paged or head-paged:
// handles, sequences and the accounting. Sequence handles are Python ints
// (SeqId's index in the low 32 bits, its generation in the high 32: the
// struct's own layout, so a uint64 array of handles is read in place).
#pragma once

#include <kvcache/kvcache.hpp>
#include <nanobind/nanobind.h>
// Every translation unit sees the same casters (a std::string parameter bound
// without this header would be cast as a class in one unit and as str in another).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <bit>
#include <span>
#include <string>

#include "arrays.hpp"
#include "errors.hpp"

namespace kvpy {

namespace kv = kvcache;
static_assert(sizeof(kv::SeqId) == sizeof(std::uint64_t) && std::endian::native == std::endian::little);
static_assert(sizeof(kv::BlockCopy) == 2 * sizeof(std::int32_t) && sizeof(kv::SlotMove) == 2 * sizeof(std::int32_t));

// prefix_stats() as a dict (every cache's).
inline nb::dict stats_dict(const kv::PrefixStats& s) {
  nb::dict d;
  d["queries"] = s.queries, d["query_tokens"] = s.query_tokens, d["hit_tokens"] = s.hit_tokens;
  d["stored"] = s.pool.stored, d["copies"] = s.pool.copies, d["recycled"] = s.pool.recycled;
  d["invalidated"] = s.pool.invalidated, d["hashes"] = s.hashes, d["used_hashed"] = s.used_hashed;
  d["used_plain"] = s.used_plain, d["free_cached"] = s.free_cached, d["free_plain"] = s.free_plain;
  return d;
}

struct Admitted {  // every cache's admit() result (Cache.admit, HybridCache.admit)
  std::uint64_t seq;
  std::int32_t cached_tokens, reserved, new_blocks;
  std::int64_t promised;
  nb::object slots;
};

inline std::uint64_t pack(kv::SeqId s) { return std::bit_cast<std::uint64_t>(s); }
inline kv::SeqId unpack(std::uint64_t h) { return std::bit_cast<kv::SeqId>(h); }
inline std::span<const kv::SeqId> seq_span(const Array<std::uint64_t>& a) {
  return {reinterpret_cast<const kv::SeqId*>(a.data()), a.size()};
}
template <class T>
std::span<const T> cspan(const Array<T>& a) {
  return {a.data(), a.size()};
}

inline std::span<kv::BlockCopy> copy_span(const Array<std::int32_t>& a) {
  return {reinterpret_cast<kv::BlockCopy*>(a.data()), a.size() / 2};
}
inline std::span<kv::SlotMove> move_span(const Array<std::int32_t>& a) {
  return {reinterpret_cast<kv::SlotMove*>(a.data()), a.size() / 2};
}

// reserve() and advance(), every cache's (advance: every reserved token
// computed first): n (a count; an int past int32 is invalid_argument naming
// n, not "ids must be ...") or the ids; the slots into a new array or the
// caller's: [n] on a token-paged cache, [groups, n] on layer groups
// (GroupRows); (slots, new_blocks, copy), the copy (-1, -1) when none.
template <bool GroupRows, class C>
nb::object reserve_call(C& self, std::uint64_t s, nb::handle n_or_ids, nb::handle slots, bool advance) {
  std::int32_t n = 0;
  const bool count = PyLong_Check(n_or_ids.ptr());
  if (count) {
    int overflow = 0;
    long long wide = PyLong_AsLongLongAndOverflow(n_or_ids.ptr(), &overflow);
    if (overflow != 0) wide = overflow > 0 ? INT64_MAX : INT64_MIN;
    require(wide <= INT32_MAX, "n", wide, INT32_MAX);
    require(wide >= INT32_MIN, "n", wide, INT32_MIN);
    n = std::int32_t(wide);
  }
  Array<std::int32_t> ids, o;
  if (!count) in_arg(ids, n_or_ids, "ids");
  const auto want = std::size_t(count ? std::max(n, 0) : std::int32_t(ids.size()));
  nb::object obj;
  if constexpr (GroupRows) {  // a caller's array is exactly [groups, n]: group g's slots start at g * n
    const auto groups = std::size_t(self.groups());
    obj = out_arg(o, slots.is_none() ? nb::cast(new_array<std::int32_t, 2>(groups, want)) : nb::borrow(slots), groups * want, "slots",
                  want ? want : 1);
  } else {
    obj = out_arg(o, slots, want, "slots");
  }
  const kv::SeqId id = unpack(s);
  const kv::ReserveInfo r = count ? check(advance ? self.advance(id, n, o.span()) : self.reserve(id, n, o.span()))
                                  : check(advance ? self.advance(id, cspan(ids), o.span()) : self.reserve(id, cspan(ids), o.span()));
  return nb::make_tuple(obj, r.new_blocks, std::make_pair(r.copy.src, r.copy.dst));
}

// reserve_batch() and advance_batch(), every cache's: (slots, copies [n, 2],
// copies written). The slots are [n] on a token-paged cache; on layer groups
// (group_rows) [groups, stride], a new [groups, sum of counts] array or the
// caller's, which may be wider than the batch (a padded one).
template <class C>
nb::object batch_call(C& self, nb::handle seqs, nb::handle counts, nb::handle slots, nb::handle copies, nb::handle ids, bool advance,
                      bool group_rows) {
  Array<std::uint64_t> sq;
  Array<std::int32_t> ct, o, cp, id;
  in_arg(sq, seqs, "seqs");
  in_arg(ct, counts, "counts");
  std::size_t total = 0;
  for (std::size_t k = 0; k < ct.size(); ++k) total += std::size_t(std::max(ct.data()[k], 0));
  nb::object sobj;
  if (group_rows) {
    const auto groups = std::size_t(self.groups());
    sobj = slots.is_none() ? nb::cast(new_array<std::int32_t, 2>(groups, total)) : nb::borrow(slots);
    if (!o.borrow(sobj, true)) bad_array("slots", "[groups, n] int32");
    require(o.ndim() == 2 && o.shape(0) == groups, "slots.shape[0] (one row a group)", std::int64_t(o.ndim() == 2 ? o.shape(0) : 0),
            std::int64_t(groups));
  } else {
    sobj = out_arg(o, slots, total, "slots");
  }
  nb::object cobj = out_arg(cp, copies, sq.size(), "copies", 2);
  const auto cps = copy_span(cp);
  kv::BatchInfo r;
  if (ids.is_none()) {
    r = check(advance ? self.advance_batch(seq_span(sq), cspan(ct), o.span(), cps) : self.reserve_batch(seq_span(sq), cspan(ct), o.span(), cps));
  } else {
    in_arg(id, ids, "ids");
    r = check(advance ? self.advance_batch(seq_span(sq), cspan(ct), cspan(id), o.span(), cps)
                      : self.reserve_batch(seq_span(sq), cspan(ct), cspan(id), o.span(), cps));
  }
  return nb::make_tuple(sobj, cobj, r.copies);
}

// Blocks the rows of seqs hold (head-paged: every head row): the size of an
// output that lists pages of them, when the caller gives none.
template <class C>
std::size_t blocks_of(const C& cache, std::span<const kv::SeqId> seqs) {
  std::size_t n = 0;
  for (const kv::SeqId s : seqs) n += std::size_t(std::max(check(cache.blocks_held(s)), 0));
  return n;
}

// A score signal by name; any other name is invalid_argument naming scores.kind.
inline kv::ScoreKind score_kind(const std::string& kind) {
  if (kind == "attention_sums") return kv::ScoreKind::attention_sums;
  if (kind == "head_attention_sums") return kv::ScoreKind::head_attention_sums;
  if (kind == "last_query_attention") return kv::ScoreKind::last_query_attention;
  require(false, "scores.kind", -1, 2);
  return {};
}

// kv.LayerGroups: the validated layout (bound in caches_hybrid.cpp; the
// transfer module's handshakes read it too, so the type lives here).
struct Groups {
  kv::LayerGroups groups;
};

// Every cache, HybridCache too (the sequence-cache contract's pool part):
// its pool, read only (a WritePolicy reads it), the holds transfers keep on
// its blocks, and its block events (each event's token ids: the pool's
// tokens_per_event, a hybrid cache's largest group block size).
template <class C>
void bind_holds(nb::class_<C>& c) {
  c.def_prop_ro("pool", [](const C& self) -> const kv::BlockPool& { return self.pool(); }, nb::rv_policy::reference_internal)
      .def("hold",
           [](C& self, nb::handle blocks) {
             Array<std::int32_t> b;
             in_arg(b, blocks, "blocks");
             return check(self.hold(cspan(b)));
           },
           nb::arg("blocks"))
      .def("release_hold", [](C& self, std::uint64_t id) { check(self.release_hold(id)); }, nb::arg("hold"))
      .def_prop_ro("holds", [](const C& self) { return self.holds().size(); })
      .def(
          "drain_events",
          [](C& self, std::int32_t max_events) {
            const auto per = std::size_t(self.pool().events().tokens_per_event());
            std::vector<kv::BlockEvent> ev(std::size_t(std::max(max_events, 0)));
            std::vector<std::int32_t> ids(ev.size() * per);
            const auto n = check(self.drain_events(ev, ids));
            nb::list out;
            for (std::int32_t i = 0; i < n; ++i) {
              const auto& e = ev[std::size_t(i)];
              nb::dict d;
              d["kind"] = e.kind == kv::EventKind::stored ? "stored" : e.kind == kv::EventKind::removed ? "removed" : "all_cleared";
              d["block"] = e.block, d["hash"] = std::make_pair(e.hash.lo, e.hash.hi);
              d["parent"] = std::make_pair(e.parent.lo, e.parent.hi), d["first"] = e.first;
              d["salt"] = e.key.salt, d["extra"] = e.key.extra, d["block_extra"] = e.block_extra;
              d["block_size"] = e.block_size, d["group"] = e.group;  // group: a HybridCache's layer group, -1 otherwise
              const auto b = std::size_t(i) * per;
              d["token_ids"] = std::vector<std::int32_t>(ids.begin() + std::ptrdiff_t(b),
                                                         ids.begin() + std::ptrdiff_t(b) + e.num_tokens);
              out.append(d);
            }
            return out;
          },
          nb::arg("max_events") = 1024)
      .def(
          "drain_kv_events",  // the drained events as vLLM's msgpack KVEventBatch (bytes), None when there were none
          [](C& self, double ts, std::int32_t dp_rank, std::int32_t group, std::int32_t max_events) -> nb::object {
            const auto per = std::size_t(self.pool().events().tokens_per_event());
            std::vector<kv::BlockEvent> ev(std::size_t(std::max(max_events, 0)));
            std::vector<std::int32_t> ids(ev.size() * per);
            const auto n = std::size_t(check(self.drain_events(ev, ids)));
            if (n == 0) return nb::none();
            std::vector<std::uint8_t> out;
            check(kv::encode_kv_events(std::span(ev).first(n), std::span(ids).first(n * per),
                                       std::int32_t(per), {ts, dp_rank, group}, out));
            return nb::bytes(reinterpret_cast<const char*>(out.data()), out.size());
          },
          nb::arg("ts"), nb::arg("dp_rank") = 0, nb::arg("group") = -1, nb::arg("max_events") = 1024);
}

template <class C>
void bind_common(nb::class_<C>& c) {
  c.def_prop_ro("block_size", &C::block_size)
      .def_prop_ro("geometry", &C::geometry)
      .def_prop_ro("eviction", [](const C& self) { return self.eviction(); })
      .def("fork", [](C& self, std::uint64_t s) { return pack(check(self.fork(unpack(s)))); })
      .def("free", [](C& self, std::uint64_t s) { check(self.free(unpack(s))); })
      .def("blocks_held", [](const C& self, std::uint64_t s) { return check(self.blocks_held(unpack(s))); })
      .def("blocks_needed",
           [](const C& self, std::int64_t prompt_len, std::int64_t max_new, std::int32_t chunk) {
             return check(self.blocks_needed(prompt_len, max_new, chunk));
           },
           nb::arg("prompt_len"), nb::arg("max_new"), nb::arg("prefill_chunk") = 0)
      .def("can_admit", [](const C& self, std::int64_t prompt_len, std::int64_t max_new) { return self.can_admit(prompt_len, max_new); },
           nb::arg("prompt_len"), nb::arg("max_new"))
      .def_prop_ro("promised_blocks", &C::promised_blocks)
      .def_prop_ro("free_blocks", &C::free_blocks)
      .def_prop_ro("free_sequences", &C::free_sequences)
      .def_prop_ro("max_tokens_after_eviction", &C::max_tokens_after_eviction)
      .def("check_invariants", [](const C& self) { check(self.check_invariants()); });
  bind_holds(c);
}

// An import's blocks of one group as Python gets them from every cache's
// import_blocks: (skip, local blocks int32), local[i] receiving the peer's block skip + i.
inline nb::object import_blocks_tuple(const kv::GroupBlocks& gb) {
  auto b = new_array<std::int32_t>(gb.local.size());
  std::copy(gb.local.begin(), gb.local.end(), b.data());
  return nb::make_tuple(gb.skip, b);
}

}  // namespace kvpy
