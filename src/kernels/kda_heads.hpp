// The per-(batch, value head) kernels of the recurrent KDA algorithm (SPEC
// §9) as the kernel table (kernels/table.hpp) holds them: their argument and
// scratch types and one entry per kernel. kda_recurrent-inl.h and
// kda_recurrent_backward-inl.h define them per Highway target; src/kda runs
// them over the heads.
#pragma once

#include <algorithm>
#include <cstddef>
#include <memory>
#include <new>
#include <utility>
#include <vector>

#include "core/buffer_allocator.hpp"

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

}  // namespace kdacp::kda::detail
