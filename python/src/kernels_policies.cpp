// The admission and selection policies' kernels on DLPack tensors: Quest's
// page bounds and page selection, Write-Gated KV's gate, ring write and
// deferred ring admission. Same rules as kernels.cpp: CPU tensors run the
// host launchers, CUDA tensors the CUDA launchers on the caller's stream
// (page_select runs on the host: its row plan is host data).
#include <kvcache/kernels/page_bounds.hpp>
#include <kvcache/kernels/page_select.hpp>
#include <kvcache/kernels/ring_admit.hpp>
#include <kvcache/kernels/ring_write.hpp>
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
#include "kernel_def.hpp"
#include "launch.hpp"
#include "tensors.hpp"

namespace kvpy {
namespace {

using namespace nb::literals;

// Write-Gated KV's gate weights for one layer: float32 tensors on one device, kept alive here.
struct GateWeights {
  kv::WriteGateWeights w;
  Device device;
  nb::object keep[6];
};

// Quest's key bounds of every block: [num_blocks][kv_heads][max, min][head_dim] floats.
float* bounds_of(const Pool& pool, const Tensor& bounds) {
  return vec<float>(bounds, "bounds", pool.view.num_blocks * pool.view.num_kv_heads * 2 * pool.view.head_dim, pool.device);
}

void bind_quest(nb::module_& m) {
  def_kernel(
      m, "page_bounds",
      [](Pool& pool, std::int32_t layer, Tensor pages, Tensor fill, Tensor bounds, nb::handle stream) {
        const auto n = std::int64_t(pages.size());
        const kv::PageBoundsParams p{pool.view,
                                     layer,
                                     vec<const std::int32_t>(pages, "pages", n, pool.device),
                                     vec<const std::int32_t>(fill, "fill", n, pool.device),
                                     std::int32_t(n),
                                     bounds_of(pool, bounds)};
        launch("page_bounds", pool.device, stream, p, kv::page_bounds_host, KVPY_CUDA(page_bounds),
               kv::check_page_bounds_shape);
      },
      "pool"_a, "layer"_a, "pages"_a, "fill"_a, "bounds"_a, "stream"_a = nb::none());
  def_kernel(
      m, "page_bounds_update",
      [](Pool& pool, std::int32_t layer, Tensor slots, Tensor bounds, bool first_slot_starts_page, nb::handle stream) {
        const auto n = std::int64_t(slots.size());
        kv::PageBoundsUpdateParams p{pool.view, layer, vec<const std::int32_t>(slots, "slots", n, pool.device), n,
                                     bounds_of(pool, bounds)};
        p.first_slot_starts_page = first_slot_starts_page;
        launch("page_bounds_update", pool.device, stream, p, kv::page_bounds_update_host, KVPY_CUDA(page_bounds_update),
               kv::check_page_bounds_update_shape);
      },
      "pool"_a, "layer"_a, "slots"_a, "bounds"_a, "first_slot_starts_page"_a = true, "stream"_a = nb::none());
  def_kernel(
      m, "page_select",
      [](Tensor bounds, Tensor queries, Tensor indptr, Tensor indices, std::int32_t budget, std::int32_t first_pages,
         std::int32_t last_pages, nb::handle out_indptr, nb::handle out_indices, nb::handle scratch) {
        if (device_of(bounds, "bounds").cuda())
          bad("bounds", "a CPU tensor: page_select runs on the host here (its CUDA launcher takes a host-made row plan)");
        const Device cpu{};
        if (bounds.ndim() != 4 || bounds.shape(2) != 2) bad("bounds", "[num_blocks, kv_heads, 2, head_dim] float32");
        if (queries.ndim() != 4) bad("queries", "[num_seqs, kv_heads, group, head_dim] float32");
        const auto blocks = std::int64_t(bounds.shape(0));
        const auto heads = std::int32_t(bounds.shape(1)), dim = std::int32_t(bounds.shape(3));
        const auto seqs = std::int32_t(queries.shape(0)), group = std::int32_t(queries.shape(2));
        require(std::int32_t(queries.shape(1)) == heads, "queries.shape[1]", std::int64_t(queries.shape(1)), heads);
        require(std::int32_t(queries.shape(3)) == dim, "queries.shape[3]", std::int64_t(queries.shape(3)), dim);
        const auto* ip = vec<const std::int32_t>(indptr, "indptr", std::int64_t(seqs) + 1, cpu);
        check(kv::check_csr(ip, seqs));
        const std::int32_t pages = seqs ? ip[seqs] : 0;
        std::int32_t longest = 0;
        for (std::int32_t k = 0; k < seqs; ++k) longest = std::max(longest, ip[k + 1] - ip[k]);
        const std::size_t rows = std::size_t(seqs) * std::size_t(heads);
        nb::module_ np = nb::module_::import_("numpy");  // new outputs are numpy arrays
        nb::object oi = out_indptr.is_none() ? np.attr("zeros")(rows + 1, "int32") : nb::borrow(out_indptr);
        Tensor oit = nb::cast<Tensor>(oi);
        auto* op = vec<std::int32_t>(oit, "out_indptr", std::int64_t(rows) + 1, cpu);
        check(kv::page_select_indptr(ip, seqs, heads, budget, op, oit.size()));
        nb::object ox = out_indices.is_none() ? np.attr("zeros")(op[rows], "int32") : nb::borrow(out_indices);
        Tensor oxt = nb::cast<Tensor>(ox);
        auto* ox_data = vec<std::int32_t>(oxt, "out_indices", op[rows], cpu);
        const std::size_t need = kv::page_select_scratch_bytes(longest, heads);
        std::vector<std::byte> own;  // without a scratch tensor: one allocation here (pass one on a hot path)
        void* scratch_ptr = nullptr;
        std::size_t scratch_bytes = need;
        if (scratch.is_none()) {
          own.resize(need), scratch_ptr = own.data();
        } else {
          Tensor st = nb::cast<Tensor>(scratch);
          on(st, "scratch", cpu);
          scratch_ptr = st.data(), scratch_bytes = st.nbytes();  // too small: page_select_host names it
        }
        kv::PageSelectParams p{vec<const float>(bounds, "bounds", blocks * heads * 2 * dim, cpu), blocks, heads, dim,
                               vec<const float>(queries, "queries", std::int64_t(seqs) * heads * group * dim, cpu), group,
                               ip, vec<const std::int32_t>(indices, "indices", pages, cpu), seqs, pages, budget,
                               first_pages, last_pages, op, ox_data, scratch_ptr, scratch_bytes};
        check(kv::page_select_host(p));
        return std::make_tuple(oi, ox);
      },
      "bounds"_a, "queries"_a, "indptr"_a, "indices"_a, "budget"_a, "first_pages"_a = 1, "last_pages"_a = 1,
      "out_indptr"_a = nb::none(), "out_indices"_a = nb::none(), "scratch"_a = nb::none());
  m.def("page_select_scratch_bytes", &kv::page_select_scratch_bytes, "longest_row_pages"_a, "num_kv_heads"_a);
}

void bind_write_gate(nb::module_& m) {
  nb::class_<GateWeights>(m, "WriteGateWeights")
      .def(
          "__init__",
          [](GateWeights* self, Tensor norm_pre, Tensor norm_post, Tensor w1, Tensor b1, Tensor w2, Tensor b2,
             float norm_eps, float min_gate, const std::string& activation) {
            const Device d = device_of(w1, "w1");
            if (w1.ndim() != 3) bad("w1", "[kv_heads, 2 * head_dim, hidden] float32");
            const auto heads = std::int32_t(w1.shape(0)), dim = std::int32_t(w1.shape(1) / 2), hidden = std::int32_t(w1.shape(2));
            require(std::int64_t(w1.shape(1)) == 2 * std::int64_t(dim), "w1.shape[1]", std::int64_t(w1.shape(1)), 2 * dim);
            if (activation != "gelu" && activation != "silu") bad("activation", "\"gelu\" or \"silu\"");
            kv::WriteGateWeights w{vec<const float>(norm_pre, "norm_pre", dim, d), vec<const float>(norm_post, "norm_post", dim, d),
                                   vec<const float>(w1, "w1", std::int64_t(heads) * 2 * dim * hidden, d),
                                   vec<const float>(b1, "b1", std::int64_t(heads) * hidden, d),
                                   vec<const float>(w2, "w2", std::int64_t(heads) * hidden, d),
                                   vec<const float>(b2, "b2", heads, d),
                                   heads, dim, hidden, norm_eps, min_gate,
                                   activation == "gelu" ? kv::GateActivation::gelu : kv::GateActivation::silu};
            new (self) GateWeights{
                w, d, {nb::cast(norm_pre), nb::cast(norm_post), nb::cast(w1), nb::cast(b1), nb::cast(w2), nb::cast(b2)}};
          },
          "norm_pre"_a, "norm_post"_a, "w1"_a, "b1"_a, "w2"_a, "b2"_a, "norm_eps"_a = 1e-6f, "min_gate"_a = 1e-3f,
          "activation"_a = "gelu");
  def_kernel(
      m, "write_gate",
      [](GateWeights& w, Tensor k_pre, Tensor k_post, Tensor gates, nb::handle stream) {
        const Device d = w.device;
        on(k_pre, "k_pre", d), on(k_post, "k_post", d);
        if (k_pre.ndim() != 3 || k_post.ndim() != 3) bad("k_pre", "[tokens, kv_heads, head_dim] (k_post the same)");
        const auto tokens = std::int64_t(k_pre.shape(0));
        const std::int64_t item = k_pre.dtype().bits / 8;
        if (k_pre.dtype() != k_post.dtype() || k_post.shape(0) != k_pre.shape(0) || k_pre.stride(0) != k_post.stride(0) ||
            k_pre.stride(1) != k_post.stride(1))
          bad("k_post", "shaped, typed and strided as k_pre");
        require(std::int32_t(k_pre.shape(1)) == w.w.num_kv_heads, "k_pre.shape[1]", std::int64_t(k_pre.shape(1)), w.w.num_kv_heads);
        require(std::int32_t(k_pre.shape(2)) == w.w.head_dim, "k_pre.shape[2]", std::int64_t(k_pre.shape(2)), w.w.head_dim);
        if (w.w.head_dim > 1 && k_pre.stride(2) != 1) bad("k_pre", "contiguous in head_dim");
        const kv::WriteGateParams p{w.w, k_pre.data(), k_post.data(), dtype_of(k_pre, "k_pre"), k_pre.stride(0) * item,
                                    k_pre.stride(1) * item, tokens, vec<float>(gates, "gates", tokens * w.w.num_kv_heads, d)};
        launch("write_gate", d, stream, p, kv::write_gate_host, KVPY_CUDA(write_gate), kv::check_write_gate_shape);
      },
      "weights"_a, "k_pre"_a, "k_post"_a, "gates"_a, "stream"_a = nb::none());
  def_kernel(
      m, "ring_write",
      [](Pool& pool, Tensor k, Tensor v, Tensor ring_slots, nb::handle promote_slots, std::int32_t first_layer, float k_scale,
         float v_scale, nb::handle stream) {
        const Device d = pool.device;
        const auto [rk, src] = source_of(k, v, pool);
        const std::int32_t* promote = nullptr;
        if (!promote_slots.is_none()) promote = vec<const std::int32_t>(nb::cast<Tensor>(promote_slots), "promote_slots", rk.tokens, d);
        const kv::RingWriteParams p{pool.view,
                                    src,
                                    rk.tokens,
                                    first_layer,
                                    std::int32_t(rk.layers),
                                    vec<const std::int32_t>(ring_slots, "ring_slots", rk.tokens, d),
                                    promote,
                                    k_scale,
                                    v_scale};
        launch("ring_write", d, stream, p, kv::ring_write_host, KVPY_CUDA(ring_write), kv::check_ring_write_shape);
      },
      "pool"_a, "k"_a, "v"_a, "ring_slots"_a, "promote_slots"_a = nb::none(), "first_layer"_a = 0, "k_scale"_a = 1.0f,
      "v_scale"_a = 1.0f, "stream"_a = nb::none());
  def_kernel(
      m, "ring_admit",
      [](Pool& pool, Tensor k, Tensor v, Tensor gates, const kv::RingAdmitParams& policy, Tensor ring_start,
         Tensor ring_len, Tensor global_len, Tensor bits, Tensor rows, nb::handle stream) {
        // K/V of one layer, [tokens, kv_heads, head_dim] with the heads side by side: entry t * heads + h.
        const Device d = pool.device;
        on(k, "k", d), on(v, "v", d);
        if (k.ndim() != 3) bad("k", "[tokens, kv_heads, head_dim]");
        if (rows.ndim() != 2) bad("rows", "[kv_heads, row_stride] int32");
        const auto tokens = std::int32_t(k.shape(0)), heads = std::int32_t(k.shape(1));
        const std::int64_t item = k.dtype().bits / 8;
        require(std::int32_t(k.shape(2)) == pool.view.head_dim, "k.shape[2]", std::int64_t(k.shape(2)), pool.view.head_dim);
        if ((pool.view.head_dim > 1 && k.stride(2) != 1) || (tokens > 1 && k.stride(0) != heads * k.stride(1)))
          bad("k", "contiguous in head_dim, its kv-heads side by side");
        if (k.dtype() != v.dtype() || k.shape(0) != v.shape(0) || k.shape(1) != v.shape(1) || k.stride(0) != v.stride(0) ||
            k.stride(1) != v.stride(1))
          bad("v", "shaped, typed and strided as k");
        require(heads == policy.num_heads, "k.shape[1] (the policy's kv-heads)", heads, policy.num_heads);
        require(std::int32_t(rows.shape(0)) == heads, "rows.shape[0]", std::int64_t(rows.shape(0)), heads);
        const std::int32_t stride = std::int32_t(rows.shape(1));
        kv::RingAdmitParams p = policy;  // num_heads, window, global_limit, tau: the policy's
        p.cache = pool.view;
        p.src = {k.data(), v.data(), dtype_of(k, "k"), 0, k.stride(1) * item, 0};
        p.gates = vec<const float>(gates, "gates", std::int64_t(tokens) * heads, d);
        p.num_tokens = tokens;
        p.ring_start = vec<const std::int32_t>(ring_start, "ring_start", heads, d);
        p.ring_len = vec<const std::int32_t>(ring_len, "ring_len", heads, d);
        p.global_len = vec<std::int32_t>(global_len, "global_len", heads, d);
        p.bits = vec<std::uint8_t>(bits, "bits", std::int64_t(heads) * policy.window, d);
        p.rows = vec<const std::int32_t>(rows, "rows", std::int64_t(heads) * stride, d);
        p.row_stride = stride;
        launch("ring_admit", d, stream, p, kv::ring_admit_host, KVPY_CUDA(ring_admit), kv::check_ring_admit_shape);
      },
      "pool"_a, "k"_a, "v"_a, "gates"_a, "params"_a, "ring_start"_a, "ring_len"_a, "global_len"_a, "bits"_a, "rows"_a,
      "stream"_a = nb::none());
}

}  // namespace

void register_policy_kernels(nb::module_& m) {
  bind_quest(m);
  bind_write_gate(m);
}

}  // namespace kvpy
