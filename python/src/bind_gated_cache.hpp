// The head-paged caches: Write-Gated KV admission, alone or with Quest
// selection and a token policy on each head row's global region. One stream
// per (sequence, layer, kv-head) over single-head blocks; writes place each
// (token, head) by its gate and hand back the engine's commands (copies,
// moves, slots), written into the caller's int32 arrays or new ones.
#pragma once

#include <kvcache/kvcache.hpp>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "arrays.hpp"
#include "bind_common.hpp"
#include "bind_selection.hpp"

namespace kvpy {

// Blocks one head's write may copy after a fork (its ring blocks and the global tail), times heads.
template <class C>
std::size_t copy_room(const C& c, std::size_t heads) {
  const auto& a = c.admission();
  return heads * std::size_t(a.local_window() / c.block_size() + 2);
}

template <class C>
std::size_t tokens_of(const C& c, std::span<const kv::SeqId> seqs) {
  std::size_t n = 0;
  for (const kv::SeqId s : seqs) n += std::size_t(check(c.tokens_held(s)));
  return n;
}

// out.promote: None (not asked), True (a new array) or the caller's array.
inline nb::object promote_arg(Array<std::int32_t>& a, nb::handle given, std::size_t n) {
  if (given.is_none()) return nb::none();
  if (nb::isinstance<nb::bool_>(given)) return nb::cast<bool>(given) ? out_arg(a, nb::none(), n, "promote") : nb::none();
  return out_arg(a, given, n, "promote");
}

template <class C>
void bind_gated_writes(nb::class_<C>& c) {
  c.def(
       "write",
       [](C& self, std::uint64_t s, std::int32_t layer, nb::handle gates, nb::handle slots, nb::handle moves,
          nb::handle promote, nb::handle copies) {
         Array<float> g;
         Array<std::int32_t> sl, mv, pr, cp;
         in_arg(g, gates, "gates");
         const auto H = std::size_t(self.admission().num_kv_heads());
         nb::object so = out_arg(sl, slots, g.size(), "slots"), mo = out_arg(mv, moves, g.size(), "moves", 2),
                    po = promote_arg(pr, promote, g.size()), co = out_arg(cp, copies, copy_room(self, H), "copies", 2);
         const auto r = check(self.write(unpack(s), layer, cspan(g), {sl.span(), move_span(mv), pr.span(), copy_span(cp)}));
         return std::make_tuple(r, so, mo, po, co);
       },
       nb::arg("seq"), nb::arg("layer"), nb::arg("gates"), nb::arg("slots") = nb::none(), nb::arg("moves") = nb::none(),
       nb::arg("promote") = nb::none(), nb::arg("copies") = nb::none())
      .def(
          "write_batch",
          [](C& self, nb::handle seqs, std::int32_t layer, nb::handle gates, nb::handle slots, nb::handle moves,
             nb::handle promote, nb::handle copies) {
            Array<std::uint64_t> sq;
            Array<float> g;
            Array<std::int32_t> sl, mv, pr, cp;
            in_arg(sq, seqs, "seqs");
            in_arg(g, gates, "gates");
            const auto H = std::size_t(self.admission().num_kv_heads());
            nb::object so = out_arg(sl, slots, g.size(), "slots"), mo = out_arg(mv, moves, g.size(), "moves", 2),
                       po = promote_arg(pr, promote, g.size()),
                       co = out_arg(cp, copies, copy_room(self, H * sq.size()), "copies", 2);
            const auto r =
                check(self.write_batch(seq_span(sq), layer, cspan(g), {sl.span(), move_span(mv), pr.span(), copy_span(cp)}));
            return std::make_tuple(r, so, mo, po, co);
          },
          nb::arg("seqs"), nb::arg("layer"), nb::arg("gates"), nb::arg("slots") = nb::none(), nb::arg("moves") = nb::none(),
          nb::arg("promote") = nb::none(), nb::arg("copies") = nb::none())
      .def(
          "truncate",
          [](C& self, std::uint64_t s, std::int32_t n, nb::handle moves, nb::handle copies) {
            Array<std::int32_t> mv, cp;
            const auto& a = self.admission();
            const auto heads = std::size_t(a.num_layers()) * std::size_t(a.num_kv_heads());
            nb::object mo = out_arg(mv, moves, heads * std::size_t(a.local_window()), "moves", 2),
                       co = out_arg(cp, copies, copy_room(self, heads), "copies", 2);
            const auto r = check(self.truncate(unpack(s), n, {.moves = move_span(mv), .copies = copy_span(cp)}));
            return std::make_tuple(r, mo, co);
          },
          nb::arg("seq"), nb::arg("n"), nb::arg("moves") = nb::none(), nb::arg("copies") = nb::none())
      .def(
          "allot",
          [](C& self, std::uint64_t s, std::int32_t layer, std::int32_t n, nb::handle ring_start, nb::handle ring_len,
             nb::handle copies) {
            Array<std::int32_t> rs, rl, cp;
            const auto H = std::size_t(self.admission().num_kv_heads());
            nb::object a = out_arg(rs, ring_start, H, "ring_start"), b = out_arg(rl, ring_len, H, "ring_len"),
                       co = out_arg(cp, copies, copy_room(self, H), "copies", 2);
            const auto r = check(self.allot(unpack(s), layer, n, {rs.span(), rl.span(), copy_span(cp)}));
            return std::make_tuple(r, a, b, co);
          },
          nb::arg("seq"), nb::arg("layer"), nb::arg("n"), nb::arg("ring_start") = nb::none(),
          nb::arg("ring_len") = nb::none(), nb::arg("copies") = nb::none())
      .def(
          "reconcile",
          [](C& self, std::uint64_t s, std::int32_t layer, nb::handle gates) {
            Array<float> g;
            in_arg(g, gates, "gates");
            return check(self.reconcile(unpack(s), layer, cspan(g)));
          },
          nb::arg("seq"), nb::arg("layer"), nb::arg("gates"))
      .def("pending_writes",
           [](const C& self, std::uint64_t s, std::int32_t layer) { return check(self.admission().pending(unpack(s), layer)); },
           nb::arg("seq"), nb::arg("layer"));
}

template <class C>
void bind_gated_exports(nb::class_<C>& c) {
  // Rows: (sequence, kv-head) of one layer, or of every layer (layer -1, layer-major).
  const auto rows = [](const C& self, std::size_t seqs, std::int32_t layer) {
    const auto& a = self.admission();
    return seqs * std::size_t(a.num_kv_heads()) * std::size_t(layer < 0 ? a.num_layers() : 1);
  };
  c.def(
       "export_heads_csr",
       [rows](const C& self, nb::handle seqs, std::int32_t layer, nb::handle indptr, nb::handle indices,
              nb::handle last_page_len) {
         Array<std::uint64_t> sq;
         Array<std::int32_t> ip, ix, lp;
         in_arg(sq, seqs, "seqs");
         const std::size_t n = rows(self, sq.size(), layer);
         nb::object a = out_arg(ip, indptr, n + 1, "indptr"),
                    b = out_arg(ix, indices, indices.is_none() ? blocks_of(self, seq_span(sq)) : 0, "indices"),
                    d = out_arg(lp, last_page_len, n, "last_page_len");
         const auto nnz = check(self.export_heads_csr(seq_span(sq), layer, ip.span(), ix.span(), lp.span()));
         return std::make_tuple(a, b, d, nnz);
       },
       nb::arg("seqs"), nb::arg("layer"), nb::arg("indptr") = nb::none(), nb::arg("indices") = nb::none(),
       nb::arg("last_page_len") = nb::none())
      .def(
          "export_heads_block_table",
          [rows](const C& self, nb::handle seqs, std::int32_t layer, std::int32_t row_stride, nb::handle out) {
            Array<std::uint64_t> sq;
            Array<std::int32_t> o;
            in_arg(sq, seqs, "seqs");
            const std::size_t n = rows(self, sq.size(), layer), cols = std::size_t(std::max(row_stride, 0));
            nb::object obj = out_arg(o, out.is_none() ? nb::cast(new_array<std::int32_t, 2>(n, cols)) : nb::borrow(out),
                                     n * cols, "out");
            check(self.export_heads_block_table(seq_span(sq), layer, o.span(), row_stride));
            return obj;
          },
          nb::arg("seqs"), nb::arg("layer"), nb::arg("row_stride"), nb::arg("out") = nb::none())
      .def(
          "export_heads_lengths",
          [rows](const C& self, nb::handle seqs, std::int32_t layer, nb::handle out) {
            Array<std::uint64_t> sq;
            Array<std::int32_t> o;
            in_arg(sq, seqs, "seqs");
            nb::object obj = out_arg(o, out, rows(self, sq.size(), layer), "out");
            check(self.export_heads_lengths(seq_span(sq), layer, o.span()));
            return obj;
          },
          nb::arg("seqs"), nb::arg("layer"), nb::arg("out") = nb::none())
      .def(
          "export_head_columns",
          [rows](const C& self, nb::handle seqs, std::int32_t layer, nb::handle indptr, nb::handle columns) {
            Array<std::uint64_t> sq;
            Array<std::int32_t> ip, co;
            in_arg(sq, seqs, "seqs");
            nb::object a = out_arg(ip, indptr, rows(self, sq.size(), layer) + 1, "indptr"),
                       b = out_arg(co, columns, columns.is_none() ? tokens_of(self, seq_span(sq)) : 0, "columns");
            const auto n = check(self.export_head_columns(seq_span(sq), layer, ip.span(), co.span()));
            return std::make_tuple(a, b, n);
          },
          nb::arg("seqs"), nb::arg("layer"), nb::arg("indptr") = nb::none(), nb::arg("columns") = nb::none())
      .def(
          "positions",
          [](const C& self, std::uint64_t s, std::int32_t layer, std::int32_t head) {
            const auto p = check(self.admission().positions(unpack(s), layer, head));
            std::vector<std::int32_t> out;
            for (std::size_t i = 0; i < p.size(); ++i) out.push_back(p[i]);
            return out;
          },
          nb::arg("seq"), nb::arg("layer"), nb::arg("head"))
      .def(
          "head_state",
          [](const C& self, std::uint64_t s, std::int32_t layer, std::int32_t head) {
            const auto h = check(self.admission().head_state(unpack(s), layer, head));
            return std::make_tuple(h.ring, h.global, h.oldest);
          },
          nb::arg("seq"), nb::arg("layer"), nb::arg("head"));
}

template <class C>
void bind_gated_cache(nb::module_& m, const char* name) {
  using E = typename std::remove_cvref_t<decltype(std::declval<C&>().eviction())>;
  nb::class_<C> c(m, name);
  if constexpr (C::selects) {
    c.def(
        "__init__",
        [](C* self, const kv::Geometry& g, std::int32_t num_blocks, std::int32_t max_sequences,
           std::int32_t max_blocks_per_sequence, const kv::WriteGateConfig& admission, const E& eviction,
           kv::QuestConfig q, nb::handle bounds) {
          q.bounds = bounds_store(bounds);
          new (self) C({.geometry = g, .num_blocks = num_blocks, .max_sequences = max_sequences,
                        .max_blocks_per_sequence = max_blocks_per_sequence},
                       admission, q, eviction);
        },
        nb::arg("geometry"), nb::arg("num_blocks"), nb::arg("max_sequences"), nb::arg("max_blocks_per_sequence"),
        nb::arg("admission"), nb::arg("eviction"), nb::arg("selection"), nb::arg("bounds"), nb::keep_alive<1, 9>());
  } else {
    c.def(
        "__init__",
        [](C* self, const kv::Geometry& g, std::int32_t num_blocks, std::int32_t max_sequences,
           std::int32_t max_blocks_per_sequence, const kv::WriteGateConfig& admission, const E& eviction) {
          new (self) C({.geometry = g, .num_blocks = num_blocks, .max_sequences = max_sequences,
                        .max_blocks_per_sequence = max_blocks_per_sequence},
                       admission, {}, eviction);
        },
        nb::arg("geometry"), nb::arg("num_blocks"), nb::arg("max_sequences"), nb::arg("max_blocks_per_sequence"),
        nb::arg("admission"), nb::arg("eviction"));
  }
  c.def_prop_ro("admission", [](const C& self) { return self.admission().config(); })
      .def("ring_admit_params", [](const C& self) { return self.admission().ring_admit_params(); })
      .def("add_sequence", [](C& self) { return pack(check(self.add_sequence())); })
      .def(
          "tokens_held",
          [](const C& self, std::uint64_t s, std::optional<std::int32_t> layer, std::optional<std::int32_t> head) {
            if (!layer && !head) return check(self.tokens_held(unpack(s)));
            require(layer && head, layer ? "head" : "layer", -1, 0);  // one head: both given
            return check(self.tokens_held(unpack(s), *layer, *head));
          },
          nb::arg("seq"), nb::arg("layer") = nb::none(), nb::arg("head") = nb::none());
  bind_common(c);
  bind_gated_writes(c);
  bind_gated_exports(c);
  if constexpr (C::selects) bind_selection(c);
  if constexpr (C::evicts_global) {  // the token policy on each head row's global region
    c.def(
         "observe",
         [](C& self, std::uint64_t s, std::int32_t layer, nb::handle scores, const std::string& kind) {
           Array<float> a;
           if (!a.borrow(scores, false)) bad_array("scores", "float32 (one layer's head rows, each row's tokens)");
           check(self.observe(unpack(s), layer, score_kind(kind), cspan(a)));
         },
         nb::arg("seq"), nb::arg("layer"), nb::arg("scores"), nb::arg("kind") = "head_attention_sums")
        .def(
            "evict",
            [](C& self, std::uint64_t s, nb::handle moves) {
              Array<std::int32_t> mv;
              const kv::SeqId one[] = {unpack(s)};
              nb::object mo = out_arg(mv, moves, tokens_of(self, one), "moves", 2);
              const auto e = check(self.evict(unpack(s), move_span(mv)));
              return std::make_tuple(e, rows(mo, e.moves));  // exactly the moves written
            },
            nb::arg("seq"), nb::arg("moves") = nb::none());
  }
}

}  // namespace kvpy
