// Helpers for kernel tests: random pools, an independent reference for where
// an element lives, poisoning, and dtype-generic element access.
#pragma once

#include <kvcache/kernels/detail/common.hpp>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace kvtest {
namespace kv = kvcache;

// Byte offset of element (block, layer, kv, token, head, d), written from the
// layout definitions, not from Strides.
inline std::int64_t ref_offset(const kv::GeometrySpec& g, std::int64_t num_blocks, std::int64_t block, int layer,
                               int kv_plane, int token, int head, int d) {
  const std::int64_t e = kv::dtype_bytes(g.dtype);
  const std::int64_t in_plane = g.layout == kv::Layout::NHD
                                    ? (std::int64_t{token} * g.num_kv_heads + head) * g.head_dim + d
                                    : (std::int64_t{head} * g.block_size + token) * g.head_dim + d;
  const std::int64_t plane = std::int64_t{g.block_size} * g.num_kv_heads * g.head_dim;
  const std::int64_t planes = g.v_head_dim == 0 ? 1 : 2;  // MLA: K alone
  const std::int64_t plane_index = g.planes == kv::KvPlanes::interleaved
                                       ? (block * g.num_layers + layer) * planes + kv_plane
                                       : (std::int64_t{layer} * planes + kv_plane) * num_blocks + block;
  return (plane_index * plane + in_plane) * e;
}

struct Pool {
  kv::GeometrySpec spec;
  std::int64_t num_blocks;
  std::vector<std::byte> bytes;
  kv::PoolView view;

  Pool(const kv::GeometrySpec& s, std::int64_t blocks) : spec(s), num_blocks(blocks) {
    auto g = kv::Geometry::make(s);
    bytes.resize(static_cast<std::size_t>(*g->pool_bytes(blocks)));
    view = *kv::make_pool_view(*g, bytes.data(), blocks);
  }
  Pool(const Pool& o) : spec(o.spec), num_blocks(o.num_blocks), bytes(o.bytes), view(o.view) { view.base = bytes.data(); }
  Pool& operator=(const Pool&) = delete;
  float get(std::int64_t block, int layer, int kv_plane, int token, int head, int d) const {
    return kv::load_elem(spec.dtype, bytes.data() + ref_offset(spec, num_blocks, block, layer, kv_plane, token, head, d), 0);
  }
  const std::byte* at(std::int64_t block, int layer, int kv_plane, int token, int head, int d) const {
    return bytes.data() + ref_offset(spec, num_blocks, block, layer, kv_plane, token, head, d);
  }
};

inline void poison(std::vector<std::byte>& v, std::uint8_t pattern = 0xA5) {
  std::memset(v.data(), pattern, v.size());
}

// Random finite values in [-4, 4], stored as `t`.
inline std::vector<std::byte> random_elems(std::mt19937_64& rng, kv::DType t, std::int64_t n) {
  std::vector<std::byte> out(static_cast<std::size_t>(n * kv::dtype_bytes(t)));
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  for (std::int64_t i = 0; i < n; ++i) kv::store_elem(t, out.data(), i, u(rng));
  return out;
}

inline kv::GeometrySpec random_spec(std::mt19937_64& rng) {
  const int block_sizes[] = {1, 16, 32};
  // int8 and e5m2 pools take a per-tensor scale (the call's k_scale / v_scale).
  const kv::DType dtypes[] = {kv::DType::f32, kv::DType::f16, kv::DType::bf16, kv::DType::fp8_e4m3, kv::DType::fp8_e5m2,
                              kv::DType::int8};
  const int dims[] = {8, 16, 64, 128};
  kv::GeometrySpec s;
  s.num_layers = 1 + static_cast<int>(rng() % 3);
  s.num_kv_heads = 1 + static_cast<int>(rng() % 4);
  s.head_dim = dims[rng() % 4];
  s.block_size = block_sizes[rng() % 3];
  s.dtype = dtypes[rng() % 6];
  if (s.dtype == kv::DType::int8) s.format = {{.scales = kv::Scales::tensor}, {.scales = kv::Scales::tensor}};
  s.layout = rng() % 2 ? kv::Layout::NHD : kv::Layout::HND;
  s.planes = rng() % 2 ? kv::KvPlanes::interleaved : kv::KvPlanes::separate;
  return s;
}

inline kv::SideFormat random_side(std::mt19937_64& rng, kv::DType d, std::int32_t head_dim) {
  if (d == kv::DType::fp4_e2m1) return {.scales = kv::Scales::group, .group = 16};
  if (rng() % 4 == 0 && d != kv::DType::int4 && d != kv::DType::int2) return {.scales = kv::Scales::tensor};
  if (rng() % 5 == 0 && d != kv::DType::int2) return {.scales = kv::Scales::head};
  std::vector<std::int32_t> groups;
  for (std::int32_t g : {16, 32, 64, 128})
    if (head_dim % g == 0) groups.push_back(g);
  const bool integer = kv::is_integer_code(d);
  return {.scales = kv::Scales::group, .group = groups[rng() % groups.size()], .minimum = integer && rng() % 2 == 0};
}

// A quantized geometry: a code, and per side group scales (any G dividing
// head_dim, a minimum for integer codes) or an engine-held scale.
inline kv::GeometrySpec random_quant_spec(std::mt19937_64& rng) {
  const kv::DType codes[] = {kv::DType::int8, kv::DType::int4, kv::DType::fp8_e4m3, kv::DType::fp8_e5m2, kv::DType::fp4_e2m1,
                             kv::DType::int2};
  const std::int32_t dims[] = {32, 64, 128, 48};
  const std::int32_t blocks[] = {1, 4, 16};
  kv::GeometrySpec s;
  s.num_layers = 1 + std::int32_t(rng() % 2);
  s.num_kv_heads = 1 + std::int32_t(rng() % 3);
  s.head_dim = dims[rng() % 4];
  s.block_size = blocks[rng() % 3];
  s.dtype = codes[rng() % 6];
  s.layout = rng() % 2 ? kv::Layout::NHD : kv::Layout::HND;
  s.planes = rng() % 2 ? kv::KvPlanes::interleaved : kv::KvPlanes::separate;
  s.format = {random_side(rng, s.dtype, s.head_dim), random_side(rng, s.dtype, s.head_dim)};
  return s;
}

}  // namespace kvtest
