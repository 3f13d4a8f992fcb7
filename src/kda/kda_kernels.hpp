// Internal to the KDA module: how it reaches its per-head kernels — the
// kernel table's entries (kernels/table.hpp), one (batch, value head) of a
// call's inputs as they take it — and the entry points of kda.hpp on an
// explicit set of entries, which the tests run once per compiled target.
#pragma once

#include <cstddef>
#include <string>

#include "kdacp/error.hpp"
#include "kdacp/kda.hpp"
#include "kernels/kda_heads.hpp"
#include "kernels/table.hpp"

namespace kdacp::kda::detail {

using kdacp::detail::KernelSet;

template <class T>
HeadInputs<T> head_inputs(const Inputs<T>& in, std::size_t b, std::size_t j) {
  const Shape& s = in.shape;
  std::size_t h = j / s.group();
  const std::size_t qk = (b * s.tokens * s.heads + h) * s.key_dim;
  const std::size_t v = (b * s.tokens * s.value_heads + j) * s.value_dim;
  const std::size_t g = (b * s.tokens * s.value_heads + j) * s.key_dim;
  const std::size_t beta = b * s.tokens * s.value_heads + j;
  // A field stored as 16-bit: its T pointer stays null, its bits advance.
  auto at = [](const T* p, std::size_t off) { return p ? p + off : nullptr; };
  auto half = [](HalfField f, std::size_t off) {
    if (f.bits) f.bits += off;
    return f;
  };
  return {at(in.q, qk), at(in.k, qk), s.heads * s.key_dim,
          at(in.v, v), s.value_heads * s.value_dim,
          at(in.g, g), s.value_heads * s.key_dim,
          at(in.beta, beta), s.value_heads,
          half(in.half.q, qk), half(in.half.k, qk), half(in.half.v, v),
          half(in.half.g, g), half(in.half.beta, beta)};
}

// Throws InvalidArgument naming `what` when `in` holds 16-bit fields: the
// kernels of Algorithm::recurrent read T rows only.
template <class T>
void require_wide(const Inputs<T>& in, const char* what) {
  if (in.half.any())
    throw InvalidArgument(std::string(what) +
                          ": 16-bit inputs read in place need Algorithm::chunk (widen them for the recurrent one)");
}

// Offset of token 0 of (b, value head j) in a [B,T,HV,D] tensor.
inline std::size_t token_major_offset(const Shape& s, std::size_t b, std::size_t j, std::size_t d) {
  return (b * s.tokens * s.value_heads + j) * d;
}

// The kernel table's recurrent kernels (kernel_table(): the best target's,
// chosen once per process).
template <class T>
const Kernels<T>& chosen_kernels();

// The calls of kda.hpp on `kernels` (the recurrent or the chunk entries, as
// kda::Exec::algorithm says), without validation: their callers validated
// the arguments (kda/validate.hpp lists the entry points).
template <class T>
void chunk_summary_on(const KernelSet<T>& kernels, const Inputs<T>& in, T* state, T* transfer,
                      const Exec& exec);
template <class T>
void forward_on(const KernelSet<T>& kernels, const Inputs<T>& in, const T* incoming, T* o,
                T* final_state, const Exec& exec, ForwardCache<T>* keep = nullptr);
template <class T>
void backward_on(const KernelSet<T>& kernels, const Inputs<T>& in, const T* incoming,
                 const T* d_o, const T* d_final, const Grads<T>& grads, const Exec& exec,
                 std::size_t checkpoint_interval, ForwardCache<T>* kept = nullptr);
template <class T>
void incoming_grad_on(const KernelSet<T>& kernels, const Inputs<T>& in, const T* d_o,
                      T* g_state, const Exec& exec);

}  // namespace kdacp::kda::detail
