// Internal: the one-slab affine step implementations behind affine_step().
#pragma once

#include <cstddef>

namespace kdacp::detail {

using StepFn = void (*)(const float* m, std::size_t ldm, const float* x, std::size_t ldx,
                        const float* s, std::size_t lds, float* c, std::size_t ldc, std::size_t k,
                        std::size_t v, bool transpose);

using StepFnF64 = void (*)(const double* m, std::size_t ldm, const double* x, std::size_t ldx,
                           const double* s, std::size_t lds, double* c, std::size_t ldc,
                           std::size_t k, std::size_t v, bool transpose);

// The float64 verification path: same operation order, scalar.
void step_scalar_f64(const double* m, std::size_t ldm, const double* x, std::size_t ldx,
                     const double* s, std::size_t lds, double* c, std::size_t ldc, std::size_t k,
                     std::size_t v, bool transpose);

void step_scalar(const float* m, std::size_t ldm, const float* x, std::size_t ldx, const float* s,
                 std::size_t lds, float* c, std::size_t ldc, std::size_t k, std::size_t v,
                 bool transpose);

// Highway dynamic dispatch to the best target of this host.
void step_simd(const float* m, std::size_t ldm, const float* x, std::size_t ldx, const float* s,
               std::size_t lds, float* c, std::size_t ldc, std::size_t k, std::size_t v,
               bool transpose);
const char* simd_target();

}  // namespace kdacp::detail
