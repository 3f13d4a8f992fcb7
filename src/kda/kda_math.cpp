// The token-by-token KDA recurrence (SPEC §9) and its reverse sweep.
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
// ISA dispatch: the library is built without -march flags, which would leave
// these loops at SSE2. Highway compiles the per-(batch, value head) kernels
// once per x86 target (SSE2/SSSE3/SSE4, AVX2, AVX-512) and picks the best one
// the CPU supports at run time, once per public call. The kernels are the
// same scalar source in every target; only the vector width the compiler uses
// changes. Results are bitwise identical across targets because
//  - every element-wise loop computes each element with the same operations
//    in the same order whatever the vector width,
//  - dots sum into kLanes<T> fixed partial sums (64 bytes: 16 floats, one
//    AVX-512 vector, two AVX2 or four SSE4 ones), then tree_sum's fixed
//    pairwise order, the same association for every width, and
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
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "kdacp/error.hpp"
#include "kdacp/kda.hpp"
#include "kdacp/memory.hpp"

namespace kdacp::kda {
namespace {

// Partial sums per dot product: 64 bytes of them (16 floats, 8 doubles), one
// AVX-512 vector. Part of the results' definition (it fixes the summation
// order), so it is the same for every target and vector width.
template <class T>
constexpr std::size_t kLanes = 64 / sizeof(T);

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
  T* decays = nullptr;       // a_t = exp(g_t) at decays + (t - t0)·K
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

// An allocator whose value-initialisation leaves elements uninitialised: for
// large scratch that is always written before it is read (a zero fill of
// backward's checkpoints and recomputed states cost about a tenth of it).
// Blocks come from kdacp's large-buffer cache (memory.hpp), so the megabytes
// of scratch a backward call takes do not fault fresh pages in every call.
template <class T>
struct NoInitAllocator : std::allocator<T> {
  using value_type = T;
  template <class U>
  struct rebind {
    using other = NoInitAllocator<U>;
  };
  NoInitAllocator() = default;
  template <class U>
  NoInitAllocator(const NoInitAllocator<U>&) noexcept {}
  T* allocate(std::size_t n) {
    return static_cast<T*>(kdacp::detail::buffer_allocate(std::max<std::size_t>(n, 1) * sizeof(T)));
  }
  void deallocate(T* p, std::size_t n) noexcept {
    kdacp::detail::buffer_deallocate(p, std::max<std::size_t>(n, 1) * sizeof(T));
  }
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

template <class T>
using ScratchVec = std::vector<T, NoInitAllocator<T>>;

template <class T>
struct BackwardScratch {
  SweepScratch<T> sweep;
  ScratchVec<T> checkpoints;  // S_{c·interval - 1}: the state entering block c
  ScratchVec<T> decayed;      // S'_t of every token of the current block
  ScratchVec<T> us;           // u_t of every token of the current block
  ScratchVec<T> decays;       // a_t of every token of the current block
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
