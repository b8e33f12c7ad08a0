// Which bytes move when a rank reads a peer's blocks (NIXL READ): from two
// handshakes and, per layer group, the two lists of block ids, the list of
// (local address, remote address, bytes). Pairs of pieces that are
// contiguous on both sides are coalesced into one descriptor: a plain pool
// with interleaved planes moves a run of consecutive blocks in one; separate
// planes move one run per (layer, K|V). The index form names the same pieces
// as descriptor ids, region × num_blocks + block, for NIXL's prepared lists
// (prepXferDlist once per peer, makeXferReq per request), as vLLM does.
//
// Options, as a decode rank needs them: skip the leading blocks its own
// prefix cache holds (read only the suffix); read only the blocks a
// sliding-window or chunked group's next query reads; read a slice of the
// peer's kv-heads when this rank's tensor-parallel size is larger (HND).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "kvcache/core/block_math.hpp"
#include "kvcache/config.hpp"
#include "kvcache/status.hpp"
#include "kvcache/transfer/layout_handshake.hpp"

KVCACHE_BEGIN_NAMESPACE

/// One copy: `bytes` from the peer's `remote` address into the local one.
struct TransferDesc {
  std::uint64_t local = 0;  ///< Destination (this rank's pool).
  std::uint64_t remote = 0;  ///< Source (the peer's pool).
  std::int64_t bytes = 0;  ///< Length.
  friend constexpr bool operator==(const TransferDesc&, const TransferDesc&) = default;
};

/// One layer group's blocks of the sequence on both sides.
struct GroupBlocks {
  std::int32_t group = 0;  ///< The layer group.
  /// The peer's blocks of the sequence, from its first (position 0).
  std::span<const std::int32_t> remote{};
  /// This rank's blocks for remote[skip ..]: local[i] receives remote[skip + i].
  std::span<const std::int32_t> local{};
  /// Leading remote blocks not read: this rank's prefix cache holds them
  /// (import()'s cached blocks). Per group, since groups' block sizes differ.
  std::int32_t skip = 0;
};

/// What a plan reads.
struct TransferOptions {
  /// The sequence's tokens, for `window_only`.
  std::int64_t num_tokens = 0;
  /// A sliding-window group reads only the blocks its next query (at position num_tokens) reads,
  /// a chunked group only its current chunk's; the rest of local may be the null block.
  bool window_only = false;
  /// Coalesce pieces contiguous on both sides (off: one descriptor per block and plane, to count them).
  bool coalesce = true;
};

namespace detail {
// One plane region of a side: where (group, layer, K|V) block b's plane lies, and its bytes per head.
struct PlaneRef {
  std::uint64_t base = 0;
  std::int64_t stride = 0, bytes = 0, head_bytes = 0;
  std::int32_t group = 0, layer = 0, kv = 0;
};
// Every K and V plane region of h, ordered by (group, layer, kv).
inline void plane_refs(const LayoutHandshake& h, std::vector<PlaneRef>& out) {
  out.clear();
  for (const KvRegion& r : h.regions) {
    const std::int32_t heads = h.groups[std::size_t(r.group)].num_kv_heads;
    if (r.k_bytes > 0) out.push_back({r.base, r.block_stride, r.k_bytes, r.k_bytes / heads, r.group, r.layer, 0});
    if (r.v_bytes > 0)
      out.push_back({r.base + std::uint64_t(r.k_bytes), r.block_stride, r.v_bytes, r.v_bytes / heads, r.group, r.layer, 1});
  }
  std::stable_sort(out.begin(), out.end(), [](const PlaneRef& a, const PlaneRef& b) {
    return a.group != b.group ? a.group < b.group : a.layer != b.layer ? a.layer < b.layer : a.kv < b.kv;
  });
}
}  // namespace detail

/// Plans reads of a peer's blocks into this rank's, reusing `out` (cleared).
/// check_compatible(local, remote) first; then each group's block lists
/// (local.size() == remote.size() - skip) and ids (within each pool) are
/// checked, and an error names the value, with `out` left empty. Returns the
/// descriptors' total bytes. With a head slice, each local plane takes its
/// heads from offset (local tp_rank mod readers) × local heads in the peer's plane.
class TransferPlanner {
 public:
  /// A planner between this rank (`local`) and a peer (both copied); check compatibility with status().
  TransferPlanner(const LayoutHandshake& local, const LayoutHandshake& remote)
      : local_(local), remote_(remote), status_(check_compatible(local, remote)) {
    if (!status_) return;
    detail::plane_refs(local, lp_);
    detail::plane_refs(remote, rp_);
    if (lp_.size() != rp_.size()) {
      status_ = Status{Errc::layout_mismatch, "regions (planes)", std::int64_t(rp_.size()), std::int64_t(lp_.size())};
      return;
    }
    for (std::size_t i = 0; i < lp_.size(); ++i)
      if (lp_[i].group != rp_[i].group || lp_[i].layer != rp_[i].layer || lp_[i].kv != rp_[i].kv || lp_[i].head_bytes != rp_[i].head_bytes) {
        status_ = Status{Errc::layout_mismatch, "regions (plane)", std::int64_t(i), std::int64_t(lp_.size())};
        return;
      }
    for (std::size_t p = 0; p < lp_.size(); ++p) {  // each plane's part of the peer's: all, or this rank's heads
      const detail::PlaneRef &l = lp_[p], &r = rp_[p];
      if (l.bytes == r.bytes) {
        slices_.emplace_back(0, l.bytes);
        continue;
      }
      const std::int32_t local_heads = local_.groups[std::size_t(l.group)].num_kv_heads;
      const std::int32_t readers = remote_.groups[std::size_t(l.group)].num_kv_heads / local_heads;
      slices_.emplace_back(std::int64_t(local_.id.tp_rank % readers) * local_heads * l.head_bytes, l.bytes);
    }
  }

  /// Whether the two layouts can exchange blocks (check_compatible and the regions).
  const Status& status() const noexcept { return status_; }
  /// This rank's handshake (a copy).
  const LayoutHandshake& local() const noexcept { return local_; }
  /// The peer's handshake (a copy).
  const LayoutHandshake& remote() const noexcept { return remote_; }
  /// Plane regions per side (descriptor ids count in them: region × num_blocks + block).
  std::int32_t num_plane_regions() const noexcept { return std::int32_t(lp_.size()); }

  /// The descriptors that read `blocks` (one entry per group read).
  Result<std::int64_t> plan(std::span<const GroupBlocks> blocks, const TransferOptions& opt, std::vector<TransferDesc>& out) const {
    out.clear();
    std::int64_t total = 0;
    auto st = walk(blocks, opt, [&](const detail::PlaneRef& l, const detail::PlaneRef& r, std::int32_t lb, std::int32_t rb, std::size_t,
                                    std::int64_t off, std::int64_t len) {
      const std::uint64_t la = l.base + std::uint64_t(l.stride) * std::uint64_t(lb),
                          ra = r.base + std::uint64_t(r.stride) * std::uint64_t(rb) + std::uint64_t(off);
      total += len;
      if (opt.coalesce && !out.empty()) {
        TransferDesc& d = out.back();
        if (d.local + std::uint64_t(d.bytes) == la && d.remote + std::uint64_t(d.bytes) == ra) return void(d.bytes += len);
      }
      out.push_back({la, ra, len});
    });
    if (!st) return out.clear(), st;
    return total;
  }

  /// The same reads as descriptor ids into each side's prepared list (dlist()):
  /// id = plane region × num_blocks + block. Never coalesced.
  Status plan_ids(std::span<const GroupBlocks> blocks, const TransferOptions& opt, std::vector<std::int64_t>& local_ids,
                  std::vector<std::int64_t>& remote_ids) const {
    local_ids.clear(), remote_ids.clear();
    auto st = walk(blocks, opt, [&](const detail::PlaneRef&, const detail::PlaneRef&, std::int32_t lb, std::int32_t rb, std::size_t p,
                                    std::int64_t, std::int64_t) {
      local_ids.push_back(std::int64_t(p) * local_.num_blocks + lb);
      remote_ids.push_back(std::int64_t(p) * remote_.num_blocks + rb);
    });
    if (!st) local_ids.clear(), remote_ids.clear();
    return st;
  }

  /// A side's prepared descriptor list, in id order: (address, bytes) of every
  /// plane region's every block; the peer's pieces are this rank's head slice.
  void dlist(bool local_side, std::vector<TransferDesc>& out) const {
    out.clear();
    const auto& planes = local_side ? lp_ : rp_;
    const std::int64_t n = local_side ? local_.num_blocks : remote_.num_blocks;
    for (std::size_t p = 0; p < planes.size(); ++p) {
      const auto [off, len] = slice(p);
      for (std::int64_t b = 0; b < n; ++b) {
        const std::uint64_t a = planes[p].base + std::uint64_t(planes[p].stride * b);
        out.push_back(local_side ? TransferDesc{a, 0, len} : TransferDesc{0, a + std::uint64_t(off), len});
      }
    }
  }

 private:
  // The byte range of remote plane p this rank reads: all of it, or its head slice.
  std::pair<std::int64_t, std::int64_t> slice(std::size_t p) const noexcept { return slices_[p]; }

  // Calls f(local plane, remote plane, local block, remote block, plane index, remote offset, bytes) for every piece read.
  template <class F>
  Status walk(std::span<const GroupBlocks> blocks, const TransferOptions& opt, F&& f) const {
    if (!status_) return status_;
    if (opt.num_tokens < 0) return Status{Errc::invalid_argument, "num_tokens", opt.num_tokens, 0};
    for (const GroupBlocks& gb : blocks) {  // check everything before the first descriptor
      const std::int64_t groups = std::int64_t(local_.groups.size());
      if (gb.group < 0 || gb.group >= groups) return Status{Errc::invalid_argument, "group", gb.group, groups - 1};
      if (gb.skip < 0 || std::int64_t(gb.remote.size()) < gb.skip)
        return Status{Errc::invalid_argument, "skip", gb.skip, std::int64_t(gb.remote.size())};
      if (gb.local.size() != gb.remote.size() - std::size_t(gb.skip))
        return Status{Errc::invalid_argument, "local.size (remote.size - skip)", std::int64_t(gb.local.size()),
                      std::int64_t(gb.remote.size()) - gb.skip};
      const std::int32_t first = first_read(gb, opt);
      for (std::size_t i = std::size_t(first); i < gb.local.size(); ++i) {
        if (gb.local[i] < 1 || gb.local[i] >= local_.num_blocks) return Status{Errc::invalid_argument, "local block", gb.local[i], local_.num_blocks - 1};
        const std::int32_t rb = gb.remote[i + std::size_t(gb.skip)];
        if (rb < 1 || rb >= remote_.num_blocks) return Status{Errc::invalid_argument, "remote block", rb, remote_.num_blocks - 1};
      }
    }
    for (const GroupBlocks& gb : blocks) {
      const std::size_t first = std::size_t(first_read(gb, opt));
      const auto [lo, hi] = planes_of(gb.group);
      // Walk in the local pool's address order, so contiguous pieces meet:
      // blocks inside planes when a plane's blocks are adjacent (separate planes), planes inside blocks otherwise.
      const bool plane_major = lo < hi && lp_[lo].stride == lp_[lo].bytes;
      const auto piece = [&](std::size_t p, std::size_t i) {
        const auto [off, len] = slice(p);
        f(lp_[p], rp_[p], gb.local[i], gb.remote[i + std::size_t(gb.skip)], p, off, len);
      };
      if (plane_major) {
        for (std::size_t p = lo; p < hi; ++p)
          for (std::size_t i = first; i < gb.local.size(); ++i) piece(p, i);
      } else {
        for (std::size_t i = first; i < gb.local.size(); ++i)
          for (std::size_t p = lo; p < hi; ++p) piece(p, i);
      }
    }
    return {};
  }

  // The first index of gb.local to read: 0, or the window's first block.
  std::int32_t first_read(const GroupBlocks& gb, const TransferOptions& opt) const noexcept {
    if (!opt.window_only) return 0;
    const GroupLayout& g = local_.groups[std::size_t(gb.group)];
    std::int64_t first_pos = 0;  // the first position the query at num_tokens reads
    if (g.kind == AttentionKind::sliding_window) first_pos = std::max<std::int64_t>(0, opt.num_tokens - g.window + 1);
    else if (g.kind == AttentionKind::chunked_local) first_pos = opt.num_tokens - opt.num_tokens % g.chunk;
    const std::int64_t block = first_pos / g.block_size - gb.skip;
    return std::int32_t(std::clamp<std::int64_t>(block, 0, std::int64_t(gb.local.size())));
  }

  // The plane regions [lo, hi) of group g (they are sorted by group).
  std::pair<std::size_t, std::size_t> planes_of(std::int32_t g) const noexcept {
    std::size_t lo = 0;
    while (lo < lp_.size() && lp_[lo].group < g) ++lo;
    std::size_t hi = lo;
    while (hi < lp_.size() && lp_[hi].group == g) ++hi;
    return {lo, hi};
  }

  LayoutHandshake local_, remote_;  // copies: the planner outlives the caller's
  Status status_;
  std::vector<detail::PlaneRef> lp_, rp_;
  std::vector<std::pair<std::int64_t, std::int64_t>> slices_;  // per plane: offset and bytes in the peer's
};

KVCACHE_END_NAMESPACE
