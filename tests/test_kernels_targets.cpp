// The SIMD affine step (src/kernels/step-inl.h) on every compiled target the
// CPU supports, through Highway's test macros. Per element it computes
// acc = S[i][j], then MulAdd(op(M)[i][k], X[k][j], acc) for k in order, so on
// each target it must equal, bit for bit, the same loop with that target's
// MulAdd rounding: std::fma where the target has FMA (step_scalar itself),
// a rounded product then a sum where it does not. Sizes sweep around the
// vector and tile widths, strided rows, both directions and C aliasing S.
#include "kernels/hwy_targets.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "test_kernels_targets.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/tests/test_util-inl.h>

#include "kernels/step-inl.h"

// Shared by every target: defined once, on the first inclusion.
#ifndef KDACP_TEST_KERNELS_TARGETS_SHARED_
#define KDACP_TEST_KERNELS_TARGETS_SHARED_

#include <cmath>
#include <cstddef>
#include <cstring>
#include <vector>

#include "helpers.hpp"
#include "kernels/step.hpp"

namespace kdacp::detail {

// One slab's operands with row strides wider than their rows.
struct StepOperands {
  std::size_t k, v, ldm, ldx, lds;
  std::vector<float> m, x, s;

  StepOperands(std::size_t k_, std::size_t v_)
      : k(k_), v(v_), ldm(k_ + 3), ldx(v_ + 5), lds(v_ + 1),
        m(k_ * ldm), x(k_ * ldx), s(k_ * lds) {
    Rng rng(k * 1000 + v);
    for (auto& e : m) e = rng.uniform(-1, 1) / float(k);
    for (auto& e : x) e = rng.uniform(-1, 1);
    for (auto& e : s) e = rng.uniform(-1, 1);
  }

  // The step's definition with `fused` (std::fma) or separately rounded
  // multiply-adds.
  std::vector<float> expected(bool transpose, bool fused) const {
    std::vector<float> c(k * v);
    for (std::size_t i = 0; i < k; ++i)
      for (std::size_t j = 0; j < v; ++j) {
        float acc = s[i * lds + j];
        for (std::size_t kk = 0; kk < k; ++kk) {
          const float a = transpose ? m[kk * ldm + i] : m[i * ldm + kk];
          const float b = x[kk * ldx + j];
          if (fused) {
            acc = std::fma(a, b, acc);
          } else {
            const float product = a * b;
            acc = product + acc;
          }
        }
        c[i * v + j] = acc;
      }
    return c;
  }
};

inline void expect_same_bits(const std::vector<float>& got, const std::vector<float>& want,
                             std::size_t k, std::size_t v, bool transpose, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)))
      << what << " k=" << k << " v=" << v << (transpose ? " backward" : " forward");
}

}  // namespace kdacp::detail

#endif  // KDACP_TEST_KERNELS_TARGETS_SHARED_

HWY_BEFORE_NAMESPACE();
namespace kdacp::detail::HWY_NAMESPACE {

void StepMatchesItsDefinition() {
  const char* target = hwy::TargetName(HWY_TARGET);
  for (std::size_t k : {1, 3, 4, 7, 8, 9, 16, 17, 33}) {
    for (std::size_t v : {1, 3, 4, 7, 8, 15, 16, 17, 31, 32, 33, 48, 70}) {
      const StepOperands op(k, v);
      for (bool transpose : {false, true}) {
        const std::vector<float> want = op.expected(transpose, HWY_NATIVE_FMA != 0);
        std::vector<float> c(k * v);
        Step(op.m.data(), op.ldm, op.x.data(), op.ldx, op.s.data(), op.lds, c.data(), v, k, v,
             transpose);
        expect_same_bits(c, want, k, v, transpose, target);
        // C may alias S exactly.
        std::vector<float> inplace = op.s;
        Step(op.m.data(), op.ldm, op.x.data(), op.ldx, inplace.data(), op.lds, inplace.data(),
             op.lds, k, v, transpose);
        std::vector<float> rows(k * v);
        for (std::size_t i = 0; i < k; ++i)
          std::memcpy(rows.data() + i * v, inplace.data() + i * op.lds, v * sizeof(float));
        expect_same_bits(rows, want, k, v, transpose, target);
        if (HWY_NATIVE_FMA) {
          std::vector<float> scalar(k * v);
          step_scalar(op.m.data(), op.ldm, op.x.data(), op.ldx, op.s.data(), op.lds,
                      scalar.data(), v, k, v, transpose);
          expect_same_bits(c, scalar, k, v, transpose, "step_scalar");
        }
      }
    }
  }
}

}  // namespace kdacp::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kdacp::detail {

HWY_BEFORE_TEST(StepTargets);
HWY_EXPORT_AND_TEST_P(StepTargets, StepMatchesItsDefinition);

}  // namespace kdacp::detail
#endif
