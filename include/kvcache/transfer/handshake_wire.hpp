// A LayoutHandshake on the wire: one msgpack array, field order fixed by its
// version, so a peer in any language (Python's msgpack, msgspec) reads it.
//   ["kvcache.layout", version, engine_id, tp_rank, tp_size, device, memory kind,
//    hash_algorithm, hash_seed, num_blocks,
//    [[kind, layers, block_size, kv_heads, head_dim, v_head_dim, dtype, layout, window, chunk,
//      k_scales, k_group, k_minimum, v_scales, v_group, v_minimum], ...],
//    [[addr, bytes, device, kind], ...],
//    [[base, block_stride, k_bytes, v_bytes, group, layer, memory], ...],
//    compat_hash]
// Decoding checks every value's domain, so what comes back is safe to plan with.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "kvcache/config.hpp"
#include "kvcache/status.hpp"
#include "kvcache/transfer/layout_handshake.hpp"
#include "kvcache/wire/msgpack.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Appends the handshake's msgpack bytes to `out`.
inline void to_msgpack(const LayoutHandshake& h, std::vector<std::uint8_t>& out) {
  MsgpackWriter w(out);
  w.array(14);
  w.str("kvcache.layout");
  w.uint(LayoutHandshake::wire_version);
  w.str(h.id.engine_id);
  w.sint(h.id.tp_rank), w.sint(h.id.tp_size), w.sint(h.id.device), w.uint(std::uint64_t(h.id.memory));
  w.str(h.id.hash_algorithm), w.uint(h.id.hash_seed);
  w.sint(h.num_blocks);
  w.array(std::uint32_t(h.groups.size()));
  for (const GroupLayout& g : h.groups) {
    w.array(16);
    for (const std::int64_t v : {std::int64_t(g.kind), std::int64_t{g.layers}, std::int64_t{g.block_size},
                                 std::int64_t{g.num_kv_heads}, std::int64_t{g.head_dim}, std::int64_t{g.v_head_dim},
                                 std::int64_t(g.dtype), std::int64_t(g.layout), std::int64_t{g.window}, std::int64_t{g.chunk}})
      w.sint(v);
    for (const SideFormat& f : {g.format.k, g.format.v}) w.sint(std::int64_t(f.scales)), w.sint(f.group), w.sint(f.minimum);
  }
  w.array(std::uint32_t(h.memory.size()));
  for (const MemoryRegion& m : h.memory) w.array(4), w.uint(m.addr), w.sint(m.bytes), w.sint(m.device), w.uint(std::uint64_t(m.kind));
  w.array(std::uint32_t(h.regions.size()));
  for (const KvRegion& r : h.regions) {
    w.array(7);
    w.uint(r.base), w.sint(r.block_stride), w.sint(r.k_bytes), w.sint(r.v_bytes), w.sint(r.group), w.sint(r.layer),
        w.sint(r.memory);
  }
  w.uint(h.compat_hash);
}

namespace detail {
// Reads one integer field into dst after checking lo <= v <= hi.
template <class T>
Status read_field(MsgpackReader& r, const char* what, std::int64_t lo, std::int64_t hi, T& dst) noexcept {
  auto v = r.sint(what);
  if (!v) return v.status();
  if (*v < lo || *v > hi) return Status{Errc::invalid_argument, what, *v, *v < lo ? lo : hi};
  dst = static_cast<T>(*v);
  return {};
}
// An array header of exactly n items (n < 0: any count up to `most`), its count in `count`.
inline Status read_array(MsgpackReader& r, const char* what, std::int64_t n, std::uint32_t& count, std::uint32_t most = 1u << 20) noexcept {
  auto a = r.array(what);
  if (!a) return a.status();
  if ((n >= 0 && *a != std::uint64_t(n)) || (n < 0 && *a > most))
    return Status{Errc::invalid_argument, what, std::int64_t(*a), n >= 0 ? n : std::int64_t{most}};
  count = *a;
  return {};
}
}  // namespace detail

/// A peer's handshake from its bytes. Malformed bytes are invalid_argument
/// naming the field (value: the byte offset); a value outside its domain (an
/// unknown kind or dtype, a region outside its registration, a region of a
/// group that does not exist) names the field with the bad value; another
/// wire version is layout_mismatch. Whether it matches this rank is
/// check_compatible()'s.
inline Result<LayoutHandshake> from_msgpack(std::span<const std::uint8_t> bytes) {
  using detail::read_array, detail::read_field;
  constexpr std::int64_t I32 = INT32_MAX, I64 = INT64_MAX;
  MsgpackReader r(bytes);
  LayoutHandshake h;
  std::uint32_t n = 0;
  if (auto st = read_array(r, "handshake (fields)", 14, n); !st) return st;
  auto tag = r.str("handshake tag");
  if (!tag) return tag.status();
  if (*tag != "kvcache.layout") return Status{Errc::invalid_argument, "handshake tag", 0, 0};
  auto ver = r.uint("wire_version");
  if (!ver) return ver.status();
  if (*ver != std::uint64_t(LayoutHandshake::wire_version))
    return Status{Errc::layout_mismatch, "wire_version", std::int64_t(*ver & 0x7fffffff), LayoutHandshake::wire_version};
  auto engine = r.str("engine_id");
  if (!engine) return engine.status();
  h.id.engine_id = std::string(*engine);
  if (auto st = read_field(r, "tp_rank", 0, I32, h.id.tp_rank); !st) return st;
  if (auto st = read_field(r, "tp_size", 1, I32, h.id.tp_size); !st) return st;
  if (h.id.tp_rank >= h.id.tp_size) return Status{Errc::invalid_argument, "tp_rank", h.id.tp_rank, h.id.tp_size - 1};
  if (auto st = read_field(r, "device", 0, I32, h.id.device); !st) return st;
  if (auto st = read_field(r, "memory kind", 0, 2, h.id.memory); !st) return st;
  auto algo = r.str("hash_algorithm");
  if (!algo) return algo.status();
  h.id.hash_algorithm = std::string(*algo);
  auto seed = r.uint("hash_seed");
  if (!seed) return seed.status();
  h.id.hash_seed = *seed;
  if (auto st = read_field(r, "num_blocks", 1, I32, h.num_blocks); !st) return st;

  if (auto st = read_array(r, "groups", -1, n, LayerGroups::max_groups); !st) return st;
  if (n == 0) return Status{Errc::invalid_argument, "groups", 0, 1};
  h.groups.resize(n);
  for (GroupLayout& g : h.groups) {
    std::uint32_t f = 0;
    if (auto st = read_array(r, "group (fields)", 16, f); !st) return st;
    for (const Status st : {read_field(r, "kind", 0, 4, g.kind), read_field(r, "layers", 1, I32, g.layers),
                            read_field(r, "block_size", 1, I32, g.block_size), read_field(r, "num_kv_heads", 1, I32, g.num_kv_heads),
                            read_field(r, "head_dim", 1, I32, g.head_dim), read_field(r, "v_head_dim", 0, I32, g.v_head_dim),
                            read_field(r, "dtype", 0, kLastDType, g.dtype), read_field(r, "layout", 0, 1, g.layout),
                            read_field(r, "window", 0, I32, g.window), read_field(r, "chunk", 0, I32, g.chunk),
                            read_field(r, "format.k.scales", 0, kLastScales, g.format.k.scales),
                            read_field(r, "format.k.group", 0, 128, g.format.k.group),
                            read_field(r, "format.k.minimum", 0, 1, g.format.k.minimum),
                            read_field(r, "format.v.scales", 0, kLastScales, g.format.v.scales),
                            read_field(r, "format.v.group", 0, 128, g.format.v.group),
                            read_field(r, "format.v.minimum", 0, 1, g.format.v.minimum)})
      if (!st) return st;
    // The format is one Geometry would take: codes a peer can read back.
    if (auto st = check_side_format(g.format.k, g.dtype, g.head_dim, true); !st) return st;
    if (g.v_head_dim == 0 && g.format.v != SideFormat{})
      return Status{Errc::invalid_argument, "format.v.scales (the group has no V plane)", std::int64_t(g.format.v.scales), 0};
    if (auto st = check_side_format(g.format.v, g.dtype, g.v_head_dim, false); g.v_head_dim != 0 && !st) return st;
  }
  if (auto st = read_array(r, "memory", -1, n, 1024); !st) return st;
  h.memory.resize(n);
  for (MemoryRegion& m : h.memory) {
    std::uint32_t f = 0;
    if (auto st = read_array(r, "memory region (fields)", 4, f); !st) return st;
    auto addr = r.uint("addr");
    if (!addr) return addr.status();
    m.addr = *addr;
    for (const Status st : {read_field(r, "bytes", 1, I64, m.bytes), read_field(r, "device", 0, I32, m.device),
                            read_field(r, "memory kind", 0, 2, m.kind)})
      if (!st) return st;
    if (m.addr == 0 || m.addr + std::uint64_t(m.bytes) < m.addr) return Status{Errc::invalid_argument, "addr", std::int64_t(m.addr & 0x7fffffff), 0};
  }
  if (auto st = read_array(r, "regions", -1, n); !st) return st;
  h.regions.resize(n);
  for (KvRegion& g : h.regions) {
    std::uint32_t f = 0;
    if (auto st = read_array(r, "region (fields)", 7, f); !st) return st;
    auto base = r.uint("base");
    if (!base) return base.status();
    g.base = *base;
    for (const Status st : {read_field(r, "block_stride", 1, I64, g.block_stride), read_field(r, "k_bytes", 0, I64, g.k_bytes),
                            read_field(r, "v_bytes", 0, I64, g.v_bytes),
                            read_field(r, "group", 0, std::int64_t(h.groups.size()) - 1, g.group),
                            read_field(r, "layer", 0, I32, g.layer),
                            read_field(r, "memory", 0, std::int64_t(h.memory.size()) - 1, g.memory)})
      if (!st) return st;
    if (g.layer >= h.groups[std::size_t(g.group)].layers)
      return Status{Errc::invalid_argument, "layer", g.layer, h.groups[std::size_t(g.group)].layers - 1};
    // Every block's piece lies inside the region's registration.
    const MemoryRegion& m = h.memory[std::size_t(g.memory)];
    std::int64_t piece = 0, last = 0;  // k_bytes + v_bytes may overflow: each field alone fits int64
    if (__builtin_add_overflow(g.k_bytes, g.v_bytes, &piece) || piece < 1 || __builtin_mul_overflow(h.num_blocks - 1, g.block_stride, &last) || __builtin_add_overflow(last, piece, &last) ||
        g.base < m.addr || g.base - m.addr > std::uint64_t(m.bytes) || std::uint64_t(last) > std::uint64_t(m.bytes) - (g.base - m.addr))
      return Status{Errc::invalid_argument, "region (outside its memory)", std::int64_t(&g - h.regions.data()), std::int64_t(n)};
  }
  auto hash = r.uint("compat_hash");
  if (!hash) return hash.status();
  h.compat_hash = *hash;
  if (!r.done()) return Status{Errc::invalid_argument, "handshake (trailing bytes)", std::int64_t(r.offset()), std::int64_t(bytes.size())};
  return h;
}

KVCACHE_END_NAMESPACE
