// Per-target affine step C = op(M)·X + S (kernels.hpp), vectorised over the
// columns j of X; each accumulator lane computes acc = S[i][j] then
// fused_mul_add(op(M)[i][k], X[k][j], acc) for k = 0..K-1 in order (the FMA
// policy, table.hpp), so the register blocking (kRows rows × 2 vectors)
// never changes a result and every target gives step_scalar's std::fma bits.
// Installed in the kernel table per Highway target by step_hwy.cpp (and
// included by the tests), hence the toggle guard instead of #pragma once.
#if defined(KDACP_KERNELS_STEP_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KDACP_KERNELS_STEP_INL_H_
#undef KDACP_KERNELS_STEP_INL_H_
#else
#define KDACP_KERNELS_STEP_INL_H_
#endif

#include "kernels/per_target.h"

#include <hwy/highway.h>

#include <algorithm>
#include <cstddef>

#include "kernels/simd-inl.h"

KDACP_TARGET_BEGIN;
namespace kdacp::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Element (i, kk) of op(M).
template <bool kTranspose>
HWY_INLINE float MAt(const float* m, std::size_t ldm, std::size_t i, std::size_t kk) {
  return kTranspose ? m[kk * ldm + i] : m[i * ldm + kk];
}

// kRows × kCols-vector tile at (i0, j0); `next_rows` rows of the next row
// block are prefetched (0: none).
template <bool kTranspose, std::size_t kRows, std::size_t kCols, class D>
HWY_INLINE void Tile(D d, const float* m, std::size_t ldm, const float* x, std::size_t ldx,
                     const float* s, std::size_t lds, float* c, std::size_t ldc, std::size_t k,
                     std::size_t v, std::size_t i0, std::size_t j0, std::size_t next_rows) {
  using V = hn::Vec<D>;
  const std::size_t n = hn::Lanes(d);
  V acc[kRows][kCols];
  const std::size_t s_lines = (v + 15) / 16;
  for (std::size_t r = 0; r < kRows; ++r)
    for (std::size_t q = 0; q < kCols; ++q) acc[r][q] = hn::LoadU(d, s + (i0 + r) * lds + j0 + q * n);
  for (std::size_t kk = 0; kk < k; ++kk) {
    // Pull the next row block's M and S toward L1 while this tile computes:
    // a chain streams fresh M and S at every step, and the hardware
    // prefetcher does not follow kRows interleaved row streams early enough.
    // One 64-byte line per row and 16 floats; S lines spread over the first
    // iterations so that they never burst.
    if (next_rows > 0) {
      if (kTranspose) {
        __builtin_prefetch(m + kk * ldm + i0 + kRows);
      } else if (kk % 16 == 0) {
        for (std::size_t r = 0; r < next_rows; ++r) __builtin_prefetch(m + (i0 + kRows + r) * ldm + kk);
      }
      if (kk < next_rows * s_lines)
        __builtin_prefetch(s + (i0 + kRows + kk / s_lines) * lds + kk % s_lines * 16);
    }
    V xv[kCols];
    for (std::size_t q = 0; q < kCols; ++q) xv[q] = hn::LoadU(d, x + kk * ldx + j0 + q * n);
    for (std::size_t r = 0; r < kRows; ++r) {
      const V a = hn::Set(d, MAt<kTranspose>(m, ldm, i0 + r, kk));
      for (std::size_t q = 0; q < kCols; ++q) acc[r][q] = fused_mul_add(d, a, xv[q], acc[r][q]);
    }
  }
  for (std::size_t r = 0; r < kRows; ++r)
    for (std::size_t q = 0; q < kCols; ++q) hn::StoreU(acc[r][q], d, c + (i0 + r) * ldc + j0 + q * n);
}

// Columns j0..j0+w-1 (w < one vector) of rows i0..i1-1, one lane at a time
// with the same operation order.
template <bool kTranspose>
HWY_INLINE void ScalarColumns(const float* m, std::size_t ldm, const float* x, std::size_t ldx,
                              const float* s, std::size_t lds, float* c, std::size_t ldc,
                              std::size_t k, std::size_t i0, std::size_t i1, std::size_t j0,
                              std::size_t j1) {
  const hn::CappedTag<float, 1> d1;
  for (std::size_t i = i0; i < i1; ++i)
    for (std::size_t j = j0; j < j1; ++j) {
      auto acc = hn::LoadU(d1, s + i * lds + j);
      for (std::size_t kk = 0; kk < k; ++kk)
        acc = fused_mul_add(d1, hn::Set(d1, MAt<kTranspose>(m, ldm, i, kk)), hn::LoadU(d1, x + kk * ldx + j),
                            acc);
      hn::StoreU(acc, d1, c + i * ldc + j);
    }
}

template <bool kTranspose>
void StepImpl(const float* m, std::size_t ldm, const float* x, std::size_t ldx, const float* s,
              std::size_t lds, float* c, std::size_t ldc, std::size_t k, std::size_t v) {
  const hn::ScalableTag<float> d;
  const std::size_t n = hn::Lanes(d);
  // 32 vector registers (AVX-512, NEON) hold an 8×2 accumulator tile; 16
  // (AVX2, SSE4) a 4×2 one.
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL || HWY_ARCH_ARM
  constexpr std::size_t kRows = 8;
#else
  constexpr std::size_t kRows = 4;
#endif
  const std::size_t rows_main = k / kRows * kRows;
  const std::size_t cols2 = v / (2 * n) * (2 * n);
  const std::size_t cols1 = v / n * n;
  for (std::size_t i0 = 0; i0 < rows_main; i0 += kRows) {
    // The first tile of a row block fetches the next block's rows of M and
    // S, each column tile of them: S rows are read once per tile.
    const std::size_t next = i0 + kRows < k ? std::min(kRows, k - i0 - kRows) : 0;
    for (std::size_t j0 = 0; j0 < cols2; j0 += 2 * n)
      Tile<kTranspose, kRows, 2>(d, m, ldm, x, ldx, s, lds, c, ldc, k, v, i0, j0, j0 == 0 ? next : 0);
    if (cols1 > cols2) Tile<kTranspose, kRows, 1>(d, m, ldm, x, ldx, s, lds, c, ldc, k, v, i0, cols2, 0);
  }
  for (std::size_t i0 = rows_main; i0 < k; ++i0) {
    for (std::size_t j0 = 0; j0 < cols2; j0 += 2 * n)
      Tile<kTranspose, 1, 2>(d, m, ldm, x, ldx, s, lds, c, ldc, k, v, i0, j0, 0);
    if (cols1 > cols2) Tile<kTranspose, 1, 1>(d, m, ldm, x, ldx, s, lds, c, ldc, k, v, i0, cols2, 0);
  }
  if (v > cols1) ScalarColumns<kTranspose>(m, ldm, x, ldx, s, lds, c, ldc, k, 0, k, cols1, v);
}

inline void Step(const float* m, std::size_t ldm, const float* x, std::size_t ldx, const float* s,
                 std::size_t lds, float* c, std::size_t ldc, std::size_t k, std::size_t v,
                 bool transpose) {
  if (transpose) {
    StepImpl<true>(m, ldm, x, ldx, s, lds, c, ldc, k, v);
  } else {
    StepImpl<false>(m, ldm, x, ldx, s, lds, c, ldc, k, v);
  }
}

}  // namespace kdacp::detail::HWY_NAMESPACE
KDACP_TARGET_END;

#endif  // KDACP_KERNELS_STEP_INL_H_
