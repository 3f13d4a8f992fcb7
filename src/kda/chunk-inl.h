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
// The forward and the backward solve for Δ directly, without W (K columns
// fewer): Δ = (I + Diag(β) L)⁻¹ Diag(β) R with R = V - Kg S_0.
//
// The transfer M of the summary is the same update of a K×K "state" started
// from I with U = 0, so the summary advances [S | M] (K×(V+K)) at once.
// The G pass runs the adjoint of the last three lines backwards over chunks:
//   dΔ = scale Pᵀ dO + Kr dS_c,   dS_0 = scale Qgᵀ dO + Diag(a_c) dS_c - Wᵀ dΔ.
//
// Strong decay (any finite g ≤ 0, down to -1e4 and beyond): every decay
// factor is a product of α's over a token range, never exp of a difference
// of cumulative sums, so nothing overflows and underflow is graceful. Inside
// a chunk, L and P are built per sub-chunk σ of kSub tokens starting at b:
// for s < b, Π(s,t] = Π(b,t] · Π(s,b], both ≤ 1 (a product of two small
// matrices); inside σ, Π(s,t] = F_t / F_s with F_t = Π(b,t]. That division
// is used per key channel, only where every F of σ stays a normal number
// with `digits` bits to spare (classify_channels: in float, the decay over
// 15 tokens above e^-69, i.e. g ≥ -4.6 per token on average); the other
// channels' share of the diagonal block is computed exactly, pair by pair,
// with running products (scalar, proportional to the number of such
// channels; the same result up to rounding).
// Gradients: dg_r = Σ_{t ≥ r} dγ_t, where every factor e^{γ_a - γ_b} adds
// +x at a and -x at b. Terms whose factor is exactly 1 (the diagonal of P,
// Kr of the chunk's last token) are left out instead of added and
// subtracted: under strong decay dg is of the size of α, and the rounding
// of such O(1) pairs would swamp it.
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

#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>
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

// Register tiles: kTileRows rows × kPanelVecs vectors of C. AVX-512 has 32
// vector registers (16 accumulators, 2 B vectors, 1 broadcast), the others
// 16 (8 + 1 + 1). The tile height is the same on every target: with the
// triangular variants below it decides which known-zero terms a row's chain
// includes, so it must not change the bits between targets.
constexpr std::size_t kTileRows = 8;
#if HWY_TARGET <= HWY_AVX3
constexpr std::size_t kPanelVecs = 2;
#else
constexpr std::size_t kPanelVecs = 1;
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
// alone): acc = Σ_k a(i,k) b(k,j) in order k = k0..p-1 (each step one fused
// multiply-add), then C = acc,
// C + acc or C - acc. a(i,k) = a[i·ars + k·acs]; B rows are contiguous.
template <GemmOp Op, std::size_t R, std::size_t NV, class T>
HWY_INLINE void gemm_tile(std::size_t i0, std::size_t j0, std::size_t k0, std::size_t p, const T* a,
                          std::size_t ars, std::size_t acs, const T* b, std::size_t ldb, T* c,
                          std::size_t ldc) {
  if constexpr (NV == 0) {
    T acc[R];
    for (std::size_t r = 0; r < R; ++r) acc[r] = 0;
    for (std::size_t k = k0; k < p; ++k) {
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
    for (std::size_t k = k0; k < p; ++k) {
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

// Known zeros of a product, skipped per row tile [i0, i0 + R):
//   lower_a: A lower triangular (a(i,k) = 0 for k > i): k stops at i0 + R;
//   upper_a: A upper triangular (a(i,k) = 0 for k < i): k starts at i0 (the
//            skipped leading terms would leave the +0 accumulator unchanged);
//   lower_c: only C's columns j < i0 + R are wanted (those above may be left
//            as anything; every panel starting below i0 + R is computed).
enum class Tri { full, lower_a, upper_a, lower_c };

// Tiles of R rows of one column panel [j, j + NV·Lanes) (NV = 0: column j).
template <GemmOp Op, Tri kTri, std::size_t NV, class T>
HWY_INLINE void gemm_panel(std::size_t m, std::size_t j, std::size_t p, const T* a, std::size_t ars,
                           std::size_t acs, const T* b, std::size_t ldb, T* c, std::size_t ldc) {
  constexpr std::size_t R = kTileRows;
  const auto k_begin = [&](std::size_t i) {
    return kTri == Tri::upper_a ? std::min(i, p) : std::size_t{0};
  };
  const auto k_end = [&](std::size_t i, std::size_t r) {
    return kTri == Tri::lower_a ? std::min(p, i + r) : p;
  };
  // lower_c: a tile whose rows all end before the panel is not wanted.
  const auto wanted = [&](std::size_t i, std::size_t r) { return kTri != Tri::lower_c || j < i + r; };
  std::size_t i = 0;
  for (; i + R <= m; i += R)
    if (wanted(i, R)) gemm_tile<Op, R, NV>(i, j, k_begin(i), k_end(i, R), a, ars, acs, b, ldb, c, ldc);
  for (; i < m; ++i)
    if (wanted(i, 1)) gemm_tile<Op, 1, NV>(i, j, k_begin(i), k_end(i, 1), a, ars, acs, b, ldb, c, ldc);
}

// C (m×n_cols) op= A (m×p) · B (p×n_cols), with the zeros of kTri skipped.
// Column panels outermost: a panel of B (p × kPanelVecs vectors) stays in
// L1 while every row tile passes over it (row tiles outermost streamed all
// of B from L2 per tile: half the FMA rate at K = V = 128). The order of
// the tiles does not change any element's chain.
template <GemmOp Op, Tri kTri = Tri::full, class T>
void gemm(std::size_t m, std::size_t n_cols, std::size_t p, const T* a, std::size_t ars,
          std::size_t acs, const T* b, std::size_t ldb, T* c, std::size_t ldc) {
  const hn::ScalableTag<T> d;
  const std::size_t n = hn::Lanes(d);
  std::size_t j = 0;
  for (; j + kPanelVecs * n <= n_cols; j += kPanelVecs * n)
    gemm_panel<Op, kTri, kPanelVecs>(m, j, p, a, ars, acs, b, ldb, c, ldc);
  if constexpr (kPanelVecs > 1)
    for (; j + n <= n_cols; j += n) gemm_panel<Op, kTri, 1>(m, j, p, a, ars, acs, b, ldb, c, ldc);
  for (; j < n_cols; ++j) gemm_panel<Op, kTri, 0>(m, j, p, a, ars, acs, b, ldb, c, ldc);
}

template <class T>
T plain_dot(const T* x, const T* y, std::size_t n) {
  T s = 0;
  for (std::size_t i = 0; i < n; ++i) s = s + x[i] * y[i];
  return s;
}

// Σ x_i y_i in the same order on every target: element i joins running sum
// i mod kLanes, then the kLanes sums are added in order. Independent sums
// instead of one dependent chain (the compiler may put them in vectors of
// any width; each sum's operations stay the same, so do the bits).
template <class T>
T lane_dot(const T* HWY_RESTRICT x, const T* HWY_RESTRICT y, std::size_t n) {
  constexpr std::size_t kLanes = 16;
  T acc[kLanes] = {};
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (std::size_t l = 0; l < kLanes; ++l) acc[l] = acc[l] + x[i + l] * y[i + l];
  for (std::size_t l = 0; i + l < n; ++l) acc[l] = acc[l] + x[i + l] * y[i + l];
  T s = 0;
  for (std::size_t l = 0; l < kLanes; ++l) s = s + acc[l];
  return s;
}

// 1/i!, i ≤ kDeg, rounded once to T (at compile time).
template <class T, int kDeg>
struct ExpCoefs {
  T c[kDeg + 1] = {};
  constexpr ExpCoefs() {
    long double f = 1;
    for (int i = 0; i <= kDeg; ++i) {
      if (i > 1) f *= i;
      c[i] = static_cast<T>(1.0L / f);
    }
  }
  constexpr T operator[](int i) const { return c[i]; }
};

// exp on whole vectors, the same operation sequence on every target (so the
// same bits): x = clamp(x); n = round(x·log2 e); r = x - n·ln2 (two fused
// steps, Cody-Waite); e^r by a Taylor polynomial (Horner, fused steps,
// degree 7 in float, 13 in double: below an ulp on |r| ≤ ln2/2); times 2^n
// in two exact halves, so the last multiplication rounds once into the
// subnormal range. NaN stays NaN. Within a few ulp of std::exp.
template <class D>
HWY_INLINE hn::Vec<D> exp_vec(D d, hn::Vec<D> x) {
  using T = hn::TFromD<D>;
  const hn::RebindToSigned<D> di;
  using TI = hn::TFromD<decltype(di)>;
  constexpr bool kF32 = sizeof(T) == 4;
  constexpr int kMant = kF32 ? 23 : 52;
  constexpr TI kBias = kF32 ? 127 : 1023;
  const T x_lo = kF32 ? T(-104) : T(-746), x_hi = kF32 ? T(89) : T(710);
  const T ln2_hi = kF32 ? T(0.693359375f) : T(0.693147180369123816490);
  const T ln2_lo = kF32 ? T(-2.12194440e-4f) : T(1.90821492927058770002e-10);
  const auto is_num = hn::Eq(x, x);
  const auto xc = hn::Min(hn::Max(hn::IfThenElse(is_num, x, hn::Zero(d)), hn::Set(d, x_lo)),
                          hn::Set(d, x_hi));
  const auto n = hn::Round(hn::Mul(xc, hn::Set(d, T(1.4426950408889634074))));
  auto r = fused_mul_add(d, n, hn::Set(d, -ln2_hi), xc);
  r = fused_mul_add(d, n, hn::Set(d, -ln2_lo), r);
  constexpr int kDeg = kF32 ? 7 : 13;
  constexpr ExpCoefs<T, kDeg> coef{};
  auto p = hn::Set(d, coef[kDeg]);
  for (int i = kDeg - 1; i >= 0; --i) p = fused_mul_add(d, p, r, hn::Set(d, coef[i]));
  const auto ni = hn::ConvertTo(di, n);
  const auto n1 = hn::ShiftRight<1>(ni);
  const auto n2 = hn::Sub(ni, n1);
  const auto s1 = hn::BitCast(d, hn::ShiftLeft<kMant>(hn::Add(n1, hn::Set(di, kBias))));
  const auto s2 = hn::BitCast(d, hn::ShiftLeft<kMant>(hn::Add(n2, hn::Set(di, kBias))));
  const auto y = hn::Mul(hn::Mul(p, s1), s2);
  return hn::IfThenElse(is_num, y, x);
}

// out[i] = exp(in[i]), i < n (the tail through a padded vector).
template <class T>
void exp_row(const T* in, T* out, std::size_t n) {
  const hn::ScalableTag<T> d;
  const std::size_t N = hn::Lanes(d);
  std::size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(exp_vec(d, hn::LoadU(d, in + i)), d, out + i);
  if (i < n) {
    HWY_ALIGN T buf[hn::MaxLanes(d)] = {};
    for (std::size_t j = i; j < n; ++j) buf[j - i] = in[j];
    hn::Store(exp_vec(d, hn::Load(d, buf)), d, buf);
    for (std::size_t j = i; j < n; ++j) out[j] = buf[j - i];
  }
}

// Element-wise loops over rows of n values on whole vectors: f(d, i) is
// called for every vector i (and the tail is done by g(i) per element, with
// the same exact operations). Multiplications, divisions, additions are
// correctly rounded on every target, so the bits do not depend on it.
template <class T, class FV, class FS>
HWY_INLINE void for_vecs(std::size_t n, FV&& fv, FS&& fs) {
  const hn::ScalableTag<T> d;
  const std::size_t N = hn::Lanes(d);
  std::size_t i = 0;
  for (; i + N <= n; i += N) fv(d, i);
  for (; i < n; ++i) fs(i);
}

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

// dst (cols×rows, stride ldd) = src (rows×cols, stride lds) transposed, by
// square blocks that stay in L1 (element by element the rows of dst are
// written with a stride of a whole row, one cache line per element).
template <class T>
void transpose(const T* HWY_RESTRICT src, std::size_t rows, std::size_t cols, std::size_t lds,
               T* HWY_RESTRICT dst, std::size_t ldd) {
  constexpr std::size_t kB = 16;
  for (std::size_t i0 = 0; i0 < rows; i0 += kB) {
    const std::size_t i1 = std::min(i0 + kB, rows);
    for (std::size_t j0 = 0; j0 < cols; j0 += kB) {
      const std::size_t j1 = std::min(j0 + kB, cols);
      for (std::size_t j = j0; j < j1; ++j)
        for (std::size_t i = i0; i < i1; ++i) dst[j * ldd + i] = src[i * lds + j];
    }
  }
}

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

// Gathers tokens [t0, t0 + c) of one head and builds everything of the
// chunk that does not depend on the state: decays, Kg, Qg, Kr, a_c, L, P and
// the solve's columns [x_lo, x_hi) of X = [U | W] (U: [0, V), W: [V, V+K)).
// alpha_all: exp(g) of the head's tokens, [tokens×K] (null: computed here).
// factors: which of L and P are built (l: P is left as it was, for the
// summary, which uses L only; none: neither, for a
// caller that kept them from an earlier call on the same chunk); L and P are
// the same either way.
enum class Factors { l, l_and_p, none };

template <class T>
void chunk_prepare(const HeadInputs<T>& h, std::size_t t0, std::size_t c, std::size_t kd,
                   std::size_t vd, std::size_t x_lo, std::size_t x_hi, ChunkWork<T>& w,
                   const T* alpha_all = nullptr, Factors factors = Factors::l_and_p) {
  const bool need_p = factors == Factors::l_and_p;
  const std::size_t ldx = vd + kd;
  w.resize(kd, vd);
  T* k = w.k.data();
  T* q = w.q.data();
  T* al = w.alpha.data();
  constexpr std::size_t kAhead = 8;  // tokens: the rows are strided, prefetch them
  for (std::size_t t = 0; t < c; ++t) {
    const T* kt = h.k_at(t0 + t);
    const T* qt = h.q_at(t0 + t);
    if (t + kAhead < c) {
      const std::size_t ta = t0 + t + kAhead;
      constexpr std::size_t kLine = 64 / sizeof(T);
      for (std::size_t i = 0; i < kd; i += kLine) {
        hwy::Prefetch(h.k_at(ta) + i);
        hwy::Prefetch(h.q_at(ta) + i);
        if (!alpha_all) hwy::Prefetch(h.g_at(ta) + i);
      }
      for (std::size_t i = 0; i < vd; i += kLine) hwy::Prefetch(h.v_at(ta) + i);
    }
    for (std::size_t i = 0; i < kd; ++i) {
      k[t * kd + i] = kt[i];
      q[t * kd + i] = qt[i];
    }
    if (alpha_all) {
      const T* at = alpha_all + (t0 + t) * kd;
      for (std::size_t i = 0; i < kd; ++i) al[t * kd + i] = at[i];
    } else {
      exp_row(h.g_at(t0 + t), al + t * kd, kd);
    }
    w.beta[t] = h.beta_at(t0 + t);
  }
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
          hn::StoreU(hn::Mul(hn::LoadU(d, q + o + i), r), d, qg + o + i);
        },
        [&](std::size_t i) {
          run[i] = run[i] * al[o + i];
          kg[o + i] = k[o + i] * run[i];
          qg[o + i] = q[o + i] * run[i];
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

  // L (strictly lower) and P (lower), kChunk×kChunk, zero above.
  // Every row t < c is written whole, [0, c): no separate zero fill.
  T* L = w.L.data();
  T* P = w.P.data();
  for (std::size_t b = 0; b < (factors == Factors::none ? 0 : c); b += kSub) {
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
            hn::StoreU(hn::Mul(hn::LoadU(d, qt + i), fv), d, aq + i);
            hn::StoreU(hn::Div(kv, fv), d, bt + i);
          },
          [&](std::size_t i) {
            f[i] = first ? T(1) : fp[i] * a[i];
            ak[i] = kt[i] * f[i];
            aq[i] = qt[i] * f[i];
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
    transpose(am, na, kd, kd, amt, na);
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
    for (std::size_t j = std::max(x_lo, vd); j < x_hi; ++j) xr[j] = kg[t * kd + j - vd];
  }
  chunk_solve(c, X + x_lo, ldx, x_hi - x_lo, w);
}

// The end of one prepared chunk given Δ (c rows of stride ldd, n columns):
// when o is set, o_t = scale (Qg S_0 + P Δ)_t on the first V columns (at
// o + t·o_stride); then S ← Diag(a_c) S + Krᵀ Δ (state: K×n).
template <class T>
void chunk_finish(std::size_t c, std::size_t kd, std::size_t vd, std::size_t n, T* state, const T* dl,
                  std::size_t ldd, T* o, std::size_t o_stride, T scale, ChunkWork<T>& w) {
  if (o != nullptr) {
    T* tmp = w.tmp.data();  // c×V
    gemm<GemmOp::set>(c, vd, kd, w.qg.data(), kd, std::size_t{1}, state, n, tmp, vd);
    gemm<GemmOp::add, Tri::lower_a>(c, vd, c, w.P.data(), kChunk, std::size_t{1}, dl, ldd, tmp, vd);
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
template <class T>
void chunk_advance_delta(const HeadInputs<T>& h, std::size_t t0, std::size_t c, std::size_t kd,
                         std::size_t vd, T* state, T* o, std::size_t o_stride, T scale,
                         ChunkWork<T>& w, T* keep_r = nullptr, T* keep_delta = nullptr) {
  T* X = keep_delta ? keep_delta : w.x.data();
  const std::size_t ldx = keep_delta ? vd : vd + kd;
  for (std::size_t t = 0; t < c; ++t) {
    const T* vt = h.v_at(t0 + t);
    T* xr = X + t * ldx;
    for (std::size_t j = 0; j < vd; ++j) xr[j] = vt[j];
  }
  gemm<GemmOp::sub>(c, vd, kd, w.kg.data(), kd, std::size_t{1}, state, vd, X, ldx);
  if (keep_r)
    for (std::size_t t = 0; t < c; ++t) std::copy_n(X + t * ldx, vd, keep_r + t * vd);
  chunk_solve(c, X, ldx, vd, w);
  chunk_finish(c, kd, vd, vd, state, X, ldx, o, o_stride, scale, w);
}

// forward of one head: o (when set) and, when set, the final state. keep
// (or null): the head's record of chunk_saved_layout, what the backward's
// first pass would recompute (the record is written in whole).
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
      std::copy_n(st, kd * vd, keep + lay.states + ci * kd * vd);
      T* lp = keep + lay.factors + ci * 2 * kChunk * kChunk;
      std::copy_n(w.L.data(), c * kChunk, lp);
      std::copy_n(w.P.data(), c * kChunk, lp + kChunk * kChunk);
      keep_r = keep + lay.r + t0 * vd;
      keep_delta = keep + lay.delta + t0 * vd;
    }
    chunk_advance_delta(h, t0, c, kd, vd, st, o ? o + t0 * o_stride : nullptr, o_stride, scale, w, keep_r,
                        keep_delta);
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

// backward of one head. Pass 1 runs the chunks forward from `incoming` and
// keeps the record of chunk_saved_layout (the state entering each chunk, R,
// Δ, L and P), unless the forward kept it (`kept`: the same bits); pass 2
// walks the chunks backwards with the state gradient dS, recomputing each
// chunk's element-wise factors (decays, Kg, Qg, Kr), and applies the adjoint of every line of the forward (chunk-inl.h's header):
//   dΔ = scale Pᵀ dO + Kr dS,   dP = scale dO Δᵀ,   dQg = scale dO S_0ᵀ,
//   dKr = Δ dSᵀ,   da_c = rowsum(dS ⊙ S_0),
//   Z = (I + Diag(β) L)⁻ᵀ dΔ,   dR = dV = Diag(β) Z,   dKg = -dR S_0ᵀ,
//   dβ_t = Z_t·R_t - Σ_{s<t} (Z_t·Δ_s) L_ts,   dL_ts = -β_t Z_t·Δ_s,
//   dS ← scale Qgᵀ dO + Diag(a_c) dS - Kgᵀ dR   (Kgᵀ dR = Wᵀ dΔ),
// then the decay factors: every factor is exp of a difference of cumulative
// log-decays γ, so each product x = k ⊙ e^{γ_a - γ_b} gives dk = dx ⊙ e^{..},
// dγ_a += dx ⊙ x, dγ_b -= dx ⊙ x; the sub-chunk reference γ_b of L and P
// cancels exactly (its two contributions are the same sum) and is skipped.
// Finally dg_t = Σ_{r ≥ t in the chunk} dγ_r.
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
  const T* states = kept + lay.states;
  const T* rs = kept + lay.r;
  const T* deltas = kept + lay.delta;

  T* ds = bw.ds.data();  // dS at the end of the current chunk
  for (std::size_t i = 0; i < kv; ++i) ds[i] = d_final ? d_final[i] : T(0);
  for (std::size_t ci = n_chunks; ci-- > 0;) {
    const std::size_t t0 = ci * kChunk, c = std::min(kChunk, tokens - t0);
    chunk_prepare(h, t0, c, kd, vd, 0, 0, w, static_cast<const T*>(nullptr), Factors::none);
    const T* lp = kept + lay.factors + ci * 2 * kChunk * kChunk;
    std::copy_n(lp, c * kChunk, w.L.data());
    std::copy_n(lp + kChunk * kChunk, c * kChunk, w.P.data());
    const T* s0 = states + ci * kv;
    const T* k = w.k.data();
    const T* q = w.q.data();
    const T* al = w.alpha.data();
    const T* HWY_RESTRICT rr = rs + t0 * vd;      // R, c×V
    const T* HWY_RESTRICT dl = deltas + t0 * vd;  // Δ, c×V
    T* HWY_RESTRICT dob = bw.dob.data();
    for (std::size_t t = 0; t < c; ++t)
      for (std::size_t j = 0; j < vd; ++j) dob[t * vd + j] = d_o[(t0 + t) * do_stride + j];
    // Transposes: S_0ᵀ, dSᵀ (V×K), Δᵀ (V×c).
    T* HWY_RESTRICT s0t = bw.s0t.data();
    T* HWY_RESTRICT dst = bw.dst.data();
    transpose(s0, kd, vd, vd, s0t, kd);
    transpose(ds, kd, vd, vd, dst, kd);
    T* HWY_RESTRICT dlt = bw.dlt.data();
    transpose(dl, c, vd, vd, dlt, c);

    // dΔ = scale Pᵀ dO + Kr dS.
    T* dd = bw.dd.data();
    gemm<GemmOp::set, Tri::upper_a>(c, vd, c, w.P.data(), std::size_t{1}, kChunk, dob, vd, dd,
                                     vd);
    for (std::size_t i = 0; i < c * vd; ++i) dd[i] = scale * dd[i];
    gemm<GemmOp::add>(c, vd, kd, w.kr.data(), kd, std::size_t{1}, ds, vd, dd, vd);
    // dP = scale dO Δᵀ (lower, incl. the diagonal), dQg = scale dO S_0ᵀ, dKr = Δ dSᵀ.
    T* dP = bw.dP.data();  // c×c
    gemm<GemmOp::set, Tri::lower_c>(c, c, vd, dob, vd, std::size_t{1}, dlt, c, dP, c);
    for (std::size_t i = 0; i < c * c; ++i) dP[i] = scale * dP[i];
    T* HWY_RESTRICT dqg = bw.dqg.data();
    gemm<GemmOp::set>(c, kd, vd, dob, vd, std::size_t{1}, s0t, kd, dqg, kd);
    for (std::size_t i = 0; i < c * kd; ++i) dqg[i] = scale * dqg[i];
    T* HWY_RESTRICT dkr = bw.dkr.data();
    gemm<GemmOp::set>(c, kd, vd, dl, vd, std::size_t{1}, dst, kd, dkr, kd);
    // da_c.
    T* dac = bw.dac.data();
    for (std::size_t i = 0; i < kd; ++i) dac[i] = lane_dot(ds + i * vd, s0 + i * vd, vd);
    // Z = (I + Diag(β) L)⁻ᵀ dΔ by back substitution, blocks of kSub rows
    // from the last; then dR = Diag(β) Z.
    T* Z = bw.z.data();  // c×V
    for (std::size_t i = 0; i < c * vd; ++i) Z[i] = dd[i];
    T* lb = bw.lb.data();  // β_t L_ts, kChunk×kChunk
    for (std::size_t t = 0; t < c; ++t)
      for (std::size_t s2 = 0; s2 < c; ++s2) lb[t * kChunk + s2] = w.beta[t] * w.L[t * kChunk + s2];
    const std::size_t n_sub = (c + kSub - 1) / kSub;
    for (std::size_t sb = n_sub; sb-- > 0;) {
      const std::size_t b = sb * kSub, e = std::min(b + kSub, c);
      if (e < c)  // Z_t -= Σ_{r ≥ e} β_r L_rt Z_r
        gemm<GemmOp::sub>(e - b, vd, c - e, lb + e * kChunk + b, std::size_t{1}, kChunk,
                          Z + e * vd, vd, Z + b * vd, vd);
      for (std::size_t t = e; t-- > b;) {
        T* HWY_RESTRICT zt = Z + t * vd;
        for (std::size_t r = t + 1; r < e; ++r) {
          const T l = lb[r * kChunk + t];
          const T* HWY_RESTRICT zr = Z + r * vd;
          for_vecs<T>(
              vd,
              [&](auto d, std::size_t j) {
                hn::StoreU(hn::Sub(hn::LoadU(d, zt + j), hn::Mul(hn::Set(d, l), hn::LoadU(d, zr + j))),
                           d, zt + j);
              },
              [&](std::size_t j) { zt[j] = zt[j] - l * zr[j]; });
        }
      }
    }
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
    gemm<GemmOp::set>(c, kd, vd, dR, vd, std::size_t{1}, s0t, kd, dkg, kd);
    for (std::size_t i = 0; i < c * kd; ++i) dkg[i] = -dkg[i];

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
    // The rest of L and P per sub-chunk σ: R = [Kf; Qf] Bmᵀ, dR = [dL; dP]
    // rows of σ, strictly below the diagonal; the exact channels' pairs of
    // the diagonal block after the products.
    for (std::size_t b = 0; b < c; b += kSub) {
      const std::size_t e = std::min(b + kSub, c), nr = e - b, ncol = e;
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
      const T* HWY_RESTRICT okc = w.ok.data();
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

    // dS ← scale Qgᵀ dO + Diag(a_c) dS - Wᵀ dΔ.
    T* t2 = w.kv.data();
    gemm<GemmOp::set>(kd, vd, c, w.qg.data(), std::size_t{1}, kd, dob, vd, t2, vd);
    for (std::size_t i = 0; i < kd; ++i) {
      const T a = w.ac[i];
      for (std::size_t j = 0; j < vd; ++j)
        ds[i * vd + j] = scale * t2[i * vd + j] + a * ds[i * vd + j];
    }
    gemm<GemmOp::sub>(kd, vd, c, w.kg.data(), std::size_t{1}, kd, dR, vd, ds, vd);
  }
  if (out.d_incoming)
    for (std::size_t i = 0; i < kv; ++i) out.d_incoming[i] = ds[i];
}

}  // namespace kdacp::kda::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // KDACP_KDA_CHUNK_INL_H_
