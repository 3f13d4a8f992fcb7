#include "kdacp/testing/reference.hpp"

#include <algorithm>
#include <cmath>

namespace kdacp::reference {

std::vector<std::vector<double>> chain(const std::vector<const float*>& offsets,
                                       const std::vector<const float*>& maps,
                                       const SummaryShape& shape, Direction dir) {
  const std::size_t p = offsets.size(), k = shape.key_dim, v = shape.value_dim;
  const std::size_t n = shape.state_elems();
  std::vector<std::vector<double>> out(p, std::vector<double>(n, 0.0));
  const bool fwd = dir == Direction::forward;
  // Walk the chain from its start; position `to` receives from `from`.
  for (std::size_t step = 1; step < p; ++step) {
    const std::size_t from = fwd ? step - 1 : p - step;
    const std::size_t to = fwd ? step : p - 1 - step;
    for (std::size_t slab = 0; slab < shape.slabs(); ++slab) {
      const float* s = offsets[from] + slab * k * v;
      const float* m = maps[from] + slab * k * k;
      const double* x = out[from].data() + slab * k * v;
      double* y = out[to].data() + slab * k * v;
      for (std::size_t i = 0; i < k; ++i)
        for (std::size_t j = 0; j < v; ++j) {
          double acc = s[i * v + j];
          for (std::size_t kk = 0; kk < k; ++kk) {
            const double a = fwd ? m[i * k + kk] : m[kk * k + i];
            acc += a * x[kk * v + j];
          }
          y[i * v + j] = acc;
        }
    }
  }
  return out;
}

ErrorStats compare(const float* x, const std::vector<double>& ref) {
  ErrorStats e;
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double d = static_cast<double>(x[i]) - ref[i];
    // A NaN propagates: a report must never show a smaller error than a NaN.
    if (!std::isnan(e.max_abs)) e.max_abs = std::isnan(d) ? std::abs(d) : std::max(e.max_abs, std::abs(d));
    num += d * d;
    den += ref[i] * ref[i];
  }
  e.rel_fro = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return e;
}

}  // namespace kdacp::reference
