// Hybrid models in Python: kv.LayerGroup (one group's kind, layers and
// shape), kv.LayerGroups (the validated layout: one page size, block sizes,
// padding, the layer map), kv.HybridCache (layer groups over one pool), and
// kv.PoolView.of_group (a group's view of the pool for the kernels).
// Handles are the same packed ints as the other caches'; arrays are read and
// written in place; errors are the typed kv exceptions.
#include <kvcache/cache/hybrid.hpp>
#include <kvcache/kernels/group_view.hpp>

#include <vector>

#include "bind_common.hpp"
#include "tensors.hpp"

namespace kvpy {

namespace {
// A group as Python gives it: the spec with its own layer list (the spec's span points into it).
struct LayerGroup {
  kv::LayerGroupSpec spec;
  std::vector<std::int32_t> layers;
};

kv::AttentionKind kind_of(const std::string& k) {
  if (k == "full") return kv::AttentionKind::full;
  if (k == "sliding_window") return kv::AttentionKind::sliding_window;
  if (k == "chunked_local") return kv::AttentionKind::chunked_local;
  if (k == "mla") return kv::AttentionKind::mla;
  if (k == "cross") return kv::AttentionKind::cross;
  require(false, "kind (full, sliding_window, chunked_local, mla, cross)", -1, 4);
  return {};
}
const char* kind_name(kv::AttentionKind k) {
  static const char* names[] = {"full", "sliding_window", "chunked_local", "mla", "cross"};
  return names[std::size_t(k)];
}
using Hybrid = kv::HybridCache<>;

// reserve() and advance(): n (a count, without prefix caching) or the ids; the slots [groups][n].
nb::object reserve(Hybrid& self, std::uint64_t s, nb::handle n_or_ids, bool advance) {
  const bool count = PyLong_Check(n_or_ids.ptr());
  Array<std::int32_t> ids;
  std::int64_t n = 0;
  if (count) n = nb::cast<std::int64_t>(n_or_ids);
  else in_arg(ids, n_or_ids, "ids"), n = std::int64_t(ids.size());
  require(n >= 0 && n <= INT32_MAX, "n", n, INT32_MAX);
  auto slots = new_array<std::int32_t, 2>(std::size_t(self.groups()), std::size_t(n));
  Array<std::int32_t> o;
  nb::object obj = out_arg(o, nb::cast(slots), std::size_t(self.groups()) * std::size_t(n), "slots", n ? std::size_t(n) : 1);
  const kv::SeqId id = unpack(s);
  if (count) check(advance ? self.advance(id, std::int32_t(n), o.span()) : self.reserve(id, std::int32_t(n), o.span()));
  else check(advance ? self.advance(id, cspan(ids), o.span()) : self.reserve(id, cspan(ids), o.span()));
  return obj;
}

// Group g's CSR over the live blocks of seqs: (indptr, indices, first_pos, nnz).
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

// A group index from Python: outside the groups is invalid_argument naming it (not an out-of-range read).
std::int32_t group_at(const Groups& g, std::int32_t i) {
  require(i >= 0 && i < g.groups.num_groups(), "group", i, g.groups.num_groups() - 1);
  return i;
}
}  // namespace

void register_hybrid(nb::module_& m) {
  nb::class_<LayerGroup>(m, "LayerGroup")
      .def(
          "__init__",
          [](LayerGroup* self, const std::string& kind, nb::handle layers, std::int32_t num_kv_heads, std::int32_t head_dim,
             std::int32_t v_head_dim, std::int32_t window, std::int32_t chunk, std::int32_t encoder_len, kv::DType dtype,
             const kv::KvFormat& format) {
            Array<std::int32_t> l;
            in_arg(l, layers, "layers");
            new (self) LayerGroup{{.kind = kind_of(kind), .num_kv_heads = num_kv_heads, .head_dim = head_dim,
                                   .v_head_dim = v_head_dim, .window = window, .chunk = chunk, .encoder_len = encoder_len,
                                   .dtype = dtype, .format = format},
                                  std::vector<std::int32_t>(l.data(), l.data() + l.size())};
          },
          nb::arg("kind"), nb::arg("layers"), nb::arg("num_kv_heads") = 1, nb::arg("head_dim") = 128,
          nb::arg("v_head_dim") = -1, nb::arg("window") = 0, nb::arg("chunk") = 0, nb::arg("encoder_len") = 0,
          nb::arg("dtype") = kv::DType::f16, nb::arg("format") = kv::KvFormat{})
      .def_prop_ro("kind", [](const LayerGroup& g) { return kind_name(g.spec.kind); })
      .def_prop_ro("format", [](const LayerGroup& g) { return g.spec.format; })
      .def_prop_ro("layers", [](const LayerGroup& g) { return g.layers; });

  nb::class_<Groups>(m, "LayerGroups")
      .def(
          "__init__",
          [](Groups* self, const std::vector<LayerGroup>& groups, std::int32_t block_size, std::int32_t block_multiple,
             std::int32_t max_padding_permille) {
            std::vector<kv::LayerGroupSpec> specs;
            for (const auto& g : groups) {
              specs.push_back(g.spec);
              specs.back().layers = g.layers;
            }
            new (self) Groups{check(kv::LayerGroups::make({.groups = specs, .block_size = block_size,
                                                           .block_multiple = block_multiple,
                                                           .max_padding_permille = max_padding_permille}))};
          },
          nb::arg("groups"), nb::arg("block_size") = 16, nb::arg("block_multiple") = 1, nb::arg("max_padding_permille") = 250)
      .def_prop_ro("num_groups", [](const Groups& g) { return g.groups.num_groups(); })
      .def_prop_ro("num_layers", [](const Groups& g) { return g.groups.num_layers(); })
      .def_prop_ro("page_bytes", [](const Groups& g) { return g.groups.page_bytes(); })
      .def_prop_ro("hit_alignment", [](const Groups& g) { return g.groups.hit_alignment(); })
      .def("block_size", [](const Groups& g, std::int32_t i) { return g.groups.block_size(group_at(g, i)); })
      .def("padding", [](const Groups& g, std::int32_t i) { return g.groups.padding(group_at(g, i)); })
      .def("token_bytes", [](const Groups& g, std::int32_t i) { return g.groups.token_bytes(group_at(g, i)); })
      .def("plane_bytes",
           [](const Groups& g, std::int32_t i) {
             const kv::GroupPlaneBytes p = g.groups.planes(group_at(g, i));
             return std::make_pair(p.k, p.v);
           })
      .def("kind", [](const Groups& g, std::int32_t i) { return kind_name(g.groups.spec(group_at(g, i)).kind); })
      .def("as_geometry", [](const Groups& g) { return check(g.groups.as_geometry()); })
      .def("layer_slot",
           [](const Groups& g, std::int32_t l) {
             const auto s = g.groups.layer_slot(l);
             return std::make_pair(s.group, s.index);
           })
      .def("blocks_needed",
           [](const Groups& g, std::int64_t length, std::int64_t in_flight) { return kv::hybrid_blocks_needed(g.groups, length, in_flight); },
           nb::arg("length"), nb::arg("in_flight"))
      .def("pool_blocks",
           [](const Groups& g, std::int64_t requests, std::int64_t length, std::int64_t prefill_chunk) {
             return kv::hybrid_pool_blocks(g.groups, requests, length, prefill_chunk);
           },
           nb::arg("requests"), nb::arg("length"), nb::arg("prefill_chunk") = 0);

  nb::class_<Hybrid> hybrid(m, "HybridCache");
  hybrid
      .def(
          "__init__",
          [](Hybrid* self, const Groups& g, std::int32_t num_blocks, std::int32_t max_sequences, std::int32_t max_tokens,
             std::int32_t prefill_chunk, bool prefix_caching, std::int32_t event_capacity) {
            try {
              new (self) Hybrid({.groups = g.groups, .num_blocks = num_blocks, .max_sequences = max_sequences,
                                 .max_tokens = max_tokens, .prefill_chunk = prefill_chunk, .prefix_caching = prefix_caching,
                                 .event_capacity = event_capacity});
            } catch (const kv::ConfigError& e) {
              check(e.status());
            }
          },
          nb::arg("groups"), nb::arg("num_blocks"), nb::arg("max_sequences"), nb::arg("max_tokens"),
          nb::arg("prefill_chunk") = 0, nb::arg("prefix_caching") = true, nb::arg("event_capacity") = 0)
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
          [](Hybrid& self, nb::handle prompt, std::int32_t reserve, std::uint64_t salt, std::uint64_t extra, std::int64_t max_new) {
            Array<std::int32_t> p;
            in_arg(p, prompt, "prompt");
            const auto stride = std::size_t(std::max<std::int64_t>(std::min<std::int64_t>(std::int64_t(p.size()), reserve), 0));
            auto slots = new_array<std::int32_t, 2>(std::size_t(self.groups()), stride);
            Array<std::int32_t> o;
            nb::object obj = out_arg(o, nb::cast(slots), std::size_t(self.groups()) * stride, "slots", stride ? stride : 1);
            const auto a = check(self.admit(cspan(p), o.span(), {.key = {salt, extra}, .max_new = max_new, .reserve = reserve}));
            return std::make_tuple(pack(a.seq), a.cached_tokens, a.reserved, obj);
          },
          nb::arg("prompt"), nb::arg("reserve") = INT32_MAX, nb::arg("salt") = 0, nb::arg("extra") = 0, nb::arg("max_new") = -1)
      .def(
          "reserve", [](Hybrid& self, std::uint64_t s, nb::handle n_or_ids) { return reserve(self, s, n_or_ids, false); },
          nb::arg("seq"), nb::arg("n"))
      .def(
          "advance", [](Hybrid& self, std::uint64_t s, nb::handle n_or_ids) { return reserve(self, s, n_or_ids, true); },
          nb::arg("seq"), nb::arg("n"))
      .def("computed", [](Hybrid& self, std::uint64_t s, std::int64_t tokens) { check(self.computed(unpack(s), tokens)); },
           nb::arg("seq"), nb::arg("tokens"))
      .def("truncate", [](Hybrid& self, std::uint64_t s, std::int32_t n) { check(self.truncate(unpack(s), n)); })
      .def("free", [](Hybrid& self, std::uint64_t s) { check(self.free(unpack(s))); })
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
      .def("export_group_csr", &group_csr, nb::arg("group"), nb::arg("seqs"))
      .def(
          "export_csr",
          [](const Hybrid& self, std::int32_t g, nb::handle seqs) {
            if (PyErr_WarnEx(PyExc_DeprecationWarning,
                             "HybridCache.export_csr is export_group_csr (its third array is first_pos, not last_page_len)", 1) < 0)
              throw nb::python_error();
            return group_csr(self, g, seqs);
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
            const auto gb = check(self.import_blocks(id, g));
            auto b = new_array<std::int32_t>(gb.local.size());
            std::copy(gb.local.begin(), gb.local.end(), b.data());
            return nb::make_tuple(gb.skip, b);
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

  // A group's view of a hybrid pool for the kernels (kvcache.PoolView.of_group wraps it).
  m.def(
      "_group_view",
      [](const Groups& lg, std::int32_t g, Tensor memory, std::int64_t num_blocks, const std::string& planes) {
        const kv::GroupPlanes p = planes == "kv" ? kv::GroupPlanes::kv
                                  : planes == "k" ? kv::GroupPlanes::k
                                  : planes == "v" ? kv::GroupPlanes::v
                                                  : (require(false, "planes (kv, k or v)", -1, 2), kv::GroupPlanes::kv);
        const Device d = device_of(memory, "memory");
        require(num_blocks >= 1, "num_blocks", num_blocks, 1);
        require(std::int64_t(memory.nbytes()) / lg.groups.page_bytes() >= num_blocks, "memory.nbytes",
                std::int64_t(memory.nbytes()), num_blocks * lg.groups.page_bytes());
        return Pool{check(kv::make_group_view(lg.groups, g, memory.data(), num_blocks, p)), d, nb::cast(memory), {}};
      },
      nb::arg("groups"), nb::arg("group"), nb::arg("memory"), nb::arg("num_blocks"), nb::arg("planes") = "kv");
}

}  // namespace kvpy
