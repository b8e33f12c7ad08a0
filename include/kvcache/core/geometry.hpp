// What a KV pool looks like in memory: shape, dtype, layout, and the 64-bit
// byte offset of every (block, layer, K|V, token, head). The caller owns the
// memory; this only says how much it needs and where things are.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kvcache/config.hpp"
#include "kvcache/core/kv_format.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Token/head order inside one (block, layer, K|V) plane.
///   NHD: [block_size][kv_heads][head_dim]   (vLLM flash, FlashInfer kNHD)
///   HND: [kv_heads][block_size][head_dim]   (FlashInfer kHND; head-major pages)
enum class Layout : std::uint8_t { NHD, HND };

/// A Layout's name ("HND"), for messages (Status::named); "?" outside the enum.
constexpr const char* layout_name(std::int64_t l) noexcept { return l == 0 ? "NHD" : l == 1 ? "HND" : "?"; }

/// Where the planes of a block sit in the pool.
///   interleaved: [num_blocks][layers][2][plane]  one block is one contiguous run
///                (TensorRT-LLM style: swap / offload / copy a block with one memcpy)
///   separate:    [layers][2][num_blocks][plane]  per-layer K and V tensors, as
///                vLLM's [2, num_blocks, ...] per-layer caches
enum class KvPlanes : std::uint8_t { interleaved, separate };

/// Byte strides of one concrete pool. Trivially copyable: kernels take it by value.
struct Strides {
  std::int64_t block = 0;  ///< Bytes between consecutive blocks.
  std::int64_t layer = 0;  ///< Bytes between consecutive layers of a block.
  std::int64_t kv = 0;  ///< Bytes between K and V.
  std::int64_t token = 0;  ///< Bytes between consecutive tokens.
  std::int64_t head = 0;  ///< Bytes between consecutive kv-heads.

  /// Byte offset of (block, layer, K|V, token, head) from the pool's base.
  KVCACHE_HOST_DEVICE constexpr std::int64_t offset(std::int64_t blk, std::int64_t layer_idx, std::int64_t kv_idx,
                                                    std::int64_t tok, std::int64_t hd) const noexcept {
    return blk * block + layer_idx * layer + kv_idx * kv + tok * token + hd * head;
  }
};

/// What a KV pool is made of; Geometry::make validates it.
struct GeometrySpec {
  std::int32_t num_layers = 1;  ///< Transformer layers stored per block.
  std::int32_t num_kv_heads = 1;  ///< Key/value heads (GQA groups).
  std::int32_t head_dim = 128;  ///< Elements per head.
  std::int32_t block_size = 16;  ///< Tokens per block.
  DType dtype = DType::f16;  ///< Element type of K and V: a float type, or a code (core/kv_format.hpp) with format's scales.
  Layout layout = Layout::NHD;  ///< NHD ([token][head][dim]) or HND ([head][token][dim]) within a block.
  KvPlanes planes = KvPlanes::interleaved;  ///< interleaved ([block][layer][K,V]) or separate ([layer][K,V][block]).
  /// V's head dim: -1 = head_dim (K and V); 0 = no V, one plane per layer (MLA's latent: DeepSeek V2/V3 store
  /// 512 + 64 values a token in one head). K and V of different dims are layer groups' (groups/layer_groups.hpp).
  std::int32_t v_head_dim = -1;
  /// How K and V are scaled (core/kv_format.hpp). Group scales live in each plane
  /// after its codes, so a block's bytes are its codes and its scales.
  KvFormat format{};
};

/// A validated GeometrySpec with its byte sizes and strides.
class Geometry {
 public:
  // A default Geometry is empty (all sizes 0); only make() builds a usable one.
  Geometry() = default;

  /// Validates every field and that one block's size fits in int64.
  static Result<Geometry> make(const GeometrySpec& s) noexcept {
    if (s.num_layers < 1) return Status{Errc::invalid_argument, "num_layers", s.num_layers, 1};
    if (s.num_kv_heads < 1) return Status{Errc::invalid_argument, "num_kv_heads", s.num_kv_heads, 1};
    if (s.head_dim < 1) return Status{Errc::invalid_argument, "head_dim", s.head_dim, 1};
    if (s.block_size < 1) return Status{Errc::invalid_argument, "block_size", s.block_size, 1};
    if (dtype_bits(s.dtype) == 0) return Status{Errc::invalid_argument, "dtype", static_cast<std::int64_t>(s.dtype), kLastDType};
    if (s.layout != Layout::NHD && s.layout != Layout::HND)
      return Status{Errc::invalid_argument, "layout", static_cast<std::int64_t>(s.layout), 1};
    if (s.planes != KvPlanes::interleaved && s.planes != KvPlanes::separate)
      return Status{Errc::invalid_argument, "planes", static_cast<std::int64_t>(s.planes), 1};
    if (s.v_head_dim != -1 && s.v_head_dim != 0 && s.v_head_dim != s.head_dim)
      return Status{Errc::invalid_argument, "v_head_dim (head_dim, or 0 for no V; other dims: layer groups)", s.v_head_dim,
                    s.head_dim};
    if (dtype_bits(s.dtype) == 4 && s.head_dim % 2 != 0)
      return Status{Errc::invalid_argument, "head_dim (odd: a 4-bit dtype packs two values a byte)", s.head_dim, 2};
    if (auto st = check_side_format(s.format.k, s.dtype, s.head_dim, true); !st) return st;
    if (s.v_head_dim == 0 && s.format.v != SideFormat{})
      return Status{Errc::invalid_argument, "format.v.scales (the pool has no V plane)", static_cast<std::int64_t>(s.format.v.scales), 0};
    if (auto st = check_side_format(s.format.v, s.dtype, s.head_dim, false); s.v_head_dim != 0 && !st) return st;
    Geometry g;
    g.spec_ = s;
    // One block's bytes, factor by factor: an overflow names the factor that
    // took the product past int64 and the largest value it could have had.
    const std::int64_t head = kvcache::row_bytes(s.dtype, s.head_dim);  // int32 x 32 bits: no overflow
    std::int64_t heads = 0, codes = 0, plane = 0, block = 0;
    const auto too_big = [](const char* what, std::int64_t v, std::int64_t so_far) {
      return Status{Errc::geometry_overflow, what, v, INT64_MAX / so_far};
    };
    if (__builtin_mul_overflow(head, std::int64_t{s.num_kv_heads}, &heads))
      return too_big("num_kv_heads (block bytes past int64)", s.num_kv_heads, head);
    if (__builtin_mul_overflow(heads, std::int64_t{s.block_size}, &codes))
      return too_big("block_size (block bytes past int64)", s.block_size, heads);
    // K's and V's planes have one size, the larger: both sides' codes are the
    // same size, their entries may differ (groups of a row, or channels).
    const std::int64_t entries = std::max(g.plane_entry_bytes(0), g.plane_entry_bytes(1));
    PlaneSplit split;
    if (g.plane_entry_bytes(0) < 0 || g.plane_entry_bytes(1) < 0 || !plane_split(codes, 1, entries, split))
      return too_big("block_size (block bytes past int64)", s.block_size, heads);
    g.scales_offset_ = split.scales_offset;
    plane = split.bytes;
    const std::int64_t planes = s.v_head_dim == 0 ? 1 : 2;
    if (__builtin_mul_overflow(plane, planes * s.num_layers, &block))
      return too_big("num_layers (block bytes past int64)", s.num_layers, planes * plane);
    g.head_bytes_ = head;
    g.plane_bytes_ = plane;
    g.block_bytes_ = block;
    return g;
  }

  /// The validated spec.
  constexpr const GeometrySpec& spec() const noexcept { return spec_; }
  /// Tokens per block.
  constexpr std::int32_t block_size() const noexcept { return spec_.block_size; }
  /// Bytes per element of the dtype (0 for the packed 4-bit types: see row_bytes()).
  constexpr std::int64_t element_bytes() const noexcept { return dtype_bytes(spec_.dtype); }
  /// Bytes of one (token, head) row's codes: head_dim elements.
  constexpr std::int64_t row_bytes() const noexcept { return head_bytes_; }
  /// One (block, layer, K|V) plane: block_size x kv_heads rows of codes, then
  /// (group scales) each row's group entries, or (channel scales) each
  /// kv-head's channel entries, from scales_offset().
  constexpr std::int64_t plane_bytes() const noexcept { return plane_bytes_; }
  /// Bytes from a plane's start to its first group entry (the codes' bytes,
  /// rounded up to 16 when there are group scales).
  constexpr std::int64_t scales_offset() const noexcept { return scales_offset_; }
  /// The format of side kv (0 = K, 1 = V).
  constexpr const SideFormat& side(std::int32_t kv) const noexcept { return kv == 0 ? spec_.format.k : spec_.format.v; }
  /// Group entries (scale, and minimum if any) of one row of side kv, in bytes;
  /// 0 without group scales (channel entries belong to the block: plane_entry_bytes).
  constexpr std::int64_t group_bytes_per_row(std::int32_t kv) const noexcept {
    const SideFormat& f = side(kv);
    return f.scales == Scales::group ? spec_.head_dim / f.group * group_entry_bytes(spec_.dtype, f) : 0;
  }
  /// Entry bytes of one plane of side kv: every row's group entries, or
  /// (channel) head_dim entries per kv-head; 0 without stored scales.
  /// (-1 past int64: make() refuses that spec).
  constexpr std::int64_t plane_entry_bytes(std::int32_t kv) const noexcept {
    const SideFormat& f = side(kv);
    const bool channel = f.scales == Scales::channel;
    // Entry sets a plane holds (int32 x int32: no overflow), and the bytes of one.
    const std::int64_t sets = channel ? spec_.num_kv_heads : std::int64_t{spec_.num_kv_heads} * spec_.block_size;
    const std::int64_t set = channel ? spec_.head_dim * group_entry_bytes(spec_.dtype, f) : group_bytes_per_row(kv);
    std::int64_t bytes = 0;
    return __builtin_mul_overflow(sets, set, &bytes) ? -1 : bytes;
  }
  /// Byte offset, from its plane's start, of the channel entries of kv-head
  /// `head` on a channel-scaled side kv: head_dim entries, channel order, one
  /// set per (block, layer, head) that every token of the block shares.
  constexpr std::int64_t channel_entries_offset(std::int32_t kv, std::int32_t head) const noexcept {
    return scales_offset_ + std::int64_t{head} * spec_.head_dim * group_entry_bytes(spec_.dtype, side(kv));
  }
  /// Byte offset, from its plane's start, of the group entries of (token, head)
  /// on side kv: rows in the codes' order (NHD: token-major; HND: head-major).
  constexpr std::int64_t group_entries_offset(std::int32_t kv, std::int32_t token, std::int32_t head) const noexcept {
    const std::int64_t row = spec_.layout == Layout::NHD ? std::int64_t{token} * spec_.num_kv_heads + head
                                                         : std::int64_t{head} * spec_.block_size + token;
    return scales_offset_ + row * group_bytes_per_row(kv);
  }
  /// All layers, K and V, of one block.
  constexpr std::int64_t block_bytes() const noexcept { return block_bytes_; }
  /// Planes per (block, layer): 2 (K and V), or 1 (v_head_dim 0: K alone).
  constexpr std::int32_t kv_planes() const noexcept { return spec_.v_head_dim == 0 ? 1 : 2; }

  /// Bytes a pool of num_blocks blocks needs (null block included: it is block 0).
  Result<std::int64_t> pool_bytes(std::int64_t num_blocks) const noexcept {
    if (num_blocks < 1) return Status{Errc::invalid_argument, "num_blocks", num_blocks, 1};
    std::int64_t total = 0;
    if (__builtin_mul_overflow(num_blocks, block_bytes_, &total))
      return Status{Errc::geometry_overflow, "num_blocks", num_blocks, INT64_MAX / block_bytes_};
    return total;
  }

  /// Strides of a pool of num_blocks blocks (separate planes depend on it).
  Result<Strides> strides(std::int64_t num_blocks) const noexcept {
    auto total = pool_bytes(num_blocks);
    if (!total) return total.status();
    Strides s;
    const bool nhd = spec_.layout == Layout::NHD;
    s.token = nhd ? std::int64_t{spec_.num_kv_heads} * head_bytes_ : head_bytes_;
    s.head = nhd ? head_bytes_ : std::int64_t{spec_.block_size} * head_bytes_;
    if (spec_.planes == KvPlanes::interleaved) {
      s.kv = plane_bytes_;
      s.layer = kv_planes() * plane_bytes_;
      s.block = block_bytes_;
    } else {
      s.block = plane_bytes_;
      s.kv = num_blocks * plane_bytes_;
      s.layer = kv_planes() * s.kv;
    }
    return s;
  }

  friend constexpr bool operator==(const Geometry& a, const Geometry& b) noexcept {
    return a.block_bytes_ == b.block_bytes_ && a.spec_.num_layers == b.spec_.num_layers &&
           a.spec_.num_kv_heads == b.spec_.num_kv_heads && a.spec_.head_dim == b.spec_.head_dim &&
           a.spec_.block_size == b.spec_.block_size && a.spec_.dtype == b.spec_.dtype &&
           a.spec_.layout == b.spec_.layout && a.spec_.planes == b.spec_.planes && a.kv_planes() == b.kv_planes() &&
           a.spec_.format == b.spec_.format;
  }

 private:
  GeometrySpec spec_{};
  std::int64_t head_bytes_ = 0;
  std::int64_t plane_bytes_ = 0;
  std::int64_t scales_offset_ = 0;
  std::int64_t block_bytes_ = 0;
};

KVCACHE_END_NAMESPACE
