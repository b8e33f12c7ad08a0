// Scale-out in Python: kv.LayoutHandshake (a rank's layout, to and from
// msgpack), kv.check_compatible, kv.TransferPlanner (descriptors as uint64
// [n, 3] arrays: local address, remote address, bytes; or descriptor ids into
// each side's prepared list), kv.TransferHolds (the sender's holds, over any
// cache with hold / release_hold), kv.EventReplay and kv.sequence_frame (KV
// events on the wire). kvcache/nixl.py moves the bytes with NIXL.
#include <kvcache/transfer/handshake_wire.hpp>
#include <kvcache/transfer/transfer_holds.hpp>
#include <kvcache/transfer/transfer_plan.hpp>
#include <kvcache/wire/kv_events_wire.hpp>

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <string>
#include <vector>

#include "bind_common.hpp"

namespace kvpy {

namespace {

kv::MemoryKind memory_of(const std::string& m) {
  if (m == "device") return kv::MemoryKind::device;
  if (m == "pinned_host") return kv::MemoryKind::pinned_host;
  if (m == "host") return kv::MemoryKind::host;
  require(false, "memory (device, pinned_host or host)", -1, 2);
  return {};
}
const char* memory_name(kv::MemoryKind m) {
  static const char* names[] = {"device", "pinned_host", "host"};
  return names[std::size_t(m)];
}
const char* kind_name(kv::AttentionKind k) {
  static const char* names[] = {"full", "sliding_window", "chunked_local", "mla", "cross"};
  return names[std::size_t(k)];
}
nb::bytes to_bytes(std::span<const std::uint8_t> b) { return nb::bytes(reinterpret_cast<const char*>(b.data()), b.size()); }
std::span<const std::uint8_t> bytes_of(const nb::bytes& b) {
  return {reinterpret_cast<const std::uint8_t*>(b.c_str()), b.size()};
}

// A cache seen through Python: TransferHolds calls its hold / release_hold.
// A Python error becomes a Status (release runs in noexcept paths).
struct PyHolder {
  nb::handle cache;
  kv::Result<std::uint64_t> hold(std::span<const std::int32_t> blocks) {
    auto a = new_array<std::int32_t>(blocks.size());
    std::copy(blocks.begin(), blocks.end(), a.data());
    return nb::cast<std::uint64_t>(cache.attr("hold")(a));  // a Python error propagates (nothing held)
  }
  kv::Status release_hold(std::uint64_t id) noexcept {
    try {
      cache.attr("release_hold")(id);
      return {};
    } catch (...) {
      return kv::Status{kv::Errc::unknown_job, "hold", std::int64_t(id & INT64_MAX), 0};
    }
  }
};

// The planner's block lists for one group.
struct Lists {
  Array<std::int32_t> remote, local;
};
kv::GroupBlocks group_blocks(Lists& l, nb::handle remote, nb::handle local, std::int32_t group, std::int32_t skip) {
  in_arg(l.remote, remote, "remote_blocks");
  in_arg(l.local, local, "local_blocks");
  return {group, cspan(l.remote), cspan(l.local), skip};
}

}  // namespace

void register_transfer(nb::module_& m) {
  nb::class_<kv::LayoutHandshake>(m, "LayoutHandshake")
      .def_static(
          "describe",
          [](nb::handle layout, std::int64_t num_blocks, std::uint64_t base, std::string engine_id, std::int32_t tp_rank,
             std::int32_t tp_size, std::int32_t device, std::string memory, std::string hash_algorithm, std::uint64_t hash_seed) {
            const kv::LayoutIdentity id{std::move(engine_id), tp_rank, tp_size, device, memory_of(memory), std::move(hash_algorithm), hash_seed};
            if (nb::isinstance<Groups>(layout)) return check(kv::describe_layout(nb::cast<const Groups&>(layout).groups, num_blocks, base, id));
            return check(kv::describe_layout(nb::cast<const kv::Geometry&>(layout), num_blocks, base, id));
          },
          nb::arg("layout"), nb::arg("num_blocks"), nb::arg("base"), nb::arg("engine_id") = "", nb::arg("tp_rank") = 0,
          nb::arg("tp_size") = 1, nb::arg("device") = 0, nb::arg("memory") = "device", nb::arg("hash_algorithm") = "fast64",
          nb::arg("hash_seed") = 0)
      .def_static("from_msgpack", [](nb::bytes b) { return check(kv::from_msgpack(bytes_of(b))); }, nb::arg("data"))
      .def("to_msgpack",
           [](const kv::LayoutHandshake& h) {
             std::vector<std::uint8_t> out;
             kv::to_msgpack(h, out);
             return to_bytes(out);
           })
      .def_prop_ro("engine_id", [](const kv::LayoutHandshake& h) { return h.id.engine_id; })
      .def_prop_ro("tp_rank", [](const kv::LayoutHandshake& h) { return h.id.tp_rank; })
      .def_prop_ro("tp_size", [](const kv::LayoutHandshake& h) { return h.id.tp_size; })
      .def_prop_ro("device", [](const kv::LayoutHandshake& h) { return h.id.device; })
      .def_prop_ro("memory", [](const kv::LayoutHandshake& h) { return memory_name(h.id.memory); })
      .def_prop_ro("hash_algorithm", [](const kv::LayoutHandshake& h) { return h.id.hash_algorithm; })
      .def_prop_ro("hash_seed", [](const kv::LayoutHandshake& h) { return h.id.hash_seed; })
      .def_ro("num_blocks", &kv::LayoutHandshake::num_blocks)
      .def_ro("compat_hash", &kv::LayoutHandshake::compat_hash)
      .def_prop_ro("registrations",  // what NIXL's register_memory takes: (addr, bytes, device, memory)
                   [](const kv::LayoutHandshake& h) {
                     nb::list out;
                     for (const auto& r : h.memory) out.append(nb::make_tuple(r.addr, r.bytes, r.device, memory_name(r.kind)));
                     return out;
                   })
      .def_prop_ro("regions",  // (base, block_stride, k_bytes, v_bytes, group, layer, memory)
                   [](const kv::LayoutHandshake& h) {
                     nb::list out;
                     for (const auto& r : h.regions)
                       out.append(nb::make_tuple(r.base, r.block_stride, r.k_bytes, r.v_bytes, r.group, r.layer, r.memory));
                     return out;
                   })
      .def_prop_ro("groups",
                   [](const kv::LayoutHandshake& h) {
                     nb::list out;
                     for (const auto& g : h.groups) {
                       nb::dict d;
                       d["kind"] = kind_name(g.kind), d["layers"] = g.layers, d["block_size"] = g.block_size;
                       d["num_kv_heads"] = g.num_kv_heads, d["head_dim"] = g.head_dim, d["v_head_dim"] = g.v_head_dim;
                       d["dtype"] = g.dtype, d["layout"] = g.layout, d["window"] = g.window, d["chunk"] = g.chunk;
                       d["format"] = g.format;
                       out.append(d);
                     }
                     return out;
                   })
      .def("__eq__", [](const kv::LayoutHandshake& a, const kv::LayoutHandshake& b) { return a == b; });

  m.def("check_compatible", [](const kv::LayoutHandshake& a, const kv::LayoutHandshake& b) { check(kv::check_compatible(a, b)); },
        nb::arg("local"), nb::arg("remote"));

  nb::class_<kv::TransferPlanner>(m, "TransferPlanner")
      .def("__init__",
           [](kv::TransferPlanner* self, const kv::LayoutHandshake& local, const kv::LayoutHandshake& remote) {
             new (self) kv::TransferPlanner(local, remote);
             check(self->status());  // a mismatch raises LayoutMismatch naming the field
           },
           nb::arg("local"), nb::arg("remote"))
      .def_prop_ro("num_plane_regions", &kv::TransferPlanner::num_plane_regions)
      .def(
          "plan",
          [](const kv::TransferPlanner& p, nb::handle remote, nb::handle local, std::int32_t group, std::int32_t skip,
             std::int64_t num_tokens, bool window_only, bool coalesce) {
            Lists l;
            const kv::GroupBlocks gb = group_blocks(l, remote, local, group, skip);
            std::vector<kv::TransferDesc> out;
            check(p.plan(std::span(&gb, 1), {num_tokens, window_only, coalesce}, out));
            auto a = new_array<std::uint64_t, 2>(out.size(), 3);
            static_assert(sizeof(kv::TransferDesc) == 3 * sizeof(std::uint64_t));
            std::memcpy(a.data(), out.data(), out.size() * sizeof(kv::TransferDesc));
            return a;
          },
          nb::arg("remote_blocks"), nb::arg("local_blocks"), nb::arg("group") = 0, nb::arg("skip") = 0,
          nb::arg("num_tokens") = 0, nb::arg("window_only") = false, nb::arg("coalesce") = true)
      .def(
          "plan_ids",
          [](const kv::TransferPlanner& p, nb::handle remote, nb::handle local, std::int32_t group, std::int32_t skip,
             std::int64_t num_tokens, bool window_only) {
            Lists l;
            const kv::GroupBlocks gb = group_blocks(l, remote, local, group, skip);
            std::vector<std::int64_t> li, ri;
            check(p.plan_ids(std::span(&gb, 1), {num_tokens, window_only, false}, li, ri));
            auto a = new_array<std::int64_t>(li.size()), b = new_array<std::int64_t>(ri.size());
            std::copy(li.begin(), li.end(), a.data());
            std::copy(ri.begin(), ri.end(), b.data());
            return nb::make_tuple(a, b);
          },
          nb::arg("remote_blocks"), nb::arg("local_blocks"), nb::arg("group") = 0, nb::arg("skip") = 0,
          nb::arg("num_tokens") = 0, nb::arg("window_only") = false)
      .def(
          "dlist",  // uint64 [n, 2]: (address, bytes) of every plane region's every block, in id order
          [](const kv::TransferPlanner& p, bool local_side) {
            std::vector<kv::TransferDesc> out;
            p.dlist(local_side, out);
            auto a = new_array<std::uint64_t, 2>(out.size(), 2);
            for (std::size_t i = 0; i < out.size(); ++i) {
              a.data()[2 * i] = local_side ? out[i].local : out[i].remote;
              a.data()[2 * i + 1] = std::uint64_t(out[i].bytes);
            }
            return a;
          },
          nb::arg("local_side"));

  nb::class_<kv::TransferHolds>(m, "TransferHolds")
      .def(nb::init<>())
      .def(
          "hold",
          [](kv::TransferHolds& t, nb::handle cache, nb::handle blocks, std::int32_t consumers, std::int64_t deadline) {
            Array<std::int32_t> b;
            in_arg(b, blocks, "blocks");
            PyHolder h{cache};
            return check(t.hold(h, cspan(b), consumers, deadline));
          },
          nb::arg("cache"), nb::arg("blocks"), nb::arg("consumers"), nb::arg("deadline"))
      .def(
          "consumed",
          [](kv::TransferHolds& t, nb::handle cache, std::uint64_t id, std::int32_t consumer) {
            PyHolder h{cache};
            return check(t.consumed(h, id, consumer));
          },
          nb::arg("cache"), nb::arg("hold"), nb::arg("consumer"))
      .def(
          "expire",
          [](kv::TransferHolds& t, nb::handle cache, std::int64_t now) {
            PyHolder h{cache};
            std::vector<std::uint64_t> ids(std::size_t(t.size()));
            ids.resize(std::size_t(t.expire(h, now, ids)));
            return ids;
          },
          nb::arg("cache"), nb::arg("now"))
      .def_prop_ro("size", &kv::TransferHolds::size);

  nb::class_<kv::EventReplay>(m, "EventReplay")
      .def("__init__",
           [](kv::EventReplay* self, std::int32_t capacity) {
             try {
               new (self) kv::EventReplay(capacity);
             } catch (const kv::ConfigError& e) {
               check(e.status());
             }
           },
           nb::arg("capacity"))
      .def("push", [](kv::EventReplay& r, nb::bytes payload) { return r.push(bytes_of(payload)); }, nb::arg("payload"))
      .def_prop_ro("next_sequence", &kv::EventReplay::next_sequence)
      .def_prop_ro("oldest", &kv::EventReplay::oldest)
      .def(
          "replay",  // [(seq, payload)] from `start` on, oldest first
          [](const kv::EventReplay& r, std::int64_t start) {
            nb::list out;
            r.replay(start, [&](std::int64_t s, std::span<const std::uint8_t> p) { out.append(nb::make_tuple(s, to_bytes(p))); });
            return out;
          },
          nb::arg("start"));

  m.def("sequence_frame", [](std::int64_t seq) { return to_bytes(kv::sequence_frame(seq)); }, nb::arg("seq"));
}

}  // namespace kvpy
