// Internal: the one-slab affine step kernels behind affine_step(), scan(),
// merge() and the reassociating protocols' helpers, and the one place that
// chooses among them.
#pragma once

#include <cstddef>

#include "kdacp/kernels.hpp"

namespace kdacp::detail {

template <class T>
using StepFn = void (*)(const T* m, std::size_t ldm, const T* x, std::size_t ldx, const T* s,
                        std::size_t lds, T* c, std::size_t ldc, std::size_t k, std::size_t v,
                        bool transpose);

// The scalar reference, for float and for the float64 verification path.
void step_scalar(const float* m, std::size_t ldm, const float* x, std::size_t ldx, const float* s,
                 std::size_t lds, float* c, std::size_t ldc, std::size_t k, std::size_t v,
                 bool transpose);
void step_scalar_f64(const double* m, std::size_t ldm, const double* x, std::size_t ldx,
                     const double* s, std::size_t lds, double* c, std::size_t ldc, std::size_t k,
                     std::size_t v, bool transpose);

// One Highway target's SIMD step and the target's name.
struct StepTarget {
  StepFn<float> step;
  const char* name;
};

// The step for element type T: float gets the scalar reference for
// KernelKind::scalar, else the SIMD step of the best target this CPU
// supports, chosen once per process; double always gets the scalar kernel
// with the same operation order.
template <class T>
StepFn<T> step_kernel(KernelKind kind);
template <>
StepFn<float> step_kernel<float>(KernelKind kind);
template <>
StepFn<double> step_kernel<double>(KernelKind kind);
// The target step_kernel<float> runs for best and simd.
const char* simd_target();

}  // namespace kdacp::detail
