// Per-target backward kernel of the chunkwise algorithm (kda_chunk-inl.h has
// the math): the adjoint of chunk_forward-inl.h, one head at a time.
// Included once per Highway target, hence the toggle guard instead of
// #pragma once.
#if defined(KDACP_KERNELS_KDA_CHUNK_BACKWARD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KDACP_KERNELS_KDA_CHUNK_BACKWARD_INL_H_
#undef KDACP_KERNELS_KDA_CHUNK_BACKWARD_INL_H_
#else
#define KDACP_KERNELS_KDA_CHUNK_BACKWARD_INL_H_
#endif

#include "kernels/per_target.h"

#include <hwy/highway.h>

#include <algorithm>
#include <cstddef>
#include <type_traits>

#include "kernels/kda_chunk.hpp"
#include "kernels/kda_chunk_exact-inl.h"
#include "kernels/kda_chunk_forward-inl.h"
#include "kernels/kda_chunk_solve-inl.h"
#include "kernels/kda_heads.hpp"
#include "kernels/gemm-inl.h"
#include "kernels/simd-inl.h"

KDACP_TARGET_BEGIN;
namespace kdacp::kda::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using namespace ::kdacp::detail::HWY_NAMESPACE;  // src/kernels: simd-inl.h, gemm-inl.h

// One chunk of the backward's pass 2: its place, its operands (views into
// the record and the scratch) and the flags of its known +0 operands. The
// adjoints it computes stay in ChunkBackWork, named after the math's
// quantities; each stage below reads the previous stages' ones there.
template <class T>
struct ChunkAdjoint {
  std::size_t t0, c, kd, vd;
  T scale;
  // Known +0 operands (gemm_zero_b): S_0 of the first chunk without an
  // incoming state, dS after the last without d_final (a short document's
  // one chunk has both).
  bool s0_zero, ds_zero;
  const T* s0;  // S_0, K×V: the state entering the chunk
  const T* rr;  // R, c×V
  const T* dl;  // Δ, c×V
  T* ds;        // dS at the end of the chunk, K×V; dS_0 after state_adjoint
  T* dob;       // dO, c×V
  T* dlt;       // Δᵀ, V×c
  // S_0ᵀ and dSᵀ (V×K), each made when a product first reads it.
  T* s0t;
  T* dst;
  bool s0t_made = false, dst_made = false;

  const T* s0_t() {
    if (!s0t_made) transpose(s0, kd, vd, vd, s0t, kd);
    s0t_made = true;
    return s0t;
  }
  const T* ds_t() {
    if (!dst_made) transpose(ds, kd, vd, vd, dst, kd);
    dst_made = true;
    return dst;
  }
};

// The adjoint of the chunk's output and end state:
//   dΔ = scale Pᵀ dO + Kr dS,   dP = scale dO Δᵀ,   dQg = scale dO S_0ᵀ,
//   dKr = Δ dSᵀ,   da_c = rowsum(dS ⊙ S_0).
template <class T>
void output_adjoint(ChunkAdjoint<T>& a, ChunkWork<T>& w, ChunkBackWork<T>& bw) {
  const std::size_t c = a.c, kd = a.kd, vd = a.vd;
  const T scale = a.scale;
  const bool s0_zero = a.s0_zero, ds_zero = a.ds_zero;
  const T* s0 = a.s0;
  const T* dl = a.dl;
  const T* ds = a.ds;
  const T* dob = a.dob;
  const T* dlt = a.dlt;
  // dΔ = scale Pᵀ dO + Kr dS.
  T* dd = bw.dd.data();
  gemm<GemmOp::set, Tri::upper_a>(c, vd, c, w.P.data(), std::size_t{1}, kChunk, dob, vd, dd,
                                   vd);
  for (std::size_t i = 0; i < c * vd; ++i) dd[i] = scale * dd[i];
  if (!(ds_zero && gemm_zero_b<GemmOp::add>(c, vd, kd, w.kr.data(), kd, std::size_t{1}, dd, vd)))
    gemm<GemmOp::add>(c, vd, kd, w.kr.data(), kd, std::size_t{1}, ds, vd, dd, vd);
  // dP = scale dO Δᵀ (lower, incl. the diagonal), dQg = scale dO S_0ᵀ, dKr = Δ dSᵀ.
  T* dP = bw.dP.data();  // c×c
  gemm<GemmOp::set, Tri::lower_c>(c, c, vd, dob, vd, std::size_t{1}, dlt, c, dP, c);
  for (std::size_t i = 0; i < c * c; ++i) dP[i] = scale * dP[i];
  T* HWY_RESTRICT dqg = bw.dqg.data();
  if (!(s0_zero && gemm_zero_b<GemmOp::set>(c, kd, vd, dob, vd, std::size_t{1}, dqg, kd)))
    gemm<GemmOp::set>(c, kd, vd, dob, vd, std::size_t{1}, a.s0_t(), kd, dqg, kd);
  for (std::size_t i = 0; i < c * kd; ++i) dqg[i] = scale * dqg[i];
  T* HWY_RESTRICT dkr = bw.dkr.data();
  if (!(ds_zero && gemm_zero_b<GemmOp::set>(c, kd, vd, dl, vd, std::size_t{1}, dkr, kd)))
    gemm<GemmOp::set>(c, kd, vd, dl, vd, std::size_t{1}, a.ds_t(), kd, dkr, kd);
  // da_c (+0 when both are +0: each lane sums +0 · +0 onto +0).
  T* dac = bw.dac.data();
  for (std::size_t i = 0; i < kd; ++i)
    dac[i] = s0_zero && ds_zero ? T(0) : lane_dot(ds + i * vd, s0 + i * vd, vd);
}

// The adjoint of the solve, Δ = (I + Diag(β) L)⁻¹ Diag(β) R with
// R = V - Kg S_0:
//   Z = (I + Diag(β) L)⁻ᵀ dΔ,   dR = dV = Diag(β) Z,   dKg = -dR S_0ᵀ,
//   dβ_t = Z_t·R_t - Σ_{s<t} (Z_t·Δ_s) L_ts,   dL_ts = -β_t Z_t·Δ_s.
template <class T>
void solve_adjoint(ChunkAdjoint<T>& a, const HeadGrads<T>& out, ChunkWork<T>& w,
                   ChunkBackWork<T>& bw) {
  const std::size_t t0 = a.t0, c = a.c, kd = a.kd, vd = a.vd;
  const bool s0_zero = a.s0_zero;
  const T* rr = a.rr;
  const T* dlt = a.dlt;
  const T* dd = bw.dd.data();
  // Z = (I + Diag(β) L)⁻ᵀ dΔ (chunk_solve_adjoint); then dR = Diag(β) Z.
  T* Z = bw.z.data();  // c×V
  for (std::size_t i = 0; i < c * vd; ++i) Z[i] = dd[i];
  chunk_solve_adjoint(c, Z, vd, vd, bw.lb.data(), w);
  // M1 = Z Δᵀ (c×c, the strictly lower part is used).
  T* m1 = bw.m1.data();
  gemm<GemmOp::set, Tri::lower_c>(c, c, vd, Z, vd, std::size_t{1}, dlt, c, m1, c);
  // dβ, dv (= dR), dL; dKg = -dR S_0ᵀ.
  T* HWY_RESTRICT dkg = bw.dkg.data();
  T* HWY_RESTRICT dL = bw.dL.data();  // c×c
  T* dR = bw.xt.data();  // c×V: dR
  for (std::size_t t = 0; t < c; ++t) {
    const T bt = w.beta[t];
    const T* zt = Z + t * vd;
    const T* rt = rr + t * vd;
    out.dbeta[(t0 + t) * out.beta_stride] =
        lane_dot(zt, rt, vd) - lane_dot(m1 + t * c, w.L.data() + t * kChunk, t);
    T* dvt = out.dv + (t0 + t) * out.v_stride;
    for (std::size_t j = 0; j < vd; ++j) dvt[j] = dR[t * vd + j] = bt * zt[j];
    for (std::size_t s2 = 0; s2 < c; ++s2) dL[t * c + s2] = s2 < t ? -bt * m1[t * c + s2] : T(0);
  }
  if (!(s0_zero && gemm_zero_b<GemmOp::set>(c, kd, vd, dR, vd, std::size_t{1}, dkg, kd)))
    gemm<GemmOp::set>(c, kd, vd, dR, vd, std::size_t{1}, a.s0_t(), kd, dkg, kd);
  for (std::size_t i = 0; i < c * kd; ++i) dkg[i] = -dkg[i];
}

// The decay factors of Kg, Qg, Kr and a_c, and the diagonal of P: dk, dq
// and dγ (c×K each) from dKg, dQg, dKr, da_c and dP. Every factor is exp of
// a difference of cumulative log-decays γ, so each product
// x = k ⊙ e^{γ_a - γ_b} gives dk = dx ⊙ e^{..}, dγ_a += dx ⊙ x,
// dγ_b -= dx ⊙ x.
template <class T>
void decay_adjoint(const ChunkAdjoint<T>& a, ChunkWork<T>& w, ChunkBackWork<T>& bw) {
  const std::size_t c = a.c, kd = a.kd;
  const T* k = w.k.data();
  const T* q = w.q.data();
  const T* al = w.alpha.data();
  const T* dkg = bw.dkg.data();
  const T* dqg = bw.dqg.data();
  const T* dkr = bw.dkr.data();
  const T* dac = bw.dac.data();
  const T* dP = bw.dP.data();
  // Gradients of the decay factors: dk, dq, dγ (c×K each).
  T* HWY_RESTRICT gk = bw.gk.data();
  T* HWY_RESTRICT gq = bw.gq.data();
  T* HWY_RESTRICT gg = bw.gg.data();
  T* HWY_RESTRICT run = w.run.data();
  // Kg, Qg: factor Π(-1,t] = e^{γ_t}; Kr: Π(s,c-1] = e^{γ_{c-1} - γ_s}.
  for (std::size_t i = 0; i < kd; ++i) run[i] = 1;
  const T* wkg = w.kg.data();
  const T* wqg = w.qg.data();
  const T* wkr = w.kr.data();
  for (std::size_t t = 0; t < c; ++t) {
    const std::size_t o = t * kd;
    for_vecs<T>(
        kd,
        [&](auto d, std::size_t i) {
          const std::size_t x = o + i;
          const auto r = hn::Mul(hn::LoadU(d, run + i), hn::LoadU(d, al + x));
          hn::StoreU(r, d, run + i);
          const auto a = hn::LoadU(d, dkg + x), bq = hn::LoadU(d, dqg + x);
          hn::StoreU(hn::Mul(a, r), d, gk + x);
          hn::StoreU(hn::Mul(bq, r), d, gq + x);
          hn::StoreU(hn::Add(hn::Mul(a, hn::LoadU(d, wkg + x)), hn::Mul(bq, hn::LoadU(d, wqg + x))),
                     d, gg + x);
        },
        [&](std::size_t i) {
          const std::size_t x = o + i;
          run[i] = run[i] * al[x];
          gk[x] = dkg[x] * run[i];
          gq[x] = dqg[x] * run[i];
          gg[x] = dkg[x] * wkg[x] + dqg[x] * wqg[x];
        });
  }
  T* HWY_RESTRICT last = bw.last.data();  // dγ_{c-1} from Kr and a_c
  for (std::size_t i = 0; i < kd; ++i) {
    run[i] = 1;
    last[i] = dac[i] * w.ac[i];
  }
  // Kr_{c-1} = k_{c-1} has no decay factor: its dγ_{c-1} terms (+ and -)
  // would cancel exactly, so they are skipped rather than added and
  // subtracted (that would leave an O(|dkr·k|) rounding error in dg, which
  // under strong decay is far larger than dg itself).
  for (std::size_t s2 = c; s2-- > 0;) {
    const std::size_t o = s2 * kd;
    const bool more = s2 > 0, decayed = s2 + 1 < c;
    for_vecs<T>(
        kd,
        [&](auto d, std::size_t i) {
          const std::size_t x = o + i;
          const auto r = hn::LoadU(d, run + i), a = hn::LoadU(d, dkr + x);
          hn::StoreU(hn::Add(hn::LoadU(d, gk + x), hn::Mul(a, r)), d, gk + x);
          if (decayed) {
            const auto dx = hn::Mul(a, hn::LoadU(d, wkr + x));
            hn::StoreU(hn::Sub(hn::LoadU(d, gg + x), dx), d, gg + x);
            hn::StoreU(hn::Add(hn::LoadU(d, last + i), dx), d, last + i);
          }
          if (more) hn::StoreU(hn::Mul(r, hn::LoadU(d, al + x)), d, run + i);
        },
        [&](std::size_t i) {
          const std::size_t x = o + i;
          gk[x] = gk[x] + dkr[x] * run[i];
          if (decayed) {
            const T dx = dkr[x] * wkr[x];
            gg[x] = gg[x] - dx;
            last[i] = last[i] + dx;
          }
          if (more) run[i] = run[i] * al[x];
        });
  }
  for (std::size_t i = 0; i < kd; ++i) gg[(c - 1) * kd + i] = gg[(c - 1) * kd + i] + last[i];

  // The diagonal of P, P_tt = q_t·k_t (no decay factor, so no dγ): exact.
  for (std::size_t t = 0; t < c; ++t) {
    const T dpt = dP[t * c + t];
    const std::size_t o = t * kd;
    for_vecs<T>(
        kd,
        [&](auto d, std::size_t i) {
          const auto cp = hn::Set(d, dpt);
          hn::StoreU(hn::Add(hn::LoadU(d, gq + o + i), hn::Mul(cp, hn::LoadU(d, k + o + i))), d, gq + o + i);
          hn::StoreU(hn::Add(hn::LoadU(d, gk + o + i), hn::Mul(cp, hn::LoadU(d, q + o + i))), d, gk + o + i);
        },
        [&](std::size_t i) {
          gq[o + i] = gq[o + i] + dpt * k[o + i];
          gk[o + i] = gk[o + i] + dpt * q[o + i];
        });
  }
}

// Sub-chunk σ = [b, e) of the rest of L and P: the factors of its rows
// (F_t, [Kf; Qf] in amat), Bm (Kb_s for s < b, Kinv_s = k_s / F_s for
// s ∈ σ) and the factor of each Bm row, with the forward's split of the
// channels (the exact ones' Kinv entries are zeros).
template <class T>
void subchunk_factors(std::size_t b, std::size_t e, std::size_t kd, ChunkWork<T>& w,
                      ChunkBackWork<T>& bw) {
  const std::size_t nr = e - b;
  const T* k = w.k.data();
  const T* q = w.q.data();
  const T* al = w.alpha.data();
  T* HWY_RESTRICT run = w.run.data();
  T* HWY_RESTRICT am = w.amat.data();   // (2·nr)×K
  T* HWY_RESTRICT bmr = bw.bmr.data();  // ncol×K: Kb_s (s < b), Kinv_s (s ∈ σ)
  T* HWY_RESTRICT fac = bw.fac.data();  // ncol×K: the factor of each bmr row (F_t for t ∈ σ in am)
  T* HWY_RESTRICT ff = bw.ff.data();    // nr×K: F_t
  for (std::size_t i = 0; i < kd; ++i) run[i] = 1;
  for (std::size_t t = b; t < e; ++t) {
    const bool step = t > b;
    const std::size_t x0 = t * kd, y0 = (t - b) * kd, yq0 = (nr + t - b) * kd;
    for_vecs<T>(
        kd,
        [&](auto d, std::size_t i) {
          auto f = hn::LoadU(d, run + i);
          if (step) {
            f = hn::Mul(f, hn::LoadU(d, al + x0 + i));
            hn::StoreU(f, d, run + i);
          }
          hn::StoreU(f, d, ff + y0 + i);
          const auto kv = hn::LoadU(d, k + x0 + i);
          hn::StoreU(hn::Mul(kv, f), d, am + y0 + i);
          hn::StoreU(hn::Mul(hn::LoadU(d, q + x0 + i), f), d, am + yq0 + i);
          hn::StoreU(hn::Div(kv, f), d, bmr + x0 + i);
        },
        [&](std::size_t i) {
          if (step) run[i] = run[i] * al[x0 + i];
          const T f = run[i];
          ff[y0 + i] = f;
          am[y0 + i] = k[x0 + i] * f;
          am[yq0 + i] = q[x0 + i] * f;
          bmr[x0 + i] = k[x0 + i] / f;
        });
  }
  // The forward's split of the channels (the same products, the same bits).
  classify_channels(ff, bmr + b * kd, nr, kd, w);
  for (std::size_t i : w.bad)
    for (std::size_t s2 = b; s2 < e; ++s2) bmr[s2 * kd + i] = 0;
  for (std::size_t i = 0; i < kd; ++i) run[i] = 1;
  for (std::size_t s2 = b; s2-- > 0;) {
    const std::size_t x0 = s2 * kd, a0 = (s2 + 1) * kd;
    for_vecs<T>(
        kd,
        [&](auto d, std::size_t i) {
          const auto r = hn::Mul(hn::LoadU(d, run + i), hn::LoadU(d, al + a0 + i));
          hn::StoreU(r, d, run + i);
          hn::StoreU(r, d, fac + x0 + i);
          hn::StoreU(hn::Mul(hn::LoadU(d, k + x0 + i), r), d, bmr + x0 + i);
        },
        [&](std::size_t i) {
          run[i] = run[i] * al[a0 + i];
          fac[x0 + i] = run[i];
          bmr[x0 + i] = k[x0 + i] * run[i];
        });
  }
}

// Sub-chunk σ = [b, e) of the rest of L and P: R = [Kf; Qf] Bmᵀ, dR = [dL; dP]
// rows of σ, strictly below the diagonal, into dk, dq, dγ; the exact
// channels' pairs of the diagonal block after the products. The sub-chunk
// reference γ_b of L and P cancels exactly (its two contributions are the
// same sum) and is skipped.
template <class T>
void subchunk_adjoint(std::size_t b, std::size_t c, std::size_t kd, ChunkWork<T>& w,
                      ChunkBackWork<T>& bw) {
  const std::size_t e = std::min(b + kSub, c), nr = e - b, ncol = e;
  subchunk_factors(b, e, kd, w, bw);
  const T* k = w.k.data();
  const T* q = w.q.data();
  const T* al = w.alpha.data();
  const T* HWY_RESTRICT am = w.amat.data();
  const T* HWY_RESTRICT bmr = bw.bmr.data();
  const T* HWY_RESTRICT fac = bw.fac.data();
  const T* HWY_RESTRICT ff = bw.ff.data();
  const T* HWY_RESTRICT okc = w.ok.data();
  const T* dL = bw.dL.data();
  const T* dP = bw.dP.data();
  T* HWY_RESTRICT gk = bw.gk.data();
  T* HWY_RESTRICT gq = bw.gq.data();
  T* HWY_RESTRICT gg = bw.gg.data();
  T* HWY_RESTRICT dr = bw.dr.data();  // (2·nr)×ncol
  for (std::size_t t = b; t < e; ++t) {
    T* rl = dr + (t - b) * ncol;
    T* rp = dr + (nr + t - b) * ncol;
    for (std::size_t s2 = 0; s2 < ncol; ++s2) {
      rl[s2] = s2 < t ? dL[t * c + s2] : T(0);
      rp[s2] = s2 < t ? dP[t * c + s2] : T(0);
    }
  }
  T* HWY_RESTRICT dam = bw.dam.data();  // (2·nr)×K
  gemm<GemmOp::set>(2 * nr, kd, ncol, dr, ncol, std::size_t{1}, bmr, kd, dam, kd);
  T* HWY_RESTRICT dbm = bw.dbm.data();  // ncol×K
  gemm<GemmOp::set>(ncol, kd, 2 * nr, dr, std::size_t{1}, ncol, am, kd, dbm, kd);
  // Kinv_s = k_s / F_s on the factorised channels (ok = 1); the exact
  // ones (ok = 0) get 0 / 1: their Kinv entries were constants (zeros).
  // Without exact channels the mask is left out (ok = 1 changes no bit).
  const auto sub_rows = [&](auto masked) {
    constexpr bool kMasked = decltype(masked)::value;
    for (std::size_t t = b; t < e; ++t) {
      const std::size_t x0 = t * kd, y0 = (t - b) * kd, yq0 = (nr + t - b) * kd;
      for_vecs<T>(
          kd,
          [&](auto d, std::size_t i) {
            const std::size_t x = x0 + i, y = y0 + i, yq = yq0 + i;
            const auto f = hn::LoadU(d, ff + y);
            const auto dy = hn::LoadU(d, dam + y), dyq = hn::LoadU(d, dam + yq);
            auto db = hn::LoadU(d, dbm + x);
            auto fd = f;
            if constexpr (kMasked) {
              const auto okv = hn::LoadU(d, okc + i);
              db = hn::Mul(db, okv);
              fd = hn::Add(hn::Mul(f, okv), hn::Sub(hn::Set(d, T(1)), okv));
            }
            const auto gkx = hn::Add(hn::Add(hn::LoadU(d, gk + x), hn::Mul(dy, f)), hn::Div(db, fd));
            hn::StoreU(hn::Add(hn::LoadU(d, gq + x), hn::Mul(dyq, f)), d, gq + x);
            const auto ggx = hn::Sub(hn::Add(hn::Add(hn::LoadU(d, gg + x), hn::Mul(dy, hn::LoadU(d, am + y))),
                                             hn::Mul(dyq, hn::LoadU(d, am + yq))),
                                     hn::Mul(db, hn::LoadU(d, bmr + x)));
            hn::StoreU(gkx, d, gk + x);
            hn::StoreU(ggx, d, gg + x);
          },
          [&](std::size_t i) {
            const std::size_t x = x0 + i, y = y0 + i, yq = yq0 + i;
            const T f = ff[y];
            T db = dbm[x], fd = f;
            if constexpr (kMasked) {
              db = db * okc[i];
              fd = f * okc[i] + (T(1) - okc[i]);
            }
            gk[x] = gk[x] + dam[y] * f + db / fd;
            gq[x] = gq[x] + dam[yq] * f;
            gg[x] = gg[x] + dam[y] * am[y] + dam[yq] * am[yq] - db * bmr[x];
          });
    }
  };
  if (w.bad.empty())
    sub_rows(std::false_type{});
  else
    sub_rows(std::true_type{});
  for_vecs<T>(
      b * kd,
      [&](auto d, std::size_t x) {
        const auto db = hn::LoadU(d, dbm + x);
        hn::StoreU(hn::Add(hn::LoadU(d, gk + x), hn::Mul(db, hn::LoadU(d, fac + x))), d, gk + x);
        hn::StoreU(hn::Sub(hn::LoadU(d, gg + x), hn::Mul(db, hn::LoadU(d, bmr + x))), d, gg + x);
      },
      [&](std::size_t x) {
        gk[x] = gk[x] + dbm[x] * fac[x];
        gg[x] = gg[x] - dbm[x] * bmr[x];
      });
  // The exact channels' pairs s < t of the diagonal block.
  if (!w.bad.empty()) exact_block_backward(k, q, al, b, e, kd, c, dL, dP, gk, gq, gg, w);
}

// The chunk's rows of dq, dk and dg (dg_t = Σ_{r ≥ t in the chunk} dγ_r).
template <class T>
void token_grads(const ChunkAdjoint<T>& a, const HeadGrads<T>& out, ChunkWork<T>& w,
                 const ChunkBackWork<T>& bw) {
  const std::size_t t0 = a.t0, c = a.c, kd = a.kd;
  const T* HWY_RESTRICT gk = bw.gk.data();
  const T* HWY_RESTRICT gq = bw.gq.data();
  const T* HWY_RESTRICT gg = bw.gg.data();
  T* HWY_RESTRICT run = w.run.data();
  // Outputs of the chunk: dq, dk, dg (reverse cumulative sum of dγ).
  for (std::size_t i = 0; i < kd; ++i) run[i] = 0;
  for (std::size_t t = c; t-- > 0;) {
    T* HWY_RESTRICT dqt = out.dq + (t0 + t) * out.qk_stride;
    T* HWY_RESTRICT dkt = out.dk + (t0 + t) * out.qk_stride;
    T* HWY_RESTRICT dgt = out.dg + (t0 + t) * out.g_stride;
    const std::size_t o = t * kd;
    for_vecs<T>(
        kd,
        [&](auto d, std::size_t i) {
          hn::StoreU(hn::LoadU(d, gq + o + i), d, dqt + i);
          hn::StoreU(hn::LoadU(d, gk + o + i), d, dkt + i);
          const auto r = hn::Add(hn::LoadU(d, run + i), hn::LoadU(d, gg + o + i));
          hn::StoreU(r, d, run + i);
          hn::StoreU(r, d, dgt + i);
        },
        [&](std::size_t i) {
          dqt[i] = gq[o + i];
          dkt[i] = gk[o + i];
          run[i] = run[i] + gg[o + i];
          dgt[i] = run[i];
        });
  }
}

// dS ← scale Qgᵀ dO + Diag(a_c) dS - Kgᵀ dR   (Kgᵀ dR = Wᵀ dΔ): the state
// gradient entering the chunk.
template <class T>
void state_adjoint(ChunkAdjoint<T>& a, ChunkWork<T>& w, const ChunkBackWork<T>& bw) {
  const std::size_t c = a.c, kd = a.kd, vd = a.vd;
  const T scale = a.scale;
  T* ds = a.ds;
  const T* dob = a.dob;
  const T* dR = bw.xt.data();
  T* t2 = w.kv.data();
  gemm<GemmOp::set>(kd, vd, c, w.qg.data(), std::size_t{1}, kd, dob, vd, t2, vd);
  for (std::size_t i = 0; i < kd; ++i) {
    const T a = w.ac[i];
    for (std::size_t j = 0; j < vd; ++j)
      ds[i * vd + j] = scale * t2[i * vd + j] + a * ds[i * vd + j];
  }
  gemm<GemmOp::sub>(kd, vd, c, w.kg.data(), std::size_t{1}, kd, dR, vd, ds, vd);
}

// backward of one head. Pass 1 runs the chunks forward from `incoming` and
// keeps the record of chunk_saved_layout (the state entering each chunk
// after the first, R, Δ, L and P), unless the forward kept it (`kept`: the
// same bits; the first chunk's state is `incoming` either way); pass 2
// walks the chunks backwards with the state gradient dS, recomputing each
// chunk's element-wise factors (decays, Kg, Qg, Kr), and applies the
// adjoint of every line of the forward (kda_chunk-inl.h's header), in the
// stages above: output_adjoint, solve_adjoint, decay_adjoint and
// subchunk_adjoint (the decay factors' gradients), token_grads,
// state_adjoint.
template <class T>
void chunk_backward_head(const HeadInputs<T>& h, std::size_t tokens, std::size_t kd,
                         std::size_t vd, T scale, const T* incoming, const T* d_o,
                         std::size_t do_stride, const T* d_final, const HeadGrads<T>& out,
                         ChunkWork<T>& w, ChunkBackWork<T>& bw, const T* kept) {
  const std::size_t kv = kd * vd;
  const std::size_t n_chunks = (tokens + kChunk - 1) / kChunk;
  w.resize(kd, vd);
  bw.resize(kd, vd);
  // Pass 1 (unless the forward kept it): the head's record of
  // chunk_saved_layout, by the forward itself without outputs.
  const ChunkSavedLayout lay = chunk_saved_layout(tokens, kd, vd);
  if (kept == nullptr) {
    if (bw.record.size() < lay.total) bw.record.resize(lay.total);
    chunk_forward_head(h, tokens, kd, vd, scale, incoming, static_cast<T*>(nullptr), 0,
                       static_cast<T*>(nullptr), w, bw.record.data());
    kept = bw.record.data();
  }
  const T* rs = kept + lay.r;
  const T* deltas = kept + lay.delta;

  T* ds = bw.ds.data();  // dS at the end of the current chunk
  for (std::size_t i = 0; i < kv; ++i) ds[i] = d_final ? d_final[i] : T(0);
  for (std::size_t ci = n_chunks; ci-- > 0;) {
    const std::size_t t0 = ci * kChunk, c = std::min(kChunk, tokens - t0);
    chunk_prepare(h, t0, c, kd, vd, 0, 0, w, static_cast<const T*>(nullptr), Factors::none);
    const T* lp = kept + lay.factors_at(ci);
    for (std::size_t t = 0; t < c; ++t) {
      std::copy_n(lp + t * c, c, w.L.data() + t * kChunk);
      std::copy_n(lp + (c + t) * c, c, w.P.data() + t * kChunk);
    }
    // The state entering the chunk: the incoming one (zero when null) for
    // the first, which the record does not hold.
    const T* s0 = ci > 0 ? kept + lay.state_at(ci, kv) : incoming ? incoming : bw.zero.data();
    ChunkAdjoint<T> a{.t0 = t0,
                      .c = c,
                      .kd = kd,
                      .vd = vd,
                      .scale = scale,
                      .s0_zero = ci == 0 && incoming == nullptr,
                      .ds_zero = ci + 1 == n_chunks && d_final == nullptr,
                      .s0 = s0,
                      .rr = rs + t0 * vd,
                      .dl = deltas + t0 * vd,
                      .ds = ds,
                      .dob = bw.dob.data(),
                      .dlt = bw.dlt.data(),
                      .s0t = bw.s0t.data(),
                      .dst = bw.dst.data()};
    for (std::size_t t = 0; t < c; ++t)
      for (std::size_t j = 0; j < vd; ++j) a.dob[t * vd + j] = d_o[(t0 + t) * do_stride + j];
    transpose(a.dl, c, vd, vd, a.dlt, c);

    output_adjoint(a, w, bw);
    solve_adjoint(a, out, w, bw);
    decay_adjoint(a, w, bw);
    for (std::size_t b = 0; b < c; b += kSub) subchunk_adjoint(b, c, kd, w, bw);
    token_grads(a, out, w, bw);
    // Nothing reads dS_0 of the first chunk when d_incoming is not wanted.
    if (ci == 0 && out.d_incoming == nullptr) break;
    state_adjoint(a, w, bw);
  }
  if (out.d_incoming)
    for (std::size_t i = 0; i < kv; ++i) out.d_incoming[i] = ds[i];
}

}  // namespace kdacp::kda::detail::HWY_NAMESPACE
KDACP_TARGET_END;

#endif  // KDACP_KERNELS_KDA_CHUNK_BACKWARD_INL_H_
