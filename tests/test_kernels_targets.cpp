// The per-target SIMD kernels (src/kernels/*-inl.h) on every compiled target
// the CPU supports, through Highway's test macros, each against its
// definition written as plain scalar code, bit for bit:
//   - the affine step (step-inl.h): per element acc = S[i][j], then
//     std::fma(op(M)[i][k], X[k][j], acc) for k in order on every target
//     (the FMA policy, src/kernels/table.hpp), which is step_scalar. Sizes
//     sweep around the vector and tile widths, strided rows, both directions
//     and C aliasing S.
//   - the chunk kernels' primitives (simd-inl.h, gemm-inl.h): fused_mul_add
//     is std::fma on every target (and hn::MulAdd where the target has FMA,
//     the step's operation); the tile GEMM is, per element, the fused chain
//     over the inner index in order, for every operation and triangular
//     variant, both layouts of A, sizes around the vector and tile widths;
//     gemm_zero_b is gemm on a B of +0 (signed zeros in A and C included);
//     exp_row is exp_vec's operation sequence (and within a few ulp of
//     std::exp); lane_dot and transpose are their definitions.
#define KDACP_PER_TARGET_FILE "test_kernels_targets.cpp"
#include "kernels/per_target.h"

#include <hwy/tests/test_util-inl.h>

#include "kernels/gemm-inl.h"
#include "kernels/simd-inl.h"
#include "kernels/step-inl.h"

// Shared by every target: defined once, on the first inclusion.
#ifndef KDACP_TEST_KERNELS_TARGETS_SHARED_
#define KDACP_TEST_KERNELS_TARGETS_SHARED_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
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

  // The step's definition: per element, fused multiply-adds in order.
  std::vector<float> expected(bool transpose) const {
    std::vector<float> c(k * v);
    for (std::size_t i = 0; i < k; ++i)
      for (std::size_t j = 0; j < v; ++j) {
        float acc = s[i * lds + j];
        for (std::size_t kk = 0; kk < k; ++kk) {
          const float a = transpose ? m[kk * ldm + i] : m[i * ldm + kk];
          acc = std::fma(a, x[kk * ldx + j], acc);
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


template <class T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

template <class T>
std::vector<T> uniform_values(std::size_t n, double lo, double hi, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<T> x(n);
  for (auto& e : x) e = T(u(rng));
  return x;
}

// exp_vec's definition on one value: clamp; n = round-to-even(x·log2 e);
// r = fma(n, -ln2_lo, fma(n, -ln2_hi, x)); the Taylor polynomial of degree 7
// (float) or 13 (double) in r by Horner with fma, coefficients 1/i! rounded
// once; times 2^(n >> 1), then times 2^(n - (n >> 1)). NaN gives itself.
template <class T>
T exp_definition(T x) {
  constexpr bool kF32 = sizeof(T) == 4;
  using TI = std::conditional_t<kF32, std::int32_t, std::int64_t>;
  using TU = std::conditional_t<kF32, std::uint32_t, std::uint64_t>;
  if (std::isnan(x)) return x;
  const T xc = std::min(std::max(x, kF32 ? T(-104) : T(-746)), kF32 ? T(89) : T(710));
  const T n = std::nearbyint(xc * T(1.4426950408889634074));
  T r = std::fma(n, -(kF32 ? T(0.693359375f) : T(0.693147180369123816490)), xc);
  r = std::fma(n, -(kF32 ? T(-2.12194440e-4f) : T(1.90821492927058770002e-10)), r);
  constexpr int kDeg = kF32 ? 7 : 13;
  T coef[kDeg + 1];
  long double f = 1;
  for (int i = 0; i <= kDeg; ++i) {
    if (i > 1) f *= i;
    coef[i] = static_cast<T>(1.0L / f);
  }
  T p = coef[kDeg];
  for (int i = kDeg - 1; i >= 0; --i) p = std::fma(p, r, coef[i]);
  const auto pow2 = [](TI e) {
    const TU bits = static_cast<TU>(e + (kF32 ? 127 : 1023)) << (kF32 ? 23 : 52);
    T v;
    std::memcpy(&v, &bits, sizeof(T));
    return v;
  };
  const TI ni = static_cast<TI>(n), n1 = ni >> 1;
  return (p * pow2(n1)) * pow2(ni - n1);
}

// lane_dot's definition: element i joins sum i mod 16, the sums added in order.
template <class T>
T lane_dot_definition(const T* x, const T* y, std::size_t n) {
  T acc[16] = {};
  for (std::size_t i = 0; i < n; ++i) {
    const T product = x[i] * y[i];
    acc[i % 16] = acc[i % 16] + product;
  }
  T s = 0;
  for (const T a : acc) s = s + a;
  return s;
}

}  // namespace kdacp::detail

#endif  // KDACP_TEST_KERNELS_TARGETS_SHARED_

// The scalar definitions inlined here must not be contracted into FMAs on
// the targets that have them (KDACP_TARGET_BEGIN turns contraction off, as
// in the kernels' own files).
KDACP_TARGET_BEGIN;
namespace kdacp::detail::HWY_NAMESPACE {

void StepMatchesItsDefinition() {
  const char* target = hwy::TargetName(HWY_TARGET);
  for (std::size_t k : {1, 3, 4, 7, 8, 9, 16, 17, 33}) {
    for (std::size_t v : {1, 3, 4, 7, 8, 15, 16, 17, 31, 32, 33, 48, 70}) {
      const StepOperands op(k, v);
      for (bool transpose : {false, true}) {
        const std::vector<float> want = op.expected(transpose);
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
        std::vector<float> scalar(k * v);
        step_scalar(op.m.data(), op.ldm, op.x.data(), op.ldx, op.s.data(), op.lds, scalar.data(),
                    v, k, v, transpose);
        expect_same_bits(scalar, want, k, v, transpose, "step_scalar");
      }
    }
  }
}


template <class T>
void ExpectFusedMulAddIsStdFma() {
  const hn::ScalableTag<T> d;
  const std::size_t n = hn::Lanes(d);
  const T eps = std::numeric_limits<T>::epsilon(), big = std::numeric_limits<T>::max();
  std::vector<T> a = uniform_values<T>(32 * n, -2, 2, 11), b = uniform_values<T>(32 * n, -2, 2, 12),
                 c = uniform_values<T>(32 * n, -2, 2, 13);
  // Where a rounded product gives another result: a·b = 1 - eps² against -1;
  // 2·max - max (the product alone overflows); a subnormal product.
  for (std::size_t i = 0; i + 2 < a.size(); i += 5) {
    a[i] = 1 + eps, b[i] = 1 - eps, c[i] = -1;
    a[i + 1] = big, b[i + 1] = 2, c[i + 1] = -big;
    a[i + 2] = std::numeric_limits<T>::denorm_min(), b[i + 2] = T(0.75), c[i + 2] = 0;
  }
  std::vector<T> got(n), muladd(n);
  for (std::size_t i = 0; i < a.size(); i += n) {
    const auto va = hn::LoadU(d, &a[i]), vb = hn::LoadU(d, &b[i]), vc = hn::LoadU(d, &c[i]);
    hn::StoreU(fused_mul_add(d, va, vb, vc), d, got.data());
    hn::StoreU(hn::MulAdd(va, vb, vc), d, muladd.data());
    for (std::size_t l = 0; l < n; ++l) {
      const T want = std::fma(a[i + l], b[i + l], c[i + l]);
      EXPECT_TRUE(same_bits(got[l], want)) << hwy::TargetName(HWY_TARGET) << " #" << i + l;
      if (HWY_NATIVE_FMA) {
        EXPECT_TRUE(same_bits(muladd[l], want)) << "MulAdd #" << i + l;
      }
    }
  }
}

void FusedMulAddIsStdFma() {
  ExpectFusedMulAddIsStdFma<float>();
  ExpectFusedMulAddIsStdFma<double>();
}

// gemm<Op, kTri> on an m×p A (stored row-major, or transposed when
// a_transposed) and a p×nc B, against the fused chain per element.
template <GemmOp Op, Tri kTri, class T>
void ExpectGemm(std::size_t m, std::size_t nc, std::size_t p, bool a_transposed) {
  const std::size_t lda = (a_transposed ? m : p) + 3, ldb = nc + 2, ldc = nc + 1;
  const std::uint64_t seed = (m * 100 + nc) * 100 + p;
  std::vector<T> a = uniform_values<T>((a_transposed ? p : m) * lda, -1, 1, seed);
  const std::vector<T> b = uniform_values<T>(p * ldb, -1, 1, seed + 1);
  const std::vector<T> c0 = uniform_values<T>(m * ldc, -1, 1, seed + 2);
  const std::size_t ars = a_transposed ? 1 : lda, acs = a_transposed ? lda : 1;
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t k = 0; k < p; ++k)
      if ((kTri == Tri::lower_a && k > i) || (kTri == Tri::upper_a && k < i)) a[i * ars + k * acs] = 0;
  std::vector<T> c = c0;
  gemm<Op, kTri>(m, nc, p, a.data(), ars, acs, b.data(), ldb, c.data(), ldc);
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < nc; ++j) {
      if (kTri == Tri::lower_c && j > i) continue;
      T acc = 0;
      for (std::size_t k = 0; k < p; ++k) acc = std::fma(a[i * ars + k * acs], b[k * ldb + j], acc);
      const T before = c0[i * ldc + j];
      const T want = Op == GemmOp::set ? acc : Op == GemmOp::add ? before + acc : before - acc;
      EXPECT_TRUE(same_bits(c[i * ldc + j], want))
          << hwy::TargetName(HWY_TARGET) << " op " << int(Op) << " tri " << int(kTri) << " m=" << m
          << " n=" << nc << " p=" << p << (a_transposed ? " Aᵀ" : " A") << " at " << i << "," << j;
    }
}

template <Tri kTri, class T>
void ExpectGemmOps(std::size_t m, std::size_t nc, std::size_t p, bool a_transposed) {
  ExpectGemm<GemmOp::set, kTri, T>(m, nc, p, a_transposed);
  ExpectGemm<GemmOp::add, kTri, T>(m, nc, p, a_transposed);
  ExpectGemm<GemmOp::sub, kTri, T>(m, nc, p, a_transposed);
}

template <class T>
void ExpectGemmSweep() {
  const std::size_t n = hn::Lanes(hn::ScalableTag<T>());
  for (std::size_t m : {1, 5, 8, 13, 17})
    for (std::size_t nc : {std::size_t{1}, n > 1 ? n - 1 : 1, n, 2 * n + 1, 3 * n + 3, std::size_t{37}})
      for (std::size_t p : {1, 7, 16, 21})
        for (bool a_transposed : {false, true}) {
          ExpectGemmOps<Tri::full, T>(m, nc, p, a_transposed);
          ExpectGemmOps<Tri::lower_a, T>(m, nc, p, a_transposed);
          ExpectGemmOps<Tri::upper_a, T>(m, nc, p, a_transposed);
          ExpectGemmOps<Tri::lower_c, T>(m, nc, p, a_transposed);
        }
}

void GemmMatchesItsDefinition() {
  ExpectGemmSweep<float>();
  ExpectGemmSweep<double>();
}

// gemm_zero_b<Op> gives gemm<Op>'s bits on a B of +0 without reading it:
// C +0 (set), C + 0 (add: a -0 of C becomes +0), C (sub: -0 stays), for A
// of either sign and both layouts; with an infinite or NaN entry in A it
// writes nothing and returns false (the product is NaN there).
template <GemmOp Op, class T>
void ExpectGemmZeroB(std::size_t m, std::size_t nc, std::size_t p, bool a_transposed) {
  const std::size_t lda = (a_transposed ? m : p) + 3, ldc = nc + 1;
  const std::uint64_t seed = (m * 100 + nc) * 100 + p + 7;
  std::vector<T> a = uniform_values<T>((a_transposed ? p : m) * lda, -1, 1, seed);
  std::vector<T> c0 = uniform_values<T>(m * ldc, -1, 1, seed + 1);
  for (std::size_t i = 0; i < c0.size(); i += 3) c0[i] = i % 2 ? T(0) : -T(0);  // signed zeros in C
  if (!a.empty()) a[0] = -T(0);
  const std::vector<T> b(p * nc, T(0));
  const std::size_t ars = a_transposed ? 1 : lda, acs = a_transposed ? lda : 1;
  std::vector<T> want = c0, got = c0;
  gemm<Op>(m, nc, p, a.data(), ars, acs, b.data(), nc, want.data(), ldc);
  EXPECT_TRUE(gemm_zero_b<Op>(m, nc, p, a.data(), ars, acs, got.data(), ldc));
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < nc; ++j)
      EXPECT_TRUE(same_bits(got[i * ldc + j], want[i * ldc + j]))
          << hwy::TargetName(HWY_TARGET) << " op " << int(Op) << " m=" << m << " n=" << nc << " p=" << p
          << " at " << i << "," << j << ": " << got[i * ldc + j] << " vs " << want[i * ldc + j];
  for (T bad : {std::numeric_limits<T>::infinity(), -std::numeric_limits<T>::infinity(),
                std::numeric_limits<T>::quiet_NaN()}) {
    std::vector<T> a_bad = a;
    a_bad[(m - 1) * ars + (p - 1) * acs] = bad;
    std::vector<T> untouched = c0;
    EXPECT_FALSE(gemm_zero_b<Op>(m, nc, p, a_bad.data(), ars, acs, untouched.data(), ldc));
    EXPECT_EQ(0, std::memcmp(untouched.data(), c0.data(), c0.size() * sizeof(T)))
        << "op " << int(Op) << ": written despite a non-finite A";
  }
}

template <class T>
void ExpectGemmZeroBSweep() {
  for (std::size_t m : {1, 8, 13})
    for (std::size_t nc : {1, 16, 37})
      for (std::size_t p : {1, 21})
        for (bool a_transposed : {false, true}) {
          ExpectGemmZeroB<GemmOp::set, T>(m, nc, p, a_transposed);
          ExpectGemmZeroB<GemmOp::add, T>(m, nc, p, a_transposed);
          ExpectGemmZeroB<GemmOp::sub, T>(m, nc, p, a_transposed);
        }
}

void GemmZeroBIsTheProductOnZeros() {
  ExpectGemmZeroBSweep<float>();
  ExpectGemmZeroBSweep<double>();
}

template <class T>
void ExpectExpRow() {
  constexpr bool kF32 = sizeof(T) == 4;
  const T inf = std::numeric_limits<T>::infinity();
  std::vector<T> x = uniform_values<T>(997, kF32 ? -110 : -760, kF32 ? 95 : 720, 21);
  const std::vector<T> special{0, -T(0), inf, -inf, std::numeric_limits<T>::quiet_NaN(),
                               kF32 ? T(-104) : T(-746), kF32 ? T(89) : T(710), T(-87.5), T(88.5),
                               T(0.5) * T(0.6931471805599453), std::numeric_limits<T>::min(), T(-1e-4)};
  x.insert(x.begin(), special.begin(), special.end());
  const std::size_t n = hn::Lanes(hn::ScalableTag<T>());
  for (std::size_t len : {std::size_t{1}, n > 1 ? n - 1 : 1, n, n + 1, 3 * n + 2, x.size()}) {
    std::vector<T> got(len);
    exp_row(x.data(), got.data(), len);
    for (std::size_t i = 0; i < len; ++i) {
      const T want = exp_definition(x[i]);
      EXPECT_TRUE(same_bits(got[i], want) || (std::isnan(got[i]) && std::isnan(want)))
          << hwy::TargetName(HWY_TARGET) << " exp(" << x[i] << ") = " << got[i] << ", want " << want;
      const T ref = std::exp(x[i]);
      if (std::isfinite(ref) && ref >= std::numeric_limits<T>::min()) {
        EXPECT_LE(std::abs(got[i] - ref), 4 * std::numeric_limits<T>::epsilon() * ref) << "exp(" << x[i] << ")";
      }
    }
  }
}

void ExpRowMatchesItsDefinition() {
  ExpectExpRow<float>();
  ExpectExpRow<double>();
}

template <class T>
void ExpectLaneDotAndTranspose() {
  for (std::size_t len : {0, 1, 15, 16, 17, 40, 129}) {
    const std::vector<T> x = uniform_values<T>(len, -1, 1, 31 + len), y = uniform_values<T>(len, -1, 1, 32 + len);
    EXPECT_TRUE(same_bits(lane_dot(x.data(), y.data(), len), lane_dot_definition(x.data(), y.data(), len)))
        << hwy::TargetName(HWY_TARGET) << " lane_dot n=" << len;
  }
  for (std::size_t rows : {1, 16, 21})
    for (std::size_t cols : {1, 17, 40}) {
      const std::size_t lds = cols + 2, ldd = rows + 3;
      const std::vector<T> src = uniform_values<T>(rows * lds, -1, 1, rows * 100 + cols);
      std::vector<T> dst(cols * ldd, T(7));
      transpose(src.data(), rows, cols, lds, dst.data(), ldd);
      for (std::size_t i = 0; i < rows; ++i)
        for (std::size_t j = 0; j < cols; ++j)
          EXPECT_TRUE(same_bits(dst[j * ldd + i], src[i * lds + j])) << "transpose " << rows << "x" << cols;
    }
}

void LaneDotAndTransposeMatchTheirDefinitions() {
  ExpectLaneDotAndTranspose<float>();
  ExpectLaneDotAndTranspose<double>();
}

}  // namespace kdacp::detail::HWY_NAMESPACE
KDACP_TARGET_END;

#if HWY_ONCE
namespace kdacp::detail {

HWY_BEFORE_TEST(StepTargets);
HWY_EXPORT_AND_TEST_P(StepTargets, StepMatchesItsDefinition);

HWY_BEFORE_TEST(SimdTargets);
HWY_EXPORT_AND_TEST_P(SimdTargets, FusedMulAddIsStdFma);
HWY_EXPORT_AND_TEST_P(SimdTargets, GemmMatchesItsDefinition);
HWY_EXPORT_AND_TEST_P(SimdTargets, GemmZeroBIsTheProductOnZeros);
HWY_EXPORT_AND_TEST_P(SimdTargets, ExpRowMatchesItsDefinition);
HWY_EXPORT_AND_TEST_P(SimdTargets, LaneDotAndTransposeMatchTheirDefinitions);

}  // namespace kdacp::detail
#endif
