// Per-target tile GEMM of the chunk kernels: C (m×n) = A·B, C + A·B or
// C - A·B, with A read through row and column strides (so Aᵀ costs nothing)
// and the known zeros of triangular operands skipped. Every element of C is
// fused_mul_add(a_{p-1}, b_{p-1}, ... fused_mul_add(a_0, b_0, 0)) in order
// of the inner index (the FMA policy, table.hpp), then combined once with C:
// vectorised along C's columns only, so neither the vector width nor the
// tiling changes a bit. Included once per Highway target, hence the toggle
// guard instead of #pragma once.
#if defined(KDACP_KERNELS_GEMM_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KDACP_KERNELS_GEMM_INL_H_
#undef KDACP_KERNELS_GEMM_INL_H_
#else
#define KDACP_KERNELS_GEMM_INL_H_
#endif

#include "kernels/per_target.h"

#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "kernels/simd-inl.h"

KDACP_TARGET_BEGIN;
namespace kdacp::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

enum class GemmOp { set, add, sub };

// Register tiles: kTileRows rows × kPanelVecs vectors of C. AVX-512 has 32
// vector registers (16 accumulators, 2 B vectors, 1 broadcast), the others
// 16 (8 + 1 + 1). The tile height is the same on every target: with the
// triangular variants below it decides which known-zero terms a row's chain
// includes, so it must not change the bits between targets.
constexpr std::size_t kTileRows = 8;
#if HWY_TARGET <= HWY_AVX3
constexpr std::size_t kPanelVecs = 2;
#else
constexpr std::size_t kPanelVecs = 1;
#endif

// One R-row tile of C at columns [j0, j0 + NV·Lanes) (NV = 0: column j0
// alone): acc = Σ_k a(i,k) b(k,j) in order k = k0..p-1 (each step one fused
// multiply-add), then C = acc,
// C + acc or C - acc. a(i,k) = a[i·ars + k·acs]; B rows are contiguous.
template <GemmOp Op, std::size_t R, std::size_t NV, class T>
HWY_INLINE void gemm_tile(std::size_t i0, std::size_t j0, std::size_t k0, std::size_t p, const T* a,
                          std::size_t ars, std::size_t acs, const T* b, std::size_t ldb, T* c,
                          std::size_t ldc) {
  if constexpr (NV == 0) {
    T acc[R];
    for (std::size_t r = 0; r < R; ++r) acc[r] = 0;
    for (std::size_t k = k0; k < p; ++k) {
      const T bv = b[k * ldb + j0];
      for (std::size_t r = 0; r < R; ++r) acc[r] = std::fma(a[(i0 + r) * ars + k * acs], bv, acc[r]);
    }
    for (std::size_t r = 0; r < R; ++r) {
      T& dst = c[(i0 + r) * ldc + j0];
      if constexpr (Op == GemmOp::set) dst = acc[r];
      if constexpr (Op == GemmOp::add) dst = dst + acc[r];
      if constexpr (Op == GemmOp::sub) dst = dst - acc[r];
    }
  } else {
    const hn::ScalableTag<T> d;
    using V = hn::Vec<decltype(d)>;
    const std::size_t n = hn::Lanes(d);
    V acc[R][NV];
    for (std::size_t r = 0; r < R; ++r)
      for (std::size_t v = 0; v < NV; ++v) acc[r][v] = hn::Zero(d);
    for (std::size_t k = k0; k < p; ++k) {
      V bv[NV];
      for (std::size_t v = 0; v < NV; ++v) bv[v] = hn::LoadU(d, b + k * ldb + j0 + v * n);
      for (std::size_t r = 0; r < R; ++r) {
        const V av = hn::Set(d, a[(i0 + r) * ars + k * acs]);
        for (std::size_t v = 0; v < NV; ++v) acc[r][v] = fused_mul_add(d, av, bv[v], acc[r][v]);
      }
    }
    for (std::size_t r = 0; r < R; ++r) {
      T* dst = c + (i0 + r) * ldc + j0;
      for (std::size_t v = 0; v < NV; ++v) {
        if constexpr (Op == GemmOp::set) hn::StoreU(acc[r][v], d, dst + v * n);
        if constexpr (Op == GemmOp::add)
          hn::StoreU(hn::Add(hn::LoadU(d, dst + v * n), acc[r][v]), d, dst + v * n);
        if constexpr (Op == GemmOp::sub)
          hn::StoreU(hn::Sub(hn::LoadU(d, dst + v * n), acc[r][v]), d, dst + v * n);
      }
    }
  }
}

// Known zeros of a product, skipped per row tile [i0, i0 + R):
//   lower_a: A lower triangular (a(i,k) = 0 for k > i): k stops at i0 + R;
//   upper_a: A upper triangular (a(i,k) = 0 for k < i): k starts at i0 (the
//            skipped leading terms would leave the +0 accumulator unchanged);
//   lower_c: only C's columns j < i0 + R are wanted (those above may be left
//            as anything; every panel starting below i0 + R is computed).
enum class Tri { full, lower_a, upper_a, lower_c };

// Tiles of R rows of one column panel [j, j + NV·Lanes) (NV = 0: column j).
template <GemmOp Op, Tri kTri, std::size_t NV, class T>
HWY_INLINE void gemm_panel(std::size_t m, std::size_t j, std::size_t p, const T* a, std::size_t ars,
                           std::size_t acs, const T* b, std::size_t ldb, T* c, std::size_t ldc) {
  constexpr std::size_t R = kTileRows;
  const auto k_begin = [&](std::size_t i) {
    return kTri == Tri::upper_a ? std::min(i, p) : std::size_t{0};
  };
  const auto k_end = [&](std::size_t i, std::size_t r) {
    return kTri == Tri::lower_a ? std::min(p, i + r) : p;
  };
  // lower_c: a tile whose rows all end before the panel is not wanted.
  const auto wanted = [&](std::size_t i, std::size_t r) { return kTri != Tri::lower_c || j < i + r; };
  std::size_t i = 0;
  for (; i + R <= m; i += R)
    if (wanted(i, R)) gemm_tile<Op, R, NV>(i, j, k_begin(i), k_end(i, R), a, ars, acs, b, ldb, c, ldc);
  for (; i < m; ++i)
    if (wanted(i, 1)) gemm_tile<Op, 1, NV>(i, j, k_begin(i), k_end(i, 1), a, ars, acs, b, ldb, c, ldc);
}

// C (m×n_cols) op= A (m×p) · B (p×n_cols), with the zeros of kTri skipped.
// Column panels outermost: a panel of B (p × kPanelVecs vectors) stays in
// L1 while every row tile passes over it (row tiles outermost streamed all
// of B from L2 per tile: half the FMA rate at K = V = 128). The order of
// the tiles does not change any element's chain.
template <GemmOp Op, Tri kTri = Tri::full, class T>
void gemm(std::size_t m, std::size_t n_cols, std::size_t p, const T* a, std::size_t ars,
          std::size_t acs, const T* b, std::size_t ldb, T* c, std::size_t ldc) {
  const hn::ScalableTag<T> d;
  const std::size_t n = hn::Lanes(d);
  std::size_t j = 0;
  for (; j + kPanelVecs * n <= n_cols; j += kPanelVecs * n)
    gemm_panel<Op, kTri, kPanelVecs>(m, j, p, a, ars, acs, b, ldb, c, ldc);
  if constexpr (kPanelVecs > 1)
    for (; j + n <= n_cols; j += n) gemm_panel<Op, kTri, 1>(m, j, p, a, ars, acs, b, ldb, c, ldc);
  for (; j < n_cols; ++j) gemm_panel<Op, kTri, 0>(m, j, p, a, ars, acs, b, ldb, c, ldc);
}

// gemm<Op>(m, n_cols, p, a, ars, acs, b, ...) when every element of B is
// +0 (a zero state), without reading B: if every a(i,k) is finite, each
// chain fma(a, +0, ... fma(a, +0, +0)) is +0 (a finite times +0 is ±0, and
// ±0 + +0 is +0), so C becomes +0 (set), C + 0 (add: a -0 becomes +0) or
// stays as it is (sub: C - +0 is C, -0 included): the same bits as the
// product. Returns false, having written nothing, when A holds a non-finite
// value (inf · 0 is NaN): the caller runs the product then.
template <GemmOp Op, class T>
bool gemm_zero_b(std::size_t m, std::size_t n_cols, std::size_t p, const T* a, std::size_t ars,
                 std::size_t acs, T* c, std::size_t ldc) {
  bool finite = true;
  for (std::size_t i = 0; i < m; ++i) {
    const T* ai = a + i * ars;
    if (acs == 1) {
      for (std::size_t k = 0; k < p; ++k) finite &= ai[k] - ai[k] == T(0);  // false for ±inf, NaN
    } else {
      for (std::size_t k = 0; k < p; ++k) finite &= ai[k * acs] - ai[k * acs] == T(0);
    }
  }
  if (!finite) return false;
  if constexpr (Op != GemmOp::sub)
    for (std::size_t i = 0; i < m; ++i) {
      T* ci = c + i * ldc;
      for (std::size_t j = 0; j < n_cols; ++j) ci[j] = Op == GemmOp::set ? T(0) : ci[j] + T(0);
    }
  return true;
}

}  // namespace kdacp::detail::HWY_NAMESPACE
KDACP_TARGET_END;

#endif  // KDACP_KERNELS_GEMM_INL_H_
