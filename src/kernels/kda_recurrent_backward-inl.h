// Per-target kernels of the token-by-token KDA recurrence, reverse
// direction: backward's gradients and incoming_grad's state gradient.
// Included once per Highway target after kda_recurrent-inl.h, whose sweep
// recomputes the forward states; why the results are the same bits on every
// target: kda_recurrent-inl.h.
#if defined(KDACP_KERNELS_KDA_RECURRENT_BACKWARD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KDACP_KERNELS_KDA_RECURRENT_BACKWARD_INL_H_
#undef KDACP_KERNELS_KDA_RECURRENT_BACKWARD_INL_H_
#else
#define KDACP_KERNELS_KDA_RECURRENT_BACKWARD_INL_H_
#endif

#include "kernels/per_target.h"

#include <hwy/highway.h>

#include <algorithm>
#include <cstddef>
#include <vector>

#include "kernels/kda_heads.hpp"
#include "kernels/kda_recurrent-inl.h"

KDACP_TARGET_BEGIN;
namespace kdacp::kda::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The reverse sweeps run token t's pull and token t-1's push in one pass over
// the state-gradient rows.
//
// Push (token t's output and rank-1 update, for one row i of dS):
//   dS[i,:] += scale·q_i do_t;  dq_i = scale·S_t[i,:]·do_t;  (dS u_t)_i;
//   z += k_i dS[i,:]  (z = dSᵀk, so du = β z).
// S_t[i,j] is rebuilt as S'_t[i,j] + k_i (β u_j), rounded as the forward did.
// Pull (token t's key read and decay, for one row i of dS):
//   dS'[i,:] = dS[i,:] - k_i duᵀ;  (S'_t du)_i;  dg_i = S'_t[i,:]·dS'[i,:];
//   dS_{t-1}[i,:] = a_i dS'[i,:].
// A step is token t's pull then token t-1's push, per element, over R rows
// [i0, i0 + R) at once: each group of kLanes columns loads its column vectors
// (du, bu, do, u, z) once for the R rows. Per row, the four dots keep kLanes
// partial sums (element j into sum j mod kLanes, in column order) and z[j]
// sums the rows in order, so the bits do not depend on R. Per row r the
// results are sdu[r] = (S'_t du)_i, dg[r], sdo[r] = S_{t-1}[i,:]·do,
// dsu[r] = (dS u_{t-1})_i.
template <class T>
struct StepArgs {
  T* ds;
  std::size_t vd;
  // pull (token t)
  const T* sd_pull;  // S'_t
  const T* a;
  const T* k_pull;
  const T* du;
  // push (token t-1)
  const T* sd_push;  // S'_{t-1}
  const T* k_push;
  const T* bu;
  const T* sq;  // scale·q_{t-1}
  const T* d_o;
  const T* u;
  T* z;
};

template <std::size_t R, bool kPull, bool kPush, class T>
HWY_INLINE void step_rows(const StepArgs<T>& p, std::size_t i0, T* sdu, T* dg, T* sdo,
                          T* dsu) {
  constexpr std::size_t L = kLanes<T>;
  using D = LaneTag<T>;
  const D d;
  using V = hn::Vec<D>;
  constexpr std::size_t n = hn::MaxLanes(D()), G = L / n;
  const std::size_t vd = p.vd;
  V ak[R][G], ag[R][G], aq[R][G], au[R][G];
  // The rows' scalars, broadcast once.
  V bkl[R], ba[R], bkp[R], bsq[R];
  for (std::size_t r = 0; r < R; ++r) {
    const std::size_t i = i0 + r;
    for (std::size_t g = 0; g < G; ++g) ak[r][g] = ag[r][g] = aq[r][g] = au[r][g] = hn::Zero(d);
    bkl[r] = hn::Set(d, kPull ? p.k_pull[i] : T(0));
    ba[r] = hn::Set(d, kPull ? p.a[i] : T(0));
    bkp[r] = hn::Set(d, kPush ? p.k_push[i] : T(0));
    bsq[r] = hn::Set(d, kPush ? p.sq[i] : T(0));
  }
  T* const ds = p.ds + i0 * vd;
  const T* const spl = kPull ? p.sd_pull + i0 * vd : nullptr;
  const T* const sph = kPush ? p.sd_push + i0 * vd : nullptr;
  std::size_t j = 0;
  for (; j + L <= vd; j += L) {
    for (std::size_t g = 0; g < G; ++g) {
      const std::size_t c = j + g * n;
      const V vdu = kPull ? hn::LoadU(d, p.du + c) : hn::Zero(d);
      const V vbu = kPush ? hn::LoadU(d, p.bu + c) : hn::Zero(d);
      const V vdo = kPush ? hn::LoadU(d, p.d_o + c) : hn::Zero(d);
      const V vu = kPush ? hn::LoadU(d, p.u + c) : hn::Zero(d);
      V vz = kPush ? hn::LoadU(d, p.z + c) : hn::Zero(d);
      for (std::size_t r = 0; r < R; ++r) {
        const std::size_t e = r * vd + c;
        V x = hn::LoadU(d, ds + e);
        if constexpr (kPull) {
          const V s = hn::LoadU(d, spl + e);
          ak[r][g] = hn::Add(ak[r][g], hn::Mul(s, vdu));
          x = hn::Sub(x, hn::Mul(bkl[r], vdu));
          ag[r][g] = hn::Add(ag[r][g], hn::Mul(s, x));
          x = hn::Mul(ba[r], x);
        }
        if constexpr (kPush) {
          const V s = hn::Add(hn::LoadU(d, sph + e), hn::Mul(bkp[r], vbu));
          aq[r][g] = hn::Add(aq[r][g], hn::Mul(s, vdo));
          x = hn::Add(x, hn::Mul(bsq[r], vdo));
          au[r][g] = hn::Add(au[r][g], hn::Mul(x, vu));
          vz = hn::Add(vz, hn::Mul(bkp[r], x));
        }
        hn::StoreU(x, d, ds + e);
      }
      if constexpr (kPush) hn::StoreU(vz, d, p.z + c);
    }
  }
  for (std::size_t r = 0; r < R; ++r) {
    if (j < vd) {
      // A partial group: element j + l adds into partial sum l.
      const std::size_t i = i0 + r;
      HWY_ALIGN T lk[L], lg[L], lq[L], lu[L];
      for (std::size_t g = 0; g < G; ++g) {
        hn::Store(ak[r][g], d, lk + g * n);
        hn::Store(ag[r][g], d, lg + g * n);
        hn::Store(aq[r][g], d, lq + g * n);
        hn::Store(au[r][g], d, lu + g * n);
      }
      T* dr = p.ds + i * vd;
      for (std::size_t jj = j, l = 0; jj < vd; ++jj, ++l) {
        T x = dr[jj];
        if constexpr (kPull) {
          const T sv = p.sd_pull[i * vd + jj];
          lk[l] += sv * p.du[jj];
          x = x - p.k_pull[i] * p.du[jj];
          lg[l] += sv * x;
          x = p.a[i] * x;
        }
        if constexpr (kPush) {
          const T sv = p.sd_push[i * vd + jj] + p.k_push[i] * p.bu[jj];
          lq[l] += sv * p.d_o[jj];
          x = x + p.sq[i] * p.d_o[jj];
          lu[l] += x * p.u[jj];
          p.z[jj] += p.k_push[i] * x;
        }
        dr[jj] = x;
      }
      for (std::size_t g = 0; g < G; ++g) {
        ak[r][g] = hn::Load(d, lk + g * n);
        ag[r][g] = hn::Load(d, lg + g * n);
        aq[r][g] = hn::Load(d, lq + g * n);
        au[r][g] = hn::Load(d, lu + g * n);
      }
    }
    if constexpr (kPull) {
      sdu[r] = tree_sum(d, ak[r]);
      dg[r] = tree_sum(d, ag[r]);
    }
    if constexpr (kPush) {
      sdo[r] = tree_sum(d, aq[r]);
      dsu[r] = tree_sum(d, au[r]);
    }
  }
}

// Rows per step_rows call: the rows' accumulators and broadcasts stay in
// registers (AVX-512 has 32 vector registers, the others 16).
#if HWY_TARGET <= HWY_AVX3
constexpr std::size_t kStepRows = 2;
#else
constexpr std::size_t kStepRows = 1;
#endif

template <bool kPull, bool kPush, class T>
HWY_INLINE void step_pass(const StepArgs<T>& p, std::size_t kd, T* sdu, T* dg, T* sdo, T* dsu) {
  std::size_t i = 0;
  for (; i + kStepRows <= kd; i += kStepRows)
    step_rows<kStepRows, kPull, kPush>(p, i, sdu + i, dg + i, sdo + i, dsu + i);
  for (; i < kd; ++i) step_rows<1, kPull, kPush>(p, i, sdu + i, dg + i, sdo + i, dsu + i);
}

template <class T>
void backward_head(const HeadInputs<T>& h, std::size_t tokens, std::size_t kd, std::size_t vd,
                   T scale, const T* incoming, const T* d_o, std::size_t do_stride,
                   const T* d_final, const HeadGrads<T>& out, std::size_t interval,
                   BackwardScratch<T>& ws) {
  const std::size_t kv = kd * vd;
  const std::size_t blocks = (tokens + interval - 1) / interval;
  ws.checkpoints.resize(blocks * kv);
  ws.decayed.resize(std::min(interval, tokens) * kv);
  ws.us.resize(std::min(interval, tokens) * vd);
  ws.decays.resize(std::min(interval, tokens) * kd);
  ws.vecs.assign(3 * vd + 5 * kd, T(0));
  ws.dstate.resize(kv);
  T* bu = ws.vecs.data();
  T* z = bu + vd;
  T* du = z + vd;
  T* sq = du + vd;
  // Per-row results of a step: (S'_t du)_i, dg_i, S_{t-1}[i,:]·do, (dS u_{t-1})_i.
  T* r_sdu = sq + kd;
  T* r_dg = r_sdu + kd;
  T* r_sdo = r_dg + kd;
  T* r_dsu = r_sdo + kd;
  T* ds = ws.dstate.data();

  T* ckpt = ws.checkpoints.data();
  for (std::size_t i = 0; i < kv; ++i) ckpt[i] = incoming ? incoming[i] : T(0);
  for (std::size_t c = 0; c + 1 < blocks; ++c) {
    SweepOut<T> so;
    so.final_state = ckpt + (c + 1) * kv;
    sweep(h, c * interval, (c + 1) * interval, kd, vd, ckpt + c * kv, so, ws.sweep);
  }
  auto recompute = [&](std::size_t c) HWY_ATTR {
    SweepOut<T> so;
    so.decayed = ws.decayed.data();
    so.us = ws.us.data();
    so.decays = ws.decays.data();
    sweep(h, c * interval, std::min(tokens, (c + 1) * interval), kd, vd, ckpt + c * kv, so,
          ws.sweep);
  };
  auto slot = [&](std::size_t t) HWY_ATTR { return ws.decayed.data() + (t % interval) * kv; };
  auto u_of = [&](std::size_t t) HWY_ATTR { return ws.us.data() + (t % interval) * vd; };

  // Push of token t for row i; its dk_i and dq_i are final only after the pull.
  StepArgs<T> args{};
  args.ds = ds;
  args.vd = vd;
  args.du = du;
  args.bu = bu;
  args.z = z;
  args.sq = sq;
  auto prepare_push = [&](std::size_t t) HWY_ATTR {
    const T beta = h.beta_at(t);
    const T* u = u_of(t);
    for (std::size_t j = 0; j < vd; ++j) {
      bu[j] = beta * u[j];
      z[j] = 0;
    }
    const T* q = h.q_at(t);
    for (std::size_t i = 0; i < kd; ++i) sq[i] = scale * q[i];
    args.sd_push = slot(t);
    args.k_push = h.k_at(t);
    args.d_o = d_o + t * do_stride;
    args.u = u;
  };
  auto push_out = [&](std::size_t t) HWY_ATTR {
    const T* k = h.k_at(t);
    const T beta = h.beta_at(t);
    T* dq = out.dq + t * out.qk_stride;
    T* dk = out.dk + t * out.qk_stride;
    T dbeta = 0;
    for (std::size_t i = 0; i < kd; ++i) {
      dq[i] = scale * r_sdo[i];
      dk[i] = beta * r_dsu[i];
      dbeta += k[i] * r_dsu[i];
    }
    out.dbeta[t * out.beta_stride] = dbeta;
  };
  auto finish_push = [&](std::size_t t) HWY_ATTR {
    const T beta = h.beta_at(t);
    T* dv = out.dv + t * out.v_stride;
    for (std::size_t j = 0; j < vd; ++j) {
      du[j] = beta * z[j];
      dv[j] = du[j];
    }
    args.a = ws.decays.data() + (t % interval) * kd;  // exp(g_t), from the recompute
    args.sd_pull = slot(t);
    args.k_pull = h.k_at(t);
  };
  auto pull_out = [&](std::size_t t) HWY_ATTR {
    T* dg = out.dg + t * out.g_stride;
    T* dk = out.dk + t * out.qk_stride;
    for (std::size_t i = 0; i < kd; ++i) {
      dg[i] = r_dg[i];
      dk[i] -= r_sdu[i];
    }
  };

  for (std::size_t i = 0; i < kv; ++i) ds[i] = d_final ? d_final[i] : T(0);
  recompute(blocks - 1);
  prepare_push(tokens - 1);
  step_pass<false, true>(args, kd, r_sdu, r_dg, r_sdo, r_dsu);
  push_out(tokens - 1);
  for (std::size_t t = tokens; t-- > 0;) {
    finish_push(t);
    if (t % interval != 0) {
      prepare_push(t - 1);
      step_pass<true, true>(args, kd, r_sdu, r_dg, r_sdo, r_dsu);
      pull_out(t);
      push_out(t - 1);
      continue;
    }
    // Token t opens its block: finish with this block's states before the
    // previous block's replace them.
    step_pass<true, false>(args, kd, r_sdu, r_dg, r_sdo, r_dsu);
    pull_out(t);
    if (t == 0) break;
    recompute(t / interval - 1);
    prepare_push(t - 1);
    step_pass<false, true>(args, kd, r_sdu, r_dg, r_sdo, r_dsu);
    push_out(t - 1);
  }
  if (out.d_incoming) std::copy(ds, ds + kv, out.d_incoming);
}

// One token step of incoming_grad over the columns [j0, j0 + NV·Lanes) (NV = 0:
// the single column j0), per element (i, j) in row order i, exactly
//   pull: dr = a_i·(dr - k_i·du[j]);
//   kPush: d = dr + sq_i·dot[j], dr = d, z[j] += kp_i·d  (z[j] from zero),
// where sq_i = scale·q_{t-1,i} and kp = k_{t-1}. kPull off: the push alone.
template <std::size_t NV, bool kPull, bool kPush, class T>
HWY_INLINE void grad_strip(T* ds, std::size_t ld, std::size_t kd, std::size_t j0, const T* a,
                           const T* k, const T* du, const T* sq, const T* kp, const T* dot,
                           T* z) {
  if constexpr (NV == 0) {
    const T duj = kPull ? du[j0] : T(0), dj = kPush ? dot[j0] : T(0);
    T sz = 0;
    for (std::size_t i = 0; i < kd; ++i) {
      T& e = ds[i * ld + j0];
      if constexpr (kPull) e = a[i] * (e - k[i] * duj);
      if constexpr (kPush) {
        T x = e + sq[i] * dj;
        e = x;
        sz += kp[i] * x;
      }
    }
    if constexpr (kPush) z[j0] = sz;
  } else {
    const hn::ScalableTag<T> d;
    using V = hn::Vec<decltype(d)>;
    const std::size_t n = hn::Lanes(d);
    V vdu[NV], vdot[NV], vz[NV];
    for (std::size_t r = 0; r < NV; ++r) {
      vdu[r] = kPull ? hn::LoadU(d, du + j0 + r * n) : hn::Zero(d);
      vdot[r] = kPush ? hn::LoadU(d, dot + j0 + r * n) : hn::Zero(d);
      vz[r] = hn::Zero(d);
    }
    for (std::size_t i = 0; i < kd; ++i) {
      T* dr = ds + i * ld + j0;
      const V vai = hn::Set(d, kPull ? a[i] : T(0)), vki = hn::Set(d, kPull ? k[i] : T(0));
      const V vsq = hn::Set(d, kPush ? sq[i] : T(0)), vkp = hn::Set(d, kPush ? kp[i] : T(0));
      for (std::size_t r = 0; r < NV; ++r) {
        V x = hn::LoadU(d, dr + r * n);
        if constexpr (kPull) x = hn::Mul(vai, hn::Sub(x, hn::Mul(vki, vdu[r])));
        if constexpr (kPush) {
          x = hn::Add(x, hn::Mul(vsq, vdot[r]));
          vz[r] = hn::Add(vz[r], hn::Mul(vkp, x));
        }
        hn::StoreU(x, d, dr + r * n);
      }
    }
    if constexpr (kPush)
      for (std::size_t r = 0; r < NV; ++r) hn::StoreU(vz[r], d, z + j0 + r * n);
  }
}

template <bool kPull, bool kPush, class T>
HWY_INLINE void grad_pass(T* ds, std::size_t kd, std::size_t vd, const T* a, const T* k,
                          const T* du, const T* sq, const T* kp, const T* dot, T* z) {
  const hn::ScalableTag<T> d;
  const std::size_t n = hn::Lanes(d);
  std::size_t j = 0;
  for (; j + kStripVecs * n <= vd; j += kStripVecs * n)
    grad_strip<kStripVecs, kPull, kPush>(ds, vd, kd, j, a, k, du, sq, kp, dot, z);
  for (; j + n <= vd; j += n) grad_strip<1, kPull, kPush>(ds, vd, kd, j, a, k, du, sq, kp, dot, z);
  for (; j < vd; ++j) grad_strip<0, kPull, kPush>(ds, vd, kd, j, a, k, du, sq, kp, dot, z);
}

template <class T>
void incoming_grad_head(const HeadInputs<T>& h, std::size_t tokens, std::size_t kd,
                        std::size_t vd, T scale, const T* d_o, std::size_t do_stride, T* ds,
                        std::vector<T>& scratch) {
  scratch.assign(2 * vd + 2 * kd, T(0));
  T* z = scratch.data();
  T* du = z + vd;
  T* a = du + vd;
  T* sq = a + kd;
  for (std::size_t i = 0; i < kd * vd; ++i) ds[i] = 0;
  // The state-gradient half of backward's push and pull, rounded identically:
  // token t's pull and token t-1's push, one pass over the rows.
  auto scaled_q = [&](std::size_t t) HWY_ATTR {
    const T* q = h.q_at(t);
    for (std::size_t i = 0; i < kd; ++i) sq[i] = scale * q[i];
  };
  scaled_q(tokens - 1);
  grad_pass<false, true>(ds, kd, vd, a, static_cast<const T*>(nullptr), du, sq,
                         h.k_at(tokens - 1), d_o + (tokens - 1) * do_stride, z);
  for (std::size_t t = tokens; t-- > 0;) {
    const T beta = h.beta_at(t);
    for (std::size_t j = 0; j < vd; ++j) du[j] = beta * z[j];
    decays(h.g_at(t), a, kd);
    if (t > 0) {
      scaled_q(t - 1);
      grad_pass<true, true>(ds, kd, vd, a, h.k_at(t), du, sq, h.k_at(t - 1),
                            d_o + (t - 1) * do_stride, z);
    } else {
      grad_pass<true, false>(ds, kd, vd, a, h.k_at(t), du, sq, static_cast<const T*>(nullptr),
                             static_cast<const T*>(nullptr), z);
    }
  }
}

}  // namespace kdacp::kda::detail::HWY_NAMESPACE
KDACP_TARGET_END;

#endif  // KDACP_KERNELS_KDA_RECURRENT_BACKWARD_INL_H_
