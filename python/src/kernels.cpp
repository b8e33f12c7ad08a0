// The kernels on DLPack tensors (torch, numpy, anything with __dlpack__):
// a pool is the engine's memory viewed through a Geometry; K/V may be any
// strided slice whose rows are contiguous (a fused QKV tensor's K part).
// This build runs the host launchers on CPU tensors; a tensor on another
// device is an invalid_argument naming it. Nothing is allocated or
// synchronized on the way; shapes, dtypes and devices are checked first.
#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/gather.hpp>
#include <kvcache/kernels/page_bounds.hpp>
#include <kvcache/kernels/page_select.hpp>
#include <kvcache/kernels/ring_write.hpp>
#include <kvcache/kernels/rope.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kernels/scores.hpp>
#include <kvcache/kernels/write_gate.hpp>
#include <kvcache/kvcache.hpp>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <string>
#include <tuple>
#include <vector>

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

// Write-Gated KV's gate weights for one layer: float32 tensors, kept alive here.
struct GateWeights {
  kv::WriteGateWeights w;
  nb::object keep[6];
};

// V must be laid out as K (the kernels take one set of strides).
void same_rows(const Rows& k, const Rows& v) {
  if (k.dtype != v.dtype || k.layers != v.layers || k.tokens != v.tokens || k.layer_stride != v.layer_stride ||
      k.token_stride != v.token_stride || k.head_stride != v.head_stride)
    bad("v", "shaped, typed and strided as k");
}

// Quest's key bounds of every block: [num_blocks][kv_heads][max, min][head_dim] floats.
float* bounds_of(const Pool& pool, const Tensor& bounds) {
  return vec<float>(bounds, "bounds", pool.view.num_blocks * pool.view.num_kv_heads * 2 * pool.view.head_dim);
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
        same_rows(rk, rv);
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

  // Selection (Quest) and admission (Write-Gated KV) kernels.
  m.def(
      "page_bounds",
      [](Pool& pool, std::int32_t layer, Tensor pages, Tensor fill, Tensor bounds) {
        const auto n = std::int64_t(pages.size());
        check(kv::page_bounds_host({pool.view, layer, vec<const std::int32_t>(pages, "pages", n),
                                    vec<const std::int32_t>(fill, "fill", n), std::int32_t(n), bounds_of(pool, bounds)}));
      },
      "pool"_a, "layer"_a, "pages"_a, "fill"_a, "bounds"_a);
  m.def(
      "page_bounds_update",
      [](Pool& pool, std::int32_t layer, Tensor slots, Tensor bounds, bool first_slot_starts_page) {
        const auto n = std::int64_t(slots.size());
        kv::PageBoundsUpdateParams p{pool.view, layer, vec<const std::int32_t>(slots, "slots", n), n, bounds_of(pool, bounds)};
        p.first_slot_starts_page = first_slot_starts_page;
        check(kv::page_bounds_update_host(p));
      },
      "pool"_a, "layer"_a, "slots"_a, "bounds"_a, "first_slot_starts_page"_a = true);
  m.def(
      "page_select",
      [](Tensor bounds, Tensor queries, Tensor indptr, Tensor indices, std::int32_t budget, std::int32_t first_pages,
         std::int32_t last_pages, nb::handle out_indptr, nb::handle out_indices, nb::handle scratch) {
        if (bounds.ndim() != 4 || bounds.shape(2) != 2) bad("bounds", "[num_blocks, kv_heads, 2, head_dim] float32");
        if (queries.ndim() != 4) bad("queries", "[num_seqs, kv_heads, group, head_dim] float32");
        const auto blocks = std::int64_t(bounds.shape(0));
        const auto heads = std::int32_t(bounds.shape(1)), dim = std::int32_t(bounds.shape(3));
        const auto seqs = std::int32_t(queries.shape(0)), group = std::int32_t(queries.shape(2));
        require(std::int32_t(queries.shape(1)) == heads, "queries.shape[1]", std::int64_t(queries.shape(1)), heads);
        require(std::int32_t(queries.shape(3)) == dim, "queries.shape[3]", std::int64_t(queries.shape(3)), dim);
        const auto* ip = vec<const std::int32_t>(indptr, "indptr", std::int64_t(seqs) + 1);
        check(kv::check_csr(ip, seqs));
        const std::int32_t pages = seqs ? ip[seqs] : 0;
        std::int32_t longest = 0;
        for (std::int32_t k = 0; k < seqs; ++k) longest = std::max(longest, ip[k + 1] - ip[k]);
        const std::size_t rows = std::size_t(seqs) * std::size_t(heads);
        nb::module_ np = nb::module_::import_("numpy");  // new outputs are numpy arrays
        nb::object oi = out_indptr.is_none() ? np.attr("zeros")(rows + 1, "int32") : nb::borrow(out_indptr);
        Tensor oit = nb::cast<Tensor>(oi);
        auto* op = vec<std::int32_t>(oit, "out_indptr", std::int64_t(rows) + 1);
        check(kv::page_select_indptr(ip, seqs, heads, budget, op, oit.size()));
        nb::object ox = out_indices.is_none() ? np.attr("zeros")(op[rows], "int32") : nb::borrow(out_indices);
        Tensor oxt = nb::cast<Tensor>(ox);
        auto* ox_data = vec<std::int32_t>(oxt, "out_indices", op[rows]);
        const std::size_t need = kv::page_select_scratch_bytes(longest, heads);
        std::vector<std::byte> own;  // without a scratch tensor: one allocation here (pass one on a hot path)
        void* scratch_ptr = nullptr;
        std::size_t scratch_bytes = need;
        if (scratch.is_none()) {
          own.resize(need), scratch_ptr = own.data();
        } else {
          Tensor st = nb::cast<Tensor>(scratch);
          on_cpu(st, "scratch");
          scratch_ptr = st.data(), scratch_bytes = st.nbytes();  // too small: page_select_host names it
        }
        kv::PageSelectParams p{vec<const float>(bounds, "bounds", blocks * heads * 2 * dim), blocks, heads, dim,
                               vec<const float>(queries, "queries", std::int64_t(seqs) * heads * group * dim), group, ip,
                               vec<const std::int32_t>(indices, "indices", pages), seqs, pages, budget, first_pages, last_pages,
                               op, ox_data, scratch_ptr, scratch_bytes};
        check(kv::page_select_host(p));
        return std::make_tuple(oi, ox);
      },
      "bounds"_a, "queries"_a, "indptr"_a, "indices"_a, "budget"_a, "first_pages"_a = 1, "last_pages"_a = 1,
      "out_indptr"_a = nb::none(), "out_indices"_a = nb::none(), "scratch"_a = nb::none());
  m.def("page_select_scratch_bytes", &kv::page_select_scratch_bytes, "longest_row_pages"_a, "num_kv_heads"_a);

  nb::class_<GateWeights>(m, "WriteGateWeights")
      .def(
          "__init__",
          [](GateWeights* self, Tensor norm_pre, Tensor norm_post, Tensor w1, Tensor b1, Tensor w2, Tensor b2,
             float norm_eps, float min_gate, const std::string& activation) {
            if (w1.ndim() != 3) bad("w1", "[kv_heads, 2 * head_dim, hidden] float32");
            const auto heads = std::int32_t(w1.shape(0)), dim = std::int32_t(w1.shape(1) / 2), hidden = std::int32_t(w1.shape(2));
            require(std::int64_t(w1.shape(1)) == 2 * std::int64_t(dim), "w1.shape[1]", std::int64_t(w1.shape(1)), 2 * dim);
            if (activation != "gelu" && activation != "silu") bad("activation", "\"gelu\" or \"silu\"");
            kv::WriteGateWeights w{vec<const float>(norm_pre, "norm_pre", dim), vec<const float>(norm_post, "norm_post", dim),
                                   vec<const float>(w1, "w1", std::int64_t(heads) * 2 * dim * hidden),
                                   vec<const float>(b1, "b1", std::int64_t(heads) * hidden),
                                   vec<const float>(w2, "w2", std::int64_t(heads) * hidden), vec<const float>(b2, "b2", heads),
                                   heads, dim, hidden, norm_eps, min_gate,
                                   activation == "gelu" ? kv::GateActivation::gelu : kv::GateActivation::silu};
            new (self) GateWeights{w, {nb::cast(norm_pre), nb::cast(norm_post), nb::cast(w1), nb::cast(b1), nb::cast(w2), nb::cast(b2)}};
          },
          "norm_pre"_a, "norm_post"_a, "w1"_a, "b1"_a, "w2"_a, "b2"_a, "norm_eps"_a = 1e-6f, "min_gate"_a = 1e-3f,
          "activation"_a = "gelu");
  m.def(
      "write_gate",
      [](GateWeights& w, Tensor k_pre, Tensor k_post, Tensor gates) {
        on_cpu(k_pre, "k_pre"), on_cpu(k_post, "k_post");
        if (k_pre.ndim() != 3 || k_post.ndim() != 3) bad("k_pre", "[tokens, kv_heads, head_dim] (k_post the same)");
        const auto tokens = std::int64_t(k_pre.shape(0));
        const std::int64_t item = k_pre.dtype().bits / 8;
        if (k_pre.dtype() != k_post.dtype() || k_post.shape(0) != k_pre.shape(0) || k_pre.stride(0) != k_post.stride(0) ||
            k_pre.stride(1) != k_post.stride(1))
          bad("k_post", "shaped, typed and strided as k_pre");
        require(std::int32_t(k_pre.shape(1)) == w.w.num_kv_heads, "k_pre.shape[1]", std::int64_t(k_pre.shape(1)), w.w.num_kv_heads);
        require(std::int32_t(k_pre.shape(2)) == w.w.head_dim, "k_pre.shape[2]", std::int64_t(k_pre.shape(2)), w.w.head_dim);
        if (w.w.head_dim > 1 && k_pre.stride(2) != 1) bad("k_pre", "contiguous in head_dim");
        kv::WriteGateParams p{w.w, k_pre.data(), k_post.data(), dtype_of(k_pre, "k_pre"), k_pre.stride(0) * item,
                              k_pre.stride(1) * item, tokens, vec<float>(gates, "gates", tokens * w.w.num_kv_heads)};
        check(kv::write_gate_host(p));
      },
      "weights"_a, "k_pre"_a, "k_post"_a, "gates"_a);
  m.def(
      "ring_write",
      [](Pool& pool, Tensor k, Tensor v, Tensor ring_slots, nb::handle promote_slots, std::int32_t first_layer, float k_scale,
         float v_scale) {
        const Rows rk = rows_of(k, "k", pool.view), rv = rows_of(v, "v", pool.view);
        same_rows(rk, rv);
        const std::int32_t* promote = nullptr;
        if (!promote_slots.is_none()) promote = vec<const std::int32_t>(nb::cast<Tensor>(promote_slots), "promote_slots", rk.tokens);
        check(kv::ring_write_host({pool.view, {k.data(), v.data(), rk.dtype, rk.layer_stride, rk.token_stride, rk.head_stride},
                                   rk.tokens, first_layer, std::int32_t(rk.layers),
                                   vec<const std::int32_t>(ring_slots, "ring_slots", rk.tokens), promote, k_scale, v_scale}));
      },
      "pool"_a, "k"_a, "v"_a, "ring_slots"_a, "promote_slots"_a = nb::none(), "first_layer"_a = 0, "k_scale"_a = 1.0f,
      "v_scale"_a = 1.0f);

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
