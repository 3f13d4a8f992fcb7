// Internal to the KDA module: the types its per-target kernels
// (recurrent-inl.h, reverse-inl.h) share with the dispatch in kda_math.cpp,
// the table of one target's kernels, and the entry points of kda.hpp with an
// explicit table, which the tests run once per compiled target.
#pragma once

#include <algorithm>
#include <cstddef>
#include <memory>
#include <new>
#include <utility>
#include <vector>

#include "core/buffer_allocator.hpp"
#include "kdacp/kda.hpp"

namespace kdacp::kda::detail {

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
inline std::size_t token_major_offset(const Shape& s, std::size_t b, std::size_t j, std::size_t d) {
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

// The best target's kernels (kda_math.cpp), chosen once per process.
template <class T>
const Kernels<T>& chosen_kernels();

// The calls of kda.hpp on `kernels`, without validation: their callers
// validated the arguments (kda/validate.hpp lists the entry points).
template <class T>
void chunk_summary_on(const Kernels<T>& kernels, const Inputs<T>& in, T* state, T* transfer,
                      const ExecPolicy& exec);
template <class T>
void forward_on(const Kernels<T>& kernels, const Inputs<T>& in, const T* incoming, T* o,
                T* final_state, const ExecPolicy& exec, ForwardCache<T>* keep = nullptr);
template <class T>
void backward_on(const Kernels<T>& kernels, const Inputs<T>& in, const T* incoming,
                 const T* d_o, const T* d_final, const Grads<T>& grads, const ExecPolicy& exec,
                 std::size_t checkpoint_interval, ForwardCache<T>* kept = nullptr);
template <class T>
void incoming_grad_on(const Kernels<T>& kernels, const Inputs<T>& in, const T* d_o,
                      T* g_state, const ExecPolicy& exec);

}  // namespace kdacp::kda::detail
