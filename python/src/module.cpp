// kvcache._kvcache: the bindings. The Python API (python/kvcache/__init__.py)
// picks the compiled Cache of an eviction policy; everything else is here.
#define KVCACHE_NUMPY_IMPORT  // this translation unit holds numpy's C API table (arrays.hpp)
#include <kvcache/kernels/detail/quant.hpp>
#include <kvcache/kernels/ring_admit.hpp>
#include <kvcache/kvcache.hpp>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "bind_cache.hpp"
#include "errors.hpp"

namespace kvpy {
void register_kernels(nanobind::module_& m);        // kernels.cpp
void register_caches(nanobind::module_& m);         // caches.cpp
void register_quest_caches(nanobind::module_& m);   // caches_quest.cpp
void register_hybrid(nanobind::module_& m);         // caches_hybrid.cpp
void register_hybrid_quest(nanobind::module_& m);   // caches_hybrid_quest.cpp
void register_hybrid_eviction(nanobind::module_& m);  // caches_hybrid_eviction.cpp
void register_gated_caches(nanobind::module_& m);   // caches_gated.cpp
void register_tiers(nanobind::module_& m);          // tiers.cpp
void register_transfer(nanobind::module_& m);       // transfer.cpp
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
      .value("fp8_e4m3", kv::DType::fp8_e4m3)
      .value("fp8_e5m2", kv::DType::fp8_e5m2)
      .value("int8", kv::DType::int8)
      .value("int4", kv::DType::int4)
      .value("fp4_e2m1", kv::DType::fp4_e2m1)
      .value("int2", kv::DType::int2);
  nb::enum_<kv::Scales>(m, "Scales")
      .value("none", kv::Scales::none)
      .value("tensor", kv::Scales::tensor)
      .value("head", kv::Scales::head)
      .value("group", kv::Scales::group)
      .value("channel", kv::Scales::channel);
  nb::class_<kv::SideFormat>(m, "SideFormat")
      .def(nb::init<>())
      .def("__init__",
           [](kv::SideFormat* self, kv::Scales scales, std::int32_t group, bool minimum) {
             new (self) kv::SideFormat{scales, group, minimum};
           },
           "scales"_a, "group"_a = 0, "minimum"_a = false)
      .def_rw("scales", &kv::SideFormat::scales)
      .def_rw("group", &kv::SideFormat::group)
      .def_rw("minimum", &kv::SideFormat::minimum)
      .def("__eq__", [](const kv::SideFormat& a, const kv::SideFormat& b) { return a == b; })
      .def("__repr__", [](const kv::SideFormat& f) {
        static const char* names[] = {"none", "tensor", "head", "group", "channel"};
        const auto s = static_cast<std::size_t>(f.scales);
        return std::string("SideFormat(Scales.") + (s < 5 ? names[s] : "?") + ", " + std::to_string(f.group) +
               (f.minimum ? ", minimum=True)" : ")");
      });
  nb::class_<kv::KvFormat>(m, "KvFormat")
      .def("__init__", [](kv::KvFormat* self, const kv::SideFormat& k, const kv::SideFormat& v) { new (self) kv::KvFormat{k, v}; },
           "k"_a = kv::SideFormat{}, "v"_a = kv::SideFormat{})
      .def_rw("k", &kv::KvFormat::k)
      .def_rw("v", &kv::KvFormat::v)
      .def("__eq__", [](const kv::KvFormat& a, const kv::KvFormat& b) { return a == b; });
  nb::enum_<kv::Layout>(m, "Layout").value("NHD", kv::Layout::NHD).value("HND", kv::Layout::HND);
  nb::enum_<kv::KvPlanes>(m, "KvPlanes").value("interleaved", kv::KvPlanes::interleaved).value("separate", kv::KvPlanes::separate);
  nb::class_<kv::Geometry>(m, "Geometry")
      .def(
          "__init__",
          [](kv::Geometry* self, std::int32_t num_layers, std::int32_t num_kv_heads, std::int32_t head_dim,
             std::int32_t block_size, kv::DType dtype, kv::Layout layout, kv::KvPlanes planes, std::int32_t v_head_dim,
             const kv::KvFormat& format) {
            new (self) kv::Geometry(kvpy::check(kv::Geometry::make({.num_layers = num_layers, .num_kv_heads = num_kv_heads,
                                                                   .head_dim = head_dim, .block_size = block_size,
                                                                   .dtype = dtype, .layout = layout, .planes = planes,
                                                                   .v_head_dim = v_head_dim, .format = format})));
          },
          "num_layers"_a, "num_kv_heads"_a, "head_dim"_a, "block_size"_a = 16, "dtype"_a = kv::DType::f16,
          "layout"_a = kv::Layout::NHD, "planes"_a = kv::KvPlanes::interleaved, "v_head_dim"_a = -1,
          "format"_a = kv::KvFormat{})
      .def_prop_ro("num_layers", [](const kv::Geometry& g) { return g.spec().num_layers; })
      .def_prop_ro("num_kv_heads", [](const kv::Geometry& g) { return g.spec().num_kv_heads; })
      .def_prop_ro("head_dim", [](const kv::Geometry& g) { return g.spec().head_dim; })
      .def_prop_ro("block_size", &kv::Geometry::block_size)
      .def_prop_ro("dtype", [](const kv::Geometry& g) { return g.spec().dtype; })
      .def_prop_ro("layout", [](const kv::Geometry& g) { return g.spec().layout; })
      .def_prop_ro("planes", [](const kv::Geometry& g) { return g.spec().planes; })
      .def_prop_ro("format", [](const kv::Geometry& g) { return g.spec().format; })
      .def_prop_ro("row_bytes", &kv::Geometry::row_bytes)
      .def_prop_ro("plane_bytes", &kv::Geometry::plane_bytes)
      .def_prop_ro("block_bytes", &kv::Geometry::block_bytes)
      .def_prop_ro("kv_planes", &kv::Geometry::kv_planes)
      .def("pool_bytes", [](const kv::Geometry& g, std::int64_t num_blocks) { return kvpy::check(g.pool_bytes(num_blocks)); });
  // The largest code magnitude (what a group's or an engine-held scale maps
  // the largest |value| to): engines calibrating scales divide by it.
  m.def("code_max", &kv::quant::code_max, "dtype"_a, "minimum"_a = false);
}

void bind_policies(nb::module_& m) {
  nb::class_<kv::KeepAll>(m, "KeepAll").def(nb::init<>());
  nb::class_<kv::SlidingWindow>(m, "SlidingWindow").def(nb::init<std::int32_t>(), "window"_a);
  nb::class_<kv::SinkWindowEviction>(m, "SinkWindow")
      .def("__init__", [](kv::SinkWindowEviction* self, std::int32_t sinks, std::int32_t window) {
        new (self) kv::SinkWindowEviction({.sinks = sinks, .window = window});
      }, "sinks"_a, "window"_a);
  nb::class_<kv::BlockScoreEviction>(m, "BlockScores")
      .def("__init__", [](kv::BlockScoreEviction* self, std::int32_t start, std::int32_t recent, std::int32_t max) {
        new (self) kv::BlockScoreEviction({.start = start, .recent = recent, .max = max});
      }, "start"_a, "recent"_a, "max"_a);
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

// Write-Gated KV's and Quest's configurations, as the caches take them.
void bind_admission_selection(nb::module_& m) {
  nb::class_<kv::WriteGateConfig>(m, "WriteGate")
      .def(
          "__init__",
          [](kv::WriteGateConfig* self, std::int32_t num_layers, std::int32_t num_kv_heads, std::int32_t local_window,
             float tau, std::int32_t global_cap, const std::string& at_cap) {
            if (at_cap != "refuse" && at_cap != "drop") {
              kvpy::StatusError e(kv::Status{kv::Errc::invalid_argument, "at_cap", 0, 0});
              e.text = "invalid_argument: at_cap must be \"refuse\" or \"drop\", got \"" + at_cap + "\"";
              throw e;
            }
            new (self) kv::WriteGateConfig{num_layers, num_kv_heads, local_window, tau, global_cap,
                                           at_cap == "drop" ? kv::GlobalCapAction::drop : kv::GlobalCapAction::refuse};
          },
          "num_layers"_a, "num_kv_heads"_a, "local_window"_a = 256, "tau"_a = 0.1f, "global_cap"_a = 0,
          "at_cap"_a = "refuse")
      .def_ro("num_layers", &kv::WriteGateConfig::num_layers)
      .def_ro("num_kv_heads", &kv::WriteGateConfig::num_kv_heads)
      .def_ro("local_window", &kv::WriteGateConfig::local_window)
      .def_ro("tau", &kv::WriteGateConfig::tau)
      .def_ro("global_cap", &kv::WriteGateConfig::global_cap)
      .def_prop_ro("at_cap", [](const kv::WriteGateConfig& c) { return c.at_cap == kv::GlobalCapAction::drop ? "drop" : "refuse"; });
  // ring_admit's policy parameters, as a WriteGate cache's ring_admit_params()
  // returns them (the device must decide with the numbers reconcile replays).
  nb::class_<kv::RingAdmitParams>(m, "RingAdmitParams")
      .def_ro("num_heads", &kv::RingAdmitParams::num_heads)
      .def_ro("window", &kv::RingAdmitParams::window)
      .def_ro("global_limit", &kv::RingAdmitParams::global_limit)
      .def_ro("tau", &kv::RingAdmitParams::tau);
  nb::class_<kv::QuestConfig>(m, "Quest")
      .def(
          "__init__",
          [](kv::QuestConfig* self, std::int32_t token_budget, std::int32_t first_pages, std::int32_t last_pages,
             std::int32_t dense_layers, std::int32_t query_group) {
            new (self) kv::QuestConfig{token_budget, first_pages, last_pages, dense_layers, query_group, {}};
          },
          "token_budget"_a, "first_pages"_a = 1, "last_pages"_a = 1, "dense_layers"_a = 2, "query_group"_a = 1)
      .def_ro("token_budget", &kv::QuestConfig::token_budget)
      .def_ro("first_pages", &kv::QuestConfig::first_pages)
      .def_ro("last_pages", &kv::QuestConfig::last_pages)
      .def_ro("dense_layers", &kv::QuestConfig::dense_layers)
      .def_ro("query_group", &kv::QuestConfig::query_group)
      .def_static("bounds_floats", [](const kv::Geometry& g, std::int64_t num_blocks) {
        return kv::QuestSelection::bounds_floats(g, num_blocks);
      }, "geometry"_a, "num_blocks"_a);
}

}  // namespace

NB_MODULE(_kvcache, m) {
  if (_import_array() < 0) throw nb::python_error();  // numpy's C API (arrays.hpp)
  m.attr("__version__") = kv::version_string();
  kvpy::register_errors(m);
  bind_geometry(m);
  bind_policies(m);
  bind_admission_selection(m);
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
  nb::class_<kv::GateWriteInfo>(m, "GateWriteInfo")
      .def_ro("promoted", &kv::GateWriteInfo::promoted)
      .def_ro("direct", &kv::GateWriteInfo::direct)
      .def_ro("dropped", &kv::GateWriteInfo::dropped)
      .def_ro("dropped_at_cap", &kv::GateWriteInfo::dropped_at_cap)
      .def_ro("moves", &kv::GateWriteInfo::moves)
      .def_ro("copies", &kv::GateWriteInfo::copies);
  kvpy::register_caches(m);
  kvpy::register_quest_caches(m);
  kvpy::register_gated_caches(m);
  kvpy::register_hybrid(m);
  kvpy::register_hybrid_quest(m);
  kvpy::register_hybrid_eviction(m);
  kvpy::register_tiers(m);
  kvpy::register_transfer(m);
}
