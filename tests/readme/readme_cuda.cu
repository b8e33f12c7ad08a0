// The README's GPU snippets compiled by nvcc against the real launchers, in
// the fixtures test_readme runs them in on the host: a launcher's signature
// or a parameter struct that drifts from the README fails the build.
#include <kvcache/kernels/block_copy.cuh>
#include <kvcache/kernels/compaction.cuh>
#include <kvcache/kernels/page_bounds.cuh>
#include <kvcache/kernels/page_select.cuh>
#include <kvcache/kernels/ring_admit.cuh>
#include <kvcache/kernels/rope.cuh>
#include <kvcache/kernels/scatter.cuh>
#include <kvcache/kernels/write_gate.cuh>

#include "readme/engine.hpp"

namespace readme {
struct GpuSnippets : PolicyEngine {
  void block_scores();
  void h2o();
  void tova();
  void average_attention();
};
struct GpuGate : GateEngine {
  void deferred();
};
struct GpuKernels : KernelEngine {
  void kernels();
  void write_gate();
  void page_select();
};

void GpuSnippets::block_scores() {
#include "snippets/block_scores.inc"
}
void GpuSnippets::h2o() {
#include "snippets/h2o.inc"
}
void GpuSnippets::tova() {
#include "snippets/tova.inc"
}
void GpuSnippets::average_attention() {
#include "snippets/average_attention.inc"
}
void GpuKernels::kernels() {
#include "snippets/pool_view.inc"
#include "snippets/kernels.inc"
}
void GpuGate::deferred() {
#include "snippets/write_gate_deferred.inc"
}
void GpuKernels::write_gate() {
#include "snippets/write_gate.inc"
}
void GpuKernels::page_select() {
#include "snippets/pool_view.inc"
#include "snippets/page_select.inc"
}
}  // namespace readme
