// The disk tier's file: one preallocated file of equal slots, one block per
// slot. A slot is the block's bytes, zero padding, and a 64-byte trailer at
// its end holding the block's hash and layer group, a digest of the layout
// (what the bytes mean: geometry, dtype, block size), the slot's own index
// and a checksum of the bytes. Slots are a multiple of the alignment (4 KiB
// by default), so the engine can read and write them with O_DIRECT. Before
// a disk block is used the library verifies it in host memory
// (Tiers::complete_disk_load runs verify on every slot a load read): a
// flipped byte, a torn write, a block written to another slot or by another
// layout is a miss, never wrong KV.
// The engine does the I/O (pread/pwrite, preadv/pwritev, io_uring) on its
// own threads, straight between the file and the host tier's blocks: the
// trailer-only forms take the block's bytes and the slot's tail apart, so
// no bounce buffer is needed. This header only says where and checks what came back.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "kvcache/core/block_hash.hpp"
#include "kvcache/config.hpp"
#include "kvcache/core/geometry.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// A 64-bit checksum of bytes (four multiply-rotate lanes, then an avalanche):
/// any one flipped bit changes it; it guards against corruption, not attackers.
inline std::uint64_t checksum64(std::span<const std::byte> bytes, std::uint64_t seed = 0) noexcept {
  constexpr std::uint64_t k1 = 0x9e3779b97f4a7c15ULL, k2 = 0xc2b2ae3d27d4eb4fULL;
  std::uint64_t lane[4] = {seed ^ k1, seed ^ k2, seed + k1 * 3, seed - k2};
  std::size_t i = 0;
  const auto rotl = [](std::uint64_t x, int r) { return (x << r) | (x >> (64 - r)); };
  for (; i + 32 <= bytes.size(); i += 32)
    for (int l = 0; l < 4; ++l) {
      std::uint64_t w;
      std::memcpy(&w, bytes.data() + i + 8 * std::size_t(l), 8);
      lane[l] = rotl(lane[l] ^ (w * k2), 31) * k1;
    }
  std::uint64_t h = rotl(lane[0], 1) ^ rotl(lane[1], 7) ^ rotl(lane[2], 12) ^ rotl(lane[3], 18) ^ bytes.size();
  for (; i < bytes.size(); ++i) h = rotl(h ^ (std::uint64_t(bytes[i]) * k2), 31) * k1;
  h ^= h >> 33, h *= 0xff51afd7ed558ccdULL, h ^= h >> 33, h *= 0xc4ceb9fe1a85ec53ULL, h ^= h >> 33;
  return h;
}

/// A digest of what a block's bytes mean: every field of the geometry, the
/// KV format included (codes read with another group size or minimum are
/// wrong values of the right size). Blocks written under another geometry
/// fail verification.
inline std::uint64_t layout_digest(const GeometrySpec& g) noexcept {
  const SideFormat &k = g.format.k, &v = g.format.v;
  const std::int64_t f[] = {g.num_layers,           g.num_kv_heads, g.head_dim,           g.block_size,
                            std::int64_t(g.dtype),  std::int64_t(g.layout), std::int64_t(g.planes), g.v_head_dim,
                            std::int64_t(k.scales), k.group,        std::int64_t{k.minimum}, std::int64_t(v.scales),
                            v.group,                std::int64_t{v.minimum}};
  return checksum64(std::as_bytes(std::span(f)), 0x6b7663616368ULL);
}

/// Calls f(offset, bytes) for each contiguous piece of block b in a pool of
/// `num_blocks` blocks of g, in the order a slot's payload holds them: the
/// whole block when planes are interleaved, else each (layer, K|V) plane.
/// Together they are g.block_bytes() bytes. Errors name the value.
template <class F>
Status for_each_block_piece(const Geometry& g, std::int64_t num_blocks, std::int64_t b, F&& f) {
  auto st = g.strides(num_blocks);
  if (!st) return st.status();
  if (b < 0 || b >= num_blocks) return Status{Errc::invalid_argument, "block", b, num_blocks - 1};
  if (g.spec().planes == KvPlanes::interleaved) {
    f(b * st->block, g.block_bytes());
    return {};
  }
  for (std::int64_t l = 0; l < g.spec().num_layers; ++l)
    for (std::int64_t kv = 0; kv < g.kv_planes(); ++kv) f(st->offset(b, l, kv, 0, 0), g.plane_bytes());
  return {};
}

/// The trailer at the end of every slot.
struct DiskTrailer {
  std::uint64_t magic = 0;  ///< kMagic once sealed.
  std::uint64_t hash_lo = 0;  ///< The block's hash, low 64 bits.
  std::uint64_t hash_hi = 0;  ///< The block's hash, high 64 bits.
  std::uint64_t digest = 0;  ///< layout_digest of the writer.
  std::uint32_t slot = 0;  ///< The slot it was written for.
  std::int32_t group = -1;  ///< The block's layer group (-1: none named), what a restarted tier's events name.
  std::uint64_t bytes = 0;  ///< Payload bytes.
  std::uint64_t checksum = 0;  ///< checksum64 of the payload.
  std::uint64_t self = 0;  ///< checksum64 of the fields above.
  /// "KKVBLK02" in little-endian bytes. Version 01 had no group: its slots
  /// read as unsealed (a miss, recomputed), never as another layout's block.
  static constexpr std::uint64_t kMagic = 0x32304b4c42564b4bULL;
};
static_assert(sizeof(DiskTrailer) == 64);

/// What an intact trailer names: the block's hash and its layer group.
struct SealedBlock {
  BlockHash hash{};  ///< The block's hash.
  std::int32_t group = -1;  ///< Its layer group (-1: none named when sealed).
  friend constexpr bool operator==(const SealedBlock&, const SealedBlock&) = default;
};

/// A disk slot as it landed in host memory: the block's bytes (wherever the
/// engine read them to: the host tier's block) and the slot's tail (its
/// tail_bytes() after the payload, padding and trailer, or just the trailer's
/// last trailer_bytes).
struct LandedSlot {
  std::span<const std::byte> payload{};  ///< The block's bytes: block_bytes() of them.
  std::span<const std::byte> tail{};  ///< The slot's tail, or its trailer alone.
};

/// Where each slot of the disk file lives, and the sealing and checking of a slot's image.
class DiskLayout {
 public:
  static constexpr std::int64_t trailer_bytes = sizeof(DiskTrailer);  ///< Bytes of a slot's trailer.

  /// Slots of `block_bytes` payload each (a whole block, every layer), for
  /// `num_blocks` blocks, rounded up to `align` bytes (a power of two; 4096
  /// suits O_DIRECT), written by a layout with digest `digest`. Errors name the value.
  static Result<DiskLayout> make(std::int64_t block_bytes, std::int32_t num_blocks, std::uint64_t digest,
                                 std::int64_t align = 4096) noexcept {
    if (block_bytes < 1) return Status{Errc::invalid_argument, "block_bytes", block_bytes, 1};
    if (num_blocks < 1) return Status{Errc::invalid_argument, "num_blocks", num_blocks, 1};
    if (align < 64 || (align & (align - 1)) != 0) return Status{Errc::invalid_argument, "align (a power of two, 64 or more)", align, 64};
    if (block_bytes > INT64_MAX / 2 - align) return Status{Errc::geometry_overflow, "block_bytes", block_bytes, INT64_MAX / 2 - align};
    DiskLayout d;
    d.payload_ = block_bytes;
    d.slot_ = (block_bytes + trailer_bytes + align - 1) / align * align;
    if (std::int64_t total = 0; __builtin_mul_overflow(d.slot_, std::int64_t{num_blocks}, &total))
      return Status{Errc::geometry_overflow, "num_blocks (file bytes past int64)", num_blocks, INT64_MAX / d.slot_};
    d.blocks_ = num_blocks;
    d.digest_ = digest;
    return d;
  }

  std::int64_t block_bytes() const noexcept { return payload_; }  ///< Payload bytes of a slot.
  std::int64_t slot_bytes() const noexcept { return slot_; }  ///< Bytes of a slot: payload, padding, trailer.
  std::int32_t num_blocks() const noexcept { return blocks_; }  ///< Slots in the file.
  std::int64_t file_bytes() const noexcept { return slot_ * blocks_; }  ///< What to preallocate (fallocate).
  std::int64_t offset(std::int32_t slot) const noexcept { return slot_ * slot; }  ///< Slot's byte offset.
  std::uint64_t digest() const noexcept { return digest_; }  ///< The writer's layout digest.
  std::int64_t tail_bytes() const noexcept { return slot_ - payload_; }  ///< A slot's bytes after the payload: padding and trailer.

  /// Seals a slot image whose first block_bytes() hold the block: zeroes the
  /// padding and writes the trailer for `slot`, hash h and layer group
  /// `group` (the source tier's record: `tiers.host().group(move.src)`; -1 names none).
  Status seal(std::span<std::byte> image, std::int32_t slot, const BlockHash& h, std::int32_t group = -1) const noexcept {
    if (auto st = shape(image.size(), slot); !st) return st;
    return seal_tail(image.first(std::size_t(payload_)), image.subspan(std::size_t(payload_), std::size_t(tail_bytes())), slot, h,
                     group);
  }
  /// seal() with the block's bytes where they are (the host tier's block) and
  /// the slot's tail apart (tail_bytes(): padding zeroed, then the trailer):
  /// the engine writes the slot with one pwritev of the two, no bounce copy.
  Status seal_tail(std::span<const std::byte> payload, std::span<std::byte> tail, std::int32_t slot, const BlockHash& h,
                   std::int32_t group = -1) const noexcept {
    if (slot < 0 || slot >= blocks_) return Status{Errc::invalid_argument, "slot", slot, blocks_ - 1};
    if (group < -1) return Status{Errc::invalid_argument, "group", group, -1};
    if (std::int64_t(payload.size()) < payload_) return Status{Errc::buffer_too_small, "payload", std::int64_t(payload.size()), payload_};
    if (std::int64_t(tail.size()) < tail_bytes()) return Status{Errc::buffer_too_small, "tail", std::int64_t(tail.size()), tail_bytes()};
    const std::int64_t pad = tail_bytes() - trailer_bytes;
    if (pad < 0) return Status{Errc::invariant_violated, "tail_bytes", tail_bytes(), trailer_bytes};  // make() rules it out
    std::fill_n(tail.begin(), pad, std::byte{0});
    DiskTrailer t{DiskTrailer::kMagic, h.lo, h.hi, digest_, std::uint32_t(slot), group, std::uint64_t(payload_),
                  checksum64(payload.first(std::size_t(payload_))), 0};
    t.self = self_check(t);
    std::memcpy(tail.data() + tail_bytes() - trailer_bytes, &t, sizeof t);
    return {};
  }

  /// Whether an image read back from `slot` holds block `expected`, intact:
  /// invalid_argument naming what differs ("trailer", "digest", "slot",
  /// "hash", "checksum"); the block is then a miss.
  Status verify(std::span<const std::byte> image, std::int32_t slot, const BlockHash& expected) const noexcept {
    if (auto st = shape(image.size(), slot); !st) return st;
    return verify(image.first(std::size_t(payload_)), image.subspan(std::size_t(payload_), std::size_t(tail_bytes())), slot, expected);
  }
  /// verify() of a slot read back in two pieces (one preadv: the block's
  /// bytes into the host tier's block, the tail into a small buffer): `tail`
  /// is the slot's tail_bytes() or only its last trailer_bytes.
  Status verify(std::span<const std::byte> payload, std::span<const std::byte> tail, std::int32_t slot,
                const BlockHash& expected) const noexcept {
    if (std::int64_t(payload.size()) < payload_) return Status{Errc::buffer_too_small, "payload", std::int64_t(payload.size()), payload_};
    auto t = trailer(tail, slot);
    if (!t) return t.status();
    if (t->hash_lo != expected.lo || t->hash_hi != expected.hi)
      return Status{Errc::invalid_argument, "hash", std::int64_t(t->hash_lo), std::int64_t(expected.lo)}.hex();
    if (const std::uint64_t c = checksum64(payload.first(std::size_t(payload_))); c != t->checksum)
      return Status{Errc::invalid_argument, "checksum", std::int64_t(c), std::int64_t(t->checksum)}.hex();
    return {};
  }

  /// The hash and group an intact trailer of `slot` names (rebuilding the
  /// disk tier's index after a restart: Tiers::restore_disk; every load of
  /// it is still verified); an error when the slot was never sealed, or by
  /// another layout. `image` is the slot, or (as verify) only its tail.
  Result<SealedBlock> sealed(std::span<const std::byte> image, std::int32_t slot) const noexcept {
    if (slot < 0 || slot >= blocks_) return Status{Errc::invalid_argument, "slot", slot, blocks_ - 1};
    const bool whole = std::int64_t(image.size()) >= slot_;
    auto t = trailer(whole ? image.subspan(std::size_t(payload_), std::size_t(tail_bytes())) : image, slot);
    if (!t) return t.status();
    return SealedBlock{{t->hash_lo, t->hash_hi}, t->group};
  }
  /// sealed()'s hash alone.
  Result<BlockHash> sealed_hash(std::span<const std::byte> image, std::int32_t slot) const noexcept {
    if (auto st = shape(image.size(), slot); !st) return st;
    auto t = sealed(image, slot);
    if (!t) return t.status();
    return t->hash;
  }

 private:
  // The checksum of every field before `self` (the first 56 bytes).
  static std::uint64_t self_check(const DiskTrailer& t) noexcept {
    return checksum64(std::as_bytes(std::span(&t, 1)).first(offsetof(DiskTrailer, self)), 0x747261696c6572ULL);
  }
  Status shape(std::size_t bytes, std::int32_t slot) const noexcept {
    if (slot < 0 || slot >= blocks_) return Status{Errc::invalid_argument, "slot", slot, blocks_ - 1};
    if (std::int64_t(bytes) < slot_) return Status{Errc::buffer_too_small, "image", std::int64_t(bytes), slot_};
    return {};
  }
  // The trailer at the end of `tail` (a slot's tail, or the trailer alone), checked against this layout and slot.
  Result<DiskTrailer> trailer(std::span<const std::byte> tail, std::int32_t slot) const noexcept {
    if (slot < 0 || slot >= blocks_) return Status{Errc::invalid_argument, "slot", slot, blocks_ - 1};
    if (std::int64_t(tail.size()) != tail_bytes() && std::int64_t(tail.size()) != trailer_bytes)
      return Status{Errc::invalid_argument, "tail (tail_bytes, or the trailer's 64)", std::int64_t(tail.size()), tail_bytes()};
    DiskTrailer t;
    std::memcpy(&t, tail.data() + tail.size() - sizeof t, sizeof t);
    if (t.magic != DiskTrailer::kMagic || t.self != self_check(t))
      return Status{Errc::invalid_argument, "trailer", std::int64_t(t.magic), std::int64_t(DiskTrailer::kMagic)}.hex();
    if (t.digest != digest_) return Status{Errc::invalid_argument, "digest", std::int64_t(t.digest), std::int64_t(digest_)}.hex();
    if (t.slot != std::uint32_t(slot) || t.bytes != std::uint64_t(payload_))
      return Status{Errc::invalid_argument, "slot", std::int64_t(t.slot), slot};
    if (t.group < -1) return Status{Errc::invalid_argument, "group", t.group, -1};  // seal() writes none
    return t;
  }

  std::int64_t payload_ = 0, slot_ = 0;
  std::int32_t blocks_ = 0;
  std::uint64_t digest_ = 0;
};

KVCACHE_END_NAMESPACE
