// Per-target kernels of the token-by-token KDA recurrence (SPEC §9),
// forward direction: the sweep that produces every forward state, and the
// chunk summary (kda_recurrent_backward-inl.h has the reverse sweep).
// Installed in the kernel table per Highway target by kda_recurrent_hwy.cpp,
// hence the toggle guard instead of #pragma once.
//
// Work is O(T·K·V) per (batch, value head), all of it row operations on the
// K×V state (V contiguous elements a row): scale a row, axpy a row into a
// V-vector, dot a row with a V-vector, rank-1 update. Each token makes one
// pass over the rows, doing all of a row's work for the end of one token and
// the start of the next. Columns are independent in the recurrence, so the
// forward-direction passes (sweep, the transfer M, incoming_grad) walk the
// rows once per strip of columns (kStripVecs vectors) with the per-column
// accumulators in registers; backward's step walks the columns once per pair
// of rows (kStepRows) with its per-row dots in registers. Neither changes any
// element's operations or their order, so results are the same bits as the
// plain row loops. Dots keep kLanes partial sums so they vectorise without
// reassociation flags and still sum in a fixed order.
//
// Recomputed states must equal the forward's bit for bit (backward's
// checkpoint interval may not change results), so every forward state comes
// from one function, sweep().
//
// Results are bitwise identical across targets (tests/test_kda_dispatch.cpp
// compares every compiled target with the reference entries) because
//  - every element-wise loop computes each element with the same operations
//    in the same order whatever the vector width,
//  - dots sum into kLanes<T> fixed partial sums (64 bytes: 16 floats, one
//    AVX-512 vector, two AVX2 or four SSE4 ones), then tree_sum's fixed
//    pairwise order, the same association for every width, and
//  - nothing is fused (the FMA policy, kernels/table.hpp: these are row
//    updates and dots, which round every product).
#if defined(KDACP_KERNELS_KDA_RECURRENT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KDACP_KERNELS_KDA_RECURRENT_INL_H_
#undef KDACP_KERNELS_KDA_RECURRENT_INL_H_
#else
#define KDACP_KERNELS_KDA_RECURRENT_INL_H_
#endif

#include "kernels/per_target.h"

#include <hwy/highway.h>

#include <cmath>
#include <cstddef>
#include <vector>

#include "kernels/kda_heads.hpp"

KDACP_TARGET_BEGIN;
namespace kdacp::kda::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Lambdas below carry HWY_ATTR: clang does not apply HWY_BEFORE_NAMESPACE's
// target attribute to lambdas, and a lambda left at the baseline ISA would
// keep its loops at SSE2.

template <class T>
void decays(const T* g, T* a, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) a[i] = std::exp(g[i]);
}

// The hot row operations are written with Highway vectors: auto-vectorised,
// these loops split into one short loop per operation, each versioned for
// aliasing, and the lane reductions vectorised poorly. Each
// element still sees the same operations in the same order as the scalar
// loops (kept as the tails), so results do not depend on the vector width.

// Vectors per column strip: the strip's accumulators stay in registers while
// a pass walks the rows. AVX-512 has 32 vector registers, the others 16.
#if HWY_TARGET <= HWY_AVX3
constexpr std::size_t kStripVecs = 4;
#else
constexpr std::size_t kStripVecs = 2;
#endif

// One token pass of a sweep over the columns [j0, j0 + NV·Lanes) (NV = 0: the
// single column j0, scalar). Per element (i, j), in row order i, exactly the
// scalar statements
//   x = pr[i,j] + k_i·bu[j]   (kSub: x = pr[i,j] - k_i·bu[j]);
//   kQ: acc[j] += q_i·x;  kNext: x *= a_i, w[j] += kn_i·x;
//   kStore: nr[i,j] = x,
// with acc[j] and w[j] starting at zero. Columns are independent, so walking
// the rows once per strip with acc, w and bu in registers gives the same bits
// as walking whole rows. pr may equal nr (the state is advanced in place).
template <std::size_t NV, bool kSub, bool kQ, bool kStore, bool kNext, class T>
HWY_INLINE void sweep_strip(const T* dp, T* dn, std::size_t ld, std::size_t kd, std::size_t j0,
                            const T* k, const T* bu, const T* q, T* acc, const T* a,
                            const T* kn, T* w) {
  if constexpr (NV == 0) {
    const T b = bu[j0];
    T sacc = 0, sw = 0;
    for (std::size_t i = 0; i < kd; ++i) {
      T x = kSub ? dp[i * ld + j0] - k[i] * b : dp[i * ld + j0] + k[i] * b;
      if constexpr (kQ) sacc += q[i] * x;
      if constexpr (kNext) {
        x *= a[i];
        sw += kn[i] * x;
      }
      if constexpr (kStore) dn[i * ld + j0] = x;
    }
    if constexpr (kQ) acc[j0] = sacc;
    if constexpr (kNext) w[j0] = sw;
  } else {
    const hn::ScalableTag<T> d;
    using V = hn::Vec<decltype(d)>;
    const std::size_t n = hn::Lanes(d);
    V vbu[NV], vacc[NV], vw[NV];
    for (std::size_t r = 0; r < NV; ++r) {
      vbu[r] = hn::LoadU(d, bu + j0 + r * n);
      vacc[r] = hn::Zero(d);
      vw[r] = hn::Zero(d);
    }
    for (std::size_t i = 0; i < kd; ++i) {
      const T* pr = dp + i * ld + j0;
      T* nr = kStore ? dn + i * ld + j0 : nullptr;
      const V vki = hn::Set(d, k[i]);
      const V vqi = hn::Set(d, kQ ? q[i] : T(0));
      const V vai = hn::Set(d, kNext ? a[i] : T(0));
      const V vkni = hn::Set(d, kNext ? kn[i] : T(0));
      for (std::size_t r = 0; r < NV; ++r) {
        const V p = hn::LoadU(d, pr + r * n);
        V x = kSub ? hn::Sub(p, hn::Mul(vki, vbu[r])) : hn::Add(p, hn::Mul(vki, vbu[r]));
        if constexpr (kQ) vacc[r] = hn::Add(vacc[r], hn::Mul(vqi, x));
        if constexpr (kNext) {
          x = hn::Mul(x, vai);
          vw[r] = hn::Add(vw[r], hn::Mul(vkni, x));
        }
        if constexpr (kStore) hn::StoreU(x, d, nr + r * n);
      }
    }
    for (std::size_t r = 0; r < NV; ++r) {
      if constexpr (kQ) hn::StoreU(vacc[r], d, acc + j0 + r * n);
      if constexpr (kNext) hn::StoreU(vw[r], d, w + j0 + r * n);
    }
  }
}

// A whole token pass: strips of kStripVecs vectors, then single vectors, then
// single columns.
template <bool kSub, bool kQ, bool kStore, bool kNext, class T>
HWY_INLINE void sweep_pass(const T* dp, T* dn, std::size_t ld, std::size_t kd, std::size_t vd,
                           const T* k, const T* bu, const T* q, T* acc, const T* a,
                           const T* kn, T* w) {
  const hn::ScalableTag<T> d;
  const std::size_t n = hn::Lanes(d);
  std::size_t j = 0;
  for (; j + kStripVecs * n <= vd; j += kStripVecs * n)
    sweep_strip<kStripVecs, kSub, kQ, kStore, kNext>(dp, dn, ld, kd, j, k, bu, q, acc, a, kn, w);
  for (; j + n <= vd; j += n)
    sweep_strip<1, kSub, kQ, kStore, kNext>(dp, dn, ld, kd, j, k, bu, q, acc, a, kn, w);
  for (; j < vd; ++j)
    sweep_strip<0, kSub, kQ, kStore, kNext>(dp, dn, ld, kd, j, k, bu, q, acc, a, kn, w);
}

// A dot's kLanes partial sums as kLanes / Lanes(d) vectors of at most kLanes
// lanes: element j of a full group of kLanes lands in lane j mod kLanes
// (vector (j mod kLanes) / Lanes(d)), whatever the target's vector width.
template <class T>
using LaneTag = hn::CappedTag<T, kLanes<T>>;

// The partial sums' one reduction order, the same for every target: while
// more than one sum is left, with m = half their number, sum l becomes
// sum l + sum (l + m) for l < m; the result is sum 0 (a fixed pairwise tree).
// Across vectors that is acc[g] + acc[g + m / Lanes], within one vector its
// lower half plus its upper half.
template <class D>
HWY_INLINE hn::TFromD<D> tree_sum_vec(D d, hn::Vec<D> v) {
  (void)d;
#if HWY_TARGET == HWY_SCALAR  // one lane, and no UpperHalf
  return hn::GetLane(v);
#else
  if constexpr (hn::MaxLanes(D()) == 1) {
    return hn::GetLane(v);
  } else {
    const hn::Half<D> dh;
    return tree_sum_vec(dh, hn::Add(hn::LowerHalf(dh, v), hn::UpperHalf(dh, v)));
  }
#endif
}

template <std::size_t G, class D>
HWY_INLINE hn::TFromD<D> tree_sum(D d, hn::Vec<D> (&acc)[G]) {
  for (std::size_t m = G / 2; m >= 1; m /= 2)
    for (std::size_t g = 0; g < m; ++g) acc[g] = hn::Add(acc[g], acc[g + m]);
  return tree_sum_vec(d, acc[0]);
}

// Runs tokens [t0, t1) from `s_in` = S_{t0-1} (null: zero), per token
//   S'_t = Diag(a_t) S_{t-1},  u_t = v_t - S'_tᵀk_t,  S_t = S'_t + k_t (β_t u_t)ᵀ.
// The state is touched once per token: the row pass that finishes token t
// also starts token t+1, while the row is in L1. Every forward state of the
// KDA kernels comes from here, so backward's recomputed states equal the
// forward's bit for bit.
template <class T>
void sweep(const HeadInputs<T>& h, std::size_t t0, std::size_t t1, std::size_t kd,
           std::size_t vd, const T* s_in, const SweepOut<T>& out, SweepScratch<T>& ws) {
  const std::size_t kv = kd * vd;
  if (out.decayed == nullptr) ws.work.resize(kv);
  ws.vecs.assign(4 * vd + kd, T(0));
  T* w = ws.vecs.data();
  T* bu = w + vd;
  T* acc = bu + vd;
  T* u_scratch = acc + vd;
  T* a_scratch = u_scratch + vd;
  // a_t, kept for the caller with out.decays.
  auto decay_of = [&](std::size_t t) HWY_ATTR {
    T* a_t = out.decays ? out.decays + (t - t0) * kd : a_scratch;
    decays(h.g_at(t), a_t, kd);
    return static_cast<const T*>(a_t);
  };
  auto decayed = [&](std::size_t t) HWY_ATTR {
    return out.decayed ? out.decayed + (t - t0) * kv : ws.work.data();
  };

  T* d = decayed(t0);
  if (s_in == nullptr) {
    for (std::size_t i = 0; i < kv; ++i) d[i] = 0;
    s_in = d;
  }
  const T* a = decay_of(t0);
  const T* k0 = h.k_at(t0);
  for (std::size_t i = 0; i < kd; ++i) {
    const T* sr = s_in + i * vd;
    T* dr = d + i * vd;
    T ai = a[i], ki = k0[i];
    for (std::size_t j = 0; j < vd; ++j) {
      dr[j] = ai * sr[j];
      w[j] += ki * dr[j];
    }
  }

  for (std::size_t t = t0; t < t1; ++t) {
    const T* k = h.k_at(t);
    const T* v = h.v_at(t);
    const T beta = h.beta_at(t);
    T* u = out.us ? out.us + (t - t0) * vd : u_scratch;
    for (std::size_t j = 0; j < vd; ++j) {
      u[j] = v[j] - w[j];
      bu[j] = beta * u[j];
    }
    const bool next = t + 1 < t1;
    const T* q = out.o ? h.q_at(t) : nullptr;
    const T* dp = decayed(t);
    // S_t is written where S'_{t+1} goes (or to final_state) and decayed in place.
    T* dn = next ? decayed(t + 1) : out.final_state;
    if (dn == nullptr && q == nullptr) continue;
    const T* kn = nullptr;
    if (next) {
      a = decay_of(t + 1);
      kn = h.k_at(t + 1);
    }
    // The pass sets acc (with q) and w (with next) for every column.
    if (dn == nullptr) {
      sweep_pass<false, true, false, false>(dp, static_cast<T*>(nullptr), vd, kd, vd, k, bu, q,
                                            acc, a, kn, w);
    } else if (q && next) {
      sweep_pass<false, true, true, true>(dp, dn, vd, kd, vd, k, bu, q, acc, a, kn, w);
    } else if (q) {
      sweep_pass<false, true, true, false>(dp, dn, vd, kd, vd, k, bu, q, acc, a, kn, w);
    } else if (next) {
      sweep_pass<false, false, true, true>(dp, dn, vd, kd, vd, k, bu, q, acc, a, kn, w);
    } else {
      sweep_pass<false, false, true, false>(dp, dn, vd, kd, vd, k, bu, q, acc, a, kn, w);
    }
    if (q) {
      T* ot = out.o + t * out.o_stride;
      for (std::size_t j = 0; j < vd; ++j) ot[j] = out.scale * acc[j];
    }
  }
}

template <class T>
void summary_head(const HeadInputs<T>& h, std::size_t tokens, std::size_t kd, std::size_t vd,
                  T* s, T* m, SweepScratch<T>& ws, std::vector<T>& vecs) {
  SweepOut<T> out;
  out.final_state = s;
  sweep(h, 0, tokens, kd, vd, static_cast<const T*>(nullptr), out, ws);

  // M ← Diag(a)M - β k (kᵀ Diag(a) M): O(K²) per token instead of a K×K
  // product, and, like the state, one pass over M per token.
  vecs.assign(3 * kd, T(0));
  T* r = vecs.data();
  T* br = r + kd;
  T* a = br + kd;
  for (std::size_t i = 0; i < kd * kd; ++i) m[i] = 0;
  decays(h.g_at(0), a, kd);
  const T* k0 = h.k_at(0);
  for (std::size_t i = 0; i < kd; ++i) {
    m[i * kd + i] = a[i];
    for (std::size_t j = 0; j < kd; ++j) r[j] += k0[i] * m[i * kd + j];
  }
  for (std::size_t t = 0; t < tokens; ++t) {
    const T* k = h.k_at(t);
    const T beta = h.beta_at(t);
    const bool next = t + 1 < tokens;
    for (std::size_t j = 0; j < kd; ++j) br[j] = beta * r[j];
    const T* kn = next ? h.k_at(t + 1) : nullptr;
    if (next) decays(h.g_at(t + 1), a, kd);
    // Per element M[i,j]: M -= k_i·br[j]; with next, M *= a_i, r[j] += kn_i·M.
    if (next) {
      sweep_pass<true, false, true, true>(m, m, kd, kd, kd, k, br, static_cast<const T*>(nullptr),
                                          static_cast<T*>(nullptr), a, kn, r);
    } else {
      sweep_pass<true, false, true, false>(m, m, kd, kd, kd, k, br, static_cast<const T*>(nullptr),
                                           static_cast<T*>(nullptr), a, kn, r);
    }
  }
}

}  // namespace kdacp::kda::detail::HWY_NAMESPACE
KDACP_TARGET_END;

#endif  // KDACP_KERNELS_KDA_RECURRENT_INL_H_
