// kvcache._kvcache: the bindings. The Python API (python/kvcache/__init__.py)
// picks the compiled Cache of an eviction policy; everything else is here.
#include <kvcache/kvcache.hpp>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "bind_cache.hpp"
#include "errors.hpp"

namespace kvpy {
void register_kernels(nanobind::module_& m);  // kernels.cpp
}

namespace nb = nanobind;
namespace kv = kvcache;
using namespace nb::literals;

namespace {

void bind_geometry(nb::module_& m) {
  nb::enum_<kv::DType>(m, "DType")
      .value("f32", kv::DType::f32)
      .value("f16", kv::DType::f16)
      .value("bf16", kv::DType::bf16)
      .value("fp8_e4m3", kv::DType::fp8_e4m3);
  nb::enum_<kv::Layout>(m, "Layout").value("NHD", kv::Layout::NHD).value("HND", kv::Layout::HND);
  nb::enum_<kv::KvPlanes>(m, "KvPlanes").value("interleaved", kv::KvPlanes::interleaved).value("separate", kv::KvPlanes::separate);
  nb::class_<kv::Geometry>(m, "Geometry")
      .def(
          "__init__",
          [](kv::Geometry* self, std::int32_t num_layers, std::int32_t num_kv_heads, std::int32_t head_dim,
             std::int32_t block_size, kv::DType dtype, kv::Layout layout, kv::KvPlanes planes) {
            new (self) kv::Geometry(kvpy::check(kv::Geometry::make({.num_layers = num_layers, .num_kv_heads = num_kv_heads,
                                                                   .head_dim = head_dim, .block_size = block_size,
                                                                   .dtype = dtype, .layout = layout, .planes = planes})));
          },
          "num_layers"_a, "num_kv_heads"_a, "head_dim"_a, "block_size"_a = 16, "dtype"_a = kv::DType::f16,
          "layout"_a = kv::Layout::NHD, "planes"_a = kv::KvPlanes::interleaved)
      .def_prop_ro("num_layers", [](const kv::Geometry& g) { return g.spec().num_layers; })
      .def_prop_ro("num_kv_heads", [](const kv::Geometry& g) { return g.spec().num_kv_heads; })
      .def_prop_ro("head_dim", [](const kv::Geometry& g) { return g.spec().head_dim; })
      .def_prop_ro("block_size", &kv::Geometry::block_size)
      .def_prop_ro("dtype", [](const kv::Geometry& g) { return g.spec().dtype; })
      .def_prop_ro("layout", [](const kv::Geometry& g) { return g.spec().layout; })
      .def_prop_ro("planes", [](const kv::Geometry& g) { return g.spec().planes; })
      .def_prop_ro("block_bytes", &kv::Geometry::block_bytes)
      .def("pool_bytes", [](const kv::Geometry& g, std::int64_t num_blocks) { return kvpy::check(g.pool_bytes(num_blocks)); });
}

void bind_policies(nb::module_& m) {
  nb::class_<kv::KeepAll>(m, "KeepAll").def(nb::init<>());
  nb::class_<kv::SlidingWindow>(m, "SlidingWindow").def(nb::init<std::int32_t>(), "window"_a);
  nb::class_<kv::SinkWindowEviction>(m, "SinkWindow")
      .def("__init__", [](kv::SinkWindowEviction* self, std::int32_t sinks, std::int32_t window, std::int32_t block_size) {
        new (self) kv::SinkWindowEviction({.sinks = sinks, .window = window, .block_size = block_size});
      }, "sinks"_a, "window"_a, "block_size"_a);
  nb::class_<kv::BlockScoreEviction>(m, "BlockScores")
      .def("__init__", [](kv::BlockScoreEviction* self, std::int32_t start, std::int32_t recent, std::int32_t max,
                          std::int32_t block_size) {
        new (self) kv::BlockScoreEviction({.start = start, .recent = recent, .max = max, .block_size = block_size});
      }, "start"_a, "recent"_a, "max"_a, "block_size"_a);
  nb::class_<kv::H2OEviction>(m, "H2O")
      .def("__init__", [](kv::H2OEviction* self, std::int32_t heavy, std::int32_t recent, std::int32_t groups) {
        new (self) kv::H2OEviction({.heavy = heavy, .recent = recent, .groups = groups});
      }, "heavy"_a, "recent"_a, "groups"_a = 1)
      .def_prop_ro("groups", &kv::H2OEviction::groups);
  nb::class_<kv::TovaEviction>(m, "Tova")
      .def("__init__", [](kv::TovaEviction* self, std::int32_t budget, std::int32_t groups) {
        new (self) kv::TovaEviction({.budget = budget, .groups = groups});
      }, "budget"_a, "groups"_a = 1)
      .def_prop_ro("groups", &kv::TovaEviction::groups);
  nb::class_<kv::SnapKVEviction>(m, "SnapKV")
      .def("__init__", [](kv::SnapKVEviction* self, std::int32_t capacity, std::int32_t window, std::int32_t kernel,
                          std::int32_t groups) {
        new (self) kv::SnapKVEviction({.capacity = capacity, .window = window, .kernel = kernel, .groups = groups});
      }, "capacity"_a, "window"_a = 32, "kernel"_a = 7, "groups"_a = 1)
      .def_prop_ro("groups", &kv::SnapKVEviction::groups);
  nb::class_<kv::AverageAttentionEviction>(m, "AverageAttention")
      .def("__init__", [](kv::AverageAttentionEviction* self, std::int32_t budget, std::int32_t step, std::int32_t groups) {
        new (self) kv::AverageAttentionEviction({.budget = budget, .step = step, .groups = groups});
      }, "budget"_a, "step"_a = 64, "groups"_a = 1)
      .def_prop_ro("groups", &kv::AverageAttentionEviction::groups);
}

template <class E>
using CacheOf = kv::Cache<kv::BlockPool, kv::PageTable, kv::AdmitAll, kv::SelectAll, E>;

}  // namespace

NB_MODULE(_kvcache, m) {
  if (_import_array() < 0) throw nb::python_error();  // numpy's C API (arrays.hpp)
  m.attr("__version__") = kv::version_string();
  kvpy::register_errors(m);
  bind_geometry(m);
  bind_policies(m);
  kvpy::register_kernels(m);
  nb::class_<kvpy::Admitted>(m, "Admitted")
      .def_ro("seq", &kvpy::Admitted::seq)
      .def_ro("cached_tokens", &kvpy::Admitted::cached_tokens)
      .def_ro("reserved", &kvpy::Admitted::reserved)
      .def_ro("new_blocks", &kvpy::Admitted::new_blocks)
      .def_ro("promised", &kvpy::Admitted::promised)
      .def_ro("slots", &kvpy::Admitted::slots);
  nb::class_<kv::EvictionResult>(m, "EvictionResult")
      .def_ro("evicted", &kv::EvictionResult::evicted)
      .def_ro("rotations", &kv::EvictionResult::rotations)
      .def_ro("tokens", &kv::EvictionResult::tokens)
      .def_ro("moves", &kv::EvictionResult::moves)
      .def_ro("first_changed", &kv::EvictionResult::first_changed);
  kvpy::bind_cache<CacheOf<kv::KeepAll>>(m, "Cache_KeepAll");
  kvpy::bind_cache<CacheOf<kv::SlidingWindow>>(m, "Cache_SlidingWindow");
  kvpy::bind_cache<CacheOf<kv::SinkWindowEviction>>(m, "Cache_SinkWindow");
  kvpy::bind_cache<CacheOf<kv::BlockScoreEviction>>(m, "Cache_BlockScores");
  kvpy::bind_cache<CacheOf<kv::H2OEviction>>(m, "Cache_H2O");
  kvpy::bind_cache<CacheOf<kv::TovaEviction>>(m, "Cache_Tova");
  kvpy::bind_cache<CacheOf<kv::SnapKVEviction>>(m, "Cache_SnapKV");
  kvpy::bind_cache<CacheOf<kv::AverageAttentionEviction>>(m, "Cache_AverageAttention");
}
