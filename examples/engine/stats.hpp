// The evaluation's intervals: an accuracy from a few dozen samples is a
// range, and the table prints the range so a small difference is not read
// as a ranking.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace engine {

struct Interval {
  double value = 0.0, lo = 0.0, hi = 0.0;  // estimate and 95 % bounds
  std::int64_t n = 0;                      // samples
};

// Wilson score interval (95 %) for k successes in n trials: unlike the
// normal approximation it stays inside [0, 1] and is not empty at 0 or n.
inline Interval wilson(std::int64_t k, std::int64_t n) {
  if (n <= 0) return {};
  const double z = 1.96, p = double(k) / double(n), z2n = z * z / double(n);
  const double mid = (p + z2n / 2) / (1 + z2n);
  const double half = z * std::sqrt(p * (1 - p) / double(n) + z2n / (4 * double(n))) / (1 + z2n);
  return {p, std::max(0.0, mid - half), std::min(1.0, mid + half), n};
}

// Mean with a normal 95 % interval (standard error of the mean).
inline Interval mean_ci(const std::vector<double>& xs) {
  if (xs.empty()) return {};
  double m = 0.0, v = 0.0;
  for (double x : xs) m += x;
  m /= double(xs.size());
  for (double x : xs) v += (x - m) * (x - m);
  const double se = xs.size() > 1 ? std::sqrt(v / double(xs.size() - 1) / double(xs.size())) : 0.0;
  return {m, m - 1.96 * se, m + 1.96 * se, std::int64_t(xs.size())};
}

}  // namespace engine
