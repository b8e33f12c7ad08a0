// Hybrid models in Python: kv.LayerGroup (one group's kind, layers and
// shape), kv.LayerGroups (the validated layout: one page size, block sizes,
// padding, the layer map), kv.HybridCache (layer groups over one pool), and
// kv.PoolView.of_group (a group's view of the pool for the kernels).
// Handles are the same packed ints as the other caches'; arrays are read and
// written in place; errors are the typed kv exceptions.
#include <kvcache/cache/hybrid.hpp>
#include <kvcache/kernels/detail/group_view.hpp>

#include <vector>

#include "bind_common.hpp"
#include "bind_hybrid.hpp"
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
      .def("global_geometry", [](const Groups& g) { return check(kv::global_geometry(g.groups)); })
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

  bind_hybrid_cache<kv::HybridCache<>>(m, "HybridCache");

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
