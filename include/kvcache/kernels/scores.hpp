// Scores: attention weights -> per-token scores, and the k lowest / highest
// tokens per stream. Sums run in one fixed order (head, then query), so host
// and CUDA agree bit for bit; ranking breaks ties toward the lower position,
// and orders floats as the radix sort does (-0 < +0).
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <span>
#include <type_traits>
#include <vector>

#include "kvcache/kernels/detail/common.hpp"

KVCACHE_BEGIN_NAMESPACE

/// How scores reduce over heads: sum (with the queries), or mean over heads.
enum class ScoreReduce : std::uint8_t { sum, mean_over_heads };

/// attn: [num_streams][num_heads][num_queries][max_keys] float; scores:
/// [num_streams][max_keys]; key k of stream s counts if k < lengths[s].
struct ScoreParams {
  const float* attn = nullptr;  ///< Attention probabilities [stream][head][query][key].
  const std::int32_t* lengths = nullptr;  ///< Keys per stream.
  float* scores = nullptr;  ///< Output: [stream][key] scores.
  std::int32_t num_streams = 0;  ///< Streams.
  std::int32_t num_heads = 1;  ///< Heads per stream.
  std::int32_t num_queries = 1;  ///< Queries per stream.
  std::int32_t max_keys = 0;  ///< Key stride of attn and scores.
  ScoreReduce reduce = ScoreReduce::sum;  ///< sum over heads and queries, or mean over heads.
};
static_assert(std::is_trivially_copyable_v<ScoreParams>);

/// Score of key k of stream s (shared by both backends).
KVCACHE_HOST_DEVICE inline void score_elem(const ScoreParams& p, std::int32_t s, std::int32_t k) noexcept {
  if (k >= p.lengths[s]) return;
  const std::int64_t per_head = std::int64_t{p.num_queries} * p.max_keys;
  const float* a = p.attn + std::int64_t{s} * p.num_heads * per_head + k;
  float acc = 0.0f;
  for (std::int32_t h = 0; h < p.num_heads; ++h)
    for (std::int32_t q = 0; q < p.num_queries; ++q) acc += a[h * per_head + std::int64_t{q} * p.max_keys];
  p.scores[std::int64_t{s} * p.max_keys + k] = p.reduce == ScoreReduce::sum ? acc : acc / float(p.num_heads);
}

/// Checks the parameters' shape (counts, pointers).
inline Status check_score_shape(const ScoreParams& p) noexcept {
  if (p.num_streams < 0 || p.num_heads < 1 || p.num_queries < 1 || p.max_keys < 0)
    return Status{Errc::invalid_argument, "shape", p.num_streams, 0};
  if (p.num_streams > 0 && p.max_keys > 0 && (!p.attn || !p.lengths || !p.scores))
    return Status{Errc::invalid_argument, "pointers", 0, 1};
  if (p.reduce != ScoreReduce::sum && p.reduce != ScoreReduce::mean_over_heads)
    return Status{Errc::invalid_argument, "reduce", static_cast<std::int64_t>(p.reduce), 1};
  return {};
}

/// Host backend: validates the shape, then writes every stream's scores.
inline Status scores_host(const ScoreParams& p) noexcept {
  if (auto st = check_score_shape(p); !st) return st;
  for (std::int32_t s = 0; s < p.num_streams; ++s)
    if (p.lengths[s] < 0 || p.lengths[s] > p.max_keys) return Status{Errc::invalid_argument, "lengths", s, p.max_keys};
  for (std::int32_t s = 0; s < p.num_streams; ++s)
    for (std::int32_t k = 0; k < p.lengths[s]; ++k) score_elem(p, s, k);
  return {};
}

/// Floats as order-preserving unsigned keys; -0 counts as +0 (the CUDA path
/// canonicalizes before sorting, so both backends rank identically).
KVCACHE_HOST_DEVICE inline std::uint32_t radix_key(float f) noexcept {
  std::uint32_t u = cvt::bits(f);
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/// out[s * k + j] = position of the j-th lowest (or highest) score of stream s,
/// ties to the lower position; -1 where the stream has fewer than k tokens.
inline Status select_host(const float* scores, const std::int32_t* lengths, std::int32_t num_streams,
                          std::int32_t max_keys, std::int32_t k, bool lowest, std::int32_t* out) {
  if (k < 0 || k > max_keys) return Status{Errc::invalid_argument, "k", k, max_keys};
  for (std::int32_t s = 0; s < num_streams; ++s) {
    if (lengths[s] < 0 || lengths[s] > max_keys) return Status{Errc::invalid_argument, "lengths", s, max_keys};
    for (std::int32_t i = 0; i < lengths[s]; ++i)
      if (scores[std::int64_t{s} * max_keys + i] != scores[std::int64_t{s} * max_keys + i])
        return Status{Errc::invalid_argument, "scores_nan_at", std::int64_t{s} * max_keys + i, 0};
  }
  std::vector<std::int32_t> idx(static_cast<std::size_t>(max_keys));
  for (std::int32_t s = 0; s < num_streams; ++s) {
    const float* sc = scores + std::int64_t{s} * max_keys;
    const auto n = static_cast<std::size_t>(lengths[s]);
    std::iota(idx.begin(), idx.begin() + std::ptrdiff_t(n), 0);
    auto before = [&](std::int32_t a, std::int32_t b) {
      const std::uint32_t ka = radix_key(sc[a]), kb = radix_key(sc[b]);
      return ka != kb ? (lowest ? ka < kb : ka > kb) : a < b;
    };
    const auto take = std::min<std::size_t>(n, std::size_t(k));
    std::partial_sort(idx.begin(), idx.begin() + std::ptrdiff_t(take), idx.begin() + std::ptrdiff_t(n), before);
    for (std::size_t j = 0; j < std::size_t(k); ++j) out[std::size_t(s) * std::size_t(k) + j] = j < take ? idx[j] : -1;
  }
  return {};
}

KVCACHE_END_NAMESPACE
