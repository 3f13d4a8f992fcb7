// The per-(batch, value head) kernels of the chunkwise KDA algorithm
// (SPEC §9, Algorithm::chunk) as the kernel table (kernels/table.hpp) holds
// them: the chunk size, their scratch and record layouts and one entry per
// kernel. kda_chunk-inl.h defines them per Highway target (with the math);
// src/kda/chunk.cpp runs them over the heads.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "kernels/kda_heads.hpp"

namespace kdacp::kda::detail {

// Tokens per chunk: the state crosses chunk boundaries, everything inside a
// chunk is dense products of C×K, C×C and K×V blocks. Sub-chunks of kSub
// tokens bound the range of the decay factors (kda_chunk-inl.h). Part of the
// results' definition (it fixes the rounding), not a tuning knob per call:
// kda.hpp's kChunkSize (kda/chunk.hpp checks that they are equal).
inline constexpr std::size_t kChunk = 64;
inline constexpr std::size_t kSub = 16;

// Scratch of one thread for one head at a time; sized once per (K, V).
template <class T>
struct ChunkWork {
  std::vector<T> k, q, alpha, kg, qg, kr;  // kChunk×K
  std::vector<T> beta;                     // kChunk
  std::vector<T> run, ac;                  // K
  std::vector<T> L, P;                     // kChunk×kChunk
  std::vector<T> amat;                     // 2·kSub×K
  std::vector<T> bmat;                     // K×kChunk (holds amat transposed, K×2·kSub)
  std::vector<T> rbuf;                     // kChunk×2·kSub: [L | P] rows of a sub-chunk, transposed
  std::vector<T> frows;                    // kSub×K
  std::vector<T> brows;                    // kChunk×K
  std::vector<T> x;                        // kChunk×(V+K): [U | W]
  std::vector<T> delta;                    // kChunk×(V+K)
  std::vector<T> tmp;                      // kChunk×V (forward: scale·O; backward: R = V - Kg S_0)
  std::vector<T> kv;                       // K×V
  std::vector<T> state;                    // K×(V+K)
  // The key channels of the current sub-chunk whose decay leaves the range
  // where its diagonal block may be factorised (kda_chunk-inl.h, "Strong
  // decay"): ok[i] = 1 or 0, bad = the channels with ok[i] = 0, ascending.
  std::vector<T> ok;                       // K
  std::vector<std::size_t> bad;            // ≤ K
  // Their columns gathered (exact_block_*): kSub×|bad| rows of k, q, α and
  // the backward's dk, dq, dγ sums; one row of running products.
  std::vector<T> kb, qb, ab, gkb, gqb, ggb;  // kSub×K
  std::vector<T> xb;                         // K
  std::size_t kd = 0, vd = 0;

  void resize(std::size_t key_dim, std::size_t value_dim) {
    if (key_dim == kd && value_dim == vd) return;
    kd = key_dim;
    vd = value_dim;
    for (auto* v : {&k, &q, &alpha, &kg, &qg, &kr}) v->assign(kChunk * kd, T(0));
    beta.assign(kChunk, T(0));
    run.assign(kd, T(0));
    ac.assign(kd, T(0));
    L.assign(kChunk * kChunk, T(0));
    P.assign(kChunk * kChunk, T(0));
    amat.assign(2 * kSub * kd, T(0));
    bmat.assign(kd * kChunk, T(0));
    rbuf.assign(2 * kSub * kChunk, T(0));
    frows.assign(kSub * kd, T(0));
    brows.assign(kChunk * kd, T(0));
    x.assign(kChunk * (vd + kd), T(0));
    delta.assign(kChunk * (vd + kd), T(0));
    tmp.assign(kChunk * vd, T(0));
    kv.assign(kd * vd, T(0));
    ok.assign(kd, T(1));
    for (auto* v : {&kb, &qb, &ab, &gkb, &gqb, &ggb}) v->assign(kSub * kd, T(0));
    xb.assign(kd, T(0));
    bad.clear();
    bad.reserve(kd);
  }
};

// What the forward keeps of one head for its backward (and what the
// backward's first pass computes otherwise), offsets in elements of one
// record: the state entering every chunk but the first ((n_chunks - 1)×K×V;
// the first chunk's is the head's incoming state, which the backward is
// given), R = V - Kg S_0 and Δ of every token (tokens×V each), and L and P
// of every chunk, c×c each for a chunk of c tokens (rows of stride c; every
// chunk but the last has kChunk tokens, so chunk i's pair is at
// factors + i·2·kChunk²). Sized by the real token count, so a piece of a few
// tokens (a short document) keeps a few rows, not a whole chunk's state and
// factors. Which channels took the exact path is not kept: the backward
// recomputes the same decay products.
struct ChunkSavedLayout {
  std::size_t states = 0, r = 0, delta = 0, factors = 0, total = 0;

  // Offset of chunk ci's L (its P follows c×c further on), and of the state
  // entering chunk ci ≥ 1.
  std::size_t factors_at(std::size_t ci) const { return factors + ci * 2 * kChunk * kChunk; }
  std::size_t state_at(std::size_t ci, std::size_t kv) const { return states + (ci - 1) * kv; }
};

inline ChunkSavedLayout chunk_saved_layout(std::size_t tokens, std::size_t key_dim,
                                           std::size_t value_dim) {
  const std::size_t n = (tokens + kChunk - 1) / kChunk;
  const std::size_t last = tokens - (n > 0 ? (n - 1) * kChunk : 0);  // tokens of the last chunk
  ChunkSavedLayout l;
  l.r = (n > 0 ? n - 1 : 0) * key_dim * value_dim;
  l.delta = l.r + tokens * value_dim;
  l.factors = l.delta + tokens * value_dim;
  l.total = l.factors + (n > 0 ? (n - 1) * 2 * kChunk * kChunk + 2 * last * last : 0);
  return l;
}

// backward's scratch on top of ChunkWork: the record of chunk_saved_layout
// when the forward kept none, and the per-chunk gradient buffers.
template <class T>
struct ChunkBackWork {
  ScratchVec<T> record;                                   // chunk_saved_layout(...).total
  std::vector<T> ds, s0t, dst;                            // K×V
  std::vector<T> zero;  // K×V zeros: S_0 of the first chunk when the incoming state is zero
  std::vector<T> dob, dd, dlt;                            // kChunk×V
  std::vector<T> dP, dL, m1, lb;                          // kChunk×kChunk
  std::vector<T> dqg, dkr, dkg, gk, gq, gg, bmr, fac, dbm;  // kChunk×K
  std::vector<T> z, xt;                                   // kChunk×(V+K): Z, dR (c×V used)
  std::vector<T> dac, last;                               // K
  std::vector<T> ff, dam, dr;                             // 2·kSub×max(K, kChunk)
  std::size_t kd = 0, vd = 0;

  void resize(std::size_t key_dim, std::size_t value_dim) {
    if (key_dim == kd && value_dim == vd) return;
    kd = key_dim;
    vd = value_dim;
    const std::size_t kv = kd * vd, cv = kChunk * vd, cc = kChunk * kChunk, ck = kChunk * kd;
    for (auto* v : {&ds, &s0t, &dst, &zero}) v->assign(kv, T(0));
    for (auto* v : {&dob, &dd, &dlt}) v->assign(cv, T(0));
    for (auto* v : {&dP, &dL, &m1, &lb}) v->assign(cc, T(0));
    for (auto* v : {&dqg, &dkr, &dkg, &gk, &gq, &gg, &bmr, &fac, &dbm}) v->assign(ck, T(0));
    for (auto* v : {&z, &xt}) v->assign(kChunk * (vd + kd), T(0));
    for (auto* v : {&dac, &last}) v->assign(kd, T(0));
    const std::size_t wide = 2 * kSub * std::max<std::size_t>(kd, kChunk);
    for (auto* v : {&ff, &dam, &dr}) v->assign(wide, T(0));
  }
};

// One thread's scratch for chunk backward calls: the forward's and the
// backward's own.
template <class T>
struct ChunkBackScratch {
  ChunkWork<T> w;
  ChunkBackWork<T> bw;
};

// The per-head chunk kernels of one target, for one element type.
template <class T>
struct ChunkKernels {
  void (*forward)(const HeadInputs<T>&, std::size_t, std::size_t, std::size_t, T, const T*, T*,
                  std::size_t, T*, ChunkWork<T>&, T*);
  void (*summary)(const HeadInputs<T>&, std::size_t, std::size_t, std::size_t, T*, T*,
                  ChunkWork<T>&);
  void (*incoming_grad)(const HeadInputs<T>&, std::size_t, std::size_t, std::size_t, T,
                        const T*, std::size_t, T*, ChunkWork<T>&);
  void (*backward)(const HeadInputs<T>&, std::size_t, std::size_t, std::size_t, T, const T*,
                   const T*, std::size_t, const T*, const HeadGrads<T>&, ChunkWork<T>&,
                   ChunkBackWork<T>&, const T*);
};

}  // namespace kdacp::kda::detail
