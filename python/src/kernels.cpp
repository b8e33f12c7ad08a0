// The kernels on DLPack tensors (torch, numpy, anything with __dlpack__):
// a pool is the engine's memory viewed through a Geometry; K/V may be any
// strided slice whose rows are contiguous (a fused QKV tensor's K part).
// This build runs the host launchers on CPU tensors; a tensor on another
// device is an invalid_argument naming it. Nothing is allocated or
// synchronized on the way; shapes, dtypes and devices are checked first.
#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/gather.hpp>
#include <kvcache/kernels/rope.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kernels/scores.hpp>
#include <kvcache/kvcache.hpp>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <string>

#include "errors.hpp"

namespace nb = nanobind;
namespace kv = kvcache;
using namespace nb::literals;

namespace kvpy {
namespace {

using Tensor = nb::ndarray<>;  // any dtype, shape, strides and device: checked here

// A pool: the engine's memory (any C-contiguous tensor of at least pool_bytes) under a Geometry.
struct Pool {
  kv::PoolView view;
  nb::object memory;  // kept alive while the view is
};

[[noreturn]] void bad(const char* name, const std::string& want) {
  StatusError e(kv::Status{kv::Errc::invalid_argument, name, 0, 0});
  e.text = std::string("invalid_argument: ") + name + " must be " + want;
  throw e;
}

void on_cpu(const Tensor& t, const char* name) {
  if (t.device_type() != nb::device::cpu::value)
    bad(name, "a CPU tensor (this build of kvcache has the host kernels only)");
}

kv::DType dtype_of(const Tensor& t, const char* name) {
  const auto d = t.dtype();
  if (d.lanes == 1) {
    if (d.code == std::uint8_t(nb::dlpack::dtype_code::Float) && d.bits == 32) return kv::DType::f32;
    if (d.code == std::uint8_t(nb::dlpack::dtype_code::Float) && d.bits == 16) return kv::DType::f16;
    if (d.code == std::uint8_t(nb::dlpack::dtype_code::Bfloat) && d.bits == 16) return kv::DType::bf16;
    if (d.code == std::uint8_t(nb::dlpack::dtype_code::UInt) && d.bits == 8) return kv::DType::fp8_e4m3;  // raw e4m3 bytes
  }
  bad(name, "float32, float16, bfloat16 or uint8 (fp8 e4m3 bytes)");
}

// An int32 / float32 vector (C-contiguous) on the CPU, at least n long.
template <class T>
T* vec(const Tensor& t, const char* name, std::int64_t n) {
  on_cpu(t, name);
  const bool is_i32 = std::is_same_v<T, std::int32_t> || std::is_same_v<T, const std::int32_t>;
  const auto want_code = std::uint8_t(is_i32 ? nb::dlpack::dtype_code::Int : nb::dlpack::dtype_code::Float);
  if (t.dtype().code != want_code || t.dtype().bits != 32 || t.dtype().lanes != 1) bad(name, is_i32 ? "int32" : "float32");
  std::int64_t expect = 1;
  for (std::size_t i = t.ndim(); i-- > 0;) {
    if (t.shape(i) > 1 && t.stride(i) != expect) bad(name, "C-contiguous");
    expect *= std::int64_t(t.shape(i));
  }
  require(std::int64_t(t.size()) >= n, name, std::int64_t(t.size()), n);
  return static_cast<T*>(t.data());
}

// K/V rows: [tokens, heads, dim] or [layers, tokens, heads, dim], dim contiguous; strides in bytes.
struct Rows {
  kv::DType dtype;
  std::int64_t layers, tokens, heads, dim, layer_stride, token_stride, head_stride;
};
Rows rows_of(const Tensor& t, const char* name, const kv::PoolView& pool) {
  on_cpu(t, name);
  if (t.ndim() != 3 && t.ndim() != 4) bad(name, "[tokens, heads, head_dim] or [layers, tokens, heads, head_dim]");
  const std::size_t o = t.ndim() - 3;
  Rows r{dtype_of(t, name), o ? std::int64_t(t.shape(0)) : 1, std::int64_t(t.shape(o)), std::int64_t(t.shape(o + 1)),
         std::int64_t(t.shape(o + 2)), 0, 0, 0};
  const std::int64_t item = t.dtype().bits / 8;
  if (r.dim > 1 && t.stride(o + 2) != 1) bad(name, "contiguous in head_dim");
  require(r.heads == pool.num_kv_heads, name, r.heads, pool.num_kv_heads);
  require(r.dim == pool.head_dim, name, r.dim, pool.head_dim);
  r.layer_stride = o ? t.stride(0) * item : 0, r.token_stride = t.stride(o) * item, r.head_stride = t.stride(o + 1) * item;
  return r;
}

}  // namespace

void register_kernels(nb::module_& m) {
  nb::class_<Pool>(m, "PoolView")
      .def(
          "__init__",
          [](Pool* self, const kv::Geometry& g, Tensor memory, std::int64_t num_blocks) {
            on_cpu(memory, "memory");
            const auto bytes = check(g.pool_bytes(num_blocks));
            require(std::int64_t(memory.nbytes()) >= bytes, "memory.nbytes", std::int64_t(memory.nbytes()), bytes);
            new (self) Pool{check(kv::make_pool_view(g, memory.data(), num_blocks)), nb::cast(memory)};
          },
          "geometry"_a, "memory"_a, "num_blocks"_a)
      .def_prop_ro("num_blocks", [](const Pool& p) { return p.view.num_blocks; });

  m.def(
      "scatter",
      [](Pool& pool, Tensor k, Tensor v, Tensor slots, std::int32_t first_layer, float k_scale, float v_scale) {
        const Rows rk = rows_of(k, "k", pool.view), rv = rows_of(v, "v", pool.view);
        if (rk.dtype != rv.dtype || rk.layers != rv.layers || rk.tokens != rv.tokens || rk.layer_stride != rv.layer_stride ||
            rk.token_stride != rv.token_stride || rk.head_stride != rv.head_stride)
          bad("v", "shaped, typed and strided as k");
        const auto* s = vec<const std::int32_t>(slots, "slots", rk.tokens);
        kv::ScatterParams p{pool.view, {k.data(), v.data(), rk.dtype, rk.layer_stride, rk.token_stride, rk.head_stride},
                            kv::TokenAddress{s}, rk.tokens, first_layer, std::int32_t(rk.layers), k_scale, v_scale};
        check(kv::scatter_host(p));
      },
      "pool"_a, "k"_a, "v"_a, "slots"_a, "first_layer"_a = 0, "k_scale"_a = 1.0f, "v_scale"_a = 1.0f);

  m.def(
      "gather",
      [](Pool& pool, std::int32_t layer, Tensor indptr, Tensor indices, Tensor out_indptr, Tensor k_out, Tensor v_out,
         float k_scale, float v_scale) {
        const Rows rk = rows_of(k_out, "k_out", pool.view), rv = rows_of(v_out, "v_out", pool.view);
        if (rk.dtype != rv.dtype || rk.tokens != rv.tokens || rk.token_stride != rv.token_stride ||
            rk.head_stride != rv.head_stride || k_out.ndim() != 3)
          bad("v_out", "[rows, heads, head_dim], typed and strided as k_out");
        const auto n = std::int64_t(out_indptr.size()) - 1;
        require(n >= 0, "out_indptr.size", std::int64_t(out_indptr.size()), 1);
        kv::GatherParams p{pool.view, layer, vec<const std::int32_t>(indptr, "indptr", n + 1),
                           vec<const std::int32_t>(indices, "indices", 0), vec<const std::int32_t>(out_indptr, "out_indptr", n + 1),
                           std::int32_t(n), rk.tokens, k_out.data(), v_out.data(), rk.dtype, rk.token_stride, rk.head_stride,
                           k_scale, v_scale};
        require(n == 0 || p.out_indptr[n] <= rk.tokens, "out_indptr[-1]", n ? p.out_indptr[n] : 0, rk.tokens);
        check(kv::gather_host(p));
      },
      "pool"_a, "layer"_a, "indptr"_a, "indices"_a, "out_indptr"_a, "k_out"_a, "v_out"_a, "k_scale"_a = 1.0f,
      "v_scale"_a = 1.0f);

  m.def(
      "block_copy",
      [](Pool& src, Pool& dst, Tensor pairs) {
        const auto n = std::int64_t(pairs.size()) / 2;
        const auto* p = vec<const std::int32_t>(pairs, "pairs", 2 * n);
        check(kv::block_copy_host({src.view, dst.view, reinterpret_cast<const kv::BlockCopy*>(p), std::int32_t(n)}));
      },
      "src"_a, "dst"_a, "pairs"_a);

  m.def(
      "compaction",
      [](Pool& pool, Tensor moves, std::int32_t first_layer, std::int32_t num_layers, std::int32_t first_head,
         std::int32_t num_heads) {
        const auto n = std::int64_t(moves.size()) / 2;
        const auto* mv = vec<const std::int32_t>(moves, "moves", 2 * n);
        if (num_layers < 0) num_layers = pool.view.num_layers - first_layer;
        check(kv::compaction_host({pool.view, reinterpret_cast<const kv::SlotMove*>(mv), std::int32_t(n), first_layer,
                                   num_layers, first_head, num_heads}));
      },
      "pool"_a, "moves"_a, "first_layer"_a = 0, "num_layers"_a = -1, "first_head"_a = 0, "num_heads"_a = 0);

  m.def(
      "rope",
      [](Pool& pool, Tensor blocks, Tensor deltas, Tensor cos, Tensor sin, std::int32_t max_delta, std::int32_t first_layer,
         std::int32_t num_layers, std::int32_t rotary_dim, const std::string& style) {
        const auto n = std::int64_t(blocks.size());
        if (num_layers < 0) num_layers = pool.view.num_layers - first_layer;
        if (style != "neox" && style != "gptj") bad("style", "\"neox\" or \"gptj\"");
        const std::int64_t half = (rotary_dim ? rotary_dim : pool.view.head_dim) / 2, table = (std::int64_t{max_delta} + 1) * half;
        check(kv::rope_host({pool.view, first_layer, num_layers, vec<const std::int32_t>(blocks, "blocks", n),
                             vec<const std::int32_t>(deltas, "deltas", n), std::int32_t(n), vec<const float>(cos, "cos", table),
                             vec<const float>(sin, "sin", table), max_delta, rotary_dim,
                             style == "neox" ? kv::RopeStyle::neox : kv::RopeStyle::gptj}));
      },
      "pool"_a, "blocks"_a, "deltas"_a, "cos"_a, "sin"_a, "max_delta"_a, "first_layer"_a = 0, "num_layers"_a = -1,
      "rotary_dim"_a = 0, "style"_a = "neox");

  m.def(
      "make_rope_table",
      [](double theta, std::int32_t rotary_dim, std::int32_t max_delta, Tensor cos, Tensor sin) {
        const std::int64_t n = (std::int64_t{max_delta} + 1) * (rotary_dim / 2);
        auto* c = vec<float>(cos, "cos", n);
        auto* s = vec<float>(sin, "sin", n);
        check(kv::make_rope_table(theta, rotary_dim, max_delta, {c, std::size_t(cos.size())}, {s, std::size_t(sin.size())}));
      },
      "theta"_a, "rotary_dim"_a, "max_delta"_a, "cos"_a, "sin"_a);

  m.def(
      "scores",
      [](Tensor attn, Tensor lengths, Tensor out, const std::string& reduce) {
        if (attn.ndim() != 4) bad("attn", "[streams, heads, queries, max_keys] float32");
        const auto s = std::int32_t(attn.shape(0)), h = std::int32_t(attn.shape(1)), q = std::int32_t(attn.shape(2)),
                   k = std::int32_t(attn.shape(3));
        if (reduce != "sum" && reduce != "mean_over_heads") bad("reduce", "\"sum\" or \"mean_over_heads\"");
        check(kv::scores_host({vec<const float>(attn, "attn", std::int64_t(s) * h * q * k),
                               vec<const std::int32_t>(lengths, "lengths", s), vec<float>(out, "out", std::int64_t(s) * k), s, h, q, k,
                               reduce == "sum" ? kv::ScoreReduce::sum : kv::ScoreReduce::mean_over_heads}));
      },
      "attn"_a, "lengths"_a, "out"_a, "reduce"_a = "sum");
}

}  // namespace kvpy
