// Per-target triangular solves of the chunk kernels (kda_chunk-inl.h has the
// math): the forward's (I + Diag(β) L)⁻¹ Diag(β) and the backward's
// (I + Diag(β) L)⁻ᵀ, each by blocks of kSub rows, one product for the rows
// outside a block and substitution inside it. Included once per Highway
// target, hence the toggle guard instead of #pragma once.
#if defined(KDACP_KERNELS_KDA_CHUNK_SOLVE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KDACP_KERNELS_KDA_CHUNK_SOLVE_INL_H_
#undef KDACP_KERNELS_KDA_CHUNK_SOLVE_INL_H_
#else
#define KDACP_KERNELS_KDA_CHUNK_SOLVE_INL_H_
#endif

#include "kernels/per_target.h"

#include <hwy/highway.h>

#include <algorithm>
#include <cstddef>

#include "kernels/kda_chunk.hpp"
#include "kernels/gemm-inl.h"
#include "kernels/simd-inl.h"

KDACP_TARGET_BEGIN;
namespace kdacp::kda::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using namespace ::kdacp::detail::HWY_NAMESPACE;  // src/kernels: simd-inl.h, gemm-inl.h

// The nx columns at X (c rows of stride ldx, holding the right-hand side Y)
// become (I + Diag(β) L)⁻¹ Diag(β) Y, by blocks of kSub rows: the rows above
// a block are subtracted with one product, then forward substitution inside
// the block.
template <class T>
void chunk_solve(std::size_t c, T* X, std::size_t ldx, std::size_t nx, const ChunkWork<T>& w) {
  const T* L = w.L.data();
  for (std::size_t b = 0; b < c; b += kSub) {
    const std::size_t e = std::min(b + kSub, c);
    if (b > 0)
      gemm<GemmOp::sub>(e - b, nx, b, L + b * kChunk, kChunk, std::size_t{1}, X, ldx, X + b * ldx, ldx);
    for (std::size_t t = b; t < e; ++t) {
      T* HWY_RESTRICT xt = X + t * ldx;
      for (std::size_t s = b; s < t; ++s) {
        const T l = L[t * kChunk + s];
        const T* HWY_RESTRICT xs = X + s * ldx;
        for_vecs<T>(
            nx,
            [&](auto d, std::size_t j) {
              hn::StoreU(hn::Sub(hn::LoadU(d, xt + j), hn::Mul(hn::Set(d, l), hn::LoadU(d, xs + j))),
                         d, xt + j);
            },
            [&](std::size_t j) { xt[j] = xt[j] - l * xs[j]; });
      }
      const T bt = w.beta[t];
      for_vecs<T>(
          nx,
          [&](auto d, std::size_t j) {
            hn::StoreU(hn::Mul(hn::Set(d, bt), hn::LoadU(d, xt + j)), d, xt + j);
          },
          [&](std::size_t j) { xt[j] = bt * xt[j]; });
    }
  }
}

// The adjoint solve of the backward: the nz columns at Z (c rows of stride
// ldz, holding dΔ) become (I + Diag(β) L)⁻ᵀ dΔ, by blocks of kSub rows from
// the last: the rows below a block are subtracted with one product, then
// back substitution inside the block. lb (kChunk×kChunk) receives β_t L_ts.
template <class T>
void chunk_solve_adjoint(std::size_t c, T* Z, std::size_t ldz, std::size_t nz, T* lb,
                         const ChunkWork<T>& w) {
  for (std::size_t t = 0; t < c; ++t)
    for (std::size_t s2 = 0; s2 < c; ++s2) lb[t * kChunk + s2] = w.beta[t] * w.L[t * kChunk + s2];
  const std::size_t n_sub = (c + kSub - 1) / kSub;
  for (std::size_t sb = n_sub; sb-- > 0;) {
    const std::size_t b = sb * kSub, e = std::min(b + kSub, c);
    if (e < c)  // Z_t -= Σ_{r ≥ e} β_r L_rt Z_r
      gemm<GemmOp::sub>(e - b, nz, c - e, lb + e * kChunk + b, std::size_t{1}, kChunk,
                        Z + e * ldz, ldz, Z + b * ldz, ldz);
    for (std::size_t t = e; t-- > b;) {
      T* HWY_RESTRICT zt = Z + t * ldz;
      for (std::size_t r = t + 1; r < e; ++r) {
        const T l = lb[r * kChunk + t];
        const T* HWY_RESTRICT zr = Z + r * ldz;
        for_vecs<T>(
            nz,
            [&](auto d, std::size_t j) {
              hn::StoreU(hn::Sub(hn::LoadU(d, zt + j), hn::Mul(hn::Set(d, l), hn::LoadU(d, zr + j))),
                         d, zt + j);
            },
            [&](std::size_t j) { zt[j] = zt[j] - l * zr[j]; });
      }
    }
  }
}

}  // namespace kdacp::kda::detail::HWY_NAMESPACE
KDACP_TARGET_END;

#endif  // KDACP_KERNELS_KDA_CHUNK_SOLVE_INL_H_
