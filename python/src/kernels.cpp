// The data-movement kernels on DLPack tensors (torch, numpy, anything with
// __dlpack__): a pool is the engine's memory viewed through a Geometry; K/V
// may be any strided slice whose rows are contiguous (a fused QKV tensor's K
// part). CPU tensors run the host launchers; CUDA tensors (a build with the
// toolkit) run the CUDA launchers on the caller's stream (launch.hpp).
// Nothing is allocated or synchronized on the way; shapes, dtypes and
// devices are checked first.
#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/gather.hpp>
#include <kvcache/kernels/rope.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kernels/scores.hpp>
#include <kvcache/kernels/seal.hpp>
#include <kvcache/kvcache.hpp>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <string>

#include "errors.hpp"
#include "kernel_def.hpp"
#include "launch.hpp"
#include "tensors.hpp"

namespace kvpy {

using namespace nb::literals;

void register_policy_kernels(nb::module_& m);  // kernels_policies.cpp

void register_kernels(nb::module_& m) {
  m.attr("has_cuda") = kHasCuda;  // whether this build has the CUDA launchers
  nb::class_<Pool>(m, "PoolView")
      .def(
          "__init__",
          [](Pool* self, const kv::Geometry& g, Tensor memory, std::int64_t num_blocks) {
            const Device d = device_of(memory, "memory");
            const auto bytes = check(g.pool_bytes(num_blocks));
            require(std::int64_t(memory.nbytes()) >= bytes, "memory.nbytes", std::int64_t(memory.nbytes()), bytes);
            new (self) Pool{check(kv::make_pool_view(g, memory.data(), num_blocks)), d, nb::cast(memory), g};
          },
          "geometry"_a, "memory"_a, "num_blocks"_a)
      .def_prop_ro("num_blocks", [](const Pool& p) { return p.view.num_blocks; })
      .def_prop_ro("geometry", [](const Pool& p) -> nb::object {  // None for a hybrid group's view
        return p.geometry.block_bytes() ? nb::cast(p.geometry) : nb::none();
      })
      .def_prop_ro("kv_planes", [](const Pool& p) { return p.view.kv_planes; })
      .def_prop_ro("memory", [](const Pool& p) { return p.memory; })
      .def_prop_ro("is_cuda", [](const Pool& p) { return p.device.cuda(); });

  // Engine-held scales (k_scales / v_scales): float32 on the pool's device,
  // one per layer (Scales::tensor) or per (layer, kv-head) (Scales::head); None: 1.
  const auto held = [](nb::handle h, const Pool& pool, std::int32_t kv, const char* name) -> const float* {
    if (h.is_none()) return nullptr;
    const kv::SideFormat& f = kv == 0 ? pool.view.format.k : pool.view.format.v;
    const std::int64_t n = std::int64_t{pool.view.num_layers} * (f.scales == kv::Scales::head ? pool.view.num_kv_heads : 1);
    return vec<const float>(nb::cast<Tensor>(h), name, n, pool.device);
  };
  def_kernel(
      m, "scatter",
      [held](Pool& pool, Tensor k, Tensor v, Tensor slots, std::int32_t first_layer, float k_scale, float v_scale,
             nb::handle k_scales, nb::handle v_scales, nb::handle stream) {
        const auto [rk, src] = source_of(k, v, pool);
        const auto* s = vec<const std::int32_t>(slots, "slots", rk.tokens, pool.device);
        kv::ScatterParams p{pool.view, src, kv::TokenAddress{s}, rk.tokens, first_layer, std::int32_t(rk.layers), k_scale, v_scale,
                            held(k_scales, pool, 0, "k_scales"), held(v_scales, pool, 1, "v_scales")};
        launch("scatter", pool.device, stream, p, kv::scatter_host, KVPY_CUDA(scatter), kv::check_scatter_shape);
      },
      "pool"_a, "k"_a, "v"_a, "slots"_a, "first_layer"_a = 0, "k_scale"_a = 1.0f, "v_scale"_a = 1.0f,
      "k_scales"_a = nb::none(), "v_scales"_a = nb::none(), "stream"_a = nb::none());

  def_kernel(
      m, "gather",
      [held](Pool& pool, std::int32_t layer, Tensor indptr, Tensor indices, Tensor out_indptr, Tensor k_out, Tensor v_out,
             float k_scale, float v_scale, nb::handle k_scales, nb::handle v_scales, nb::handle stream) {
        const Device d = pool.device;
        const Rows rk = rows_of(k_out, "k_out", pool), rv = rows_of(v_out, "v_out", pool);
        if (rk.dtype != rv.dtype || rk.tokens != rv.tokens || rk.token_stride != rv.token_stride ||
            rk.head_stride != rv.head_stride || k_out.ndim() != 3)
          bad("v_out", "[rows, heads, head_dim], typed and strided as k_out");
        const auto n = std::int64_t(out_indptr.size()) - 1;
        require(n >= 0, "out_indptr.size", std::int64_t(out_indptr.size()), 1);
        kv::GatherParams p{pool.view, layer, vec<const std::int32_t>(indptr, "indptr", n + 1, d),
                           vec<const std::int32_t>(indices, "indices", 0, d),
                           vec<const std::int32_t>(out_indptr, "out_indptr", n + 1, d), std::int32_t(n), rk.tokens,
                           k_out.data(), v_out.data(), rk.dtype, rk.token_stride, rk.head_stride, k_scale, v_scale,
                           held(k_scales, pool, 0, "k_scales"), held(v_scales, pool, 1, "v_scales")};
        // The rows fit the outputs (host memory only: a device's offsets are the caller's to keep).
        if (!d.cuda()) require(n == 0 || p.out_indptr[n] <= rk.tokens, "out_indptr[-1]", n ? p.out_indptr[n] : 0, rk.tokens);
        launch("gather", d, stream, p, kv::gather_host, KVPY_CUDA(gather), kv::check_gather_shape);
      },
      "pool"_a, "layer"_a, "indptr"_a, "indices"_a, "out_indptr"_a, "k_out"_a, "v_out"_a, "k_scale"_a = 1.0f,
      "v_scale"_a = 1.0f, "k_scales"_a = nb::none(), "v_scales"_a = nb::none(), "stream"_a = nb::none());

  // Whole blocks from their tokens' K/V: len(blocks) * block_size rows,
  // block i's tokens at rows [i * block_size, (i + 1) * block_size).
  def_kernel(
      m, "seal_blocks",
      [held](Pool& pool, Tensor k, Tensor v, Tensor blocks, std::int32_t first_layer, float k_scale, float v_scale,
             nb::handle k_scales, nb::handle v_scales, nb::handle stream) {
        const auto [rk, src] = source_of(k, v, pool);
        const auto n = std::int64_t(blocks.size());
        require(rk.tokens == n * pool.view.block_size, "k.tokens (len(blocks) x block_size)", rk.tokens, n * pool.view.block_size);
        const auto* b = vec<const std::int32_t>(blocks, "blocks", n, pool.device);
        kv::SealParams p{pool.view, src, b, std::int32_t(n), first_layer, std::int32_t(rk.layers), k_scale, v_scale,
                         held(k_scales, pool, 0, "k_scales"), held(v_scales, pool, 1, "v_scales")};
        launch("seal_blocks", pool.device, stream, p, kv::seal_blocks_host, KVPY_CUDA(seal_blocks), kv::check_seal_shape);
      },
      "pool"_a, "k"_a, "v"_a, "blocks"_a, "first_layer"_a = 0, "k_scale"_a = 1.0f, "v_scale"_a = 1.0f,
      "k_scales"_a = nb::none(), "v_scales"_a = nb::none(), "stream"_a = nb::none());

  def_kernel(
      m, "block_copy",
      [](Pool& src, Pool& dst, Tensor pairs, std::int32_t first_layer, std::int32_t layers, nb::handle stream) {
        if (src.device != dst.device) bad("dst", "on the device of src");
        const auto n = std::int64_t(pairs.size()) / 2;
        const auto* p = vec<const std::int32_t>(pairs, "pairs", 2 * n, src.device);
        const kv::BlockCopyParams params{src.view, dst.view, reinterpret_cast<const kv::BlockCopy*>(p), std::int32_t(n),
                                         first_layer, layers};
        launch("block_copy", src.device, stream, params, kv::block_copy_host, KVPY_CUDA(block_copy),
               kv::check_block_copy_shape);
      },
      "src"_a, "dst"_a, "pairs"_a, "first_layer"_a = 0, "layers"_a = 0, "stream"_a = nb::none());

  def_kernel(
      m, "compaction",
      [](Pool& pool, Tensor moves, std::int32_t first_layer, std::int32_t num_layers, std::int32_t first_head,
         std::int32_t num_heads, nb::handle stream) {
        const auto n = std::int64_t(moves.size()) / 2;
        const auto* mv = vec<const std::int32_t>(moves, "moves", 2 * n, pool.device);
        if (num_layers < 0) num_layers = pool.view.num_layers - first_layer;
        const kv::CompactionParams p{pool.view,   reinterpret_cast<const kv::SlotMove*>(mv), std::int32_t(n), first_layer,
                                     num_layers, first_head, num_heads};
        launch("compaction", pool.device, stream, p, kv::compaction_host, KVPY_CUDA(compaction), kv::check_compaction_shape);
      },
      "pool"_a, "moves"_a, "first_layer"_a = 0, "num_layers"_a = -1, "first_head"_a = 0, "num_heads"_a = 0,
      "stream"_a = nb::none());

  def_kernel(
      m, "rope",
      [](Pool& pool, Tensor blocks, Tensor deltas, Tensor cos, Tensor sin, std::int32_t max_delta, std::int32_t first_layer,
         std::int32_t num_layers, std::int32_t rotary_dim, const std::string& style, nb::handle stream) {
        const Device d = pool.device;
        const auto n = std::int64_t(blocks.size());
        if (num_layers < 0) num_layers = pool.view.num_layers - first_layer;
        if (style != "neox" && style != "gptj") bad("style", "\"neox\" or \"gptj\"");
        const std::int64_t half = (rotary_dim ? rotary_dim : pool.view.head_dim) / 2, table = (std::int64_t{max_delta} + 1) * half;
        const kv::RopeParams p{pool.view, first_layer, num_layers, vec<const std::int32_t>(blocks, "blocks", n, d),
                               vec<const std::int32_t>(deltas, "deltas", n, d), std::int32_t(n),
                               vec<const float>(cos, "cos", table, d), vec<const float>(sin, "sin", table, d), max_delta,
                               rotary_dim, style == "neox" ? kv::RopeStyle::neox : kv::RopeStyle::gptj};
        launch("rope", d, stream, p, kv::rope_host, KVPY_CUDA(rope), kv::check_rope_shape);
      },
      "pool"_a, "blocks"_a, "deltas"_a, "cos"_a, "sin"_a, "max_delta"_a, "first_layer"_a = 0, "num_layers"_a = -1,
      "rotary_dim"_a = 0, "style"_a = "neox", "stream"_a = nb::none());

  def_kernel(
      m, "make_rope_table",  // computed on the host: copy the tables to the device once
      [](double theta, std::int32_t rotary_dim, std::int32_t max_delta, Tensor cos, Tensor sin) {
        const std::int64_t n = (std::int64_t{max_delta} + 1) * (rotary_dim / 2);
        auto* c = vec<float>(cos, "cos", n, Device{});
        auto* s = vec<float>(sin, "sin", n, Device{});
        check(kv::make_rope_table(theta, rotary_dim, max_delta, {c, std::size_t(cos.size())}, {s, std::size_t(sin.size())}));
      },
      "theta"_a, "rotary_dim"_a, "max_delta"_a, "cos"_a, "sin"_a);

  def_kernel(
      m, "scores",
      [](Tensor attn, Tensor lengths, Tensor out, const std::string& reduce, nb::handle stream) {
        const Device d = device_of(attn, "attn");
        if (attn.ndim() != 4) bad("attn", "[streams, heads, queries, max_keys] float32");
        const auto s = std::int32_t(attn.shape(0)), h = std::int32_t(attn.shape(1)), q = std::int32_t(attn.shape(2)),
                   k = std::int32_t(attn.shape(3));
        if (reduce != "sum" && reduce != "mean_over_heads") bad("reduce", "\"sum\" or \"mean_over_heads\"");
        const kv::ScoreParams p{vec<const float>(attn, "attn", std::int64_t(s) * h * q * k, d),
                                vec<const std::int32_t>(lengths, "lengths", s, d),
                                vec<float>(out, "out", std::int64_t(s) * k, d), s, h, q, k,
                                reduce == "sum" ? kv::ScoreReduce::sum : kv::ScoreReduce::mean_over_heads};
        launch("scores", d, stream, p, kv::scores_host, KVPY_CUDA(scores), kv::check_score_shape);
      },
      "attn"_a, "lengths"_a, "out"_a, "reduce"_a = "sum", "stream"_a = nb::none());

  register_policy_kernels(m);
}

}  // namespace kvpy
