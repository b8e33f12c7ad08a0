// The kernels' tensors (DLPack: torch, numpy, anything with __dlpack__):
// where they live, and the checks that name a bad one before anything runs.
// A launch's tensors all live where its pool (or first tensor) lives: the
// CPU, or one CUDA device when this build has the CUDA launchers.
#pragma once

#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kvcache.hpp>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <string>
#include <type_traits>

#include "errors.hpp"

namespace kvpy {

namespace nb = nanobind;
namespace kv = kvcache;

using Tensor = nb::ndarray<>;  // any dtype, shape, strides and device: checked here

#ifdef KVCACHE_PYTHON_CUDA
inline constexpr bool kHasCuda = true;
#else
inline constexpr bool kHasCuda = false;
#endif

[[noreturn]] inline void bad(const char* name, const std::string& want) {
  StatusError e(kv::Status{kv::Errc::invalid_argument, name, 0, 0});
  e.text = std::string("invalid_argument: ") + name + " must be " + want;
  throw e;
}

// Where a launch runs: the CPU, or CUDA device `id`.
struct Device {
  std::int32_t type = nb::device::cpu::value, id = 0;
  bool cuda() const { return type == nb::device::cuda::value; }
  bool operator==(const Device&) const = default;
};

inline Device device_of(const Tensor& t, const char* name) {
  const Device d{std::int32_t(t.device_type()), std::int32_t(t.device_id())};
  if (d.type == nb::device::cpu::value) return {};
  if (d.cuda() && kHasCuda) return d;
  bad(name, kHasCuda ? "a CPU or CUDA tensor"
                     : "a CPU tensor (this build of kvcache has the host kernels only: no CUDA toolkit when it was built)");
}

// t lives where the launch runs.
inline void on(const Tensor& t, const char* name, Device d) {
  if (device_of(t, name) != d) bad(name, d.cuda() ? "on the launch's CUDA device (the pool's)" : "a CPU tensor, as the pool is");
}

inline kv::DType dtype_of(const Tensor& t, const char* name) {
  const auto d = t.dtype();
  if (d.lanes == 1) {
    if (d.code == std::uint8_t(nb::dlpack::dtype_code::Float) && d.bits == 32) return kv::DType::f32;
    if (d.code == std::uint8_t(nb::dlpack::dtype_code::Float) && d.bits == 16) return kv::DType::f16;
    if (d.code == std::uint8_t(nb::dlpack::dtype_code::Bfloat) && d.bits == 16) return kv::DType::bf16;
    if (d.code == std::uint8_t(nb::dlpack::dtype_code::UInt) && d.bits == 8) return kv::DType::fp8_e4m3;  // raw e4m3 bytes
  }
  bad(name, "float32, float16, bfloat16 or uint8 (fp8 e4m3 bytes)");
}

// An int32 / float32 / uint8 vector (C-contiguous) on device d, at least n long.
template <class T>
T* vec(const Tensor& t, const char* name, std::int64_t n, Device d) {
  on(t, name, d);
  using U = std::remove_const_t<T>;
  constexpr auto code = std::is_same_v<U, float> ? nb::dlpack::dtype_code::Float
                        : std::is_same_v<U, std::uint8_t> ? nb::dlpack::dtype_code::UInt
                                                          : nb::dlpack::dtype_code::Int;
  if (t.dtype().code != std::uint8_t(code) || t.dtype().bits != 8 * sizeof(U) || t.dtype().lanes != 1)
    bad(name, std::is_same_v<U, float> ? "float32" : std::is_same_v<U, std::uint8_t> ? "uint8" : "int32");
  std::int64_t expect = 1;
  for (std::size_t i = t.ndim(); i-- > 0;) {
    if (t.shape(i) > 1 && t.stride(i) != expect) bad(name, "C-contiguous");
    expect *= std::int64_t(t.shape(i));
  }
  require(std::int64_t(t.size()) >= n, name, std::int64_t(t.size()), n);
  return static_cast<T*>(t.data());
}

// A pool: the engine's memory (any C-contiguous tensor of at least pool_bytes) under a Geometry.
struct Pool {
  kv::PoolView view;
  Device device;
  nb::object memory;  // kept alive while the view is
  kv::Geometry geometry;
};

// K/V rows: [tokens, heads, dim] or [layers, tokens, heads, dim], dim contiguous; strides in bytes.
struct Rows {
  kv::DType dtype;
  std::int64_t layers, tokens, heads, dim, layer_stride, token_stride, head_stride;
};
inline Rows rows_of(const Tensor& t, const char* name, const Pool& pool) {
  on(t, name, pool.device);
  if (t.ndim() != 3 && t.ndim() != 4) bad(name, "[tokens, heads, head_dim] or [layers, tokens, heads, head_dim]");
  const std::size_t o = t.ndim() - 3;
  Rows r{dtype_of(t, name), o ? std::int64_t(t.shape(0)) : 1, std::int64_t(t.shape(o)), std::int64_t(t.shape(o + 1)),
         std::int64_t(t.shape(o + 2)), 0, 0, 0};
  const std::int64_t item = t.dtype().bits / 8;
  if (r.dim > 1 && t.stride(o + 2) != 1) bad(name, "contiguous in head_dim");
  require(r.heads == pool.view.num_kv_heads, name, r.heads, pool.view.num_kv_heads);
  require(r.dim == pool.view.head_dim, name, r.dim, pool.view.head_dim);
  r.layer_stride = o ? t.stride(0) * item : 0, r.token_stride = t.stride(o) * item, r.head_stride = t.stride(o + 1) * item;
  return r;
}

// V must be laid out as K (the kernels take one set of strides).
inline void same_rows(const Rows& k, const Rows& v) {
  if (k.dtype != v.dtype || k.layers != v.layers || k.tokens != v.tokens || k.layer_stride != v.layer_stride ||
      k.token_stride != v.token_stride || k.head_stride != v.head_stride)
    bad("v", "shaped, typed and strided as k");
}

// K and V as a writing kernel's source: their rows, checked alike, and the KvSource over them.
struct Source {
  Rows rows;
  kv::KvSource src;
};
inline Source source_of(const Tensor& k, const Tensor& v, const Pool& pool) {
  const Rows rk = rows_of(k, "k", pool), rv = rows_of(v, "v", pool);
  same_rows(rk, rv);
  return {rk, {k.data(), v.data(), rk.dtype, rk.layer_stride, rk.token_stride, rk.head_stride}};
}

}  // namespace kvpy
