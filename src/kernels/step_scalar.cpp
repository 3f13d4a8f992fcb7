// Scalar reference of the affine step. Same per-element operation order as
// the SIMD kernel: acc = S[i][j], then fma over k = 0..K-1.
#include <cmath>

#include "kernels/step.hpp"

namespace kdacp::detail {

void step_scalar(const float* m, std::size_t ldm, const float* x, std::size_t ldx, const float* s,
                 std::size_t lds, float* c, std::size_t ldc, std::size_t k, std::size_t v,
                 bool transpose) {
  for (std::size_t i = 0; i < k; ++i) {
    float* crow = c + i * ldc;
    const float* srow = s + i * lds;
    // Copy first: C may alias S, and this keeps S read before any write.
    for (std::size_t j = 0; j < v; ++j) crow[j] = srow[j];
    for (std::size_t kk = 0; kk < k; ++kk) {
      const float a = transpose ? m[kk * ldm + i] : m[i * ldm + kk];
      const float* xrow = x + kk * ldx;
      for (std::size_t j = 0; j < v; ++j) crow[j] = std::fma(a, xrow[j], crow[j]);
    }
  }
}

}  // namespace kdacp::detail
