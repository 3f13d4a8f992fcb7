// Internal: the one-slab affine step behind affine_step(), scan(), merge()
// and the reassociating protocols' helpers, as the kernel table
// (kernels/table.hpp) holds it, and the one place that chooses the entry.
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

// The step for element type T: the reference entry for KernelKind::scalar,
// else the kernel table's (the SIMD step of the best target this CPU
// supports in float; the reference in double, which no target overrides).
// Under a folded simulation (core/simulation.hpp) a step that charges its
// flops instead.
template <class T>
StepFn<T> step_kernel(KernelKind kind);
template <>
StepFn<float> step_kernel<float>(KernelKind kind);
template <>
StepFn<double> step_kernel<double>(KernelKind kind);
// The target whose entries the kernel table holds (step_kernel<float> runs
// its step for best and simd).
const char* simd_target();

}  // namespace kdacp::detail
