// The token-by-token KDA recurrence (SPEC §9) and its reverse sweep.
//
// Work is O(T·K·V) per (batch, value head), all of it row operations on the
// K×V state (V contiguous elements a row): scale a row, axpy a row into a
// V-vector, dot a row with a V-vector, rank-1 update. Each token makes one
// pass over the rows, doing all of a row's work for the end of one token and
// the start of the next while the row is in L1. The row loops are plain
// indexed loops the compiler vectorises; dots keep kLanes partial sums so they
// vectorise without reassociation flags and still sum in a fixed order.
//
// Recomputed states must equal the forward's bit for bit (backward's
// checkpoint interval may not change results), so every forward state comes
// from one function, sweep().
//
// ISA dispatch: the library is built without -march flags, which would leave
// these loops at SSE2. Highway compiles the per-(batch, value head) kernels
// once per x86 target (SSE2/SSSE3/SSE4, AVX2, AVX-512) and picks the best one
// the CPU supports at run time, once per public call. The kernels are the
// same scalar source in every target; only the vector width the compiler uses
// changes. Results are bitwise identical across targets because
//  - every element-wise loop computes each element with the same operations
//    in the same order whatever the vector width,
//  - dots sum into kLanes fixed partial sums, then lane_sum, the same
//    association for every width, and
//  - nothing is contracted into FMA (see the pragmas below): an FMA rounds
//    once where a*b+c rounds twice, and only some targets have FMA.
// tests/test_kda_dispatch.cpp forces each target and compares bitwise.
//
// Validation, threading and the public templates live once, outside the
// per-target section (the HWY_ONCE block at the end).
#ifdef __clang__
#pragma clang fp contract(off)
#endif

// SVE is excluded as in kernels/step_hwy.cpp, so that every library target
// set is the same; nothing here is x86-specific.
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SVE | HWY_SVE2 | HWY_SVE_256 | HWY_SVE2_128)
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kda/kda_math.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

// Types shared by every target: defined once, on the first inclusion.
#ifndef KDACP_KDA_MATH_SHARED_
#define KDACP_KDA_MATH_SHARED_

#include <algorithm>
#include <cmath>
#include <exception>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "kdacp/error.hpp"
#include "kdacp/kda.hpp"

namespace kdacp::kda {
namespace {

// Partial sums per dot product. Part of the results' definition (it fixes the
// summation order), so it is the same for every target and vector width.
constexpr std::size_t kLanes = 8;

// One (batch, value head) slice of the inputs: token t of a field starts at
// base + t * stride.
template <class T>
struct HeadInputs {
  const T* q;
  const T* k;
  std::size_t qk_stride;
  const T* v;
  std::size_t v_stride;
  const T* g;
  std::size_t g_stride;
  const T* beta;
  std::size_t beta_stride;

  const T* q_at(std::size_t t) const { return q + t * qk_stride; }
  const T* k_at(std::size_t t) const { return k + t * qk_stride; }
  const T* v_at(std::size_t t) const { return v + t * v_stride; }
  const T* g_at(std::size_t t) const { return g + t * g_stride; }
  T beta_at(std::size_t t) const { return beta[t * beta_stride]; }
};

template <class T>
HeadInputs<T> head_inputs(const Inputs<T>& in, std::size_t b, std::size_t j) {
  const Shape& s = in.shape;
  std::size_t h = j / s.group();
  return {in.q + (b * s.tokens * s.heads + h) * s.key_dim,
          in.k + (b * s.tokens * s.heads + h) * s.key_dim,
          s.heads * s.key_dim,
          in.v + (b * s.tokens * s.value_heads + j) * s.value_dim,
          s.value_heads * s.value_dim,
          in.g + (b * s.tokens * s.value_heads + j) * s.key_dim,
          s.value_heads * s.key_dim,
          in.beta + b * s.tokens * s.value_heads + j,
          s.value_heads};
}

// Offset of token 0 of (b, value head j) in a [B,T,HV,D] tensor.
std::size_t token_major_offset(const Shape& s, std::size_t b, std::size_t j, std::size_t d) {
  return (b * s.tokens * s.value_heads + j) * d;
}

// What a forward sweep produces besides advancing the state; unset fields are
// not produced.
template <class T>
struct SweepOut {
  T* o = nullptr;  // o_t at o + t·o_stride
  std::size_t o_stride = 0;
  T scale = 0;
  T* decayed = nullptr;      // S'_t at decayed + (t - t0)·K·V; null: one reused buffer
  T* us = nullptr;           // u_t at us + (t - t0)·V
  T* final_state = nullptr;  // S_{t1-1}
};

template <class T>
struct SweepScratch {
  std::vector<T> work;
  std::vector<T> vecs;
};

// Where one value head's gradients go; token t of a field starts at
// base + t * stride.
template <class T>
struct HeadGrads {
  T* dq;
  T* dk;
  std::size_t qk_stride;
  T* dv;
  std::size_t v_stride;
  T* dg;
  std::size_t g_stride;
  T* dbeta;
  std::size_t beta_stride;
  T* d_incoming;
};

template <class T>
struct BackwardScratch {
  SweepScratch<T> sweep;
  std::vector<T> checkpoints;  // S_{c·interval - 1}: the state entering block c
  std::vector<T> decayed;      // S'_t of every token of the current block
  std::vector<T> us;           // u_t of every token of the current block
  std::vector<T> vecs;
  std::vector<T> dstate;
};


// The per-head kernels of one target, for one element type.
template <class T>
struct Kernels {
  void (*sweep)(const HeadInputs<T>&, std::size_t, std::size_t, std::size_t, std::size_t,
                const T*, const SweepOut<T>&, SweepScratch<T>&);
  void (*summary)(const HeadInputs<T>&, std::size_t, std::size_t, std::size_t, T*, T*,
                  SweepScratch<T>&, std::vector<T>&);
  void (*backward)(const HeadInputs<T>&, std::size_t, std::size_t, std::size_t, T, const T*,
                   const T*, std::size_t, const T*, const HeadGrads<T>&, std::size_t,
                   BackwardScratch<T>&);
  void (*incoming_grad)(const HeadInputs<T>&, std::size_t, std::size_t, std::size_t, T,
                        const T*, std::size_t, T*, std::vector<T>&);
};

struct KernelSet {
  Kernels<float> f32;
  Kernels<double> f64;
};

}  // namespace
}  // namespace kdacp::kda

#endif  // KDACP_KDA_MATH_SHARED_

HWY_BEFORE_NAMESPACE();
// g++ contracts a*b+c into an FMA by default even with -std=c++20
// (-ffp-contract=fast; only ISO C turns it off), and the AVX2/AVX-512 targets
// have FMA while the baseline does not. Contraction would make results depend
// on the CPU, so it is off for the kernels; HWY_AFTER_NAMESPACE's
// pop_options ends this with the per-target section.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
namespace kdacp::kda::HWY_NAMESPACE {

// Lambdas below carry HWY_ATTR: clang does not apply HWY_BEFORE_NAMESPACE's
// target attribute to lambdas, and a lambda left at the baseline ISA would
// keep its loops at SSE2.

// A dot product keeps kLanes partial sums: element j of each full group of
// kLanes elements adds into sum j mod kLanes, the tail's elements into sums
// 0, 1, ...; lane_sum then adds the sums in order. The order is fixed, so it
// vectorises without reassociation and is the same for every vector width.
template <class T>
T lane_sum(const T (&acc)[kLanes]) {
  T sum = 0;
  for (std::size_t l = 0; l < kLanes; ++l) sum += acc[l];
  return sum;
}

template <class T>
void decays(const T* g, T* a, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) a[i] = std::exp(g[i]);
}

// Runs tokens [t0, t1) from `s_in` = S_{t0-1} (null: zero), per token
//   S'_t = Diag(a_t) S_{t-1},  u_t = v_t - S'_tᵀk_t,  S_t = S'_t + k_t (β_t u_t)ᵀ.
// The state is touched once per token: the row pass that finishes token t
// also starts token t+1, while the row is in L1. Every forward state in this
// file comes from here, so backward's recomputed states equal the forward's
// bit for bit.
namespace hn = hwy::HWY_NAMESPACE;

// The hot row operations are written with Highway vectors: the auto-vectorised
// loops they replace were split into one short loop per operation, each
// versioned for aliasing, and the lane reductions vectorised poorly. Each
// element still sees the same operations in the same order as the scalar
// loops (kept as the tails), so results do not depend on the vector width.

// One row of a sweep's token pass (the scalar statements, per element j):
//   s = pr[j] + ki·bu[j];  kQ: acc[j] += qi·s;  kStore: nr[j] = s, and with
//   kNext: nr[j] = ai·s, w[j] += kni·nr[j].
// pr may equal nr (the state is advanced in place).
template <bool kQ, bool kStore, bool kNext, class T>
HWY_INLINE void sweep_row(const T* pr, T* nr, T ki, const T* bu, T qi, T* acc, T ai, T kni,
                          T* w, std::size_t vd) {
  const hn::ScalableTag<T> d;
  const std::size_t n = hn::Lanes(d);
  const auto vki = hn::Set(d, ki), vqi = hn::Set(d, qi), vai = hn::Set(d, ai),
             vkni = hn::Set(d, kni);
  std::size_t j = 0;
  for (; j + n <= vd; j += n) {
    auto x = hn::Add(hn::LoadU(d, pr + j), hn::Mul(vki, hn::LoadU(d, bu + j)));
    if constexpr (kQ) hn::StoreU(hn::Add(hn::LoadU(d, acc + j), hn::Mul(vqi, x)), d, acc + j);
    if constexpr (kNext) {
      x = hn::Mul(x, vai);
      hn::StoreU(hn::Add(hn::LoadU(d, w + j), hn::Mul(vkni, x)), d, w + j);
    }
    if constexpr (kStore) hn::StoreU(x, d, nr + j);
  }
  for (; j < vd; ++j) {
    T x = pr[j] + ki * bu[j];
    if constexpr (kQ) acc[j] += qi * x;
    if constexpr (kNext) {
      x *= ai;
      w[j] += kni * x;
    }
    if constexpr (kStore) nr[j] = x;
  }
}

// A dot's kLanes partial sums as kLanes / Lanes(d) vectors of at most kLanes
// lanes: element j of a full group of kLanes lands in lane j mod kLanes, as in
// for_lanes, whatever the target's vector width.
template <class T>
using LaneTag = hn::CappedTag<T, kLanes>;

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
  T* a = u_scratch + vd;
  auto decayed = [&](std::size_t t) HWY_ATTR {
    return out.decayed ? out.decayed + (t - t0) * kv : ws.work.data();
  };

  T* d = decayed(t0);
  if (s_in == nullptr) {
    for (std::size_t i = 0; i < kv; ++i) d[i] = 0;
    s_in = d;
  }
  decays(h.g_at(t0), a, kd);
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
      decays(h.g_at(t + 1), a, kd);
      kn = h.k_at(t + 1);
      for (std::size_t j = 0; j < vd; ++j) w[j] = 0;
    }
    if (q)
      for (std::size_t j = 0; j < vd; ++j) acc[j] = 0;
    for (std::size_t i = 0; i < kd; ++i) {
      const T* pr = dp + i * vd;
      const T ki = k[i];
      if (dn == nullptr) {
        sweep_row<true, false, false>(pr, static_cast<T*>(nullptr), ki, bu, q[i], acc, T(0), T(0), w, vd);
        continue;
      }
      T* nr = dn + i * vd;
      const T qi = q ? q[i] : T(0);
      const T ai = next ? a[i] : T(0), kni = next ? kn[i] : T(0);
      if (q && next) {
        sweep_row<true, true, true>(pr, nr, ki, bu, qi, acc, ai, kni, w, vd);
      } else if (q) {
        sweep_row<true, true, false>(pr, nr, ki, bu, qi, acc, ai, kni, w, vd);
      } else if (next) {
        sweep_row<false, true, true>(pr, nr, ki, bu, qi, acc, ai, kni, w, vd);
      } else {
        sweep_row<false, true, false>(pr, nr, ki, bu, qi, acc, ai, kni, w, vd);
      }
    }
    if (q) {
      T* ot = out.o + t * out.o_stride;
      for (std::size_t j = 0; j < vd; ++j) ot[j] = out.scale * acc[j];
    }
  }
}

// The reverse sweeps run token t's pull and token t-1's push in one pass over
// the state-gradient rows.
//
// Push (token t's output and rank-1 update, for one row i of dS):
//   dS[i,:] += scale·q_i do_t;  dq_i = scale·S_t[i,:]·do_t;  (dS u_t)_i;
//   z += k_i dS[i,:]  (z = dSᵀk, so du = β z).
// S_t[i,j] is rebuilt as S'_t[i,j] + k_i (β u_j), rounded as the forward did.
template <class T>
void push_row(T* dr, const T* sd, T ki, const T* bu, T sq, const T* d_o, const T* u, T* z,
              std::size_t vd, T& s_do, T& ds_u) {
  const LaneTag<T> d;
  using V = hn::Vec<LaneTag<T>>;
  const std::size_t n = hn::Lanes(d), groups = kLanes / n;
  V acc_q[kLanes], acc_u[kLanes];
  for (std::size_t r = 0; r < groups; ++r) acc_q[r] = acc_u[r] = hn::Zero(d);
  const V vki = hn::Set(d, ki), vsq = hn::Set(d, sq);
  std::size_t j = 0;
  for (; j + kLanes <= vd; j += kLanes) {
    for (std::size_t r = 0; r < groups; ++r) {
      const std::size_t c = j + r * n;
      const V dov = hn::LoadU(d, d_o + c);
      const V s = hn::Add(hn::LoadU(d, sd + c), hn::Mul(vki, hn::LoadU(d, bu + c)));
      acc_q[r] = hn::Add(acc_q[r], hn::Mul(s, dov));
      const V x = hn::Add(hn::LoadU(d, dr + c), hn::Mul(vsq, dov));
      hn::StoreU(x, d, dr + c);
      acc_u[r] = hn::Add(acc_u[r], hn::Mul(x, hn::LoadU(d, u + c)));
      hn::StoreU(hn::Add(hn::LoadU(d, z + c), hn::Mul(vki, x)), d, z + c);
    }
  }
  T lanes_q[kLanes], lanes_u[kLanes];
  for (std::size_t r = 0; r < groups; ++r) {
    hn::StoreU(acc_q[r], d, lanes_q + r * n);
    hn::StoreU(acc_u[r], d, lanes_u + r * n);
  }
  for (std::size_t l = 0; j < vd; ++j, ++l) {
    T s = sd[j] + ki * bu[j];
    lanes_q[l] += s * d_o[j];
    T x = dr[j] + sq * d_o[j];
    dr[j] = x;
    lanes_u[l] += x * u[j];
    z[j] += ki * x;
  }
  s_do = lane_sum(lanes_q);
  ds_u = lane_sum(lanes_u);
}

// Pull (token t's key read and decay, for one row i of dS):
//   dS'[i,:] = dS[i,:] - k_i duᵀ;  (S'_t du)_i;  dg_i = S'_t[i,:]·dS'[i,:];
//   dS_{t-1}[i,:] = a_i dS'[i,:].
template <class T>
void pull_row(T* dr, const T* sd, T ai, T ki, const T* du, std::size_t vd, T& s_du, T& dg) {
  const LaneTag<T> d;
  using V = hn::Vec<LaneTag<T>>;
  const std::size_t n = hn::Lanes(d), groups = kLanes / n;
  V acc_k[kLanes], acc_g[kLanes];
  for (std::size_t r = 0; r < groups; ++r) acc_k[r] = acc_g[r] = hn::Zero(d);
  const V vai = hn::Set(d, ai), vki = hn::Set(d, ki);
  std::size_t j = 0;
  for (; j + kLanes <= vd; j += kLanes) {
    for (std::size_t r = 0; r < groups; ++r) {
      const std::size_t c = j + r * n;
      const V s = hn::LoadU(d, sd + c), duv = hn::LoadU(d, du + c);
      acc_k[r] = hn::Add(acc_k[r], hn::Mul(s, duv));
      const V x = hn::Sub(hn::LoadU(d, dr + c), hn::Mul(vki, duv));
      acc_g[r] = hn::Add(acc_g[r], hn::Mul(s, x));
      hn::StoreU(hn::Mul(vai, x), d, dr + c);
    }
  }
  T lanes_k[kLanes], lanes_g[kLanes];
  for (std::size_t r = 0; r < groups; ++r) {
    hn::StoreU(acc_k[r], d, lanes_k + r * n);
    hn::StoreU(acc_g[r], d, lanes_g + r * n);
  }
  for (std::size_t l = 0; j < vd; ++j, ++l) {
    lanes_k[l] += sd[j] * du[j];
    T x = dr[j] - ki * du[j];
    lanes_g[l] += sd[j] * x;
    dr[j] = ai * x;
  }
  s_du = lane_sum(lanes_k);
  dg = lane_sum(lanes_g);
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
    for (std::size_t j = 0; j < kd; ++j) {
      br[j] = beta * r[j];
      r[j] = 0;
    }
    const T* kn = next ? h.k_at(t + 1) : nullptr;
    if (next) decays(h.g_at(t + 1), a, kd);
    for (std::size_t i = 0; i < kd; ++i) {
      T* mr = m + i * kd;
      const T ki = k[i];
      for (std::size_t j = 0; j < kd; ++j) mr[j] -= ki * br[j];
      if (next) {
        const T ai = a[i], kni = kn[i];
        for (std::size_t j = 0; j < kd; ++j) {
          mr[j] *= ai;
          r[j] += kni * mr[j];
        }
      }
    }
  }
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
  ws.vecs.assign(3 * vd + kd, T(0));
  ws.dstate.resize(kv);
  T* bu = ws.vecs.data();
  T* z = bu + vd;
  T* du = z + vd;
  T* a = du + vd;
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
    sweep(h, c * interval, std::min(tokens, (c + 1) * interval), kd, vd, ckpt + c * kv, so,
          ws.sweep);
  };
  auto slot = [&](std::size_t t) HWY_ATTR { return ws.decayed.data() + (t % interval) * kv; };
  auto u_of = [&](std::size_t t) HWY_ATTR { return ws.us.data() + (t % interval) * vd; };

  // Push of token t for row i; its dk_i and dq_i are final only after the pull.
  T dbeta = 0;
  auto prepare_push = [&](std::size_t t) HWY_ATTR {
    const T beta = h.beta_at(t);
    const T* u = u_of(t);
    for (std::size_t j = 0; j < vd; ++j) {
      bu[j] = beta * u[j];
      z[j] = 0;
    }
    dbeta = 0;
  };
  auto push = [&](std::size_t t, std::size_t i) HWY_ATTR {
    const T* k = h.k_at(t);
    T s_do = 0, ds_u = 0;
    push_row(ds + i * vd, slot(t) + i * vd, k[i], bu, scale * h.q_at(t)[i], d_o + t * do_stride,
             u_of(t), z, vd, s_do, ds_u);
    out.dq[t * out.qk_stride + i] = scale * s_do;
    out.dk[t * out.qk_stride + i] = h.beta_at(t) * ds_u;
    dbeta += k[i] * ds_u;
  };
  auto finish_push = [&](std::size_t t) HWY_ATTR {
    out.dbeta[t * out.beta_stride] = dbeta;
    const T beta = h.beta_at(t);
    T* dv = out.dv + t * out.v_stride;
    for (std::size_t j = 0; j < vd; ++j) {
      du[j] = beta * z[j];
      dv[j] = du[j];
    }
    decays(h.g_at(t), a, kd);
  };
  auto pull = [&](std::size_t t, std::size_t i) HWY_ATTR {
    T s_du = 0;
    pull_row(ds + i * vd, slot(t) + i * vd, a[i], h.k_at(t)[i], du, vd, s_du,
             out.dg[t * out.g_stride + i]);
    out.dk[t * out.qk_stride + i] -= s_du;
  };

  for (std::size_t i = 0; i < kv; ++i) ds[i] = d_final ? d_final[i] : T(0);
  recompute(blocks - 1);
  prepare_push(tokens - 1);
  for (std::size_t i = 0; i < kd; ++i) push(tokens - 1, i);
  for (std::size_t t = tokens; t-- > 0;) {
    finish_push(t);
    if (t % interval != 0) {
      prepare_push(t - 1);
      for (std::size_t i = 0; i < kd; ++i) {
        pull(t, i);
        push(t - 1, i);
      }
      continue;
    }
    // Token t opens its block: finish with this block's states before the
    // previous block's replace them.
    for (std::size_t i = 0; i < kd; ++i) pull(t, i);
    if (t == 0) break;
    recompute(t / interval - 1);
    prepare_push(t - 1);
    for (std::size_t i = 0; i < kd; ++i) push(t - 1, i);
  }
  if (out.d_incoming) std::copy(ds, ds + kv, out.d_incoming);
}

template <class T>
void incoming_grad_head(const HeadInputs<T>& h, std::size_t tokens, std::size_t kd,
                        std::size_t vd, T scale, const T* d_o, std::size_t do_stride, T* ds,
                        std::vector<T>& scratch) {
  scratch.assign(2 * vd + kd, T(0));
  T* z = scratch.data();
  T* du = z + vd;
  T* a = du + vd;
  for (std::size_t i = 0; i < kd * vd; ++i) ds[i] = 0;
  // The state-gradient half of backward's push and pull, rounded identically.
  auto push = [&](std::size_t t, std::size_t i) HWY_ATTR {
    T* dr = ds + i * vd;
    const T* dot = d_o + t * do_stride;
    const T sq = scale * h.q_at(t)[i], ki = h.k_at(t)[i];
    for (std::size_t j = 0; j < vd; ++j) {
      T d = dr[j] + sq * dot[j];
      dr[j] = d;
      z[j] += ki * d;
    }
  };
  auto pull = [&](std::size_t t, std::size_t i) HWY_ATTR {
    T* dr = ds + i * vd;
    const T ai = a[i], ki = h.k_at(t)[i];
    for (std::size_t j = 0; j < vd; ++j) dr[j] = ai * (dr[j] - ki * du[j]);
  };
  for (std::size_t i = 0; i < kd; ++i) push(tokens - 1, i);
  for (std::size_t t = tokens; t-- > 0;) {
    const T beta = h.beta_at(t);
    for (std::size_t j = 0; j < vd; ++j) {
      du[j] = beta * z[j];
      z[j] = 0;
    }
    decays(h.g_at(t), a, kd);
    for (std::size_t i = 0; i < kd; ++i) {
      pull(t, i);
      if (t > 0) push(t - 1, i);
    }
  }
}


template <class T>
constexpr Kernels<T> kernels_of() {
  return {&sweep<T>, &summary_head<T>, &backward_head<T>, &incoming_grad_head<T>};
}

constexpr KernelSet kKernels{kernels_of<float>(), kernels_of<double>()};

// What HWY_DYNAMIC_DISPATCH picks: this target's kernels for both types.
const KernelSet* ChooseKernels() { return &kKernels; }

}  // namespace kdacp::kda::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kdacp::kda {
namespace {

HWY_EXPORT(ChooseKernels);

// The best target's kernels, chosen once per public call so that one call
// runs every head with the same code.
template <class T>
const Kernels<T>& kernels() {
  const KernelSet* set = HWY_DYNAMIC_DISPATCH(ChooseKernels)();
  if constexpr (std::is_same_v<T, float>) {
    return set->f32;
  } else {
    return set->f64;
  }
}

// Splits [0, n) into contiguous ranges, one per thread; fn(begin, end) runs
// once per range so it can allocate its scratch once.
template <class Fn>
void for_ranges(std::size_t n, std::size_t threads, const Fn& fn) {
  std::size_t parts = std::min(std::max<std::size_t>(threads, 1), n);
  if (parts <= 1) {
    if (n > 0) fn(std::size_t{0}, n);
    return;
  }
  std::vector<std::exception_ptr> errors(parts);
  std::vector<std::thread> workers;
  workers.reserve(parts - 1);
  auto run = [&](std::size_t p) {
    try {
      fn(n * p / parts, n * (p + 1) / parts);
    } catch (...) {
      errors[p] = std::current_exception();
    }
  };
  for (std::size_t p = 1; p < parts; ++p) workers.emplace_back(run, p);
  run(0);
  for (auto& t : workers) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

void require(const void* ptr, const char* op, const char* field) {
  if (ptr == nullptr)
    throw InvalidArgument(std::string("kda::") + op + ": " + field +
                          " is null, expected a pointer to its tensor");
}

template <class T>
void validate_inputs(const Inputs<T>& in, const char* op) {
  validate(in.shape);
  require(in.q, op, "q");
  require(in.k, op, "k");
  require(in.v, op, "v");
  require(in.g, op, "g");
  require(in.beta, op, "beta");
  if (!std::isfinite(in.scale) || !(in.scale > 0))
    throw InvalidArgument(std::string("kda::") + op + ": scale = " + std::to_string(in.scale) +
                          ", expected a finite value > 0 (default_scale(K) = 1/sqrt(K))");
}

}  // namespace

void validate(const Shape& shape) {
  auto at_least_one = [](std::size_t value, const char* field) {
    if (value == 0)
      throw InvalidArgument(std::string("kda: shape.") + field + " = 0, expected >= 1");
  };
  at_least_one(shape.batch, "batch (B)");
  at_least_one(shape.tokens, "tokens (T)");
  at_least_one(shape.heads, "heads (H)");
  at_least_one(shape.value_heads, "value_heads (HV)");
  at_least_one(shape.key_dim, "key_dim (K)");
  at_least_one(shape.value_dim, "value_dim (V)");
  if (shape.value_heads % shape.heads != 0)
    throw InvalidArgument("kda: shape.value_heads (HV) = " + std::to_string(shape.value_heads) +
                          ", expected a multiple of heads (H) = " +
                          std::to_string(shape.heads));
}

template <class T>
T default_scale(std::size_t key_dim) {
  if (key_dim == 0) throw InvalidArgument("kda: default_scale: key_dim (K) = 0, expected >= 1");
  return T(1) / std::sqrt(static_cast<T>(key_dim));
}

template <class T>
void chunk_summary(const Inputs<T>& in, Elem<T>* state, Elem<T>* transfer, std::size_t threads) {
  validate_inputs(in, "chunk_summary");
  require(state, "chunk_summary", "state");
  require(transfer, "chunk_summary", "transfer");
  const Shape& s = in.shape;
  const std::size_t kv = s.key_dim * s.value_dim, kk = s.key_dim * s.key_dim;
  const Kernels<T>& kern = kernels<T>();
  for_ranges(s.batch * s.value_heads, threads, [&](std::size_t begin, std::size_t end) {
    SweepScratch<T> ws;
    std::vector<T> vecs;
    for (std::size_t p = begin; p < end; ++p)
      kern.summary(head_inputs(in, p / s.value_heads, p % s.value_heads), s.tokens, s.key_dim,
                   s.value_dim, state + p * kv, transfer + p * kk, ws, vecs);
  });
}

template <class T>
void forward(const Inputs<T>& in, const Elem<T>* incoming, Elem<T>* o, Elem<T>* final_state,
             std::size_t threads) {
  validate_inputs(in, "forward");
  require(o, "forward", "o");
  const Shape& s = in.shape;
  const std::size_t kv = s.key_dim * s.value_dim;
  const Kernels<T>& kern = kernels<T>();
  for_ranges(s.batch * s.value_heads, threads, [&](std::size_t begin, std::size_t end) {
    SweepScratch<T> ws;
    for (std::size_t p = begin; p < end; ++p) {
      std::size_t b = p / s.value_heads, j = p % s.value_heads;
      SweepOut<T> out;
      out.o = o + token_major_offset(s, b, j, s.value_dim);
      out.o_stride = s.value_heads * s.value_dim;
      out.scale = in.scale;
      out.final_state = final_state ? final_state + p * kv : nullptr;
      kern.sweep(head_inputs(in, b, j), 0, s.tokens, s.key_dim, s.value_dim,
            incoming ? incoming + p * kv : nullptr, out, ws);
    }
  });
}

template <class T>
void backward(const Inputs<T>& in, const Elem<T>* incoming, const Elem<T>* d_o,
              const Elem<T>* d_final, const Grads<Elem<T>>& grads, std::size_t threads,
              std::size_t checkpoint_interval) {
  validate_inputs(in, "backward");
  require(d_o, "backward", "d_o");
  require(grads.dq, "backward", "dq");
  require(grads.dk, "backward", "dk");
  require(grads.dv, "backward", "dv");
  require(grads.dg, "backward", "dg");
  require(grads.dbeta, "backward", "dbeta");
  if (checkpoint_interval == 0)
    throw InvalidArgument("kda::backward: checkpoint_interval = 0, expected >= 1");
  const Shape& s = in.shape;
  const std::size_t kv = s.key_dim * s.value_dim, group = s.group();
  const std::size_t head_qk = s.tokens * s.key_dim;
  // With grouped value heads several value heads feed one dq/dk slice; each
  // writes its own partial so the heads stay independent, and the partials
  // are summed afterwards in value-head order.
  std::vector<T> partial_dq(group > 1 ? s.batch * s.value_heads * head_qk : 0);
  std::vector<T> partial_dk(partial_dq.size());

  const Kernels<T>& kern = kernels<T>();
  for_ranges(s.batch * s.value_heads, threads, [&](std::size_t begin, std::size_t end) {
    BackwardScratch<T> ws;
    for (std::size_t p = begin; p < end; ++p) {
      std::size_t b = p / s.value_heads, j = p % s.value_heads, h = j / group;
      HeadGrads<T> out{};
      if (group > 1) {
        out.dq = partial_dq.data() + p * head_qk;
        out.dk = partial_dk.data() + p * head_qk;
        out.qk_stride = s.key_dim;
      } else {
        out.dq = grads.dq + (b * s.tokens * s.heads + h) * s.key_dim;
        out.dk = grads.dk + (b * s.tokens * s.heads + h) * s.key_dim;
        out.qk_stride = s.heads * s.key_dim;
      }
      out.dv = grads.dv + token_major_offset(s, b, j, s.value_dim);
      out.v_stride = s.value_heads * s.value_dim;
      out.dg = grads.dg + token_major_offset(s, b, j, s.key_dim);
      out.g_stride = s.value_heads * s.key_dim;
      out.dbeta = grads.dbeta + token_major_offset(s, b, j, 1);
      out.beta_stride = s.value_heads;
      out.d_incoming = grads.d_incoming ? grads.d_incoming + p * kv : nullptr;
      kern.backward(head_inputs(in, b, j), s.tokens, s.key_dim, s.value_dim, in.scale,
                    incoming ? incoming + p * kv : nullptr,
                    d_o + token_major_offset(s, b, j, s.value_dim), s.value_heads * s.value_dim,
                    d_final ? d_final + p * kv : nullptr, out, checkpoint_interval, ws);
    }
  });
  if (group == 1) return;

  for_ranges(s.batch * s.heads, threads, [&](std::size_t begin, std::size_t end) {
    for (std::size_t p = begin; p < end; ++p) {
      std::size_t b = p / s.heads, h = p % s.heads;
      for (std::size_t t = 0; t < s.tokens; ++t) {
        T* dq = grads.dq + ((b * s.tokens + t) * s.heads + h) * s.key_dim;
        T* dk = grads.dk + ((b * s.tokens + t) * s.heads + h) * s.key_dim;
        for (std::size_t i = 0; i < s.key_dim; ++i) dq[i] = dk[i] = 0;
        for (std::size_t j = h * group; j < (h + 1) * group; ++j) {
          const T* pq = partial_dq.data() + (b * s.value_heads + j) * head_qk + t * s.key_dim;
          const T* pk = partial_dk.data() + (b * s.value_heads + j) * head_qk + t * s.key_dim;
          for (std::size_t i = 0; i < s.key_dim; ++i) {
            dq[i] += pq[i];
            dk[i] += pk[i];
          }
        }
      }
    }
  });
}

template <class T>
void incoming_grad(const Inputs<T>& in, const Elem<T>* d_o, Elem<T>* g_state,
                   std::size_t threads) {
  validate_inputs(in, "incoming_grad");
  require(d_o, "incoming_grad", "d_o");
  require(g_state, "incoming_grad", "g_state");
  const Shape& s = in.shape;
  const std::size_t kv = s.key_dim * s.value_dim;
  const Kernels<T>& kern = kernels<T>();
  for_ranges(s.batch * s.value_heads, threads, [&](std::size_t begin, std::size_t end) {
    std::vector<T> scratch;
    for (std::size_t p = begin; p < end; ++p) {
      std::size_t b = p / s.value_heads, j = p % s.value_heads;
      kern.incoming_grad(head_inputs(in, b, j), s.tokens, s.key_dim, s.value_dim, in.scale,
                         d_o + token_major_offset(s, b, j, s.value_dim),
                         s.value_heads * s.value_dim, g_state + p * kv, scratch);
    }
  });
}

#define KDACP_KDA_INSTANTIATE(T)                                                                \
  template T default_scale<T>(std::size_t);                                                     \
  template void chunk_summary<T>(const Inputs<T>&, T*, T*, std::size_t);                        \
  template void forward<T>(const Inputs<T>&, const T*, T*, T*, std::size_t);                    \
  template void backward<T>(const Inputs<T>&, const T*, const T*, const T*, const Grads<T>&,    \
                            std::size_t, std::size_t);                                          \
  template void incoming_grad<T>(const Inputs<T>&, const T*, T*, std::size_t);

KDACP_KDA_INSTANTIATE(float)
KDACP_KDA_INSTANTIATE(double)
#undef KDACP_KDA_INSTANTIATE

}  // namespace kdacp::kda
#endif  // HWY_ONCE
