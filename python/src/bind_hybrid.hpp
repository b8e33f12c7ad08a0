// kv.HybridCache's calls, bound once for each HybridCache the module
// compiles: the dense one (caches_hybrid.cpp), the one with Quest on the
// global layers (caches_hybrid_quest.cpp), whose selection calls are
// bind_hybrid_selection's, and those with a block eviction policy there
// (caches_hybrid_eviction.cpp), whose calls are bind_hybrid_eviction's. Handles are the same packed ints as the other
// caches'; arrays are read and written in place; errors are the typed kv exceptions.
#pragma once

#include <kvcache/cache/hybrid.hpp>
#include <kvcache/eviction/block_scores.hpp>
#include <kvcache/eviction/sink_window.hpp>
#include <kvcache/selection/quest.hpp>
#include <nanobind/ndarray.h>

#include <string>
#include <type_traits>
#include <vector>

#include "bind_common.hpp"
#include "bind_selection.hpp"

namespace kvpy {

// Group g's CSR over the live blocks of seqs: (indptr, indices, first_pos, nnz).
template <class Hybrid>
nb::object group_csr(const Hybrid& self, std::int32_t g, nb::handle seqs) {
  Array<std::uint64_t> sq;
  in_arg(sq, seqs, "seqs");
  std::size_t pages = 0;
  for (const auto s : seq_span(sq)) pages += std::size_t(std::max(check(self.blocks_held(s, g)), 0));
  Array<std::int32_t> ip, ix, fp;
  nb::object a = out_arg(ip, nb::none(), sq.size() + 1, "indptr"), b = out_arg(ix, nb::none(), pages, "indices"),
             c = out_arg(fp, nb::none(), sq.size(), "first_pos");
  const auto nnz = check(self.export_group_csr(g, seq_span(sq), ip.span(), ix.span(), fp.span()));
  return nb::make_tuple(a, b, c, nnz);
}

// Quest's calls on a hybrid cache: the store's slice of a global layer (a
// numpy view [num_blocks, kv_heads, 2, head_dim]), the pages an import or a
// rollback left stale, and the host selection over that layer's group rows.
template <class Hybrid>
void bind_hybrid_selection(nb::class_<Hybrid>& c) {
  const auto global_blocks = [](const Hybrid& self, std::span<const kv::SeqId> seqs, std::int32_t only) {
    std::size_t n = 0;  // the global groups' blocks of seqs (only >= 0: that group's)
    for (std::int32_t g = 0; g < self.groups(); ++g)
      if (kv::global_kind(self.layer_groups().spec(g).kind) && (only < 0 || g == only))
        for (const auto s : seqs) n += std::size_t(std::max(check(self.blocks_held(s, g)), 0));
    return n;
  };
  c.def(
       "page_bounds",
       [](nb::handle self, std::int32_t layer) {
         const Hybrid& cache = nb::cast<const Hybrid&>(self);
         return bounds_view(self, check(cache.page_bounds(layer)), check(kv::global_geometry(cache.layer_groups())).spec());
       },
       nb::arg("layer"))
      .def(
          "stale_pages",
          [global_blocks](Hybrid& self, nb::handle seqs, nb::handle pages, nb::handle fill) {
            Array<std::uint64_t> sq;
            Array<std::int32_t> pg, fl;
            in_arg(sq, seqs, "seqs");
            const std::size_t n = pages.is_none() || fill.is_none() ? global_blocks(self, seq_span(sq), -1) : 0;
            nb::object a = out_arg(pg, pages, n, "pages"), b = out_arg(fl, fill, n, "fill");
            const auto listed = check(self.stale_pages(seq_span(sq), {pg.span(), fl.span()}));
            return std::make_tuple(a, b, listed);
          },
          nb::arg("seqs"), nb::arg("pages") = nb::none(), nb::arg("fill") = nb::none())
      .def(
          "select",  // (indptr, indices, n): row k * kv_heads + h = kv-head h of seqs[k], the layer group's pages it reads
          [global_blocks](Hybrid& self, nb::handle seqs, std::int32_t layer, nb::handle queries, nb::handle indptr, nb::handle indices) {
            Array<std::uint64_t> sq;
            Array<float> q;
            Array<std::int32_t> ip, ix;
            in_arg(sq, seqs, "seqs");
            in_arg(q, queries, "queries");
            require(layer >= 0 && layer < self.layer_groups().num_layers(), "layer", layer, self.layer_groups().num_layers() - 1);
            const std::size_t heads = std::size_t(check(kv::global_geometry(self.layer_groups())).spec().num_kv_heads);
            const std::size_t pages = indices.is_none() ? global_blocks(self, seq_span(sq), self.layer_groups().layer_slot(layer).group) * heads : 0;
            nb::object a = out_arg(ip, indptr, sq.size() * heads + 1, "indptr"), b = out_arg(ix, indices, pages, "indices");
            const auto n = check(self.select(seq_span(sq), layer, cspan(q), {ip.span(), ix.span()}));
            return std::make_tuple(a, b, n);
          },
          nb::arg("seqs"), nb::arg("layer"), nb::arg("queries"), nb::arg("indptr") = nb::none(), nb::arg("indices") = nb::none());
}

// A block eviction policy on the global layers: evict (the blocks that
// left, as holes), observe one global group's attention sums (a scored
// policy), evicted (the sequence publishes no more).
template <class Hybrid>
void bind_hybrid_eviction(nb::class_<Hybrid>& c) {
  using E = std::remove_cvref_t<decltype(std::declval<const Hybrid&>().eviction())>;
  if constexpr (kv::ObservingEviction<E>) {
    c.def(
        "observe",
        [](Hybrid& self, std::uint64_t s, std::int32_t group, nb::handle scores, std::string kind) {
          Array<float> a;
          if (!a.borrow(scores, false)) bad_array("scores", "float32 [tokens_held(seq, group)]");
          require(a.ndim() == 1, "scores.ndim", std::int64_t(a.ndim()), 1);
          check(self.observe(unpack(s), group, kv::Scores{score_kind(kind), {a.data(), a.size()}, 1}));
        },
        nb::arg("seq"), nb::arg("group"), nb::arg("scores"), nb::arg("kind") = "attention_sums");
  }
  c.def(
       "evict",
       [](Hybrid& self, std::uint64_t s, nb::handle blocks) {
         const auto held = std::size_t(check(self.blocks_held(unpack(s))));
         Array<std::int32_t> b;
         nb::object bobj = out_arg(b, blocks, held, "blocks");
         const auto e = check(self.evict(unpack(s), kv::EvictionSpans{.blocks = b.span()}));
         return std::make_tuple(e, rows(bobj, e.evicted));
       },
       nb::arg("seq"), nb::arg("blocks") = nb::none())
      .def("evicted", [](const Hybrid& self, std::uint64_t s) { return check(self.evicted(unpack(s))); }, nb::arg("seq"))
      .def(  // the tokens whose K/V read the prompt's own context (what a tier or a peer may take)
          "computed_before_eviction", [](const Hybrid& self, std::uint64_t s) { return check(self.computed_before_eviction(unpack(s))); },
          nb::arg("seq"));
}

// The HybridCache H as Python class `name`.
template <class Hybrid>
void bind_hybrid_cache(nb::module_& m, const char* name) {
  nb::class_<Hybrid> hybrid(m, name);
  const auto make = [](const Groups& g, std::int32_t num_blocks, std::int32_t max_sequences, std::int32_t max_tokens,
                       std::int32_t prefill_chunk, bool prefix_caching, std::int32_t event_capacity) {
    return kv::HybridConfig{.groups = g.groups, .num_blocks = num_blocks, .max_sequences = max_sequences, .max_tokens = max_tokens,
                            .prefill_chunk = prefill_chunk, .prefix_caching = prefix_caching, .event_capacity = event_capacity};
  };
  if constexpr (Hybrid::selects && Hybrid::evicts) {  // Quest and a block policy on the global layers
    using E = std::remove_cvref_t<decltype(std::declval<const Hybrid&>().eviction())>;
    hybrid.def(
        "__init__",
        [make](Hybrid* self, const Groups& g, std::int32_t num_blocks, std::int32_t max_sequences, std::int32_t max_tokens,
               std::int32_t prefill_chunk, bool prefix_caching, std::int32_t event_capacity, kv::QuestConfig q, nb::handle bounds,
               const E& eviction) {
          q.bounds = bounds_store(bounds);
          try {
            new (self) Hybrid(make(g, num_blocks, max_sequences, max_tokens, prefill_chunk, prefix_caching, event_capacity), q, eviction);
          } catch (const kv::ConfigError& e) {
            check(e.status());
          }
        },
        nb::arg("groups"), nb::arg("num_blocks"), nb::arg("max_sequences"), nb::arg("max_tokens"), nb::arg("prefill_chunk"),
        nb::arg("prefix_caching"), nb::arg("event_capacity"), nb::arg("selection"), nb::arg("bounds"), nb::arg("eviction"),
        nb::keep_alive<1, 10>());
    bind_hybrid_selection(hybrid);
    bind_hybrid_eviction(hybrid);
  } else if constexpr (Hybrid::selects) {  // Quest on the global layers: its config, and the bounds store (float32, kept alive by the cache)
    hybrid.def(
        "__init__",
        [make](Hybrid* self, const Groups& g, std::int32_t num_blocks, std::int32_t max_sequences, std::int32_t max_tokens,
               std::int32_t prefill_chunk, bool prefix_caching, std::int32_t event_capacity, kv::QuestConfig q, nb::handle bounds) {
          q.bounds = bounds_store(bounds);
          try {
            new (self) Hybrid(make(g, num_blocks, max_sequences, max_tokens, prefill_chunk, prefix_caching, event_capacity), q);
          } catch (const kv::ConfigError& e) {
            check(e.status());
          }
        },
        nb::arg("groups"), nb::arg("num_blocks"), nb::arg("max_sequences"), nb::arg("max_tokens"), nb::arg("prefill_chunk"),
        nb::arg("prefix_caching"), nb::arg("event_capacity"), nb::arg("selection"), nb::arg("bounds"), nb::keep_alive<1, 10>());
    bind_hybrid_selection(hybrid);
  } else if constexpr (Hybrid::evicts) {  // a block policy on the global layers, bound per group by the cache
    using E = std::remove_cvref_t<decltype(std::declval<const Hybrid&>().eviction())>;
    hybrid.def(
        "__init__",
        [make](Hybrid* self, const Groups& g, std::int32_t num_blocks, std::int32_t max_sequences, std::int32_t max_tokens,
               std::int32_t prefill_chunk, bool prefix_caching, std::int32_t event_capacity, const E& eviction) {
          try {
            new (self) Hybrid(make(g, num_blocks, max_sequences, max_tokens, prefill_chunk, prefix_caching, event_capacity),
                              kv::SelectAll{}, eviction);
          } catch (const kv::ConfigError& e) {
            check(e.status());
          }
        },
        nb::arg("groups"), nb::arg("num_blocks"), nb::arg("max_sequences"), nb::arg("max_tokens"), nb::arg("prefill_chunk"),
        nb::arg("prefix_caching"), nb::arg("event_capacity"), nb::arg("eviction"));
    bind_hybrid_eviction(hybrid);
  } else {
    hybrid.def(
        "__init__",
        [make](Hybrid* self, const Groups& g, std::int32_t num_blocks, std::int32_t max_sequences, std::int32_t max_tokens,
               std::int32_t prefill_chunk, bool prefix_caching, std::int32_t event_capacity) {
          try {
            new (self) Hybrid(make(g, num_blocks, max_sequences, max_tokens, prefill_chunk, prefix_caching, event_capacity));
          } catch (const kv::ConfigError& e) {
            check(e.status());
          }
        },
        nb::arg("groups"), nb::arg("num_blocks"), nb::arg("max_sequences"), nb::arg("max_tokens"),
        nb::arg("prefill_chunk") = 0, nb::arg("prefix_caching") = true, nb::arg("event_capacity") = 0);
  }
  hybrid
      .def_prop_ro("groups", &Hybrid::groups)
      .def_prop_ro("free_blocks", &Hybrid::free_blocks)
      .def_prop_ro("free_sequences", &Hybrid::free_sequences)
      .def_prop_ro("promised_blocks", &Hybrid::promised_blocks)
      .def("add_sequence", [](Hybrid& self, std::uint64_t salt, std::uint64_t extra) { return pack(check(self.add_sequence({salt, extra}))); },
           nb::arg("salt") = 0, nb::arg("extra") = 0)
      .def("match",
           [](Hybrid& self, nb::handle prompt, std::uint64_t salt, std::uint64_t extra) {
             Array<std::int32_t> p;
             in_arg(p, prompt, "prompt");
             return self.match(cspan(p), {salt, extra});
           },
           nb::arg("prompt"), nb::arg("salt") = 0, nb::arg("extra") = 0)
      .def(
          "admit",
          [](Hybrid& self, nb::handle prompt, nb::handle slots, std::uint64_t salt, std::uint64_t extra, std::int64_t max_new,
             std::int32_t prefill_chunk, std::int32_t reserve) {
            Array<std::int32_t> p;
            in_arg(p, prompt, "prompt");
            const auto stride = std::size_t(std::max<std::int64_t>(std::min<std::int64_t>(std::int64_t(p.size()), reserve), 0));
            Array<std::int32_t> o;
            nb::object obj = out_arg(o, slots.is_none() ? nb::cast(new_array<std::int32_t, 2>(std::size_t(self.groups()), stride)) : slots,
                                     std::size_t(self.groups()) * stride, "slots", stride ? stride : 1);
            const auto a = check(self.admit(cspan(p), o.span(),
                                            {.key = {salt, extra}, .max_new = max_new, .prefill_chunk = prefill_chunk, .reserve = reserve}));
            return Admitted{pack(a.seq), a.cached_tokens, a.reserved, a.new_blocks, a.promised, obj};
          },
          nb::arg("prompt"), nb::arg("slots") = nb::none(), nb::arg("salt") = 0, nb::arg("extra") = 0, nb::arg("max_new") = -1,
          nb::arg("prefill_chunk") = 0, nb::arg("reserve") = INT32_MAX)
      .def(
          "reserve",
          [](Hybrid& self, std::uint64_t s, nb::handle n_or_ids, nb::handle slots) { return reserve_call<true>(self, s, n_or_ids, slots, false); },
          nb::arg("seq"), nb::arg("n"), nb::arg("slots") = nb::none())
      .def(
          "advance",
          [](Hybrid& self, std::uint64_t s, nb::handle n_or_ids, nb::handle slots) { return reserve_call<true>(self, s, n_or_ids, slots, true); },
          nb::arg("seq"), nb::arg("n"), nb::arg("slots") = nb::none())
      .def("computed", [](Hybrid& self, std::uint64_t s, std::int64_t tokens) { check(self.computed(unpack(s), tokens)); },
           nb::arg("seq"), nb::arg("tokens"))
      .def("truncate", [](Hybrid& self, std::uint64_t s, std::int32_t n) { check(self.truncate(unpack(s), n)); })
      .def("free", [](Hybrid& self, std::uint64_t s) { check(self.free(unpack(s))); })
      .def(
          "reserve_batch",
          [](Hybrid& self, nb::handle seqs, nb::handle counts, nb::handle slots, nb::handle copies, nb::handle ids) {
            return batch_call(self, seqs, counts, slots, copies, ids, false, true);
          },
          nb::arg("seqs"), nb::arg("counts"), nb::arg("slots") = nb::none(), nb::arg("copies") = nb::none(), nb::arg("ids") = nb::none())
      .def(
          "advance_batch",
          [](Hybrid& self, nb::handle seqs, nb::handle counts, nb::handle slots, nb::handle copies, nb::handle ids) {
            return batch_call(self, seqs, counts, slots, copies, ids, true, true);
          },
          nb::arg("seqs"), nb::arg("counts"), nb::arg("slots") = nb::none(), nb::arg("copies") = nb::none(), nb::arg("ids") = nb::none())
      .def("prefix_stats", [](const Hybrid& self) { return stats_dict(self.prefix_stats()); })
      .def("reset_prefix_cache", [](Hybrid& self) { check(self.reset_prefix_cache()); })
      .def(
          "export_block_table",
          [](const Hybrid& self, std::int32_t g, nb::handle seqs, std::int32_t row_stride) {
            Array<std::uint64_t> sq;
            in_arg(sq, seqs, "seqs");
            const std::size_t cols = std::size_t(std::max(row_stride, 1));
            auto out = new_array<std::int32_t, 2>(sq.size(), cols);
            Array<std::int32_t> o;
            nb::object obj = out_arg(o, nb::cast(out), sq.size() * cols, "out", cols);
            check(self.export_block_table(g, seq_span(sq), o.span(), row_stride));
            return obj;
          },
          nb::arg("group"), nb::arg("seqs"), nb::arg("row_stride"))
      .def("export_group_csr", &group_csr<Hybrid>, nb::arg("group"), nb::arg("seqs"))
      .def(
          "export_csr",
          [](const Hybrid& self, std::int32_t g, nb::handle seqs) {
            if (PyErr_WarnEx(PyExc_DeprecationWarning,
                             "HybridCache.export_csr is export_group_csr (its third array is first_pos, not last_page_len)", 1) < 0)
              throw nb::python_error();
            return group_csr<Hybrid>(self, g, seqs);
          },
          nb::arg("group"), nb::arg("seqs"))
      .def(
          "slot_mapping",
          [](const Hybrid& self, std::int32_t g, std::uint64_t s, std::int64_t begin, std::int64_t end) {
            require(end >= begin, "end", end, begin);
            Array<std::int32_t> o;
            nb::object obj = out_arg(o, nb::none(), std::size_t(end - begin), "out");
            check(self.slot_mapping(g, unpack(s), begin, end, o.span()));
            return obj;
          },
          nb::arg("group"), nb::arg("seq"), nb::arg("begin"), nb::arg("end"))
      .def("tokens", [](const Hybrid& self, std::uint64_t s) { return check(self.tokens(unpack(s))); })
      .def("computed_tokens", [](const Hybrid& self, std::uint64_t s) { return check(self.computed_tokens(unpack(s))); })
      .def("tokens_held", [](const Hybrid& self, std::uint64_t s, std::int32_t g) { return check(self.tokens_held(unpack(s), g)); })
      .def(
          "blocks",  // group g's row: block j holds positions [j * block_size(g), ...), 0 (the null block) where freed or evicted
          [](const Hybrid& self, std::uint64_t s, std::int32_t g) {
            const auto row = check(self.blocks(unpack(s), g));
            auto out = new_array<std::int32_t, 1>(row.size());
            std::copy(row.begin(), row.end(), out.data());
            return out;
          },
          nb::arg("seq"), nb::arg("group"))
      .def("blocks_held",
           [](const Hybrid& self, std::uint64_t s, nb::handle g) {
             return g.is_none() ? check(self.blocks_held(unpack(s))) : check(self.blocks_held(unpack(s), nb::cast<std::int32_t>(g)));
           },
           nb::arg("seq"), nb::arg("group") = nb::none())
      .def("blocks_needed", [](const Hybrid& self, std::int64_t prompt_len, std::int64_t max_new) {
        return check(self.blocks_needed(prompt_len, max_new));
      })
      .def("can_admit", &Hybrid::can_admit, nb::arg("prompt_len"), nb::arg("max_new"))
      .def("max_concurrency", &Hybrid::max_concurrency, nb::arg("max_len"))
      .def("promise", [](Hybrid& self, std::uint64_t s, std::int64_t blocks) { check(self.promise(unpack(s), blocks)); })
      .def("usage",
           [](const Hybrid& self, std::int32_t g) {
             require(g >= 0 && g < self.groups(), "group", g, self.groups() - 1);
             const auto u = self.usage(g);
             return std::make_pair(u.held, u.cached);
           })
      .def("check_invariants", [](const Hybrid& self) { check(self.check_invariants()); })
      // Imports: a prompt a peer prefilled (cache/hybrid_imports.hpp).
      .def(
          "import_prompt",  // (id, cached_tokens, num_blocks): every group's blocks pending (import_blocks lists them)
          [](Hybrid& self, nb::handle prompt, std::uint64_t salt, std::uint64_t extra, std::int64_t max_new) {
            Array<std::int32_t> p;
            in_arg(p, prompt, "prompt");
            const auto r = check(self.import(cspan(p), {.key = {salt, extra}, .max_new = max_new}));
            return std::make_tuple(r.id, r.cached_tokens, r.num_blocks);
          },
          nb::arg("prompt"), nb::arg("salt") = 0, nb::arg("extra") = 0, nb::arg("max_new") = -1)
      .def(
          "import_blocks",  // (skip, blocks int32): blocks[i] receives the peer's block skip + i of this group
          [](const Hybrid& self, std::uint64_t id, std::int32_t g) {
            return import_blocks_tuple(check(self.import_blocks(id, g)));
          },
          nb::arg("id"), nb::arg("group"))
      .def(
          "commit_import",  // (seq, published); the prompt imported, as on Cache (None: deprecated, unchecked)
          [](Hybrid& self, std::uint64_t id, nb::handle prompt) {
            if (prompt.is_none()) {
              if (PyErr_WarnEx(PyExc_DeprecationWarning,
                               "HybridCache.commit_import(id) names no prompt: pass the prompt imported, commit_import(id, prompt)", 1) < 0)
                throw nb::python_error();
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
              const auto r = check(self.commit_import(id));
#pragma GCC diagnostic pop
              return std::make_pair(pack(r.seq), r.published);
            }
            Array<std::int32_t> p;
            in_arg(p, prompt, "prompt");
            const auto r = check(self.commit_import(id, cspan(p)));
            return std::make_pair(pack(r.seq), r.published);
          },
          nb::arg("id"), nb::arg("prompt") = nb::none())
      .def(
          "abort_import",  // (seq, cached_tokens, recompute)
          [](Hybrid& self, std::uint64_t id) {
            const auto r = check(self.abort_import(id));
            return std::make_tuple(pack(r.seq), r.cached_tokens, r.recompute);
          },
          nb::arg("id"))
      .def_prop_ro("imports", [](const Hybrid& self) { return self.imports().size(); })
      .def(
          "live_blocks",  // int32: every group's live blocks of seq (what a sender holds)
          [](const Hybrid& self, std::uint64_t s) {
            std::vector<kv::BlockId> v;
            check(self.live_blocks(unpack(s), v));
            auto b = new_array<std::int32_t>(v.size());
            std::copy(v.begin(), v.end(), b.data());
            return b;
          },
          nb::arg("seq"));
  bind_holds(hybrid);
}

}  // namespace kvpy
