// What two engines tell each other before one reads the other's KV blocks
// (disaggregated prefill and decode, NIXL): who they are, the shape of every
// layer group, where each pool lives and how its blocks are cut into
// regions. Each side builds its own from its geometry and its pool, sends it
// (handshake_wire.hpp), and checks the peer's (check_compatible)
// before any byte moves: a mismatch is a typed error naming the field, never
// a silent mis-copy. vLLM's NixlConnector handshake carries the same facts.
//
// Regions: a region is one (group, layer)'s planes across every block: block
// b's piece sits at base + b * block_stride and holds k_bytes of K then
// v_bytes of V (0 when the region has no such plane). A plain pool with
// interleaved planes gives one region per layer with K and V adjacent;
// separate planes give a K region and a V region per layer; a hybrid pool
// one region per (group, layer) of its pages; MLA's latent is K alone.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvcache/config.hpp"
#include "kvcache/core/geometry.hpp"
#include "kvcache/groups/layer_groups.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Where a pool lives: what NIXL's memory type (VRAM or DRAM) and a pinned host buffer are told apart by.
enum class MemoryKind : std::uint8_t { device, pinned_host, host };

/// A MemoryKind's name ("pinned_host"), for messages (Status::named); "?" outside the enum.
constexpr const char* memory_kind_name(std::int64_t m) noexcept {
  return m == 0 ? "device" : m == 1 ? "pinned_host" : m == 2 ? "host" : "?";
}

/// The shape of one layer group's blocks on one rank.
struct GroupLayout {
  AttentionKind kind = AttentionKind::full;  ///< What its queries read.
  std::int32_t layers = 1;  ///< Layers in the group.
  std::int32_t block_size = 16;  ///< Tokens per block.
  std::int32_t num_kv_heads = 1;  ///< Kv-heads this rank stores (tensor parallelism splits them).
  std::int32_t head_dim = 128;  ///< K elements per head.
  std::int32_t v_head_dim = 128;  ///< V elements per head (0: no V, MLA).
  DType dtype = DType::f16;  ///< Element type.
  /// K's and V's scaling (core/kv_format.hpp): a quantized block's codes are read
  /// only with the scheme they were written with. Engine-held scales (tensor,
  /// head) are the engines' own to agree on; only the scheme travels.
  KvFormat format{};
  Layout layout = Layout::NHD;  ///< Token/head order inside a plane.
  std::int32_t window = 0;  ///< sliding_window: its W.
  std::int32_t chunk = 0;  ///< chunked_local: its C.
  friend constexpr bool operator==(const GroupLayout&, const GroupLayout&) = default;
};

/// One registration: what NIXL's registerMem takes (a pool, once, never per block).
struct MemoryRegion {
  std::uint64_t addr = 0;  ///< First byte.
  std::int64_t bytes = 0;  ///< Length.
  std::int32_t device = 0;  ///< Device ordinal (0 for host memory).
  MemoryKind kind = MemoryKind::device;  ///< Device, pinned host or plain host memory.
  friend constexpr bool operator==(const MemoryRegion&, const MemoryRegion&) = default;
};

/// One (group, layer)'s planes in every block of a pool.
struct KvRegion {
  std::uint64_t base = 0;  ///< Block 0's piece.
  std::int64_t block_stride = 0;  ///< Bytes from one block's piece to the next.
  std::int64_t k_bytes = 0;  ///< K plane bytes at the piece's start (0: none).
  std::int64_t v_bytes = 0;  ///< V plane bytes after it (0: none).
  std::int32_t group = 0;  ///< The layer group.
  std::int32_t layer = 0;  ///< The layer's index within its group.
  std::int32_t memory = 0;  ///< The MemoryRegion that holds it.
  friend constexpr bool operator==(const KvRegion&, const KvRegion&) = default;
};

/// Who an engine rank is and how it names blocks: what describe_layout() adds to the geometry.
struct LayoutIdentity {
  std::string engine_id{};  ///< The engine instance (a router's and a peer's name for it).
  std::int32_t tp_rank = 0;  ///< Tensor-parallel rank.
  std::int32_t tp_size = 1;  ///< Tensor-parallel size.
  std::int32_t device = 0;  ///< Device ordinal of the pool.
  MemoryKind memory = MemoryKind::device;  ///< Where the pool lives.
  std::string hash_algorithm = "fast64";  ///< The block hasher's name (fast64, siphash128, or the engine's own).
  std::uint64_t hash_seed = 0;  ///< Its seed or a digest of its key (never the secret itself).
};

/// A rank's layout, as sent to a peer.
struct LayoutHandshake {
  static constexpr std::int32_t wire_version = 2;  ///< The msgpack form's version (2: groups carry their KV format).

  LayoutIdentity id{};  ///< Engine id, ranks, hash algorithm and seed.
  std::vector<GroupLayout> groups{};  ///< Every layer group (a plain cache: one).
  std::int64_t num_blocks = 0;  ///< Blocks in the pool (null block included): descriptor ids count in it.
  std::vector<MemoryRegion> memory{};  ///< What to register.
  std::vector<KvRegion> regions{};  ///< How blocks are cut, grouped by group then layer, K before V.
  std::uint64_t compat_hash = 0;  ///< compat_hash() of the above when it was built.

  friend bool operator==(const LayoutHandshake& a, const LayoutHandshake& b) {
    return a.id.engine_id == b.id.engine_id && a.id.tp_rank == b.id.tp_rank && a.id.tp_size == b.id.tp_size &&
           a.id.device == b.id.device && a.id.memory == b.id.memory && a.id.hash_algorithm == b.id.hash_algorithm &&
           a.id.hash_seed == b.id.hash_seed && a.groups == b.groups && a.num_blocks == b.num_blocks &&
           a.memory == b.memory && a.regions == b.regions && a.compat_hash == b.compat_hash;
  }
};

namespace detail {
constexpr std::uint64_t mix64(std::uint64_t h, std::uint64_t v) noexcept {
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdULL;
  return h ^ (h >> 29);
}
}  // namespace detail

/// A digest of everything two ranks must share to exchange blocks: each
/// group's kind, layers, block size, heads over all ranks (num_kv_heads ×
/// tp_size; MLA's one latent head is replicated), head dims, dtype, KV
/// format, layout, window and chunk; the hash algorithm and seed; the wire version.
/// Addresses, ranks and the engine id may differ.
inline std::uint64_t compat_hash(const LayoutHandshake& h) noexcept {
  std::uint64_t x = detail::mix64(0x6b76636163686531ULL, std::uint64_t(LayoutHandshake::wire_version));
  for (const char c : h.id.hash_algorithm) x = detail::mix64(x, std::uint8_t(c));
  x = detail::mix64(x, h.id.hash_seed);
  x = detail::mix64(x, h.groups.size());
  for (const GroupLayout& g : h.groups) {
    const std::int64_t heads = g.kind == AttentionKind::mla ? g.num_kv_heads : std::int64_t{g.num_kv_heads} * h.id.tp_size;
    for (const std::int64_t v : {std::int64_t(g.kind), std::int64_t{g.layers}, std::int64_t{g.block_size}, heads,
                                 std::int64_t{g.head_dim}, std::int64_t{g.v_head_dim}, std::int64_t(g.dtype),
                                 std::int64_t(g.layout), std::int64_t{g.window}, std::int64_t{g.chunk}})
      x = detail::mix64(x, std::uint64_t(v));
    for (const SideFormat& f : {g.format.k, g.format.v})
      for (const std::int64_t v : {std::int64_t(f.scales), std::int64_t{f.group}, std::int64_t{f.minimum}})
        x = detail::mix64(x, std::uint64_t(v));
  }
  return x;
}

namespace detail {
// describe_layout()'s checks of what the caller names: the pool's address and the ranks.
inline Status check_identity(std::uint64_t base, const LayoutIdentity& id) noexcept {
  if (base == 0) return Status{Errc::invalid_argument, "base", 0, 1};
  if (id.tp_size < 1) return Status{Errc::invalid_argument, "tp_size", id.tp_size, 1};
  if (id.tp_rank < 0 || id.tp_rank >= id.tp_size) return Status{Errc::invalid_argument, "tp_rank", id.tp_rank, id.tp_size - 1};
  return {};
}
}  // namespace detail

/// A plain pool's handshake: `num_blocks` blocks of geometry `g` at `base`
/// (one registration; regions as the planes lie). Errors name the value: a
/// null base, num_blocks < 1 or past int64 bytes, tp_rank outside tp_size.
inline Result<LayoutHandshake> describe_layout(const Geometry& g, std::int64_t num_blocks, std::uint64_t base,
                                               const LayoutIdentity& id) {
  if (auto st = detail::check_identity(base, id); !st) return st;
  auto st = g.strides(num_blocks);
  if (!st) return st.status();
  const GeometrySpec& s = g.spec();
  LayoutHandshake h;
  h.id = id;
  h.num_blocks = num_blocks;
  h.groups.push_back({.kind = g.kv_planes() == 1 ? AttentionKind::mla : AttentionKind::full, .layers = s.num_layers,
                      .block_size = s.block_size, .num_kv_heads = s.num_kv_heads, .head_dim = s.head_dim,
                      .v_head_dim = g.kv_planes() == 1 ? 0 : s.head_dim, .dtype = s.dtype, .format = s.format,
                      .layout = s.layout});
  h.memory.push_back({base, *g.pool_bytes(num_blocks), id.device, id.memory});
  const std::int64_t plane = g.plane_bytes();
  for (std::int32_t l = 0; l < s.num_layers; ++l) {
    const std::uint64_t at = base + std::uint64_t(st->layer * l);
    if (g.kv_planes() == 1) h.regions.push_back({at, st->block, plane, 0, 0, l, 0});
    else if (s.planes == KvPlanes::interleaved) h.regions.push_back({at, st->block, plane, plane, 0, l, 0});
    else {
      h.regions.push_back({at, st->block, plane, 0, 0, l, 0});
      h.regions.push_back({at + std::uint64_t(st->kv), st->block, 0, plane, 0, l, 0});
    }
  }
  h.compat_hash = compat_hash(h);
  return h;
}

/// A hybrid pool's handshake: `num_blocks` pages of `lg` at `base`, one region per (group, layer).
inline Result<LayoutHandshake> describe_layout(const LayerGroups& lg, std::int64_t num_blocks, std::uint64_t base,
                                               const LayoutIdentity& id) {
  if (auto st = detail::check_identity(base, id); !st) return st;
  if (lg.num_groups() < 1) return Status{Errc::invalid_argument, "groups", 0, 1};
  std::int64_t bytes = 0;
  if (num_blocks < 1) return Status{Errc::invalid_argument, "num_blocks", num_blocks, 1};
  if (__builtin_mul_overflow(num_blocks, lg.page_bytes(), &bytes))
    return Status{Errc::geometry_overflow, "num_blocks", num_blocks, INT64_MAX / lg.page_bytes()};
  LayoutHandshake h;
  h.id = id;
  h.num_blocks = num_blocks;
  h.memory.push_back({base, bytes, id.device, id.memory});
  for (std::int32_t g = 0; g < lg.num_groups(); ++g) {
    const LayerGroupSpec& s = lg.spec(g);
    const std::int32_t dv = lg.v_head_dim(g), B = lg.block_size(g);
    h.groups.push_back({.kind = s.kind, .layers = lg.layers_in(g), .block_size = B, .num_kv_heads = s.num_kv_heads,
                        .head_dim = s.head_dim, .v_head_dim = dv, .dtype = s.dtype, .format = s.format,
                        .layout = Layout::NHD, .window = s.window, .chunk = s.chunk});
    const GroupPlaneBytes pb = lg.planes(g);
    const std::int64_t k = pb.k, v = pb.v;
    for (std::int32_t l = 0; l < lg.layers_in(g); ++l)
      h.regions.push_back({base + std::uint64_t((k + v) * l), lg.page_bytes(), k, v, g, l, 0});
  }
  h.compat_hash = compat_hash(h);
  return h;
}

namespace detail {
// layout_mismatch naming the first field of a side's format that differs (value: the peer's, limit: ours).
inline Status compare_format(const SideFormat& b, const SideFormat& a, bool is_k) noexcept {
  constexpr Errc E = Errc::layout_mismatch;
  if (b.scales != a.scales)
    return Status{E, is_k ? "format.k.scales" : "format.v.scales", std::int64_t(b.scales), std::int64_t(a.scales)}.named(scales_name);
  if (b.group != a.group) return Status{E, is_k ? "format.k.group" : "format.v.group", b.group, a.group};
  if (b.minimum != a.minimum)
    return Status{E, is_k ? "format.k.minimum" : "format.v.minimum", std::int64_t{b.minimum}, std::int64_t{a.minimum}};
  return {};
}
}  // namespace detail

/// Whether a peer's blocks can be copied into this rank's, byte for byte:
/// layout_mismatch naming the first field that differs (value: the peer's,
/// limit: ours). Kv-heads may differ only by tensor parallelism: this rank
/// reads a slice of the peer's heads (it must hold fewer, a divisor, in the
/// HND layout, and be one of the peer's rank's readers); MLA's latent is whole on every rank.
inline Status check_compatible(const LayoutHandshake& local, const LayoutHandshake& remote) noexcept {
  using S = Status;
  constexpr Errc E = Errc::layout_mismatch;
  if (remote.compat_hash != compat_hash(remote)) return S{E, "compat_hash (the peer's does not match its fields)", 0, 0};
  if (remote.id.hash_algorithm != local.id.hash_algorithm) return S{E, "hash_algorithm", 0, 0};
  if (remote.id.hash_seed != local.id.hash_seed)
    return S{E, "hash_seed", std::int64_t(remote.id.hash_seed), std::int64_t(local.id.hash_seed)}.hex();
  if (remote.groups.size() != local.groups.size())
    return S{E, "groups", std::int64_t(remote.groups.size()), std::int64_t(local.groups.size())};
  for (std::size_t i = 0; i < local.groups.size(); ++i) {
    const GroupLayout &a = local.groups[i], &b = remote.groups[i];
    if (b.kind != a.kind) return S{E, "kind", std::int64_t(b.kind), std::int64_t(a.kind)}.named(attention_kind_name);
    if (b.layers != a.layers) return S{E, "layers", b.layers, a.layers};
    if (b.block_size != a.block_size) return S{E, "block_size", b.block_size, a.block_size};
    if (b.head_dim != a.head_dim) return S{E, "head_dim", b.head_dim, a.head_dim};
    if (b.v_head_dim != a.v_head_dim) return S{E, "v_head_dim", b.v_head_dim, a.v_head_dim};
    if (b.dtype != a.dtype) return S{E, "dtype", std::int64_t(b.dtype), std::int64_t(a.dtype)}.named(dtype_name);
    if (auto st = detail::compare_format(b.format.k, a.format.k, true); !st) return st;
    if (auto st = detail::compare_format(b.format.v, a.format.v, false); !st) return st;
    if (b.layout != a.layout) return S{E, "layout", std::int64_t(b.layout), std::int64_t(a.layout)}.named(layout_name);
    if (b.window != a.window) return S{E, "window", b.window, a.window};
    if (b.chunk != a.chunk) return S{E, "chunk", b.chunk, a.chunk};
    if (b.num_kv_heads == a.num_kv_heads) continue;
    const std::int64_t all_b = std::int64_t{b.num_kv_heads} * remote.id.tp_size, all_a = std::int64_t{a.num_kv_heads} * local.id.tp_size;
    if (a.kind == AttentionKind::mla || all_a != all_b) return S{E, "num_kv_heads (over every rank)", all_b, all_a};
    if (a.num_kv_heads > b.num_kv_heads || b.num_kv_heads % a.num_kv_heads != 0)
      return S{E, "num_kv_heads (a reader takes a slice of one peer rank's heads)", b.num_kv_heads, a.num_kv_heads};
    if (a.layout != Layout::HND)
      return S{E, "layout (a head slice needs HND)", std::int64_t(a.layout), std::int64_t(Layout::HND)}.named(layout_name);
    const std::int32_t readers = b.num_kv_heads / a.num_kv_heads;
    if (remote.id.tp_rank != local.id.tp_rank / readers)
      return S{E, "tp_rank (the peer rank whose heads this rank reads)", remote.id.tp_rank, local.id.tp_rank / readers};
  }
  return {};
}

KVCACHE_END_NAMESPACE
