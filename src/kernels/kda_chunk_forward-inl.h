// Per-target forward kernels of the chunkwise algorithm (kda_chunk-inl.h has
// the math): a chunk's state-independent factors (chunk_prepare), the state
// update over one chunk, and the per-head forward, summary and incoming
// gradient. Included once per Highway target, hence the toggle guard
// instead of #pragma once.
#if defined(KDACP_KERNELS_KDA_CHUNK_FORWARD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KDACP_KERNELS_KDA_CHUNK_FORWARD_INL_H_
#undef KDACP_KERNELS_KDA_CHUNK_FORWARD_INL_H_
#else
#define KDACP_KERNELS_KDA_CHUNK_FORWARD_INL_H_
#endif

#include "kernels/per_target.h"

#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cstddef>
#include <type_traits>

#include "kernels/kda_chunk.hpp"
#include "kernels/kda_chunk_exact-inl.h"
#include "kernels/kda_chunk_solve-inl.h"
#include "kernels/kda_heads.hpp"
#include "kernels/gemm-inl.h"
#include "kernels/simd-inl.h"

KDACP_TARGET_BEGIN;
namespace kdacp::kda::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using namespace ::kdacp::detail::HWY_NAMESPACE;  // src/kernels: simd-inl.h, gemm-inl.h

// Gathers tokens [t0, t0 + c) of one head and builds everything of the
// chunk that does not depend on the state: decays, Kg, Qg, Kr, a_c, L, P and
// the solve's columns [x_lo, x_hi) of X = [U | W] (U: [0, V), W: [V, V+K)).
// alpha_all: exp(g) of the head's tokens, [tokens×K] (null: computed here).
// factors: which of L and P are built (l: P is left as it was, for the
// summary, which uses L only, and so are q and Qg; none: neither, for a
// caller that kept them from an earlier call on the same chunk); L and P are
// the same either way.
enum class Factors { l, l_and_p, none };

// transpose(src, rows, cols, lds, dst, ldd) of simd-inl.h (a copy, the same
// values), with the float 16×16 blocks transposed in registers on the
// AVX-512 targets: chunk_prepare transposes its rows of K·F and Q·F once per
// sub-chunk, and element by element that was a tenth of the summary's time.
template <class T>
void transpose_rows(const T* HWY_RESTRICT src, std::size_t rows, std::size_t cols, std::size_t lds,
                    T* HWY_RESTRICT dst, std::size_t ldd) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  if constexpr (std::is_same_v<T, float>) {
    constexpr std::size_t kB = 16;
    const std::size_t rb = rows / kB * kB, cb = cols / kB * kB;
    for (std::size_t i0 = 0; i0 < rb; i0 += kB)
      for (std::size_t j0 = 0; j0 < cb; j0 += kB) {
        __m512 r[kB], t[kB];
        for (std::size_t i = 0; i < kB; ++i) r[i] = _mm512_loadu_ps(src + (i0 + i) * lds + j0);
        for (std::size_t i = 0; i < kB / 2; ++i) {  // 2×2 blocks of 32-bit lanes
          t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
          t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        for (std::size_t i = 0; i < kB / 4; ++i) {  // 4×4 blocks inside each 128-bit lane
          const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
          const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
          r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
          r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
          r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
          r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
        }
        for (std::size_t h = 0; h < 2; ++h)  // then the 128-bit lanes themselves
          for (std::size_t i = 0; i < 4; ++i) {
            t[8 * h + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0x88);
            t[8 * h + 4 + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0xdd);
          }
        for (std::size_t i = 0; i < kB / 2; ++i) {
          _mm512_storeu_ps(dst + (j0 + i) * ldd + i0, _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88));
          _mm512_storeu_ps(dst + (j0 + 8 + i) * ldd + i0, _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd));
        }
      }
    // The edges: rows below rb (all columns), columns right of cb.
    if (rb < rows) transpose(src + rb * lds, rows - rb, cols, lds, dst + rb, ldd);
    if (cb < cols && rb > 0) transpose(src + cb, rb, cols - cb, lds, dst + cb * ldd, ldd);
    return;
  }
#endif
  transpose(src, rows, cols, lds, dst, ldd);
}

// chunk_prepare's stages, one function each (the same operations in the
// same order: the bytes do not depend on the cut).

// The chunk's rows of k, q (need_q), α = exp(g) (or alpha_all's) and β.
template <class T>
void chunk_load(const HeadInputs<T>& h, std::size_t t0, std::size_t c, std::size_t kd, std::size_t vd,
                ChunkWork<T>& w, const T* alpha_all, bool need_q) {
  T* k = w.k.data();
  T* q = w.q.data();
  T* al = w.alpha.data();
  constexpr std::size_t kAhead = 8;  // tokens: the rows are strided, prefetch them
  const auto prefetch = [](typename HeadInputs<T>::Row r) {
    const char* p = static_cast<const char*>(r.p);
    for (std::size_t b = 0; b < r.bytes; b += 64) hwy::Prefetch(p + b);
  };
  for (std::size_t t = 0; t < c; ++t) {
    if (t + kAhead < c) {
      const std::size_t ta = t0 + t + kAhead;
      prefetch(h.k_row(ta, kd));
      if (need_q) prefetch(h.q_row(ta, kd));
      if (!alpha_all) prefetch(h.g_row(ta, kd));
      prefetch(h.v_row(ta, vd));
    }
    // A 16-bit row is widened as it is copied: the same values as a T row.
    h.load_k(t0 + t, 0, kd, k + t * kd);
    if (need_q) h.load_q(t0 + t, 0, kd, q + t * kd);
    if (alpha_all) {
      const T* at = alpha_all + (t0 + t) * kd;
      for (std::size_t i = 0; i < kd; ++i) al[t * kd + i] = at[i];
    } else if (h.g16.bits) {
      h.load_g(t0 + t, 0, kd, al + t * kd);
      exp_row(al + t * kd, al + t * kd, kd);  // element-wise: in place is the same
    } else {
      exp_row(h.g_at(t0 + t), al + t * kd, kd);
    }
    w.beta[t] = h.beta_at(t0 + t);
  }
}

// Kg, Qg (need_q) and Kr from the running products of α; a_c.
template <class T>
void chunk_decays(std::size_t c, std::size_t kd, ChunkWork<T>& w, bool need_q) {
  const T* k = w.k.data();
  const T* q = w.q.data();
  const T* al = w.alpha.data();
  // Kg, Qg with the running product Π(-1,t]; a_c.
  T* HWY_RESTRICT run = w.run.data();
  T* HWY_RESTRICT kg = w.kg.data();
  T* HWY_RESTRICT qg = w.qg.data();
  T* HWY_RESTRICT kr = w.kr.data();
  for (std::size_t i = 0; i < kd; ++i) run[i] = 1;
  for (std::size_t t = 0; t < c; ++t) {
    const std::size_t o = t * kd;
    for_vecs<T>(
        kd,
        [&](auto d, std::size_t i) {
          const auto r = hn::Mul(hn::LoadU(d, run + i), hn::LoadU(d, al + o + i));
          hn::StoreU(r, d, run + i);
          hn::StoreU(hn::Mul(hn::LoadU(d, k + o + i), r), d, kg + o + i);
          if (need_q) hn::StoreU(hn::Mul(hn::LoadU(d, q + o + i), r), d, qg + o + i);
        },
        [&](std::size_t i) {
          run[i] = run[i] * al[o + i];
          kg[o + i] = k[o + i] * run[i];
          if (need_q) qg[o + i] = q[o + i] * run[i];
        });
  }
  for (std::size_t i = 0; i < kd; ++i) w.ac[i] = run[i];
  // Kr_s = Π(s,c-1] ⊙ k_s, backwards.
  for (std::size_t i = 0; i < kd; ++i) run[i] = 1;
  for (std::size_t s = c; s-- > 0;) {
    const std::size_t o = s * kd;
    const bool more = s > 0;
    for_vecs<T>(
        kd,
        [&](auto d, std::size_t i) {
          const auto r = hn::LoadU(d, run + i);
          hn::StoreU(hn::Mul(hn::LoadU(d, k + o + i), r), d, kr + o + i);
          if (more) hn::StoreU(hn::Mul(r, hn::LoadU(d, al + o + i)), d, run + i);
        },
        [&](std::size_t i) {
          kr[o + i] = k[o + i] * run[i];
          if (more) run[i] = run[i] * al[o + i];
        });
  }
}

// L's and P's (need_p) rows [b, min(b + kSub, c)).
template <class T>
void chunk_factor_block(std::size_t b, std::size_t c, std::size_t kd, bool need_p, ChunkWork<T>& w) {
  const T* k = w.k.data();
  const T* q = w.q.data();
  const T* al = w.alpha.data();
  T* HWY_RESTRICT run = w.run.data();
  T* L = w.L.data();
  T* P = w.P.data();
  const std::size_t e = std::min(b + kSub, c), nr = e - b, ncol = e;
  T* HWY_RESTRICT am = w.amat.data();   // rows [Kf_t; Qf_t], t ∈ σ: (2·nr)×K
  T* HWY_RESTRICT amt = w.bmat.data();  // K×(2·nr): am transposed
  // br: ncol×K, row s = Π(s,b] ⊙ k_s (s < b), k_s / F_s (s ∈ σ).
  T* HWY_RESTRICT fr = w.frows.data();  // nr×K: F_t
  T* HWY_RESTRICT br = w.brows.data();
  for (std::size_t t = b; t < e; ++t) {
    T* f = fr + (t - b) * kd;
    const T* fp = f - kd;
    const T* a = al + t * kd;
    const bool first = t == b;
    const T* kt = k + t * kd;
    const T* qt = q + t * kd;
    T* ak = am + (t - b) * kd;
    T* aq = am + (nr + t - b) * kd;
    T* bt = br + t * kd;
    for_vecs<T>(
        kd,
        [&](auto d, std::size_t i) {
          const auto fv = first ? hn::Set(d, T(1)) : hn::Mul(hn::LoadU(d, fp + i), hn::LoadU(d, a + i));
          hn::StoreU(fv, d, f + i);
          const auto kv = hn::LoadU(d, kt + i);
          hn::StoreU(hn::Mul(kv, fv), d, ak + i);
          if (need_p) hn::StoreU(hn::Mul(hn::LoadU(d, qt + i), fv), d, aq + i);
          hn::StoreU(hn::Div(kv, fv), d, bt + i);
        },
        [&](std::size_t i) {
          f[i] = first ? T(1) : fp[i] * a[i];
          ak[i] = kt[i] * f[i];
          if (need_p) aq[i] = qt[i] * f[i];
          bt[i] = kt[i] / f[i];
        });
  }
  // Channels out of the factorisable range take the exact path: their k/F
  // entries leave the product (zeros), their pairs are added below.
  classify_channels(fr, br + b * kd, nr, kd, w);
  for (std::size_t i : w.bad)
    for (std::size_t s2 = b; s2 < e; ++s2) br[s2 * kd + i] = 0;
  for (std::size_t i = 0; i < kd; ++i) run[i] = 1;
  for (std::size_t s2 = b; s2-- > 0;) {
    const T* a = al + (s2 + 1) * kd;
    const T* ks = k + s2 * kd;
    T* bs = br + s2 * kd;
    for_vecs<T>(
        kd,
        [&](auto d, std::size_t i) {
          const auto r = hn::Mul(hn::LoadU(d, run + i), hn::LoadU(d, a + i));
          hn::StoreU(r, d, run + i);
          hn::StoreU(hn::Mul(hn::LoadU(d, ks + i), r), d, bs + i);
        },
        [&](std::size_t i) {
          run[i] = run[i] * a[i];
          bs[i] = ks[i] * run[i];
        });
  }
  const std::size_t na = need_p ? 2 * nr : nr;
  transpose_rows(am, na, kd, kd, amt, na);
  // rt = br · amᵀ (ncol×(2·nr)): element (s, t) is the same fused chain
  // over the key channels as (am · brᵀ)(t, s), factors swapped.
  T* r = w.rbuf.data();
  gemm<GemmOp::set>(ncol, na, kd, br, kd, std::size_t{1}, amt, na, r, na);
  for (std::size_t t = b; t < e; ++t) {
    T* lt = L + t * kChunk;
    T* pt = P + t * kChunk;
    for (std::size_t s2 = 0; s2 < c; ++s2) lt[s2] = s2 < t ? r[s2 * na + (t - b)] : T(0);
    if (need_p)
      for (std::size_t s2 = 0; s2 < c; ++s2) pt[s2] = s2 <= t ? r[s2 * na + (nr + t - b)] : T(0);
  }
  // The exact channels' share of the diagonal block.
  if (!w.bad.empty()) exact_block_forward(k, q, al, b, e, kd, need_p, L, P, w);
}

// X = (I + Diag(β) L)⁻¹ Diag(β) [V | Kg] on columns [x_lo, x_hi).
template <class T>
void chunk_right_side(const HeadInputs<T>& h, std::size_t t0, std::size_t c, std::size_t kd, std::size_t vd,
                      std::size_t x_lo, std::size_t x_hi, ChunkWork<T>& w) {
  const std::size_t ldx = vd + kd;
  const T* kg = w.kg.data();
  // By blocks of kSub rows: the rows above a block are subtracted with one
  // product, then forward substitution inside the block.
  T* X = w.x.data();
  for (std::size_t t = 0; t < c; ++t) {
    T* xr = X + t * ldx;
    if (x_lo < std::min(x_hi, vd)) h.load_v(t0 + t, x_lo, std::min(x_hi, vd) - x_lo, xr + x_lo);
    for (std::size_t j = std::max(x_lo, vd); j < x_hi; ++j) xr[j] = kg[t * kd + j - vd];
  }
  chunk_solve(c, X + x_lo, ldx, x_hi - x_lo, w);
}

template <class T>
void chunk_prepare(const HeadInputs<T>& h, std::size_t t0, std::size_t c, std::size_t kd,
                   std::size_t vd, std::size_t x_lo, std::size_t x_hi, ChunkWork<T>& w,
                   const T* alpha_all = nullptr, Factors factors = Factors::l_and_p) {
  const bool need_p = factors == Factors::l_and_p;
  const bool need_q = factors != Factors::l;  // P and the output's Qg S_0 read q
  w.resize(kd, vd);
  chunk_load(h, t0, c, kd, vd, w, alpha_all, need_q);
  chunk_decays(c, kd, w, need_q);
  // L (strictly lower) and P (lower), kChunk×kChunk, zero above. Every
  // row t < c is written whole, [0, c): no separate zero fill.
  for (std::size_t b = 0; b < (factors == Factors::none ? 0 : c); b += kSub)
    chunk_factor_block(b, c, kd, need_p, w);
  chunk_right_side(h, t0, c, kd, vd, x_lo, x_hi, w);
}

// The end of one prepared chunk given Δ (c rows of stride ldd, n columns):
// when o is set, o_t = scale (Qg S_0 + P Δ)_t on the first V columns (at
// o + t·o_stride); then, when `advance`, S ← Diag(a_c) S + Krᵀ Δ (state:
// K×n; a caller that reads no state after the chunk skips it). zero_state:
// S_0 is known to be +0 (gemm_zero_b).
template <class T>
void chunk_finish(std::size_t c, std::size_t kd, std::size_t vd, std::size_t n, T* state, const T* dl,
                  std::size_t ldd, T* o, std::size_t o_stride, T scale, ChunkWork<T>& w,
                  bool zero_state = false, bool advance = true) {
  if (o != nullptr) {
    T* tmp = w.tmp.data();  // c×V
    if (!(zero_state && gemm_zero_b<GemmOp::set>(c, vd, kd, w.qg.data(), kd, std::size_t{1}, tmp, vd)))
      gemm<GemmOp::set>(c, vd, kd, w.qg.data(), kd, std::size_t{1}, state, n, tmp, vd);
    gemm<GemmOp::add, Tri::lower_a>(c, vd, c, w.P.data(), kChunk, std::size_t{1}, dl, ldd, tmp, vd);
    for (std::size_t t = 0; t < c; ++t) {
      T* ot = o + t * o_stride;
      for (std::size_t j = 0; j < vd; ++j) ot[j] = scale * tmp[t * vd + j];
    }
  }
  if (!advance) return;
  for (std::size_t i = 0; i < kd; ++i) {
    const T a = w.ac[i];
    T* row = state + i * n;
    for (std::size_t j = 0; j < n; ++j) row[j] = a * row[j];
  }
  gemm<GemmOp::add>(kd, n, c, w.kr.data(), std::size_t{1}, kd, dl, ldd, state, n);
}

// Advances the summary's [S | M] (K×n, n = V + K; the M columns see U = 0)
// over one chunk prepared with X = [U | W]: Δ = [U | 0] - W [S | M].
template <class T>
void chunk_advance(std::size_t c, std::size_t kd, std::size_t vd, std::size_t n, T* state, ChunkWork<T>& w) {
  const std::size_t ldx = vd + kd;
  const T* X = w.x.data();
  T* dl = w.delta.data();  // c×n
  for (std::size_t t = 0; t < c; ++t) {
    for (std::size_t j = 0; j < vd; ++j) dl[t * n + j] = X[t * ldx + j];
    for (std::size_t j = vd; j < n; ++j) dl[t * n + j] = 0;
  }
  gemm<GemmOp::sub>(c, n, kd, X + vd, ldx, std::size_t{1}, state, n, dl, n);
  chunk_finish(c, kd, vd, n, state, dl, n, static_cast<T*>(nullptr), 0, T(0), w);
}

// The forward's step over one chunk (n = V), with Δ solved directly:
// Δ = (I + Diag(β) L)⁻¹ Diag(β) (V - Kg S_0), which is U - W S_0 without
// solving for W (K columns fewer). Needs chunk_prepare's factors only
// (x_lo = x_hi). o as in chunk_finish. keep_r / keep_delta (c×V each, or
// null): where R = V - Kg S_0 and Δ are kept (the same bits either way).
// zero_state, advance: as in chunk_finish.
template <class T>
void chunk_advance_delta(const HeadInputs<T>& h, std::size_t t0, std::size_t c, std::size_t kd,
                         std::size_t vd, T* state, T* o, std::size_t o_stride, T scale,
                         ChunkWork<T>& w, T* keep_r = nullptr, T* keep_delta = nullptr,
                         bool zero_state = false, bool advance = true) {
  T* X = keep_delta ? keep_delta : w.x.data();
  const std::size_t ldx = keep_delta ? vd : vd + kd;
  for (std::size_t t = 0; t < c; ++t) h.load_v(t0 + t, 0, vd, X + t * ldx);
  if (!(zero_state && gemm_zero_b<GemmOp::sub>(c, vd, kd, w.kg.data(), kd, std::size_t{1}, X, ldx)))
    gemm<GemmOp::sub>(c, vd, kd, w.kg.data(), kd, std::size_t{1}, state, vd, X, ldx);
  if (keep_r)
    for (std::size_t t = 0; t < c; ++t) std::copy_n(X + t * ldx, vd, keep_r + t * vd);
  chunk_solve(c, X, ldx, vd, w);
  chunk_finish(c, kd, vd, vd, state, X, ldx, o, o_stride, scale, w, zero_state, advance);
}

// forward of one head: o (when set) and, when set, the final state. keep
// (or null): the head's record of chunk_saved_layout, what the backward's
// first pass would recompute (the record is written in whole; the state
// entering the first chunk, `incoming`, is not part of it).
template <class T>
void chunk_forward_head(const HeadInputs<T>& h, std::size_t tokens, std::size_t kd,
                        std::size_t vd, T scale, const T* incoming, T* o, std::size_t o_stride,
                        T* final_state, ChunkWork<T>& w, T* keep) {
  const ChunkSavedLayout lay = chunk_saved_layout(tokens, kd, vd);
  w.state.resize(kd * vd);
  T* st = w.state.data();
  for (std::size_t i = 0; i < kd * vd; ++i) st[i] = incoming ? incoming[i] : T(0);
  for (std::size_t ci = 0, t0 = 0; t0 < tokens; ++ci, t0 += kChunk) {
    const std::size_t c = std::min(kChunk, tokens - t0);
    chunk_prepare(h, t0, c, kd, vd, 0, 0, w, static_cast<const T*>(nullptr),
                  o != nullptr || keep != nullptr ? Factors::l_and_p : Factors::l);
    T* keep_r = nullptr;
    T* keep_delta = nullptr;
    if (keep) {
      // The first chunk's state is the incoming one: not kept.
      if (ci > 0) std::copy_n(st, kd * vd, keep + lay.state_at(ci, kd * vd));
      // L and P: rows [0, c), columns [0, c) (the rest of w.L's rows is
      // never read), c×c each.
      T* lp = keep + lay.factors_at(ci);
      for (std::size_t t = 0; t < c; ++t) {
        std::copy_n(w.L.data() + t * kChunk, c, lp + t * c);
        std::copy_n(w.P.data() + t * kChunk, c, lp + (c + t) * c);
      }
      keep_r = keep + lay.r + t0 * vd;
      keep_delta = keep + lay.delta + t0 * vd;
    }
    // The state entering the first chunk is +0 when there is no incoming
    // one; the state after the last is read only as the final state.
    const bool last = t0 + c == tokens;
    chunk_advance_delta(h, t0, c, kd, vd, st, o ? o + t0 * o_stride : nullptr, o_stride, scale, w, keep_r,
                        keep_delta, ci == 0 && incoming == nullptr, !last || final_state != nullptr);
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
    chunk_prepare(h, t0, c, kd, vd, 0, vd + kd, w, static_cast<const T*>(nullptr), Factors::l);
    chunk_advance(c, kd, vd, n, st, w);
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
    gemm<GemmOp::set, Tri::upper_a>(c, vd, c, w.P.data(), std::size_t{1}, kChunk, dob, vd, dd,
                                     vd);
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

}  // namespace kdacp::kda::detail::HWY_NAMESPACE
KDACP_TARGET_END;

#endif  // KDACP_KERNELS_KDA_CHUNK_FORWARD_INL_H_
