// Per-target kernels of the chunkwise (WY/UT) KDA algorithm (SPEC §9,
// Algorithm::chunk), in four files: kda_chunk_forward-inl.h (a chunk's
// factors, the state update, forward, summary, incoming gradient),
// kda_chunk_backward-inl.h, kda_chunk_solve-inl.h (both triangular solves),
// kda_chunk_exact-inl.h (strong gates); on the SIMD primitives gemm-inl.h
// and simd-inl.h. Installed in the kernel table per Highway target by
// kda_chunk_hwy.cpp, hence the toggle guard instead of #pragma once.
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
// Bitwise agreement across targets: matrix products vectorise along the
// output's columns only; every output element is
// fma(a_{p-1}, b_{p-1}, ... fma(a_0, b_0, 0)) in order of the inner index
// (explicit fused multiply-adds, exact on every target: the FMA policy of
// kernels/table.hpp), then combined once with the destination; nothing else
// is fused; dots (the exact fallback) are loops in a fixed order
// (lane_dot).
#if defined(KDACP_KERNELS_KDA_CHUNK_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KDACP_KERNELS_KDA_CHUNK_INL_H_
#undef KDACP_KERNELS_KDA_CHUNK_INL_H_
#else
#define KDACP_KERNELS_KDA_CHUNK_INL_H_
#endif

#include "kernels/kda_chunk_backward-inl.h"
#include "kernels/kda_chunk_forward-inl.h"

#endif  // KDACP_KERNELS_KDA_CHUNK_INL_H_
