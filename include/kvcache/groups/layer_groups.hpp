// A hybrid model's layers in groups of one attention kind each, over one pool
// of pages that all have the same byte size.
//
// A page (a block id) holds block_size(g) tokens of every layer of the group
// that owns it: [layers of g][K, V][block_size(g)][kv_heads][head_dim] (MLA:
// K only, one latent vector per token). Groups whose tokens are smaller take
// more of them per page, so one id means the same bytes in every group and
// one free list serves all of them (vLLM's hybrid allocator; no static split
// as in SGLang or TensorRT-LLM). Where a page is not a whole number of a
// group's tokens (or of `block_multiple` tokens) the rest is padding, which
// padding(g) reports and `max_padding` bounds.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "kvcache/config.hpp"
#include "kvcache/core/geometry.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// What a group's queries read, and so what its rows keep.
///   full            every earlier token
///   sliding_window  the last `window` tokens (a query at p reads p-W+1 .. p)
///   chunked_local   the tokens of its own chunk of `chunk` (Llama 4's local layers)
///   mla             every earlier token, one latent vector each, no V (DeepSeek V2/V3)
///   cross           the `encoder_len` encoder tokens, stored once per sequence
enum class AttentionKind : std::uint8_t { full, sliding_window, chunked_local, mla, cross };

/// The kinds whose rows grow with the context (full and MLA): where selection and eviction policies act.
constexpr bool global_kind(AttentionKind k) noexcept { return k == AttentionKind::full || k == AttentionKind::mla; }

/// An AttentionKind's name ("sliding_window"), for messages (Status::named); "?" outside the enum.
constexpr const char* attention_kind_name(std::int64_t k) noexcept {
  constexpr const char* names[] = {"full", "sliding_window", "chunked_local", "mla", "cross"};
  return k >= 0 && k <= 4 ? names[k] : "?";
}

/// One group: its kind, its layers (indices into the model's), and the shape of one token of one layer.
struct LayerGroupSpec {
  AttentionKind kind = AttentionKind::full;  ///< What its queries read.
  std::span<const std::int32_t> layers{};  ///< The model's layers in this group (each layer in exactly one group).
  std::int32_t num_kv_heads = 1;  ///< Kv-heads per layer (MLA: 1).
  std::int32_t head_dim = 128;  ///< K elements per head (MLA: latent + rope values, 512 + 64 in DeepSeek V3).
  std::int32_t v_head_dim = -1;  ///< V elements per head: -1 = head_dim (MLA: none); only MLA stores no V.
  std::int32_t window = 0;  ///< sliding_window: W >= 1.
  std::int32_t chunk = 0;  ///< chunked_local: C >= 1.
  std::int32_t encoder_len = 0;  ///< cross: encoder tokens >= 1.
  DType dtype = DType::f16;  ///< Element type.
  /// K's and V's scaling (core/kv_format.hpp), as a Geometry's: group entries
  /// follow each plane's codes (GroupPlaneBytes). MLA: V's stays none.
  KvFormat format{};
};

/// One layer's planes in a page of its group: K's and V's bytes, and where
/// each plane's group entries start. Codes come first, [block_size][kv-heads]
/// rows; with group scales the entries follow from a 16-byte boundary, a
/// row's worth each of the larger of K's and V's (so a group whose K and V
/// share a head dim lays a page out as Geometry lays a block).
struct GroupPlaneBytes {
  std::int64_t k = 0;  ///< Bytes of the K plane.
  std::int64_t v = 0;  ///< Bytes of the V plane (0: MLA).
  std::int64_t k_scales_offset = 0;  ///< From the K plane's start to its group entries (its codes' bytes without group scales).
  std::int64_t v_scales_offset = 0;  ///< The same in the V plane.
};

/// The groups and the page they share.
struct LayerGroupsSpec {
  std::span<const LayerGroupSpec> groups{};  ///< At least one; at most max_groups.
  /// Tokens per page of the group whose tokens are largest (all its layers):
  /// it sets the page's bytes; every other group fits as many of its tokens as the page holds.
  std::int32_t block_size = 16;
  /// Every group's block size is a multiple of this (a kernel's page-size rule: FlashMLA 64, FlashAttention 16).
  std::int32_t block_multiple = 1;
  /// The largest share of a page a group may leave as padding, per mille (0..999).
  std::int32_t max_padding_permille = 250;
};

/// Where one layer lives: its group and its index among the group's layers.
struct LayerSlot {
  std::int32_t group = -1;  ///< Index of the layer's group.
  std::int32_t index = -1;  ///< The layer's place in the group's pages.
  friend constexpr bool operator==(const LayerSlot&, const LayerSlot&) = default;
};

/// A validated LayerGroupsSpec: per-group block sizes, the page bytes, the padding, the layer map.
class LayerGroups {
 public:
  static constexpr std::int32_t max_groups = 64;  ///< Groups per cache.

  LayerGroups() = default;

  /// Validates every group and the page; typed errors name the field:
  /// invalid_argument for a bad count, kind or shape, for a layer listed
  /// twice or missing ("layers", the layer), and for a group wasting more of
  /// a page than allowed ("padding_permille", its waste); geometry_overflow past int64.
  static Result<LayerGroups> make(const LayerGroupsSpec& s) {
    const auto n = static_cast<std::int64_t>(s.groups.size());
    if (n < 1 || n > max_groups) return Status{Errc::invalid_argument, "groups", n, max_groups};
    if (s.block_multiple < 1) return Status{Errc::invalid_argument, "block_multiple", s.block_multiple, 1};
    if (s.block_size < 1 || s.block_size % s.block_multiple != 0)
      return Status{Errc::invalid_argument, "block_size (a multiple of block_multiple)", s.block_size, s.block_multiple};
    if (s.max_padding_permille < 0 || s.max_padding_permille > 999)
      return Status{Errc::invalid_argument, "max_padding_permille", s.max_padding_permille, 999};
    LayerGroups lg;
    std::int32_t layers = 0;
    for (const auto& g : s.groups) {
      if (auto st = check_group(g); !st) return st;
      std::int64_t bytes = 0;  // one token, every layer of the group (codes and entries)
      const std::int64_t per_layer = std::int64_t{g.num_kv_heads} * (side_row_bytes(g, 0) + side_row_bytes(g, 1));
      if (__builtin_mul_overflow(per_layer, std::int64_t(g.layers.size()), &bytes))
        return Status{Errc::geometry_overflow, "layers (token bytes past int64)", std::int64_t(g.layers.size()), 0};
      lg.groups_.push_back({g, bytes, 0, 0, std::int32_t(g.layers.size())});
      layers += std::int32_t(g.layers.size());
    }
    // The page: the largest group's bytes at block_size tokens (the same as
    // the widest token times block_size unless group entries round up).
    for (const auto& g : lg.groups_) {
      const std::int64_t bytes = group_bytes(g.spec, s.block_size);
      if (bytes < 0) return Status{Errc::geometry_overflow, "block_size (page bytes past int64)", s.block_size, 0};
      lg.page_bytes_ = std::max(lg.page_bytes_, bytes);
    }
    for (auto& g : lg.groups_) {
      // As many tokens as fit, in whole block_multiples: at most the page
      // over the token's bytes, fewer where the entries' alignment does not fit.
      std::int64_t fits = lg.page_bytes_ / g.token_bytes / s.block_multiple * s.block_multiple;
      if (fits > INT32_MAX) return Status{Errc::geometry_overflow, "block_size (a group's tokens per page)", fits, INT32_MAX};
      while (group_bytes(g.spec, fits) > lg.page_bytes_) fits -= s.block_multiple;  // >= block_size: the page fits it
      g.block_size = std::int32_t(fits);
      g.padding = lg.page_bytes_ - group_bytes(g.spec, fits);
      const std::int64_t permille = g.padding * 1000 / lg.page_bytes_;
      if (permille > s.max_padding_permille) return Status{Errc::invalid_argument, "padding_permille", permille, s.max_padding_permille};
    }
    // The layer map: every layer 0 .. layers-1 in exactly one group.
    lg.map_.assign(std::size_t(layers), LayerSlot{});
    for (std::int32_t gi = 0; gi < std::int32_t(n); ++gi) {
      const auto& ls = s.groups[std::size_t(gi)].layers;
      for (std::size_t i = 0; i < ls.size(); ++i) {
        const std::int32_t l = ls[i];
        if (l < 0 || l >= layers) return Status{Errc::invalid_argument, "layers", l, layers - 1};
        if (lg.map_[std::size_t(l)].group >= 0) return Status{Errc::invalid_argument, "layers (listed twice)", l, 0};
        lg.map_[std::size_t(l)] = {gi, std::int32_t(i)};
      }
    }
    std::int64_t lcm = 1;  // prefix hits are whole blocks of every caching group
    for (const auto& g : lg.groups_)
      if (g.spec.kind != AttentionKind::cross) lcm = std::lcm(lcm, std::int64_t{g.block_size});
    if (lcm > INT32_MAX) return Status{Errc::geometry_overflow, "block_size (the groups' common multiple)", lcm, INT32_MAX};
    lg.hit_align_ = std::int32_t(lcm);
    for (auto& g : lg.groups_) g.spec.layers = {};  // the caller's span need not outlive make()
    return lg;
  }

  /// Groups.
  std::int32_t num_groups() const noexcept { return std::int32_t(groups_.size()); }
  /// Layers of the model (every group's).
  std::int32_t num_layers() const noexcept { return std::int32_t(map_.size()); }
  /// Bytes of one page: the same for every group.
  std::int64_t page_bytes() const noexcept { return page_bytes_; }
  /// Group g's spec (its `layers` span is empty: layer_slot() keeps the map).
  const LayerGroupSpec& spec(std::int32_t g) const noexcept { return groups_[std::size_t(g)].spec; }
  /// Tokens per page in group g.
  std::int32_t block_size(std::int32_t g) const noexcept { return groups_[std::size_t(g)].block_size; }
  /// Layers in group g.
  std::int32_t layers_in(std::int32_t g) const noexcept { return groups_[std::size_t(g)].layers; }
  /// Bytes of one token in group g, all its layers.
  std::int64_t token_bytes(std::int32_t g) const noexcept { return groups_[std::size_t(g)].token_bytes; }
  /// Bytes of each of group g's pages left unused.
  std::int64_t padding(std::int32_t g) const noexcept { return groups_[std::size_t(g)].padding; }
  /// One layer's planes in a page of group g.
  GroupPlaneBytes planes(std::int32_t g) const noexcept {
    return planes_of(groups_[std::size_t(g)].spec, groups_[std::size_t(g)].block_size);
  }
  /// V elements per head of group g (0: none).
  std::int32_t v_head_dim(std::int32_t g) const noexcept { return v_dim(groups_[std::size_t(g)].spec); }
  /// Where layer l lives; {-1, -1} outside the model.
  LayerSlot layer_slot(std::int32_t l) const noexcept {
    return l >= 0 && l < num_layers() ? map_[std::size_t(l)] : LayerSlot{};
  }
  /// A one-group layout of full or MLA attention as a Geometry: the token-paged
  /// Cache<> runs it with the same pages (interleaved NHD), and none of
  /// HybridCache's per-group work (vLLM runs one group on its unitary coordinator
  /// too). Errors name the value: more than one group; a window, chunk or
  /// encoder (their retention is HybridCache's); K and V of different head dims.
  Result<Geometry> as_geometry() const noexcept {
    if (num_groups() != 1) return Status{Errc::invalid_argument, "groups (only one runs on Cache<>)", num_groups(), 1};
    const LayerGroupSpec& s = spec(0);
    if (s.kind != AttentionKind::full && s.kind != AttentionKind::mla)
      return Status{Errc::invalid_argument, "kind (only full and MLA run on Cache<>)", std::int64_t(s.kind), 0};
    const std::int32_t dv = v_head_dim(0);
    if (dv != 0 && dv != s.head_dim) return Status{Errc::invalid_argument, "v_head_dim (K and V differ)", dv, s.head_dim};
    return Geometry::make({.num_layers = layers_in(0), .num_kv_heads = s.num_kv_heads, .head_dim = s.head_dim,
                           .block_size = block_size(0), .dtype = s.dtype, .v_head_dim = dv == 0 ? 0 : -1,
                           .format = s.format});
  }
  /// Prefix hits are a multiple of this many tokens: the caching groups' block sizes' least common multiple.
  std::int32_t hit_alignment() const noexcept { return hit_align_; }

  friend bool operator==(const LayerGroups& a, const LayerGroups& b) noexcept {
    if (a.page_bytes_ != b.page_bytes_ || a.map_ != b.map_ || a.groups_.size() != b.groups_.size()) return false;
    for (std::size_t i = 0; i < a.groups_.size(); ++i)
      if (a.groups_[i].block_size != b.groups_[i].block_size || a.groups_[i].token_bytes != b.groups_[i].token_bytes ||
          a.groups_[i].spec.kind != b.groups_[i].spec.kind || a.groups_[i].spec.format != b.groups_[i].spec.format)
        return false;
    return true;
  }

 private:
  struct Group {
    LayerGroupSpec spec;
    std::int64_t token_bytes = 0, padding = 0;
    std::int32_t block_size = 0, layers = 0;
  };
  static std::int32_t v_dim(const LayerGroupSpec& g) noexcept {
    if (g.kind == AttentionKind::mla) return 0;
    return g.v_head_dim < 0 ? g.head_dim : g.v_head_dim;
  }
  // Group entry bytes of one row of side kv (0 without group scales).
  static std::int64_t entry_bytes(const LayerGroupSpec& g, std::int32_t kv) noexcept {
    const SideFormat& f = kv == 0 ? g.format.k : g.format.v;
    const std::int32_t dim = kv == 0 ? g.head_dim : v_dim(g);
    return f.scales == Scales::group && dim > 0 ? dim / f.group * group_entry_bytes(g.dtype, f) : 0;
  }
  // One row of side kv, codes and entries (0: no V).
  static std::int64_t side_row_bytes(const LayerGroupSpec& g, std::int32_t kv) noexcept {
    const std::int32_t dim = kv == 0 ? g.head_dim : v_dim(g);
    return dim == 0 ? 0 : row_bytes(g.dtype, dim) + std::max(entry_bytes(g, 0), entry_bytes(g, 1));
  }
  // The plane rule (GroupPlaneBytes) at B tokens a page; sizes past int64 give -1.
  static GroupPlaneBytes planes_of(const LayerGroupSpec& g, std::int64_t B) noexcept {
    const std::int64_t rows_per_token = g.num_kv_heads, entries = std::max(entry_bytes(g, 0), entry_bytes(g, 1));
    GroupPlaneBytes p;
    for (std::int32_t kv = 0; kv < 2; ++kv) {
      const std::int32_t dim = kv == 0 ? g.head_dim : v_dim(g);
      std::int64_t rows = 0, codes = 0;
      PlaneSplit split;
      if (dim == 0) continue;
      if (__builtin_mul_overflow(B, rows_per_token, &rows) || __builtin_mul_overflow(rows, row_bytes(g.dtype, dim), &codes) ||
          !plane_split(codes, rows, entries, split))
        return {-1, -1, -1, -1};
      (kv == 0 ? p.k : p.v) = split.bytes;
      (kv == 0 ? p.k_scales_offset : p.v_scales_offset) = split.scales_offset;
    }
    return p;
  }
  // Every layer's planes at B tokens a page; -1 past int64.
  static std::int64_t group_bytes(const LayerGroupSpec& g, std::int64_t B) noexcept {
    const GroupPlaneBytes p = planes_of(g, B);
    std::int64_t bytes = 0;
    if (p.k < 0 || __builtin_mul_overflow(p.k + p.v, std::int64_t(g.layers.size()), &bytes)) return -1;
    return bytes;
  }
  static Status check_group(const LayerGroupSpec& g) noexcept {
    if (g.kind > AttentionKind::cross) return Status{Errc::invalid_argument, "kind", std::int64_t(g.kind), 4};
    if (g.layers.empty()) return Status{Errc::invalid_argument, "layers (a group's count)", 0, 1};
    if (g.num_kv_heads < 1) return Status{Errc::invalid_argument, "num_kv_heads", g.num_kv_heads, 1};
    if (g.head_dim < 1) return Status{Errc::invalid_argument, "head_dim", g.head_dim, 1};
    if (g.v_head_dim < -1) return Status{Errc::invalid_argument, "v_head_dim", g.v_head_dim, -1};
    if (g.kind == AttentionKind::mla && (g.v_head_dim > 0 || g.num_kv_heads != 1))
      return Status{Errc::invalid_argument, "v_head_dim (MLA stores no V, one latent head)", g.v_head_dim, 0};
    if (g.kind != AttentionKind::mla && g.v_head_dim == 0)
      return Status{Errc::invalid_argument, "v_head_dim (only MLA stores no V)", 0, 1};
    if (g.kind == AttentionKind::sliding_window && g.window < 1) return Status{Errc::invalid_argument, "window", g.window, 1};
    if (g.kind == AttentionKind::chunked_local && g.chunk < 1) return Status{Errc::invalid_argument, "chunk", g.chunk, 1};
    if (g.kind == AttentionKind::cross && g.encoder_len < 1)
      return Status{Errc::invalid_argument, "encoder_len", g.encoder_len, 1};
    if (dtype_bits(g.dtype) == 0) return Status{Errc::invalid_argument, "dtype", std::int64_t(g.dtype), kLastDType};
    if (dtype_bits(g.dtype) == 4 && (g.head_dim % 2 != 0 || v_dim(g) % 2 != 0))
      return Status{Errc::invalid_argument, "head_dim (odd: a 4-bit dtype packs two values a byte)",
                    g.head_dim % 2 != 0 ? g.head_dim : v_dim(g), 2};
    if (auto st = check_side_format(g.format.k, g.dtype, g.head_dim, true); !st) return st;
    // A channel's group is a block, and a group's page holds a number of
    // tokens derived from the shared page (planes_of's B), not one block_size.
    if (g.format.k.scales == Scales::channel || g.format.v.scales == Scales::channel)
      return Status{Errc::invalid_argument, "format.scales (channel scales are a single Geometry's, not a layer group's)",
                    std::int64_t(Scales::channel), std::int64_t(Scales::group)};
    if (v_dim(g) == 0 && g.format.v != SideFormat{})
      return Status{Errc::invalid_argument, "format.v.scales (the group stores no V)", std::int64_t(g.format.v.scales), 0};
    if (v_dim(g) > 0)
      if (auto st = check_side_format(g.format.v, g.dtype, v_dim(g), false); !st) return st;
    return {};
  }

  std::vector<Group> groups_;
  std::vector<LayerSlot> map_;
  std::int64_t page_bytes_ = 0;
  std::int32_t hit_align_ = 1;
};

KVCACHE_END_NAMESPACE
