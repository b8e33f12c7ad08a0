// The kernels' view of one layer group's pages in a hybrid pool
// (groups/layer_groups.hpp): a page of group g is [its layers][K plane][V
// plane], each plane [block_size(g)][kv-heads][head dim] (NHD), and every page
// is page_bytes() long whichever group owns it; a quantized group's planes
// end in their group entries (GroupPlaneBytes). scatter, gather, block_copy
// and compaction take the view as they take a plain pool's.
#pragma once

#include <cstdint>

#include "kvcache/config.hpp"
#include "kvcache/groups/layer_groups.hpp"
#include "kvcache/kernels/detail/common.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Which planes of a group's pages a view covers.
///   kv  K and V (their head dims equal)
///   k   K alone: MLA's latent, or K where V's head dim differs
///   v   V alone (a kernel's K side then reads and writes it)
enum class GroupPlanes : std::uint8_t { kv, k, v };

/// A view of group g's pages among `num_blocks` pages at `base`. Errors name
/// the value: a null base, a group outside lg, num_blocks < 1 or past int64
/// bytes, `kv` where K and V differ (view each alone), `v` on MLA (no V).
inline Result<PoolView> make_group_view(const LayerGroups& lg, std::int32_t g, void* base, std::int64_t num_blocks,
                                        GroupPlanes planes = GroupPlanes::kv) noexcept {
  if (base == nullptr) return Status{Errc::invalid_argument, "base", 0, 1};
  if (g < 0 || g >= lg.num_groups()) return Status{Errc::invalid_argument, "group", g, lg.num_groups() - 1};
  if (num_blocks < 1) return Status{Errc::invalid_argument, "num_blocks", num_blocks, 1};
  if (std::int64_t bytes = 0; __builtin_mul_overflow(num_blocks, lg.page_bytes(), &bytes))
    return Status{Errc::geometry_overflow, "num_blocks", num_blocks, INT64_MAX / lg.page_bytes()};
  const LayerGroupSpec& s = lg.spec(g);
  const std::int32_t dk = s.head_dim, dv = lg.v_head_dim(g), B = lg.block_size(g), H = s.num_kv_heads;
  if (planes == GroupPlanes::kv && dv != dk)
    return Status{Errc::invalid_argument, "planes (K and V differ: view each alone)", dv, dk};
  if (planes == GroupPlanes::v && dv == 0) return Status{Errc::invalid_argument, "planes (MLA stores no V)", 0, 1};
  const GroupPlaneBytes pb = lg.planes(g);
  const bool v = planes == GroupPlanes::v;
  const std::int32_t dim = v ? dv : dk;
  const std::int64_t row = row_bytes(s.dtype, dim);
  PoolView view{};
  view.base = static_cast<std::byte*>(base) + (v ? pb.k : 0);
  view.strides = Strides{.block = lg.page_bytes(), .layer = pb.k + pb.v, .kv = pb.k, .token = H * row, .head = row};
  view.num_blocks = num_blocks;
  view.num_layers = lg.layers_in(g);
  view.num_kv_heads = H;
  view.head_dim = dim;
  view.block_size = B;
  view.dtype = s.dtype;
  view.kv_planes = planes == GroupPlanes::kv ? 2 : 1;
  // A one-plane view's kernels read and write its K side: V's format goes there.
  view.format = {v ? s.format.v : s.format.k, s.format.v};
  view.plane_bytes = v ? pb.v : pb.k;
  view.scales_offset = v ? pb.v_scales_offset : pb.k_scales_offset;
  return view;
}

KVCACHE_END_NAMESPACE
