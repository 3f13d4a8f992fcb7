// Scalar reference of the affine step. Same per-element operation order as
// the SIMD kernel: acc = S[i][j], then fma over k = 0..K-1.
#include <cmath>

#include "kernels/step.hpp"

namespace kdacp::detail {

namespace {

template <class T>
void step_ref(const T* m, std::size_t ldm, const T* x, std::size_t ldx, const T* s, std::size_t lds,
              T* c, std::size_t ldc, std::size_t k, std::size_t v, bool transpose) {
  for (std::size_t i = 0; i < k; ++i) {
    T* crow = c + i * ldc;
    const T* srow = s + i * lds;
    // Copy first: C may alias S, and this keeps S read before any write.
    for (std::size_t j = 0; j < v; ++j) crow[j] = srow[j];
    for (std::size_t kk = 0; kk < k; ++kk) {
      const T a = transpose ? m[kk * ldm + i] : m[i * ldm + kk];
      const T* xrow = x + kk * ldx;
      for (std::size_t j = 0; j < v; ++j) crow[j] = std::fma(a, xrow[j], crow[j]);
    }
  }
}

}  // namespace

void step_scalar(const float* m, std::size_t ldm, const float* x, std::size_t ldx, const float* s,
                 std::size_t lds, float* c, std::size_t ldc, std::size_t k, std::size_t v,
                 bool transpose) {
  step_ref(m, ldm, x, ldx, s, lds, c, ldc, k, v, transpose);
}

void step_scalar_f64(const double* m, std::size_t ldm, const double* x, std::size_t ldx,
                     const double* s, std::size_t lds, double* c, std::size_t ldc, std::size_t k,
                     std::size_t v, bool transpose) {
  step_ref(m, ldm, x, ldx, s, lds, c, ldc, k, v, transpose);
}

}  // namespace kdacp::detail
