// Write gate (Write-Gated KV admission): per (token, kv-head), a small MLP
// over [RMSNorm(pre-RoPE key); RMSNorm(post-RoPE key)] predicts whether the
// token's K/V will be worth keeping: g = max(sigmoid(MLP), min_gate).
//
// One body for both backends, bit-identical: every product and sum is a
// separately rounded IEEE operation in one fixed order (round_mul/round_add
// stop nvcc from fusing them into fma and g++ from contracting them), and
// exp/erf are written here from those operations instead of calling libm or
// CUDA's versions, which differ. Keeping the products unfused also lets the
// host compiler vectorize the first layer across hidden units without -mfma.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvcache/kernels/detail/common.hpp"

// Host compilers must not fuse a product into the next sum (g++ does by
// default wherever FMA instructions are enabled, e.g. -march=native): the
// functions below compile with contraction off, so both backends round alike.
// (nvcc's own host pass takes no pragma; it enables no FMA by default. Clang's
// -ffp-contract=fast ignores the pragma: use fast-honor-pragmas.)
#if !defined(__CUDACC__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#define KVCACHE_GATE_NO_CONTRACT
#elif !defined(__CUDACC__) && defined(__clang__)
#define KVCACHE_GATE_NO_CONTRACT _Pragma("clang fp contract(off)")
#else
#define KVCACHE_GATE_NO_CONTRACT
#endif

KVCACHE_BEGIN_NAMESPACE

/// The MLP's activation: exact GELU (the paper's default) or SiLU.
enum class GateActivation : std::uint8_t { gelu, silu };

/// One layer's gate weights, fp32, caller-owned (host or device memory to
/// match the backend). w1 is input-major so a host loop runs along hidden units.
struct WriteGateWeights {
  const float* norm_pre = nullptr;   ///< [head_dim] RMSNorm weight of the pre-RoPE key (shared by the layer's kv-heads).
  const float* norm_post = nullptr;  ///< [head_dim] RMSNorm weight of the post-RoPE key.
  const float* w1 = nullptr;         ///< [kv_heads][2 * head_dim][hidden]: input i (pre dims, then post) to hidden j.
  const float* b1 = nullptr;         ///< [kv_heads][hidden]
  const float* w2 = nullptr;         ///< [kv_heads][hidden]
  const float* b2 = nullptr;         ///< [kv_heads]
  std::int32_t num_kv_heads = 0;     ///< Kv-heads of the layer (one MLP each).
  std::int32_t head_dim = 0;         ///< Elements per key.
  std::int32_t hidden = 0;           ///< Hidden units per MLP (the paper: 4 * head_dim).
  float norm_eps = 1e-6f;            ///< RMSNorm epsilon.
  float min_gate = 1e-3f;            ///< Gates are clamped to at least this (log g stays finite in training).
  GateActivation activation = GateActivation::gelu;  ///< Hidden activation.
};
static_assert(std::is_trivially_copyable_v<WriteGateWeights>);

/// Parameters of write_gate: keys of num_tokens tokens in, one gate per (token, kv-head) out.
struct WriteGateParams {
  WriteGateWeights w{};               ///< The layer's gate weights.
  const void* k_pre = nullptr;        ///< Pre-RoPE key of token 0, head 0.
  const void* k_post = nullptr;       ///< Post-RoPE key of token 0, head 0 (same strides).
  DType dtype = DType::f16;           ///< Key element type.
  std::int64_t token_stride = 0;      ///< Bytes between tokens.
  std::int64_t head_stride = 0;       ///< Bytes between kv-heads.
  std::int64_t num_tokens = 0;        ///< Tokens gated.
  float* gates = nullptr;             ///< Output: [num_tokens][num_kv_heads], in [min_gate, 1].
};
static_assert(std::is_trivially_copyable_v<WriteGateParams>);

namespace gate_math {
/// a * b rounded once, never fused with a following add.
KVCACHE_HOST_DEVICE inline float round_mul(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  KVCACHE_GATE_NO_CONTRACT
  return a * b;
#endif
}
/// a + b rounded once.
KVCACHE_HOST_DEVICE inline float round_add(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  KVCACHE_GATE_NO_CONTRACT
  return a + b;
#endif
}
/// a / b, IEEE (also under nvcc -prec-div=false).
KVCACHE_HOST_DEVICE inline float round_div(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
/// sqrt(a), IEEE (also under nvcc -prec-sqrt=false).
KVCACHE_HOST_DEVICE inline float round_sqrt(float a) noexcept {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return __builtin_sqrtf(a);
#endif
}

/// e^x for x in float range (relative error a few ulp): x = k ln2 + r with
/// |r| <= ln2 / 2, a degree-6 Taylor polynomial for e^r, then 2^k from bits.
KVCACHE_HOST_DEVICE inline float exp(float x) noexcept {
  if (!(x > -87.0f)) return x != x ? x : 0.0f;  // NaN stays NaN; below 2^-125 is 0 for a gate
  if (x > 88.0f) return cvt::from_bits(0x7f800000u);
  // Round x / ln2 to the nearest integer with the 1.5 * 2^23 shifter (exact for |v| < 2^22).
  const float shifter = 12582912.0f;
  const float k = round_add(round_add(round_mul(x, 1.44269502f), shifter), -shifter);
  const float r = round_add(round_add(x, round_mul(k, -0.693145752f)), round_mul(k, -1.42860677e-06f));  // ln2 hi + lo
  float p = 1.0f / 720.0f;
  p = round_add(round_mul(p, r), 1.0f / 120.0f);
  p = round_add(round_mul(p, r), 1.0f / 24.0f);
  p = round_add(round_mul(p, r), 1.0f / 6.0f);
  p = round_add(round_mul(p, r), 0.5f);
  p = round_add(round_mul(p, r), 1.0f);
  p = round_add(round_mul(p, r), 1.0f);
  const auto e = static_cast<std::int32_t>(k);  // in [-126, 127]
  return round_mul(p, cvt::from_bits(static_cast<std::uint32_t>(e + 127) << 23));
}

/// erf(x), absolute error below 2e-7 (Abramowitz and Stegun 7.1.26).
KVCACHE_HOST_DEVICE inline float erf(float x) noexcept {
  const float a = x < 0.0f ? -x : x;
  const float t = round_div(1.0f, round_add(1.0f, round_mul(0.3275911f, a)));
  float p = 1.061405429f;
  p = round_add(round_mul(p, t), -1.453152027f);
  p = round_add(round_mul(p, t), 1.421413741f);
  p = round_add(round_mul(p, t), -0.284496736f);
  p = round_add(round_mul(p, t), 0.254829592f);
  p = round_mul(p, t);
  const float y = round_add(1.0f, -round_mul(p, exp(-round_mul(a, a))));
  return x < 0.0f ? -y : y;
}

/// The hidden activation.
KVCACHE_HOST_DEVICE inline float activate(float h, GateActivation act) noexcept {
  if (act == GateActivation::silu) return round_div(h, round_add(1.0f, exp(-h)));
  return round_mul(round_mul(0.5f, h), round_add(1.0f, erf(round_mul(h, 0.707106781f))));
}

/// sigmoid(y) clamped to [min_gate, 1].
KVCACHE_HOST_DEVICE inline float gate_of(float y, float min_gate) noexcept {
  const float g = round_div(1.0f, round_add(1.0f, exp(-y)));
  return g < min_gate ? min_gate : g;
}

/// Strided partial sums: the second layer's dot product is summed as 32
/// interleaved partials (lane l takes hidden units l, l + 32, ...) added in
/// lane order. The CUDA kernel gives each lane of a warp one partial.
inline constexpr std::int32_t kPartials = 32;
}  // namespace gate_math

/// RMSNorm of one key into z[0..head_dim): sum of squares in index order.
KVCACHE_HOST_DEVICE inline void gate_norm(const void* key, DType t, const float* weight, std::int32_t hd, float eps,
                                          float* z) noexcept {
  using namespace gate_math;
  float ss = 0.0f;
  for (std::int32_t i = 0; i < hd; ++i) {
    const float v = load_elem(t, key, i);
    ss = round_add(ss, round_mul(v, v));
  }
  const float inv = round_div(1.0f, round_sqrt(round_add(round_div(ss, static_cast<float>(hd)), eps)));
  for (std::int32_t i = 0; i < hd; ++i) z[i] = round_mul(round_mul(load_elem(t, key, i), inv), weight[i]);
}

/// Hidden unit j of head h before its activation: b1 + sum over inputs in index order.
KVCACHE_HOST_DEVICE inline float gate_hidden(const WriteGateWeights& w, std::int32_t h, std::int32_t j,
                                             const float* z) noexcept {
  using namespace gate_math;
  const std::int32_t in = 2 * w.head_dim;
  const float* col = w.w1 + std::int64_t{h} * in * w.hidden + j;
  float acc = w.b1[std::int64_t{h} * w.hidden + j];
  for (std::int32_t i = 0; i < in; ++i) acc = round_add(acc, round_mul(col[std::int64_t{i} * w.hidden], z[i]));
  return acc;
}

/// Partial l of head h's output: sum of w2[j] * a[j] over j = l, l + 32, ... (a: activations).
KVCACHE_HOST_DEVICE inline float gate_partial(const WriteGateWeights& w, std::int32_t h, std::int32_t l,
                                              const float* a) noexcept {
  using namespace gate_math;
  const float* w2 = w.w2 + std::int64_t{h} * w.hidden;
  float acc = 0.0f;
  for (std::int32_t j = l; j < w.hidden; j += kPartials) acc = round_add(acc, round_mul(w2[j], a[j]));
  return acc;
}

/// The gate from the partials: b2 + partials in lane order, sigmoid, clamp.
KVCACHE_HOST_DEVICE inline float gate_finish(const WriteGateWeights& w, std::int32_t h, const float* partials) noexcept {
  using namespace gate_math;
  float y = w.b2[h];
  for (std::int32_t l = 0; l < kPartials; ++l) y = round_add(y, partials[l]);
  return gate_of(y, w.min_gate);
}

/// Key row of (token, head) in the pre- or post-RoPE tensor.
KVCACHE_HOST_DEVICE inline const void* gate_key(const WriteGateParams& p, const void* base, std::int64_t token,
                                                std::int32_t head) noexcept {
  return static_cast<const std::byte*>(base) + token * p.token_stride + head * p.head_stride;
}

/// What the host can see: shapes, pointers, dtype, the clamp and epsilon.
inline Status check_write_gate_shape(const WriteGateParams& p) noexcept {
  const auto& w = p.w;
  if (w.num_kv_heads < 1) return Status{Errc::invalid_argument, "num_kv_heads", w.num_kv_heads, 1};
  if (w.head_dim < 1 || w.head_dim > 4096) return Status{Errc::invalid_argument, "head_dim", w.head_dim, 4096};
  if (w.hidden < 1 || w.hidden > 16384) return Status{Errc::invalid_argument, "hidden", w.hidden, 16384};
  if (!(w.min_gate >= 0.0f && w.min_gate <= 1.0f)) return Status{Errc::invalid_argument, "min_gate", 0, 1};
  if (!(w.norm_eps > 0.0f && w.norm_eps < 1.0f)) return Status{Errc::invalid_argument, "norm_eps", 0, 1};
  if (w.activation != GateActivation::gelu && w.activation != GateActivation::silu)
    return Status{Errc::invalid_argument, "activation", std::int64_t(w.activation), 1};
  if (dtype_bytes(p.dtype) == 0) return Status{Errc::invalid_argument, "dtype", std::int64_t(p.dtype), 0};
  if (p.num_tokens < 0) return Status{Errc::invalid_argument, "num_tokens", p.num_tokens, 0};
  if (p.num_tokens > 0 && (!p.k_pre || !p.k_post || !p.gates || !w.norm_pre || !w.norm_post || !w.w1 || !w.b1 ||
                           !w.w2 || !w.b2))
    return Status{Errc::invalid_argument, "pointers", 0, 1};
  return {};
}

/// Host backend: validates the shape, then gates every (token, head). The
/// first layer runs along hidden units (vectorizable; each unit's sum keeps
/// the input order gate_hidden uses).
inline Status write_gate_host(const WriteGateParams& p) noexcept {
  using namespace gate_math;
  if (auto st = check_write_gate_shape(p); !st) return st;
  const auto& w = p.w;
  const std::int32_t hd = w.head_dim, in = 2 * hd, hid = w.hidden;
  constexpr std::int32_t kMaxIn = 2 * 4096, kMaxHidden = 16384;
  static thread_local float z[kMaxIn], a[kMaxHidden];
  float partials[kPartials];
  for (std::int64_t t = 0; t < p.num_tokens; ++t)
    for (std::int32_t h = 0; h < w.num_kv_heads; ++h) {
      gate_norm(gate_key(p, p.k_pre, t, h), p.dtype, w.norm_pre, hd, w.norm_eps, z);
      gate_norm(gate_key(p, p.k_post, t, h), p.dtype, w.norm_post, hd, w.norm_eps, z + hd);
      const float* b1 = w.b1 + std::int64_t{h} * hid;
      for (std::int32_t j = 0; j < hid; ++j) a[j] = b1[j];
      const float* w1 = w.w1 + std::int64_t{h} * in * hid;
      for (std::int32_t i = 0; i < in; ++i) {
        const float zi = z[i];
        const float* row = w1 + std::int64_t{i} * hid;
        for (std::int32_t j = 0; j < hid; ++j) a[j] = round_add(a[j], round_mul(row[j], zi));
      }
      for (std::int32_t j = 0; j < hid; ++j) a[j] = activate(a[j], w.activation);
      for (std::int32_t l = 0; l < kPartials; ++l) partials[l] = gate_partial(w, h, l, a);
      p.gates[t * w.num_kv_heads + h] = gate_finish(w, h, partials);
    }
  return {};
}

KVCACHE_END_NAMESPACE

#if !defined(__CUDACC__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
#undef KVCACHE_GATE_NO_CONTRACT
