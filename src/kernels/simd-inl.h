// Per-target SIMD primitives of the kernels whose results must be the same
// bits on every Highway target (the step, the chunk kernels):
// the fused multiply-add, element-wise loops on whole vectors, a dot
// product in a fixed order, exp on vectors, a blocked transpose. The tile
// GEMM built on them is gemm-inl.h. Included once per Highway target, hence
// the toggle guard instead of #pragma once.
//
// fused_mul_add is the one fused multiply-add of every kernel (the FMA
// policy: kernels/table.hpp).
#if defined(KDACP_KERNELS_SIMD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KDACP_KERNELS_SIMD_INL_H_
#undef KDACP_KERNELS_SIMD_INL_H_
#else
#define KDACP_KERNELS_SIMD_INL_H_
#endif

#include "kernels/per_target.h"

#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstddef>

KDACP_TARGET_BEGIN;
namespace kdacp::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// acc + a·b rounded once (a fused multiply-add) on every target: the
// hardware instruction where the target has one (HWY_NATIVE_FMA), otherwise
// std::fma per lane, which is correctly rounded too, so every target gets the
// same bits (slowly on pre-FMA CPUs, fast on everything since Haswell/Zen).
template <class D>
HWY_INLINE hn::Vec<D> fused_mul_add(D d, hn::Vec<D> a, hn::Vec<D> b, hn::Vec<D> acc) {
#if HWY_NATIVE_FMA
  (void)d;
  return hn::MulAdd(a, b, acc);
#else
  using T = hn::TFromD<D>;
  constexpr std::size_t kMax = hn::MaxLanes(D());
  HWY_ALIGN T va[kMax], vb[kMax], vc[kMax];
  hn::Store(a, d, va);
  hn::Store(b, d, vb);
  hn::Store(acc, d, vc);
  for (std::size_t i = 0; i < hn::Lanes(d); ++i) vc[i] = std::fma(va[i], vb[i], vc[i]);
  return hn::Load(d, vc);
#endif
}

// Element-wise loops over rows of n values on whole vectors: f(d, i) is
// called for every vector i (and the tail is done by g(i) per element, with
// the same exact operations). Multiplications, divisions, additions are
// correctly rounded on every target, so the bits do not depend on it.
template <class T, class FV, class FS>
HWY_INLINE void for_vecs(std::size_t n, FV&& fv, FS&& fs) {
  const hn::ScalableTag<T> d;
  const std::size_t N = hn::Lanes(d);
  std::size_t i = 0;
  for (; i + N <= n; i += N) fv(d, i);
  for (; i < n; ++i) fs(i);
}

// Σ x_i y_i in the same order on every target: element i joins running sum
// i mod kLanes, then the kLanes sums are added in order. Independent sums
// instead of one dependent chain (the compiler may put them in vectors of
// any width; each sum's operations stay the same, so do the bits).
template <class T>
T lane_dot(const T* HWY_RESTRICT x, const T* HWY_RESTRICT y, std::size_t n) {
  constexpr std::size_t kLanes = 16;
  T acc[kLanes] = {};
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (std::size_t l = 0; l < kLanes; ++l) acc[l] = acc[l] + x[i + l] * y[i + l];
  for (std::size_t l = 0; i + l < n; ++l) acc[l] = acc[l] + x[i + l] * y[i + l];
  T s = 0;
  for (std::size_t l = 0; l < kLanes; ++l) s = s + acc[l];
  return s;
}

// 1/i!, i ≤ kDeg, rounded once to T (at compile time).
template <class T, int kDeg>
struct ExpCoefs {
  T c[kDeg + 1] = {};
  constexpr ExpCoefs() {
    long double f = 1;
    for (int i = 0; i <= kDeg; ++i) {
      if (i > 1) f *= i;
      c[i] = static_cast<T>(1.0L / f);
    }
  }
  constexpr T operator[](int i) const { return c[i]; }
};

// exp on whole vectors, the same operation sequence on every target (so the
// same bits): x = clamp(x); n = round(x·log2 e); r = x - n·ln2 (two fused
// steps, Cody-Waite); e^r by a Taylor polynomial (Horner, fused steps,
// degree 7 in float, 13 in double: below an ulp on |r| ≤ ln2/2); times 2^n
// in two exact halves, so the last multiplication rounds once into the
// subnormal range. NaN stays NaN. Within a few ulp of std::exp.
template <class D>
HWY_INLINE hn::Vec<D> exp_vec(D d, hn::Vec<D> x) {
  using T = hn::TFromD<D>;
  const hn::RebindToSigned<D> di;
  using TI = hn::TFromD<decltype(di)>;
  constexpr bool kF32 = sizeof(T) == 4;
  constexpr int kMant = kF32 ? 23 : 52;
  constexpr TI kBias = kF32 ? 127 : 1023;
  const T x_lo = kF32 ? T(-104) : T(-746), x_hi = kF32 ? T(89) : T(710);
  const T ln2_hi = kF32 ? T(0.693359375f) : T(0.693147180369123816490);
  const T ln2_lo = kF32 ? T(-2.12194440e-4f) : T(1.90821492927058770002e-10);
  const auto is_num = hn::Eq(x, x);
  const auto xc = hn::Min(hn::Max(hn::IfThenElse(is_num, x, hn::Zero(d)), hn::Set(d, x_lo)),
                          hn::Set(d, x_hi));
  const auto n = hn::Round(hn::Mul(xc, hn::Set(d, T(1.4426950408889634074))));
  auto r = fused_mul_add(d, n, hn::Set(d, -ln2_hi), xc);
  r = fused_mul_add(d, n, hn::Set(d, -ln2_lo), r);
  constexpr int kDeg = kF32 ? 7 : 13;
  constexpr ExpCoefs<T, kDeg> coef{};
  auto p = hn::Set(d, coef[kDeg]);
  for (int i = kDeg - 1; i >= 0; --i) p = fused_mul_add(d, p, r, hn::Set(d, coef[i]));
  const auto ni = hn::ConvertTo(di, n);
  const auto n1 = hn::ShiftRight<1>(ni);
  const auto n2 = hn::Sub(ni, n1);
  const auto s1 = hn::BitCast(d, hn::ShiftLeft<kMant>(hn::Add(n1, hn::Set(di, kBias))));
  const auto s2 = hn::BitCast(d, hn::ShiftLeft<kMant>(hn::Add(n2, hn::Set(di, kBias))));
  const auto y = hn::Mul(hn::Mul(p, s1), s2);
  return hn::IfThenElse(is_num, y, x);
}

// out[i] = exp(in[i]), i < n (the tail through a padded vector).
template <class T>
void exp_row(const T* in, T* out, std::size_t n) {
  const hn::ScalableTag<T> d;
  const std::size_t N = hn::Lanes(d);
  std::size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(exp_vec(d, hn::LoadU(d, in + i)), d, out + i);
  if (i < n) {
    HWY_ALIGN T buf[hn::MaxLanes(d)] = {};
    for (std::size_t j = i; j < n; ++j) buf[j - i] = in[j];
    hn::Store(exp_vec(d, hn::Load(d, buf)), d, buf);
    for (std::size_t j = i; j < n; ++j) out[j] = buf[j - i];
  }
}

// dst (cols×rows, stride ldd) = src (rows×cols, stride lds) transposed, by
// square blocks that stay in L1 (element by element the rows of dst are
// written with a stride of a whole row, one cache line per element).
template <class T>
void transpose(const T* HWY_RESTRICT src, std::size_t rows, std::size_t cols, std::size_t lds,
               T* HWY_RESTRICT dst, std::size_t ldd) {
  constexpr std::size_t kB = 16;
  for (std::size_t i0 = 0; i0 < rows; i0 += kB) {
    const std::size_t i1 = std::min(i0 + kB, rows);
    for (std::size_t j0 = 0; j0 < cols; j0 += kB) {
      const std::size_t j1 = std::min(j0 + kB, cols);
      for (std::size_t j = j0; j < j1; ++j)
        for (std::size_t i = i0; i < i1; ++i) dst[j * ldd + i] = src[i * lds + j];
    }
  }
}

}  // namespace kdacp::detail::HWY_NAMESPACE
KDACP_TARGET_END;

#endif  // KDACP_KERNELS_SIMD_INL_H_
