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
#include <type_traits>
#include <utility>
#include <vector>

#include "core/buffer_allocator.hpp"
#include "kdacp/half.hpp"

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

  // 16-bit fields (T = float; kda::HalfInputs): their T pointers are null,
  // and their bits start at the same element as the T pointer would.
  HalfField q16{}, k16{}, v16{}, g16{}, beta16{};

  // The T rows: of fields not stored as 16-bit only.
  const T* q_at(std::size_t t) const { return q + t * qk_stride; }
  const T* k_at(std::size_t t) const { return k + t * qk_stride; }
  const T* v_at(std::size_t t) const { return v + t * v_stride; }
  const T* g_at(std::size_t t) const { return g + t * g_stride; }
  T beta_at(std::size_t t) const {
    if constexpr (std::is_same_v<T, float>)
      if (beta16.bits) return beta16.at(t * beta_stride);
    return beta[t * beta_stride];
  }

  bool has_half() const { return q16.bits || k16.bits || v16.bits || g16.bits || beta16.bits; }

  // Columns [lo, lo + n) of token t's row into dst as T, from either storage:
  // a 16-bit row widened exactly, so the values are a T row's.
  void load_q(std::size_t t, std::size_t lo, std::size_t n, T* dst) const { load(q, q16, t * qk_stride + lo, n, dst); }
  void load_k(std::size_t t, std::size_t lo, std::size_t n, T* dst) const { load(k, k16, t * qk_stride + lo, n, dst); }
  void load_v(std::size_t t, std::size_t lo, std::size_t n, T* dst) const { load(v, v16, t * v_stride + lo, n, dst); }
  void load_g(std::size_t t, std::size_t lo, std::size_t n, T* dst) const { load(g, g16, t * g_stride + lo, n, dst); }

  // Token t's row of a field as bytes and its length in bytes, for prefetching.
  struct Row {
    const void* p;
    std::size_t bytes;
  };
  Row q_row(std::size_t t, std::size_t n) const { return row(q, q16, t * qk_stride, n); }
  Row k_row(std::size_t t, std::size_t n) const { return row(k, k16, t * qk_stride, n); }
  Row v_row(std::size_t t, std::size_t n) const { return row(v, v16, t * v_stride, n); }
  Row g_row(std::size_t t, std::size_t n) const { return row(g, g16, t * g_stride, n); }

  // The inputs from token lo on.
  HeadInputs from(std::size_t lo) const {
    HeadInputs h = *this;
    shift(h.q, h.q16, lo * qk_stride);
    shift(h.k, h.k16, lo * qk_stride);
    shift(h.v, h.v16, lo * v_stride);
    shift(h.g, h.g16, lo * g_stride);
    shift(h.beta, h.beta16, lo * beta_stride);
    return h;
  }

 private:
  static void load(const T* wide, const HalfField& half, std::size_t at, std::size_t n, T* dst) {
    if constexpr (std::is_same_v<T, float>)
      if (half.bits) return half.load(at, n, dst);
    std::copy_n(wide + at, n, dst);
  }
  static Row row(const T* wide, const HalfField& half, std::size_t at, std::size_t n) {
    if (half.bits) return {half.bits + at, n * sizeof(std::uint16_t)};
    return {wide + at, n * sizeof(T)};
  }
  static void shift(const T*& wide, HalfField& half, std::size_t by) {
    if (half.bits) half.bits += by;
    else wide += by;
  }
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
