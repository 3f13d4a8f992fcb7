// Per-target kernels of the chunkwise (WY/UT) KDA algorithm (SPEC §9,
// Algorithm::chunk). Included once per Highway target by chunk.cpp (and by
// the tests), hence the toggle guard instead of #pragma once.
//
// The math, for one (batch, value head) and one chunk of c ≤ kChunk tokens
// (local index t = 0..c-1) entering with state S_0 (K×n):
//
//   Π(s,t]  = Π_{s<r≤t} α_r (per key channel, ≤ 1 for g ≤ 0)
//   δ_t     = β_t (v_t - S'_tᵀ k_t)            so that  S_t = Diag(α_t) S_{t-1} + k_t δ_tᵀ
//   L_ts    = k_tᵀ Diag(Π(s,t]) k_s   (s < t),   P_ts = q_tᵀ Diag(Π(s,t]) k_s   (s ≤ t)
//   Kg_t    = Π(-1,t] ⊙ k_t,   Qg_t = Π(-1,t] ⊙ q_t,   Kr_s = Π(s,c-1] ⊙ k_s,   a_c = Π(-1,c-1]
//   (I + Diag(β) L) [U | W] = Diag(β) [V | Kg]       (forward substitution)
//   Δ = U - W S_0,   O = scale (Qg S_0 + P Δ),   S_c = Diag(a_c) S_0 + Krᵀ Δ.
//
// The transfer M of the summary is the same update of a K×K "state" started
// from I with U = 0, so the summary advances [S | M] (K×(V+K)) at once.
// The G pass runs the adjoint of the last three lines backwards over chunks:
//   dΔ = scale Pᵀ dO + Kr dS_c,   dS_0 = scale Qgᵀ dO + Diag(a_c) dS_c - Wᵀ dΔ.
//
// Strong decay: every decay factor is a product of α's over a token range,
// never exp of a difference of cumulative sums, so nothing overflows. Inside
// a chunk, L and P are built per sub-chunk σ of kSub tokens starting at b:
// for s < b, Π(s,t] = Π(b,t] · Π(s,b], both ≤ 1 (a product of two small
// matrices); inside σ, Π(s,t] = F_t / F_s with F_t = Π(b,t] ≥ Π over
// kSub-1 tokens. That division is used only while every F of the sub-chunk
// is a normal number well inside range (in float: the decay over 15 tokens
// above e^-83, i.e. g ≥ -5.5 per channel per token on average); otherwise that
// diagonal block is computed exactly, pair by pair, with running products
// (slower, same result up to rounding).
//
// Bitwise agreement across targets (see kda_math.cpp): matrix products
// vectorise along the output's columns only; every output element is
// fma(a_{p-1}, b_{p-1}, ... fma(a_0, b_0, 0)) in order of the inner index
// (explicit fused multiply-adds, exact on every target, see fused_mul_add),
// then combined once with the destination; no implicit FMA contraction
// elsewhere; dots (the exact fallback) are plain scalar loops in index order.
#if defined(KDACP_KDA_CHUNK_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KDACP_KDA_CHUNK_INL_H_
#undef KDACP_KDA_CHUNK_INL_H_
#else
#define KDACP_KDA_CHUNK_INL_H_
#endif

#ifdef __clang__
#pragma clang fp contract(off)
#endif

#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

#include "kda/chunk.hpp"
#include "kda/kda_kernels.hpp"

HWY_BEFORE_NAMESPACE();
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
namespace kdacp::kda::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

enum class GemmOp { set, add, sub };

// Output vectors per row of a register tile. AVX-512 has 32 vector
// registers, the others 16: 4 rows × kGemmVecs accumulators plus the B row.
#if HWY_TARGET <= HWY_AVX3
constexpr std::size_t kGemmVecs = 4;
#else
constexpr std::size_t kGemmVecs = 2;
#endif

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

// One R-row tile of C at columns [j0, j0 + NV·Lanes) (NV = 0: column j0
// alone): acc = Σ_k a(i,k) b(k,j) in order k = 0..p-1 (each step one fused
// multiply-add), then C = acc,
// C + acc or C - acc. a(i,k) = a[i·ars + k·acs]; B rows are contiguous.
template <GemmOp Op, std::size_t R, std::size_t NV, class T>
HWY_INLINE void gemm_tile(std::size_t i0, std::size_t j0, std::size_t p, const T* a,
                          std::size_t ars, std::size_t acs, const T* b, std::size_t ldb, T* c,
                          std::size_t ldc) {
  if constexpr (NV == 0) {
    T acc[R];
    for (std::size_t r = 0; r < R; ++r) acc[r] = 0;
    for (std::size_t k = 0; k < p; ++k) {
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
    for (std::size_t k = 0; k < p; ++k) {
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

template <GemmOp Op, std::size_t R, class T>
HWY_INLINE void gemm_rows(std::size_t i0, std::size_t n_cols, std::size_t p, const T* a,
                          std::size_t ars, std::size_t acs, const T* b, std::size_t ldb, T* c,
                          std::size_t ldc) {
  const hn::ScalableTag<T> d;
  const std::size_t n = hn::Lanes(d);
  std::size_t j = 0;
  for (; j + kGemmVecs * n <= n_cols; j += kGemmVecs * n)
    gemm_tile<Op, R, kGemmVecs>(i0, j, p, a, ars, acs, b, ldb, c, ldc);
  for (; j + n <= n_cols; j += n) gemm_tile<Op, R, 1>(i0, j, p, a, ars, acs, b, ldb, c, ldc);
  for (; j < n_cols; ++j) gemm_tile<Op, R, 0>(i0, j, p, a, ars, acs, b, ldb, c, ldc);
}

// C (m×n_cols) op= A (m×p) · B (p×n_cols). With kLower, A is lower
// triangular (a(i,k) = 0 for k > i) and row tile [i0, i0 + R) stops at
// k = i0 + R: the skipped terms are exact zeros.
template <GemmOp Op, bool kLower = false, class T>
void gemm(std::size_t m, std::size_t n_cols, std::size_t p, const T* a, std::size_t ars,
          std::size_t acs, const T* b, std::size_t ldb, T* c, std::size_t ldc) {
  constexpr std::size_t kRows = 4;
  std::size_t i = 0;
  for (; i + kRows <= m; i += kRows)
    gemm_rows<Op, kRows>(i, n_cols, kLower ? std::min(p, i + kRows) : p, a, ars, acs, b, ldb, c,
                         ldc);
  for (; i < m; ++i)
    gemm_rows<Op, 1>(i, n_cols, kLower ? std::min(p, i + 1) : p, a, ars, acs, b, ldb, c, ldc);
}

template <class T>
T plain_dot(const T* x, const T* y, std::size_t n) {
  T s = 0;
  for (std::size_t i = 0; i < n; ++i) s = s + x[i] * y[i];
  return s;
}

// Gathers tokens [t0, t0 + c) of one head and builds everything of the
// chunk that does not depend on the state: decays, Kg, Qg, Kr, a_c, L, P and
// the solve's columns [x_lo, x_hi) of X = [U | W] (U: [0, V), W: [V, V+K)).
// alpha_all: exp(g) of the head's tokens, [tokens×K] (null: computed here).
template <class T>
void chunk_prepare(const HeadInputs<T>& h, std::size_t t0, std::size_t c, std::size_t kd,
                   std::size_t vd, std::size_t x_lo, std::size_t x_hi, ChunkWork<T>& w,
                   const T* alpha_all = nullptr) {
  const std::size_t ldx = vd + kd;
  w.resize(kd, vd);
  T* k = w.k.data();
  T* q = w.q.data();
  T* al = w.alpha.data();
  for (std::size_t t = 0; t < c; ++t) {
    const T* kt = h.k_at(t0 + t);
    const T* qt = h.q_at(t0 + t);
    for (std::size_t i = 0; i < kd; ++i) {
      k[t * kd + i] = kt[i];
      q[t * kd + i] = qt[i];
    }
    if (alpha_all) {
      const T* at = alpha_all + (t0 + t) * kd;
      for (std::size_t i = 0; i < kd; ++i) al[t * kd + i] = at[i];
    } else {
      const T* gt = h.g_at(t0 + t);
      for (std::size_t i = 0; i < kd; ++i) al[t * kd + i] = std::exp(gt[i]);
    }
    w.beta[t] = h.beta_at(t0 + t);
  }
  // Kg, Qg with the running product Π(-1,t]; a_c.
  T* run = w.run.data();
  for (std::size_t i = 0; i < kd; ++i) run[i] = 1;
  for (std::size_t t = 0; t < c; ++t) {
    for (std::size_t i = 0; i < kd; ++i) {
      run[i] = run[i] * al[t * kd + i];
      w.kg[t * kd + i] = k[t * kd + i] * run[i];
      w.qg[t * kd + i] = q[t * kd + i] * run[i];
    }
  }
  for (std::size_t i = 0; i < kd; ++i) w.ac[i] = run[i];
  // Kr_s = Π(s,c-1] ⊙ k_s, backwards.
  for (std::size_t i = 0; i < kd; ++i) run[i] = 1;
  for (std::size_t s = c; s-- > 0;) {
    for (std::size_t i = 0; i < kd; ++i) w.kr[s * kd + i] = k[s * kd + i] * run[i];
    if (s > 0)
      for (std::size_t i = 0; i < kd; ++i) run[i] = run[i] * al[s * kd + i];
  }

  // L (strictly lower) and P (lower), kChunk×kChunk, zero above.
  // Every row t < c is written whole, [0, c): no separate zero fill.
  T* L = w.L.data();
  T* P = w.P.data();
  const T lo = std::ldexp(T(1), std::numeric_limits<T>::min_exponent + 5);
  const T hi = std::ldexp(T(1), std::numeric_limits<T>::max_exponent - 8);
  for (std::size_t b = 0; b < c; b += kSub) {
    const std::size_t e = std::min(b + kSub, c), nr = e - b, ncol = e;
    T* am = w.amat.data();   // rows [Kf_t; Qf_t], t ∈ σ: (2·nr)×K
    T* bm = w.bmat.data();   // K×ncol: column s = Π(s,b] ⊙ k_s (s < b), k_s / F_s (s ∈ σ)
    // Rows first (contiguous, vectorisable), then one transposing copy into bm.
    T* fr = w.frows.data();  // nr×K: F_t
    T* br = w.brows.data();  // ncol×K: the columns of bm as rows
    for (std::size_t t = b; t < e; ++t) {
      T* f = fr + (t - b) * kd;
      const T* fp = f - kd;
      const T* a = al + t * kd;
      if (t == b) {
        for (std::size_t i = 0; i < kd; ++i) f[i] = 1;
      } else {
        for (std::size_t i = 0; i < kd; ++i) f[i] = fp[i] * a[i];
      }
      const T* kt = k + t * kd;
      const T* qt = q + t * kd;
      T* ak = am + (t - b) * kd;
      T* aq = am + (nr + t - b) * kd;
      T* bt = br + t * kd;
      for (std::size_t i = 0; i < kd; ++i) {
        ak[i] = kt[i] * f[i];
        aq[i] = qt[i] * f[i];
        bt[i] = kt[i] / f[i];
      }
    }
    // Safe when every F is a normal number in [lo, hi] and every k/F finite
    // (the comparisons are false for NaN).
    int bad = 0;
    for (std::size_t x = 0; x < nr * kd; ++x) {
      bad |= static_cast<int>(!(fr[x] >= lo)) | static_cast<int>(!(fr[x] <= hi));
      bad |= static_cast<int>(!(std::abs(br[b * kd + x]) <= std::numeric_limits<T>::max()));
    }
    const bool safe = bad == 0;
    w.safe[b / kSub] = safe;
    for (std::size_t i = 0; i < kd; ++i) run[i] = 1;
    for (std::size_t s2 = b; s2-- > 0;) {
      const T* a = al + (s2 + 1) * kd;
      const T* ks = k + s2 * kd;
      T* bs = br + s2 * kd;
      for (std::size_t i = 0; i < kd; ++i) {
        run[i] = run[i] * a[i];
        bs[i] = ks[i] * run[i];
      }
    }
    for (std::size_t i = 0; i < kd; ++i) {
      T* col = bm + i * ncol;
      for (std::size_t s2 = 0; s2 < ncol; ++s2) col[s2] = br[s2 * kd + i];
    }
    T* r = w.rbuf.data();  // (2·nr)×ncol
    gemm<GemmOp::set>(2 * nr, ncol, kd, am, kd, std::size_t{1}, bm, ncol, r, ncol);
    for (std::size_t t = b; t < e; ++t) {
      const T* rl = r + (t - b) * ncol;
      const T* rp = r + (nr + t - b) * ncol;
      const std::size_t l_end = safe ? t : b, p_end = safe ? t + 1 : b;
      T* lt = L + t * kChunk;
      T* pt = P + t * kChunk;
      for (std::size_t s2 = 0; s2 < c; ++s2) {
        lt[s2] = s2 < l_end ? rl[s2] : T(0);
        pt[s2] = s2 < p_end ? rp[s2] : T(0);
      }
    }
    if (!safe) {
      // Exact diagonal block: x = Π(s,t] ⊙ k_s by running products.
      T* x = w.run.data();
      for (std::size_t s = b; s < e; ++s) {
        for (std::size_t i = 0; i < kd; ++i) x[i] = k[s * kd + i];
        for (std::size_t t = s; t < e; ++t) {
          if (t > s)
            for (std::size_t i = 0; i < kd; ++i) x[i] = x[i] * al[t * kd + i];
          if (t > s) L[t * kChunk + s] = plain_dot(k + t * kd, x, kd);
          P[t * kChunk + s] = plain_dot(q + t * kd, x, kd);
        }
      }
    }
  }

  // X = (I + Diag(β) L)⁻¹ Diag(β) Y, Y = [V | Kg], columns [x_lo, x_hi), by
  // blocks of kSub rows: the rows above a block are subtracted with one
  // product, then forward substitution inside the block.
  T* X = w.x.data();
  for (std::size_t t = 0; t < c; ++t) {
    T* xr = X + t * ldx;
    if (x_lo < vd) {
      const T* vt = h.v_at(t0 + t);
      for (std::size_t j = x_lo; j < std::min(x_hi, vd); ++j) xr[j] = vt[j];
    }
    for (std::size_t j = std::max(x_lo, vd); j < x_hi; ++j) xr[j] = w.kg[t * kd + j - vd];
  }
  const std::size_t nx = x_hi - x_lo;
  for (std::size_t b = 0; b < c; b += kSub) {
    const std::size_t e = std::min(b + kSub, c);
    if (b > 0)
      gemm<GemmOp::sub>(e - b, nx, b, L + b * kChunk, kChunk, std::size_t{1}, X + x_lo, ldx,
                        X + b * ldx + x_lo, ldx);
    for (std::size_t t = b; t < e; ++t) {
      T* xt = X + t * ldx;
      for (std::size_t s = b; s < t; ++s) {
        const T l = L[t * kChunk + s];
        const T* xs = X + s * ldx;
        for (std::size_t j = x_lo; j < x_hi; ++j) xt[j] = xt[j] - l * xs[j];
      }
      const T bt = w.beta[t];
      for (std::size_t j = x_lo; j < x_hi; ++j) xt[j] = bt * xt[j];
    }
  }
}

// Advances `state` (K×n, n ≥ V; columns ≥ V see U = 0) over one prepared
// chunk and, when o is set, writes its outputs (o_t at o + t·o_stride).
template <class T>
void chunk_advance(std::size_t c, std::size_t kd, std::size_t vd, std::size_t n, T* state,
                   T* o, std::size_t o_stride, T scale, ChunkWork<T>& w) {
  const std::size_t ldx = vd + kd;
  const T* X = w.x.data();
  T* dl = w.delta.data();  // c×n
  for (std::size_t t = 0; t < c; ++t) {
    for (std::size_t j = 0; j < vd; ++j) dl[t * n + j] = X[t * ldx + j];
    for (std::size_t j = vd; j < n; ++j) dl[t * n + j] = 0;
  }
  gemm<GemmOp::sub>(c, n, kd, X + vd, ldx, std::size_t{1}, state, n, dl, n);
  if (o != nullptr) {
    T* tmp = w.tmp.data();  // c×V
    gemm<GemmOp::set>(c, vd, kd, w.qg.data(), kd, std::size_t{1}, state, n, tmp, vd);
    gemm<GemmOp::add, true>(c, vd, c, w.P.data(), kChunk, std::size_t{1}, dl, n, tmp, vd);
    for (std::size_t t = 0; t < c; ++t) {
      T* ot = o + t * o_stride;
      for (std::size_t j = 0; j < vd; ++j) ot[j] = scale * tmp[t * vd + j];
    }
  }
  for (std::size_t i = 0; i < kd; ++i) {
    const T a = w.ac[i];
    T* row = state + i * n;
    for (std::size_t j = 0; j < n; ++j) row[j] = a * row[j];
  }
  gemm<GemmOp::add>(kd, n, c, w.kr.data(), std::size_t{1}, kd, dl, n, state, n);
}

// forward of one head: o and, when set, the final state.
template <class T>
void chunk_forward_head(const HeadInputs<T>& h, std::size_t tokens, std::size_t kd,
                        std::size_t vd, T scale, const T* incoming, T* o, std::size_t o_stride,
                        T* final_state, ChunkWork<T>& w) {
  w.state.resize(kd * vd);
  T* st = w.state.data();
  for (std::size_t i = 0; i < kd * vd; ++i) st[i] = incoming ? incoming[i] : T(0);
  for (std::size_t t0 = 0; t0 < tokens; t0 += kChunk) {
    const std::size_t c = std::min(kChunk, tokens - t0);
    chunk_prepare(h, t0, c, kd, vd, 0, vd + kd, w);
    chunk_advance(c, kd, vd, vd, st, o + t0 * o_stride, o_stride, scale, w);
  }
  if (final_state)
    for (std::size_t i = 0; i < kd * vd; ++i) final_state[i] = st[i];
}

// chunk_summary of one head: S from zero and M, advanced together as [S | M].
template <class T>
void chunk_summary_head(const HeadInputs<T>& h, std::size_t tokens, std::size_t kd,
                        std::size_t vd, T* s, T* m, ChunkWork<T>& w) {
  const std::size_t n = vd + kd;
  w.state.resize(kd * n);
  T* st = w.state.data();
  for (std::size_t i = 0; i < kd; ++i)
    for (std::size_t j = 0; j < n; ++j) st[i * n + j] = (j == vd + i) ? T(1) : T(0);
  for (std::size_t t0 = 0; t0 < tokens; t0 += kChunk) {
    const std::size_t c = std::min(kChunk, tokens - t0);
    chunk_prepare(h, t0, c, kd, vd, 0, vd + kd, w);
    chunk_advance(c, kd, vd, n, st, static_cast<T*>(nullptr), 0, T(0), w);
  }
  for (std::size_t i = 0; i < kd; ++i) {
    for (std::size_t j = 0; j < vd; ++j) s[i * vd + j] = st[i * n + j];
    for (std::size_t j = 0; j < kd; ++j) m[i * kd + j] = st[i * n + vd + j];
  }
}

// incoming_grad of one head: the adjoint of the state recurrence, backwards
// over chunks (U is not needed, so only W is solved for).
template <class T>
void chunk_incoming_grad_head(const HeadInputs<T>& h, std::size_t tokens, std::size_t kd,
                              std::size_t vd, T scale, const T* d_o, std::size_t do_stride,
                              T* g_state, ChunkWork<T>& w) {
  const std::size_t ldx = vd + kd;
  T* ds = g_state;
  for (std::size_t i = 0; i < kd * vd; ++i) ds[i] = 0;
  const std::size_t n_chunks = (tokens + kChunk - 1) / kChunk;
  for (std::size_t ci = n_chunks; ci-- > 0;) {
    const std::size_t t0 = ci * kChunk, c = std::min(kChunk, tokens - t0);
    chunk_prepare(h, t0, c, kd, vd, vd, vd + kd, w);
    T* dob = w.tmp.data();  // c×V: d_o of the chunk
    for (std::size_t t = 0; t < c; ++t)
      for (std::size_t j = 0; j < vd; ++j) dob[t * vd + j] = d_o[(t0 + t) * do_stride + j];
    T* dd = w.delta.data();  // dΔ, c×V
    gemm<GemmOp::set>(c, vd, c, w.P.data(), std::size_t{1}, kChunk, dob, vd, dd, vd);
    for (std::size_t i = 0; i < c * vd; ++i) dd[i] = scale * dd[i];
    gemm<GemmOp::add>(c, vd, kd, w.kr.data(), kd, std::size_t{1}, ds, vd, dd, vd);
    T* t2 = w.kv.data();  // K×V
    gemm<GemmOp::set>(kd, vd, c, w.qg.data(), std::size_t{1}, kd, dob, vd, t2, vd);
    for (std::size_t i = 0; i < kd; ++i) {
      const T a = w.ac[i];
      for (std::size_t j = 0; j < vd; ++j)
        ds[i * vd + j] = scale * t2[i * vd + j] + a * ds[i * vd + j];
    }
    gemm<GemmOp::sub>(kd, vd, c, w.x.data() + vd, std::size_t{1}, ldx, dd, vd, ds, vd);
  }
}

// backward of one head. Pass 1 runs the chunks forward from `incoming` and
// keeps the state entering each chunk; pass 2 walks the chunks backwards with
// the state gradient dS, recomputing each chunk's prepared matrices, and
// applies the adjoint of every line of the forward (chunk-inl.h's header):
//   dΔ = scale Pᵀ dO + Kr dS,   dP = scale dO Δᵀ,   dQg = scale dO S_0ᵀ,
//   dKr = Δ dSᵀ,   da_c = rowsum(dS ⊙ S_0),   dW = -dΔ S_0ᵀ,   dU = dΔ,
//   Z = (I + Diag(β) L)⁻ᵀ [dU | dW],   [dV | dKg] = Diag(β) Z,
//   dβ_t = Z_t·Y_t - Σ_{s<t} (Z_t·X_s) L_ts,   dL_ts = -β_t Z_t·X_s,
//   dS ← scale Qgᵀ dO + Diag(a_c) dS - Wᵀ dΔ,
// then the decay factors: every factor is exp of a difference of cumulative
// log-decays γ, so each product x = k ⊙ e^{γ_a - γ_b} gives dk = dx ⊙ e^{..},
// dγ_a += dx ⊙ x, dγ_b -= dx ⊙ x; the sub-chunk reference γ_b of L and P
// cancels exactly (its two contributions are the same sum) and is skipped.
// Finally dg_t = Σ_{r ≥ t in the chunk} dγ_r.
template <class T>
void chunk_backward_head(const HeadInputs<T>& h, std::size_t tokens, std::size_t kd,
                         std::size_t vd, T scale, const T* incoming, const T* d_o,
                         std::size_t do_stride, const T* d_final, const HeadGrads<T>& out,
                         ChunkWork<T>& w, ChunkBackWork<T>& bw) {
  const std::size_t ldx = vd + kd, kv = kd * vd;
  const std::size_t n_chunks = (tokens + kChunk - 1) / kChunk;
  w.resize(kd, vd);
  bw.resize(kd, vd, n_chunks);
  // exp(g) once for both passes.
  T* alpha_all = bw.alpha.data();
  for (std::size_t t = 0; t < tokens; ++t) {
    const T* gt = h.g_at(t);
    for (std::size_t i = 0; i < kd; ++i) alpha_all[t * kd + i] = std::exp(gt[i]);
  }
  // Pass 1: the state entering every chunk.
  T* states = bw.states.data();
  for (std::size_t i = 0; i < kv; ++i) states[i] = incoming ? incoming[i] : T(0);
  for (std::size_t ci = 0; ci + 1 < n_chunks; ++ci) {
    T* next = states + (ci + 1) * kv;
    for (std::size_t i = 0; i < kv; ++i) next[i] = states[ci * kv + i];
    chunk_prepare(h, ci * kChunk, kChunk, kd, vd, 0, ldx, w, alpha_all);
    chunk_advance(kChunk, kd, vd, vd, next, static_cast<T*>(nullptr), 0, T(0), w);
  }

  T* ds = bw.ds.data();  // dS at the end of the current chunk
  for (std::size_t i = 0; i < kv; ++i) ds[i] = d_final ? d_final[i] : T(0);
  for (std::size_t ci = n_chunks; ci-- > 0;) {
    const std::size_t t0 = ci * kChunk, c = std::min(kChunk, tokens - t0);
    chunk_prepare(h, t0, c, kd, vd, 0, ldx, w, alpha_all);
    const T* s0 = states + ci * kv;
    const T* X = w.x.data();
    const T* k = w.k.data();
    const T* q = w.q.data();
    const T* al = w.alpha.data();
    // Δ = U - W S_0 (c×V).
    T* dl = bw.delta.data();
    for (std::size_t t = 0; t < c; ++t)
      for (std::size_t j = 0; j < vd; ++j) dl[t * vd + j] = X[t * ldx + j];
    gemm<GemmOp::sub>(c, vd, kd, X + vd, ldx, std::size_t{1}, s0, vd, dl, vd);
    T* dob = bw.dob.data();
    for (std::size_t t = 0; t < c; ++t)
      for (std::size_t j = 0; j < vd; ++j) dob[t * vd + j] = d_o[(t0 + t) * do_stride + j];
    // Transposes: S_0ᵀ, dSᵀ (V×K), Δᵀ (V×c).
    T* s0t = bw.s0t.data();
    T* dst = bw.dst.data();
    for (std::size_t i = 0; i < kd; ++i)
      for (std::size_t j = 0; j < vd; ++j) {
        s0t[j * kd + i] = s0[i * vd + j];
        dst[j * kd + i] = ds[i * vd + j];
      }
    T* dlt = bw.dlt.data();
    for (std::size_t t = 0; t < c; ++t)
      for (std::size_t j = 0; j < vd; ++j) dlt[j * c + t] = dl[t * vd + j];

    // dΔ = scale Pᵀ dO + Kr dS.
    T* dd = bw.dd.data();
    gemm<GemmOp::set>(c, vd, c, w.P.data(), std::size_t{1}, kChunk, dob, vd, dd, vd);
    for (std::size_t i = 0; i < c * vd; ++i) dd[i] = scale * dd[i];
    gemm<GemmOp::add>(c, vd, kd, w.kr.data(), kd, std::size_t{1}, ds, vd, dd, vd);
    // dP = scale dO Δᵀ (lower, incl. the diagonal), dQg = scale dO S_0ᵀ, dKr = Δ dSᵀ.
    T* dP = bw.dP.data();  // c×c
    gemm<GemmOp::set>(c, c, vd, dob, vd, std::size_t{1}, dlt, c, dP, c);
    for (std::size_t i = 0; i < c * c; ++i) dP[i] = scale * dP[i];
    T* dqg = bw.dqg.data();
    gemm<GemmOp::set>(c, kd, vd, dob, vd, std::size_t{1}, s0t, kd, dqg, kd);
    for (std::size_t i = 0; i < c * kd; ++i) dqg[i] = scale * dqg[i];
    T* dkr = bw.dkr.data();
    gemm<GemmOp::set>(c, kd, vd, dl, vd, std::size_t{1}, dst, kd, dkr, kd);
    // da_c.
    T* dac = bw.dac.data();
    for (std::size_t i = 0; i < kd; ++i) {
      T acc = 0;
      for (std::size_t j = 0; j < vd; ++j) acc = acc + ds[i * vd + j] * s0[i * vd + j];
      dac[i] = acc;
    }
    // dX = [dΔ | -dΔ S_0ᵀ]; Z = (I + Diag(β) L)⁻ᵀ dX by back substitution,
    // blocks of kSub rows from the last.
    T* Z = bw.z.data();  // c×(V+K)
    for (std::size_t t = 0; t < c; ++t) {
      for (std::size_t j = 0; j < vd; ++j) Z[t * ldx + j] = dd[t * vd + j];
      for (std::size_t j = vd; j < ldx; ++j) Z[t * ldx + j] = 0;
    }
    gemm<GemmOp::sub>(c, kd, vd, dd, vd, std::size_t{1}, s0t, kd, Z + vd, ldx);
    T* lb = bw.lb.data();  // β_t L_ts, kChunk×kChunk
    for (std::size_t t = 0; t < c; ++t)
      for (std::size_t s2 = 0; s2 < c; ++s2) lb[t * kChunk + s2] = w.beta[t] * w.L[t * kChunk + s2];
    const std::size_t n_sub = (c + kSub - 1) / kSub;
    for (std::size_t sb = n_sub; sb-- > 0;) {
      const std::size_t b = sb * kSub, e = std::min(b + kSub, c);
      if (e < c)  // Z_t -= Σ_{r ≥ e} β_r L_rt Z_r
        gemm<GemmOp::sub>(e - b, ldx, c - e, lb + e * kChunk + b, std::size_t{1}, kChunk,
                          Z + e * ldx, ldx, Z + b * ldx, ldx);
      for (std::size_t t = e; t-- > b;) {
        T* zt = Z + t * ldx;
        for (std::size_t r = t + 1; r < e; ++r) {
          const T l = lb[r * kChunk + t];
          const T* zr = Z + r * ldx;
          for (std::size_t j = 0; j < ldx; ++j) zt[j] = zt[j] - l * zr[j];
        }
      }
    }
    // M1 = Z Xᵀ (c×c, the strictly lower part is used).
    T* xt = bw.xt.data();  // (V+K)×c
    for (std::size_t t = 0; t < c; ++t)
      for (std::size_t j = 0; j < ldx; ++j) xt[j * c + t] = X[t * ldx + j];
    T* m1 = bw.m1.data();
    gemm<GemmOp::set>(c, c, ldx, Z, ldx, std::size_t{1}, xt, c, m1, c);
    // dβ, dv, dKg; dL.
    T* dkg = bw.dkg.data();
    T* dL = bw.dL.data();  // c×c
    for (std::size_t t = 0; t < c; ++t) {
      const T bt = w.beta[t];
      const T* zt = Z + t * ldx;
      const T* vt = h.v_at(t0 + t);
      T acc = 0;
      for (std::size_t j = 0; j < vd; ++j) acc = acc + zt[j] * vt[j];
      for (std::size_t i = 0; i < kd; ++i) acc = acc + zt[vd + i] * w.kg[t * kd + i];
      for (std::size_t s2 = 0; s2 < t; ++s2) acc = acc - m1[t * c + s2] * w.L[t * kChunk + s2];
      out.dbeta[(t0 + t) * out.beta_stride] = acc;
      T* dvt = out.dv + (t0 + t) * out.v_stride;
      for (std::size_t j = 0; j < vd; ++j) dvt[j] = bt * zt[j];
      for (std::size_t i = 0; i < kd; ++i) dkg[t * kd + i] = bt * zt[vd + i];
      for (std::size_t s2 = 0; s2 < c; ++s2) dL[t * c + s2] = s2 < t ? -bt * m1[t * c + s2] : T(0);
    }

    // Gradients of the decay factors: dk, dq, dγ (c×K each).
    T* gk = bw.gk.data();
    T* gq = bw.gq.data();
    T* gg = bw.gg.data();
    T* run = w.run.data();
    // Kg, Qg: factor Π(-1,t] = e^{γ_t}; Kr: Π(s,c-1] = e^{γ_{c-1} - γ_s}.
    for (std::size_t i = 0; i < kd; ++i) run[i] = 1;
    for (std::size_t t = 0; t < c; ++t)
      for (std::size_t i = 0; i < kd; ++i) {
        const std::size_t x = t * kd + i;
        run[i] = run[i] * al[x];
        gk[x] = dkg[x] * run[i];
        gq[x] = dqg[x] * run[i];
        gg[x] = dkg[x] * w.kg[x] + dqg[x] * w.qg[x];
      }
    T* last = bw.last.data();  // dγ_{c-1} from Kr and a_c
    for (std::size_t i = 0; i < kd; ++i) {
      run[i] = 1;
      last[i] = dac[i] * w.ac[i];
    }
    for (std::size_t s2 = c; s2-- > 0;) {
      for (std::size_t i = 0; i < kd; ++i) {
        const std::size_t x = s2 * kd + i;
        gk[x] = gk[x] + dkr[x] * run[i];
        const T dx = dkr[x] * w.kr[x];
        gg[x] = gg[x] - dx;
        last[i] = last[i] + dx;
      }
      if (s2 > 0)
        for (std::size_t i = 0; i < kd; ++i) run[i] = run[i] * al[s2 * kd + i];
    }
    for (std::size_t i = 0; i < kd; ++i) gg[(c - 1) * kd + i] = gg[(c - 1) * kd + i] + last[i];

    // L and P per sub-chunk σ: R = [Kf; Qf] Bmᵀ, dR = [dL; dP] rows of σ.
    for (std::size_t b = 0; b < c; b += kSub) {
      const std::size_t e = std::min(b + kSub, c), nr = e - b, ncol = e;
      const bool safe = w.safe[b / kSub];
      T* am = w.amat.data();   // (2·nr)×K
      T* bmr = bw.bmr.data();  // ncol×K: Kb_s (s < b), Kinv_s (s ∈ σ)
      T* fac = bw.fac.data();  // ncol×K: the factor of each bmr row (F_t for t ∈ σ in am)
      T* ff = bw.ff.data();    // nr×K: F_t
      for (std::size_t i = 0; i < kd; ++i) run[i] = 1;
      for (std::size_t t = b; t < e; ++t)
        for (std::size_t i = 0; i < kd; ++i) {
          if (t > b) run[i] = run[i] * al[t * kd + i];
          const T f = run[i];
          ff[(t - b) * kd + i] = f;
          am[(t - b) * kd + i] = k[t * kd + i] * f;
          am[(nr + t - b) * kd + i] = q[t * kd + i] * f;
          bmr[t * kd + i] = k[t * kd + i] / f;
        }
      for (std::size_t i = 0; i < kd; ++i) run[i] = 1;
      for (std::size_t s2 = b; s2-- > 0;)
        for (std::size_t i = 0; i < kd; ++i) {
          run[i] = run[i] * al[(s2 + 1) * kd + i];
          fac[s2 * kd + i] = run[i];
          bmr[s2 * kd + i] = k[s2 * kd + i] * run[i];
        }
      T* dr = bw.dr.data();  // (2·nr)×ncol
      for (std::size_t t = b; t < e; ++t) {
        T* rl = dr + (t - b) * ncol;
        T* rp = dr + (nr + t - b) * ncol;
        const std::size_t s_end = safe ? t + 1 : b;
        for (std::size_t s2 = 0; s2 < ncol; ++s2) {
          rl[s2] = (s2 < s_end && s2 < t) ? dL[t * c + s2] : T(0);
          rp[s2] = s2 < s_end ? dP[t * c + s2] : T(0);
        }
      }
      T* dam = bw.dam.data();  // (2·nr)×K
      gemm<GemmOp::set>(2 * nr, kd, ncol, dr, ncol, std::size_t{1}, bmr, kd, dam, kd);
      T* dbm = bw.dbm.data();  // ncol×K
      gemm<GemmOp::set>(ncol, kd, 2 * nr, dr, std::size_t{1}, ncol, am, kd, dbm, kd);
      for (std::size_t t = b; t < e; ++t)
        for (std::size_t i = 0; i < kd; ++i) {
          const std::size_t x = t * kd + i, y = (t - b) * kd + i, yq = (nr + t - b) * kd + i;
          const T f = ff[y];
          gk[x] = gk[x] + dam[y] * f;
          gq[x] = gq[x] + dam[yq] * f;
          gg[x] = gg[x] + dam[y] * am[y] + dam[yq] * am[yq];
          if (safe) {  // Kinv_s = k_s / F_s
            gk[x] = gk[x] + dbm[x] / f;
            gg[x] = gg[x] - dbm[x] * bmr[x];
          }
        }
      for (std::size_t s2 = 0; s2 < b; ++s2)
        for (std::size_t i = 0; i < kd; ++i) {
          const std::size_t x = s2 * kd + i;
          gk[x] = gk[x] + dbm[x] * fac[x];
          gg[x] = gg[x] - dbm[x] * bmr[x];
        }
      if (!safe) {
        // The exact diagonal block, pair by pair: y = Π(s,t], x = y ⊙ k_s.
        T* y = bw.y.data();
        for (std::size_t s2 = b; s2 < e; ++s2) {
          for (std::size_t i = 0; i < kd; ++i) y[i] = 1;
          for (std::size_t t = s2; t < e; ++t) {
            if (t > s2)
              for (std::size_t i = 0; i < kd; ++i) y[i] = y[i] * al[t * kd + i];
            const T cl = t > s2 ? dL[t * c + s2] : T(0), cp = dP[t * c + s2];
            for (std::size_t i = 0; i < kd; ++i) {
              const T xi = y[i] * k[s2 * kd + i];
              const T u = cl * k[t * kd + i] + cp * q[t * kd + i];
              gk[t * kd + i] = gk[t * kd + i] + cl * xi;
              gq[t * kd + i] = gq[t * kd + i] + cp * xi;
              gk[s2 * kd + i] = gk[s2 * kd + i] + y[i] * u;
              const T dgm = u * xi;
              gg[t * kd + i] = gg[t * kd + i] + dgm;
              gg[s2 * kd + i] = gg[s2 * kd + i] - dgm;
            }
          }
        }
      }
    }

    // Outputs of the chunk: dq, dk, dg (reverse cumulative sum of dγ).
    for (std::size_t i = 0; i < kd; ++i) run[i] = 0;
    for (std::size_t t = c; t-- > 0;) {
      T* dqt = out.dq + (t0 + t) * out.qk_stride;
      T* dkt = out.dk + (t0 + t) * out.qk_stride;
      T* dgt = out.dg + (t0 + t) * out.g_stride;
      for (std::size_t i = 0; i < kd; ++i) {
        dqt[i] = gq[t * kd + i];
        dkt[i] = gk[t * kd + i];
        run[i] = run[i] + gg[t * kd + i];
        dgt[i] = run[i];
      }
    }

    // dS ← scale Qgᵀ dO + Diag(a_c) dS - Wᵀ dΔ.
    T* t2 = w.kv.data();
    gemm<GemmOp::set>(kd, vd, c, w.qg.data(), std::size_t{1}, kd, dob, vd, t2, vd);
    for (std::size_t i = 0; i < kd; ++i) {
      const T a = w.ac[i];
      for (std::size_t j = 0; j < vd; ++j)
        ds[i * vd + j] = scale * t2[i * vd + j] + a * ds[i * vd + j];
    }
    gemm<GemmOp::sub>(kd, vd, c, X + vd, std::size_t{1}, ldx, dd, vd, ds, vd);
  }
  if (out.d_incoming)
    for (std::size_t i = 0; i < kv; ++i) out.d_incoming[i] = ds[i];
}

}  // namespace kdacp::kda::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // KDACP_KDA_CHUNK_INL_H_
