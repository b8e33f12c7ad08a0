// One compiled Cache per eviction policy, bound with the same methods:
// sequence handles are Python ints (SeqId's index in the low 32 bits, its
// generation in the high 32: the struct's own layout, so a uint64 array of
// handles is read in place), arrays are read and written without copies.
#pragma once

#include <kvcache/kvcache.hpp>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <bit>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "arrays.hpp"
#include "bind_common.hpp"
#include "bind_selection.hpp"

namespace kvpy {

// observe and evict, by the policy's kind. evict returns what the engine acts
// on: (result, blocks, rotations) for block policies ([n] and [n, 3] int32),
// (result, moves, group_moves) for token policies ([n, 2] and [groups + 1]),
// (result,) for window and keep-all.
template <class C, class E>
void bind_eviction_calls(nb::class_<C>& c) {
  if constexpr (kv::ObservingEviction<E>) {
    c.def(
        "observe",
        [](C& self, std::uint64_t s, nb::handle scores, std::string kind) {
          Array<float> a;
          if (!a.borrow(scores, false)) bad_array("scores", "float32 ([rows, held] or [held])");
          const auto k = score_kind(kind);
          require(a.ndim() == 1 || a.ndim() == 2, "scores.ndim", std::int64_t(a.ndim()), 2);
          const auto rows = a.ndim() == 2 ? std::int32_t(a.shape(0)) : 1;
          check(self.observe(unpack(s), kv::Scores{k, {a.data(), a.size()}, rows}));
        },
        nb::arg("seq"), nb::arg("scores"), nb::arg("kind") = "attention_sums");
  }
  if constexpr (kv::BlockEviction<E>) {
    c.def(
        "evict",
        [](C& self, std::uint64_t s, nb::handle blocks, nb::handle rotations) {
          const auto held = std::size_t(check(self.blocks_held(unpack(s))));
          Array<std::int32_t> b, r;
          nb::object bobj = out_arg(b, blocks, held, "blocks"), robj = out_arg(r, rotations, held, "rotations", 3);
          std::span<kv::BlockRotation> rs(reinterpret_cast<kv::BlockRotation*>(r.data()), r.size() / 3);
          const auto e = check(self.evict(unpack(s), kv::EvictionSpans{.blocks = b.span(), .rotations = rs}));
          return std::make_tuple(e, rows(bobj, e.evicted), rows(robj, e.rotations));
        },
        nb::arg("seq"), nb::arg("blocks") = nb::none(), nb::arg("rotations") = nb::none());
  } else if constexpr (kv::TokenEviction<E>) {
    c.def(
        "evict",
        [](C& self, std::uint64_t s, nb::handle moves, nb::handle group_moves) {
          const std::int32_t groups = self.eviction().groups();
          const auto held = std::size_t(check(self.tokens_held(unpack(s))));
          Array<std::int32_t> mv, gm;
          nb::object mobj = out_arg(mv, moves, held * std::size_t(groups), "moves", 2);
          nb::object gobj = out_arg(gm, group_moves, std::size_t(groups) + 1, "group_moves");
          std::span<kv::SlotMove> ms(reinterpret_cast<kv::SlotMove*>(mv.data()), mv.size() / 2);
          const auto e = check(self.evict(unpack(s), kv::EvictionSpans{.moves = ms, .group_moves = gm.span()}));
          return std::make_tuple(e, rows(mobj, e.moves), gobj);  // exactly the moves written (group_moves[-1])
        },
        nb::arg("seq"), nb::arg("moves") = nb::none(), nb::arg("group_moves") = nb::none());
    c.def(
        "positions",
        [](const C& self, std::uint64_t s, std::int32_t group) {
          check(self.tokens_held(unpack(s)));
          require(group >= 0 && group < self.eviction().groups(), "group", group, self.eviction().groups());
          const auto p = self.eviction().positions(unpack(s).index, group);
          return std::vector<std::int32_t>(p.begin(), p.end());
        },
        nb::arg("seq"), nb::arg("group") = 0);
  } else {
    c.def(
        "evict",
        [](C& self, std::uint64_t s, std::int32_t pending_queries) {
          return std::make_tuple(check(self.evict(unpack(s), kv::EvictionSpans{}, pending_queries)));
        },
        nb::arg("seq"), nb::arg("pending_queries") = 0);
  }
}

template <class C>
void bind_cache(nb::module_& m, const char* name) {
  using E = typename std::remove_cvref_t<decltype(std::declval<C&>().eviction())>;
  nb::class_<C> c(m, name);
  if constexpr (C::selects) {  // Quest: its config, and the bounds store (float32, kept alive by the cache)
    c.def(
        "__init__",
        [](C* self, const kv::Geometry& g, std::int32_t num_blocks, std::int32_t max_sequences,
           std::int32_t max_blocks_per_sequence, std::int32_t event_capacity, bool publish_on_reserve, const E& eviction,
           kv::QuestConfig q, nb::handle bounds) {
          q.bounds = bounds_store(bounds);
          new (self) C({.geometry = g, .num_blocks = num_blocks, .max_sequences = max_sequences,
                        .max_blocks_per_sequence = max_blocks_per_sequence, .event_capacity = event_capacity,
                        .publish_on_reserve = publish_on_reserve},
                       {}, q, eviction);
        },
        nb::arg("geometry"), nb::arg("num_blocks"), nb::arg("max_sequences"), nb::arg("max_blocks_per_sequence"),
        nb::arg("event_capacity"), nb::arg("publish_on_reserve"), nb::arg("eviction"), nb::arg("selection"),
        nb::arg("bounds"), nb::keep_alive<1, 10>());
  } else {
    c.def(
        "__init__",
        [](C* self, const kv::Geometry& g, std::int32_t num_blocks, std::int32_t max_sequences,
           std::int32_t max_blocks_per_sequence, std::int32_t event_capacity, bool publish_on_reserve, const E& eviction) {
          new (self) C({.geometry = g, .num_blocks = num_blocks, .max_sequences = max_sequences,
                        .max_blocks_per_sequence = max_blocks_per_sequence, .event_capacity = event_capacity,
                        .publish_on_reserve = publish_on_reserve},
                       {}, {}, eviction);
        },
        nb::arg("geometry"), nb::arg("num_blocks"), nb::arg("max_sequences"), nb::arg("max_blocks_per_sequence"),
        nb::arg("event_capacity") = 0, nb::arg("publish_on_reserve") = false, nb::arg("eviction"));
  }
  c
      // A sliding window's dead front slots in the first block (0 under other policies).
      .def("front", [](const C& self, std::uint64_t s) { return check(self.table().front(unpack(s))); })
      // Sequences.
      .def("add_sequence", [](C& self) { return pack(check(self.add_sequence())); })
      .def(
          "add_sequence_with_prefix",
          [](C& self, nb::handle prompt, std::uint64_t salt, std::uint64_t extra) {
            Array<std::int32_t> p;
            in_arg(p, prompt, "prompt");
            const auto hit = check(self.add_sequence(cspan(p), kv::PrefixKey{salt, extra}));
            return std::pair<std::uint64_t, std::int32_t>(pack(hit.seq), hit.cached_tokens);
          },
          nb::arg("prompt"), nb::arg("salt") = 0, nb::arg("extra") = 0)
      .def(
          "admit",
          [](C& self, nb::handle prompt, nb::handle slots, std::uint64_t salt, std::uint64_t extra, std::int64_t max_new,
             std::int32_t prefill_chunk, std::int32_t reserve) {
            Array<std::int32_t> p, o;
            in_arg(p, prompt, "prompt");
            nb::object obj = out_arg(o, slots, slots.is_none() ? p.size() : 0, "slots");
            const auto a = check(self.admit(cspan(p), o.span(),
                                            {.key = {salt, extra}, .max_new = max_new, .prefill_chunk = prefill_chunk,
                                             .reserve = reserve}));
            return Admitted{pack(a.seq), a.cached_tokens, a.reserved, a.new_blocks, a.promised, obj};
          },
          nb::arg("prompt"), nb::arg("slots") = nb::none(), nb::arg("salt") = 0, nb::arg("extra") = 0,
          nb::arg("max_new") = -1, nb::arg("prefill_chunk") = 0, nb::arg("reserve") = INT32_MAX)
      .def(
          "can_admit_prompt",
          [](const C& self, nb::handle prompt, std::uint64_t salt, std::uint64_t extra, std::int64_t max_new,
             std::int32_t prefill_chunk) {
            Array<std::int32_t> p;
            in_arg(p, prompt, "prompt");
            return self.can_admit(cspan(p), {.key = {salt, extra}, .max_new = max_new, .prefill_chunk = prefill_chunk});
          },
          nb::arg("prompt"), nb::arg("salt") = 0, nb::arg("extra") = 0, nb::arg("max_new") = -1,
          nb::arg("prefill_chunk") = 0)
      .def("truncate", [](C& self, std::uint64_t s, std::int32_t n) { check(self.truncate(unpack(s), n)); })
      // Slots.
      .def(
          "reserve",
          [](C& self, std::uint64_t s, nb::handle n_or_ids, nb::handle slots) { return reserve_call<false>(self, s, n_or_ids, slots, false); },
          nb::arg("seq"), nb::arg("n"), nb::arg("slots") = nb::none())
      .def(
          "advance",
          [](C& self, std::uint64_t s, nb::handle n_or_ids, nb::handle slots) { return reserve_call<false>(self, s, n_or_ids, slots, true); },
          nb::arg("seq"), nb::arg("n"), nb::arg("slots") = nb::none())
      .def("computed", [](const C& self, std::uint64_t s, std::int64_t tokens) { check(self.computed(unpack(s), tokens)); },
           nb::arg("seq"), nb::arg("tokens"))
      .def(
          "reserve_batch",
          [](C& self, nb::handle seqs, nb::handle counts, nb::handle slots, nb::handle copies, nb::handle ids) {
            return batch_call(self, seqs, counts, slots, copies, ids, false, false);
          },
          nb::arg("seqs"), nb::arg("counts"), nb::arg("slots") = nb::none(), nb::arg("copies") = nb::none(),
          nb::arg("ids") = nb::none())
      .def(
          "advance_batch",
          [](C& self, nb::handle seqs, nb::handle counts, nb::handle slots, nb::handle copies, nb::handle ids) {
            return batch_call(self, seqs, counts, slots, copies, ids, true, false);
          },
          nb::arg("seqs"), nb::arg("counts"), nb::arg("slots") = nb::none(), nb::arg("copies") = nb::none(),
          nb::arg("ids") = nb::none())
      // Prefix cache.
      .def(
          "publish",
          [](C& self, std::uint64_t s, nb::handle tokens) {
            Array<std::int32_t> t;
            in_arg(t, tokens, "tokens");
            return check(self.publish(unpack(s), cspan(t)));
          },
          nb::arg("seq"), nb::arg("tokens"))
      .def(
          "match_prefix",
          [](const C& self, nb::handle tokens, std::uint64_t salt, std::uint64_t extra) {
            Array<std::int32_t> t;
            in_arg(t, tokens, "tokens");
            std::vector<kv::BlockId> blocks(t.size() / std::size_t(self.block_size()) + 1);
            const auto n = self.match_prefix(cspan(t), kv::PrefixKey{salt, extra}, blocks);
            blocks.resize(std::size_t(n));
            return blocks;
          },
          nb::arg("tokens"), nb::arg("salt") = 0, nb::arg("extra") = 0)
      .def(
          "match",
          [](const C& self, nb::handle tokens, std::uint64_t salt, std::uint64_t extra) {
            Array<std::int32_t> t;
            in_arg(t, tokens, "tokens");
            return self.match(cspan(t), kv::PrefixKey{salt, extra});
          },
          nb::arg("tokens"), nb::arg("salt") = 0, nb::arg("extra") = 0)
      .def("reset_prefix_cache", [](C& self) { check(self.reset_prefix_cache()); })
      .def("prefix_stats", [](const C& self) { return stats_dict(self.prefix_stats()); })
      .def(
          "hash_chain",
          [](const C& self, nb::handle tokens, std::uint64_t salt, std::uint64_t extra) {
            Array<std::int32_t> t;
            in_arg(t, tokens, "tokens");
            std::vector<kv::BlockHash> h(t.size() / std::size_t(self.block_size()));
            h.resize(std::size_t(self.hash_chain(cspan(t), {salt, extra}, h)));
            auto out = new_array<std::uint64_t, 2>(h.size(), 2);
            std::memcpy(out.data(), h.data(), h.size() * sizeof(kv::BlockHash));
            return out;
          },
          nb::arg("tokens"), nb::arg("salt") = 0, nb::arg("extra") = 0)
      // Imports: a prompt a peer prefilled (transfer/pending_imports.hpp).
      .def(
          "import_prompt",  // (id, cached_tokens, skip, blocks int32 [num_blocks]): blocks to receive, pending
          [](C& self, nb::handle prompt, std::uint64_t salt, std::uint64_t extra, std::int64_t max_new) {
            Array<std::int32_t> p;
            in_arg(p, prompt, "prompt");
            std::vector<kv::BlockId> blocks(p.size() / std::size_t(self.block_size()) + 1);
            const auto r = check(self.import(cspan(p), blocks, {.key = {salt, extra}, .max_new = max_new}));
            auto b = new_array<std::int32_t>(std::size_t(r.num_blocks));
            std::copy_n(blocks.begin(), r.num_blocks, b.data());
            return nb::make_tuple(r.id, r.cached_tokens, r.skip, b);
          },
          nb::arg("prompt"), nb::arg("salt") = 0, nb::arg("extra") = 0, nb::arg("max_new") = -1)
      .def(
          "import_blocks",  // (skip, blocks int32): as HybridCache.import_blocks; one group, 0
          [](const C& self, std::uint64_t id, std::int32_t g) {
            return import_blocks_tuple(check(self.import_blocks(id, g)));
          },
          nb::arg("id"), nb::arg("group") = 0)
      .def(
          "commit_import",  // (seq, published)
          [](C& self, std::uint64_t id, nb::handle prompt) {
            Array<std::int32_t> p;
            in_arg(p, prompt, "prompt");
            const auto r = check(self.commit_import(id, cspan(p)));
            return std::make_pair(pack(r.seq), r.published);
          },
          nb::arg("id"), nb::arg("prompt"))
      .def(
          "abort_import",  // (seq, cached_tokens, recompute)
          [](C& self, std::uint64_t id) {
            const auto r = check(self.abort_import(id));
            return std::make_tuple(pack(r.seq), r.cached_tokens, r.recompute);
          },
          nb::arg("id"))
      .def_prop_ro("imports", [](const C& self) { return self.imports().size(); })
      // Exports.
      .def(
          "export_block_table",
          [](const C& self, nb::handle seqs, std::int32_t row_stride, nb::handle out) {
            Array<std::uint64_t> sq;
            Array<std::int32_t> o;
            in_arg(sq, seqs, "seqs");
            const std::size_t rows = sq.size(), cols = std::size_t(std::max(row_stride, 0));
            nb::object obj = out_arg(o, out.is_none() ? nb::cast(new_array<std::int32_t, 2>(rows, cols)) : nb::borrow(out),
                                     rows * cols, "out");
            check(self.export_block_table(seq_span(sq), o.span(), row_stride));
            return obj;
          },
          nb::arg("seqs"), nb::arg("row_stride"), nb::arg("out") = nb::none())
      .def(
          "export_csr",
          [](const C& self, nb::handle seqs, nb::handle indptr, nb::handle indices, nb::handle last_page_len) {
            Array<std::uint64_t> sq;
            Array<std::int32_t> ip, ix, lp;
            in_arg(sq, seqs, "seqs");
            std::size_t pages = 0;
            if (indices.is_none())
              for (auto s : seq_span(sq)) pages += std::size_t(std::max(check(self.blocks_held(s)), 0));
            nb::object a = out_arg(ip, indptr, sq.size() + 1, "indptr"), b = out_arg(ix, indices, pages, "indices"),
                       c = out_arg(lp, last_page_len, sq.size(), "last_page_len");
            const auto nnz = check(self.export_csr(seq_span(sq), ip.span(), ix.span(), lp.span()));
            return std::make_tuple(a, b, c, nnz);
          },
          nb::arg("seqs"), nb::arg("indptr") = nb::none(), nb::arg("indices") = nb::none(),
          nb::arg("last_page_len") = nb::none())
      .def(
          "export_lengths",
          [](const C& self, nb::handle seqs, nb::handle out) {
            Array<std::uint64_t> sq;
            Array<std::int32_t> o;
            in_arg(sq, seqs, "seqs");
            nb::object obj = out_arg(o, out, sq.size(), "out");
            check(self.export_lengths(seq_span(sq), o.span()));
            return obj;
          },
          nb::arg("seqs"), nb::arg("out") = nb::none())
      // Accounting.
      .def("tokens_held", [](const C& self, std::uint64_t s) { return check(self.tokens_held(unpack(s))); })
      .def("tokens", [](const C& self, std::uint64_t s) { return check(self.tokens(unpack(s))); })
      .def("promise", [](C& self, std::uint64_t s, std::int64_t blocks) { check(self.promise(unpack(s), blocks)); })
      .def("shared_excess", [](const C& self, std::uint64_t s) { return check(self.shared_excess(unpack(s))); });
  bind_common(c);
  bind_eviction_calls<C, E>(c);
  if constexpr (C::selects) bind_selection(c);
}

// Every eviction policy's token-paged cache under selection S, named prefix + policy.
template <class S>
void bind_token_paged_caches(nb::module_& m, const std::string& prefix) {
  const auto bind = [&]<class E>(const char* policy) {
    bind_cache<kv::Cache<kv::BlockPool, kv::PageTable, kv::AdmitAll, S, E>>(m, (prefix + policy).c_str());
  };
  bind.template operator()<kv::KeepAll>("KeepAll");
  bind.template operator()<kv::SlidingWindow>("SlidingWindow");
  bind.template operator()<kv::SinkWindowEviction>("SinkWindow");
  bind.template operator()<kv::BlockScoreEviction>("BlockScores");
  bind.template operator()<kv::H2OEviction>("H2O");
  bind.template operator()<kv::TovaEviction>("Tova");
  bind.template operator()<kv::SnapKVEviction>("SnapKV");
  bind.template operator()<kv::AverageAttentionEviction>("AverageAttention");
}

}  // namespace kvpy
