// Per-target exact handling of strong gates in the chunk kernels
// (kda_chunk-inl.h, "Strong decay"): which key channels of a sub-chunk leave the
// range where the diagonal block may be factorised, and those channels'
// share of the diagonal block of L and P (forward) and its adjoint
// (backward), pair by pair with running products. Included once per Highway
// target, hence the toggle guard instead of #pragma once.
#if defined(KDACP_KERNELS_KDA_CHUNK_EXACT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KDACP_KERNELS_KDA_CHUNK_EXACT_INL_H_
#undef KDACP_KERNELS_KDA_CHUNK_EXACT_INL_H_
#else
#define KDACP_KERNELS_KDA_CHUNK_EXACT_INL_H_
#endif

#include "kernels/per_target.h"

#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

#include "kernels/kda_chunk.hpp"
#include "kernels/simd-inl.h"

KDACP_TARGET_BEGIN;
namespace kdacp::kda::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using namespace ::kdacp::detail::HWY_NAMESPACE;  // src/kernels: simd-inl.h, gemm-inl.h

// The factorisable range of a sub-chunk's decay products F_t = Π(b,t]: a
// channel's diagonal block is factorised as (k_t F_t)·(k_s / F_s) only while
// every F of the sub-chunk is in [2^(min_exponent + digits), 2^(max_exponent
// - 8)] (so k·F and q·F keep full precision for |k|, |q| ≥ 2^-digits) and
// every k/F is finite; otherwise (strong decay: in float an average g below about -4.6
// per token over the 15 steps) that channel's pairs are computed exactly.
// Fills w.ok and w.bad for the nr rows of fr (F) and brow (k/F).
template <class T>
void classify_channels(const T* HWY_RESTRICT fr, const T* HWY_RESTRICT brow, std::size_t nr,
                       std::size_t kd, ChunkWork<T>& w) {
  const T lo = std::ldexp(T(1), std::numeric_limits<T>::min_exponent + std::numeric_limits<T>::digits);
  const T hi = std::ldexp(T(1), std::numeric_limits<T>::max_exponent - 8);
  constexpr T kMax = std::numeric_limits<T>::max();
  T* HWY_RESTRICT ok = w.ok.data();
  for (std::size_t i = 0; i < kd; ++i) ok[i] = 1;
  // ok = 0 where a row is out of range; the comparisons are false for NaN,
  // so such a channel is exact too.
  for (std::size_t t = 0; t < nr; ++t) {
    const T* HWY_RESTRICT f = fr + t * kd;
    const T* HWY_RESTRICT bv = brow + t * kd;
    for_vecs<T>(
        kd,
        [&](auto d, std::size_t i) {
          const auto fv = hn::LoadU(d, f + i);
          const auto in = hn::And(hn::And(hn::Ge(fv, hn::Set(d, lo)), hn::Le(fv, hn::Set(d, hi))),
                                  hn::Le(hn::Abs(hn::LoadU(d, bv + i)), hn::Set(d, kMax)));
          hn::StoreU(hn::IfThenElseZero(in, hn::LoadU(d, ok + i)), d, ok + i);
        },
        [&](std::size_t i) {
          if (!(f[i] >= lo) || !(f[i] <= hi) || !(std::abs(bv[i]) <= kMax)) ok[i] = 0;
        });
  }
  w.bad.clear();
  for (std::size_t i = 0; i < kd; ++i)
    if (ok[i] == T(0)) w.bad.push_back(i);
}

// The exact channels (w.bad) of rows [b, e) gathered into compact rows of
// nb = |bad| columns: kb, qb, ab (α), row t - b.
template <class T>
void gather_exact(const T* k, const T* q, const T* al, std::size_t b, std::size_t e,
                  std::size_t kd, ChunkWork<T>& w) {
  const std::size_t nb = w.bad.size();
  const std::size_t* bad = w.bad.data();
  for (std::size_t t = b; t < e; ++t) {
    T* HWY_RESTRICT kr = w.kb.data() + (t - b) * nb;
    T* HWY_RESTRICT qr = w.qb.data() + (t - b) * nb;
    T* HWY_RESTRICT ar = w.ab.data() + (t - b) * nb;
    for (std::size_t j = 0; j < nb; ++j) {
      kr[j] = k[t * kd + bad[j]];
      qr[j] = q[t * kd + bad[j]];
      ar[j] = al[t * kd + bad[j]];
    }
  }
}

// The exact channels' share of the diagonal block of sub-chunk [b, e):
// L_ts += Σ_j k_tj x_j, P_ts += Σ_j q_tj x_j with x = Π(s,t] ⊙ k_s by
// running products (element-wise, so any vector width gives the same
// bits), the sums by lane_dot's fixed order.
template <class T>
void exact_block_forward(const T* k, const T* q, const T* al, std::size_t b, std::size_t e,
                         std::size_t kd, bool need_p, T* L, T* P, ChunkWork<T>& w) {
  gather_exact(k, q, al, b, e, kd, w);
  const std::size_t nb = w.bad.size();
  const T* kb = w.kb.data();
  const T* qb = w.qb.data();
  const T* ab = w.ab.data();
  T* HWY_RESTRICT x = w.xb.data();
  for (std::size_t s = b; s < e; ++s) {
    std::copy_n(kb + (s - b) * nb, nb, x);
    for (std::size_t t = s; t < e; ++t) {
      const std::size_t r = (t - b) * nb;
      if (t > s) {
        const T* HWY_RESTRICT a = ab + r;
        for_vecs<T>(
            nb,
            [&](auto d, std::size_t j) {
              hn::StoreU(hn::Mul(hn::LoadU(d, x + j), hn::LoadU(d, a + j)), d, x + j);
            },
            [&](std::size_t j) { x[j] = x[j] * a[j]; });
        L[t * kChunk + s] = L[t * kChunk + s] + lane_dot(kb + r, x, nb);
      }
      if (need_p) P[t * kChunk + s] = P[t * kChunk + s] + lane_dot(qb + r, x, nb);
    }
  }
}

// The adjoint of exact_block_forward's pairs s < t (the diagonal of P is
// handled with every channel): with y = Π(s,t], x = y ⊙ k_s and
// u = dL_ts k_t + dP_ts q_t, dk_t += dL_ts x, dq_t += dP_ts x, dk_s += y ⊙ u,
// dγ_t += u ⊙ x, dγ_s -= u ⊙ x; summed in compact rows, then added to
// gk, gq, gg (c×K) once per element.
template <class T>
void exact_block_backward(const T* k, const T* q, const T* al, std::size_t b, std::size_t e,
                          std::size_t kd, std::size_t c, const T* dL, const T* dP, T* gk, T* gq,
                          T* gg, ChunkWork<T>& w) {
  gather_exact(k, q, al, b, e, kd, w);
  const std::size_t nb = w.bad.size(), nr = e - b;
  const T* kb = w.kb.data();
  const T* qb = w.qb.data();
  const T* ab = w.ab.data();
  T* gkb = w.gkb.data();
  T* gqb = w.gqb.data();
  T* ggb = w.ggb.data();
  std::fill_n(gkb, nr * nb, T(0));
  std::fill_n(gqb, nr * nb, T(0));
  std::fill_n(ggb, nr * nb, T(0));
  T* HWY_RESTRICT y = w.xb.data();
  for (std::size_t s = b; s < e; ++s) {
    const std::size_t rs = (s - b) * nb;
    std::fill_n(y, nb, T(1));
    const T* HWY_RESTRICT ks = kb + rs;
    T* HWY_RESTRICT gks = gkb + rs;
    T* HWY_RESTRICT ggs = ggb + rs;
    for (std::size_t t = s + 1; t < e; ++t) {
      const std::size_t rt = (t - b) * nb;
      const T cl = dL[t * c + s], cp = dP[t * c + s];
      const T* HWY_RESTRICT a = ab + rt;
      const T* HWY_RESTRICT kt = kb + rt;
      const T* HWY_RESTRICT qt = qb + rt;
      T* HWY_RESTRICT gkt = gkb + rt;
      T* HWY_RESTRICT gqt = gqb + rt;
      T* HWY_RESTRICT ggt = ggb + rt;
      for_vecs<T>(
          nb,
          [&](auto d, std::size_t j) {
            const auto yv = hn::Mul(hn::LoadU(d, y + j), hn::LoadU(d, a + j));
            hn::StoreU(yv, d, y + j);
            const auto xi = hn::Mul(yv, hn::LoadU(d, ks + j));
            const auto u = hn::Add(hn::Mul(hn::Set(d, cl), hn::LoadU(d, kt + j)),
                                   hn::Mul(hn::Set(d, cp), hn::LoadU(d, qt + j)));
            hn::StoreU(hn::Add(hn::LoadU(d, gkt + j), hn::Mul(hn::Set(d, cl), xi)), d, gkt + j);
            hn::StoreU(hn::Add(hn::LoadU(d, gqt + j), hn::Mul(hn::Set(d, cp), xi)), d, gqt + j);
            hn::StoreU(hn::Add(hn::LoadU(d, gks + j), hn::Mul(yv, u)), d, gks + j);
            const auto dgm = hn::Mul(u, xi);
            hn::StoreU(hn::Add(hn::LoadU(d, ggt + j), dgm), d, ggt + j);
            hn::StoreU(hn::Sub(hn::LoadU(d, ggs + j), dgm), d, ggs + j);
          },
          [&](std::size_t j) {
            y[j] = y[j] * a[j];
            const T xi = y[j] * ks[j];
            const T u = cl * kt[j] + cp * qt[j];
            gkt[j] = gkt[j] + cl * xi;
            gqt[j] = gqt[j] + cp * xi;
            gks[j] = gks[j] + y[j] * u;
            const T dgm = u * xi;
            ggt[j] = ggt[j] + dgm;
            ggs[j] = ggs[j] - dgm;
          });
    }
  }
  const std::size_t* bad = w.bad.data();
  for (std::size_t t = b; t < e; ++t) {
    const std::size_t r = (t - b) * nb;
    for (std::size_t j = 0; j < nb; ++j) {
      const std::size_t x = t * kd + bad[j];
      gk[x] = gk[x] + gkb[r + j];
      gq[x] = gq[x] + gqb[r + j];
      gg[x] = gg[x] + ggb[r + j];
    }
  }
}

}  // namespace kdacp::kda::detail::HWY_NAMESPACE
KDACP_TARGET_END;

#endif  // KDACP_KERNELS_KDA_CHUNK_EXACT_INL_H_
