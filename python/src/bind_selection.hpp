// Quest's calls on a page-selecting cache, token-paged or head-paged: the
// bounds store's slices (numpy views the kernels write), the pages an edit
// left stale, and the host selection.
#pragma once

#include <kvcache/kvcache.hpp>
#include <nanobind/ndarray.h>
#include <nanobind/stl/tuple.h>

#include <tuple>

#include "arrays.hpp"
#include "bind_common.hpp"

namespace kvpy {

// The bounds store a Quest cache reads: a C-contiguous float32 CPU array (the
// cache keeps it alive); its size is the cache's to check.
inline std::span<float> bounds_store(nb::handle bounds) {
  nb::ndarray<float, nb::c_contig, nb::device::cpu> nd;
  if (!nb::try_cast(bounds, nd, false)) bad_array("bounds", "float32");
  return {nd.data(), nd.size()};
}

// A slice of the bounds store as a numpy view [num_blocks, kv_heads, 2, head_dim]; `owner`, the cache, keeps the store alive.
inline nb::ndarray<nb::numpy, float> bounds_view(nb::handle owner, std::span<float> b, const kv::GeometrySpec& g) {
  const std::size_t per_block = std::size_t(g.num_kv_heads) * 2 * std::size_t(g.head_dim);
  const std::size_t shape[4] = {b.size() / per_block, std::size_t(g.num_kv_heads), 2, std::size_t(g.head_dim)};
  return nb::ndarray<nb::numpy, float>(b.data(), 4, shape, owner);
}

template <class C>
void bind_selection(nb::class_<C>& c) {
  c.def(
       "page_bounds",
       [](nb::handle self, std::int32_t layer) {
         const C& cache = nb::cast<const C&>(self);
         return bounds_view(self, check(cache.page_bounds(layer)), cache.geometry().spec());
       },
       nb::arg("layer"))
      .def(
          "stale_pages",
          [](C& self, nb::handle seqs, nb::handle pages, nb::handle fill) {
            Array<std::uint64_t> sq;
            Array<std::int32_t> pg, fl;
            in_arg(sq, seqs, "seqs");
            const std::size_t n = pages.is_none() || fill.is_none() ? blocks_of(self, seq_span(sq)) : 0;
            nb::object a = out_arg(pg, pages, n, "pages"), b = out_arg(fl, fill, n, "fill");
            const auto listed = check(self.stale_pages(seq_span(sq), {pg.span(), fl.span()}));
            return std::make_tuple(a, b, listed);
          },
          nb::arg("seqs"), nb::arg("pages") = nb::none(), nb::arg("fill") = nb::none())
      .def(
          "select",
          [](C& self, nb::handle seqs, std::int32_t layer, nb::handle queries, nb::handle indptr, nb::handle indices) {
            Array<std::uint64_t> sq;
            Array<float> q;
            Array<std::int32_t> ip, ix;
            in_arg(sq, seqs, "seqs");
            in_arg(q, queries, "queries");
            // Rows are (sequence, kv-head). Head-paged, each row is one head's own stream, so the
            // sequence's blocks bound a layer's pages; token-paged, each head reads its row's blocks.
            std::size_t heads = std::size_t(self.geometry().spec().num_kv_heads), fold = heads;
            if constexpr (C::head_paged) heads = std::size_t(self.admission().num_kv_heads()), fold = 1;
            const std::size_t rows = sq.size() * heads;
            const std::size_t pages = indices.is_none() ? blocks_of(self, seq_span(sq)) * fold : 0;
            nb::object a = out_arg(ip, indptr, rows + 1, "indptr"), b = out_arg(ix, indices, pages, "indices");
            const auto n = check(self.select(seq_span(sq), layer, cspan(q), {ip.span(), ix.span()}));
            return std::make_tuple(a, b, n);
          },
          nb::arg("seqs"), nb::arg("layer"), nb::arg("queries"), nb::arg("indptr") = nb::none(),
          nb::arg("indices") = nb::none());
}

}  // namespace kvpy
