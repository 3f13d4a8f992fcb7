// Per-token pieces of the causal convolution's backward (conv.cpp): the
// gradient of one token's pre-activation, and the results' finiteness.
// Private to module conv.
#pragma once

#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

#include <fmt/format.h>

#include "kdacp/conv.hpp"
#include "kdacp/error.hpp"
#include "kdacp/finite.hpp"

namespace kdacp::conv::detail {

inline double sigmoid(double z) {
  if (z >= 0) return 1.0 / (1.0 + std::exp(-z));
  const double e = std::exp(z);
  return e / (1.0 + e);
}

template <class T>
void require_finite_result(std::span<const T> data, const std::vector<std::size_t>& shape, const char* name,
                           const char* pass) {
  if (const auto i = find_non_finite(data))
    throw NumericalError(fmt::format(
        "causal_conv1d: the {} produced a non-finite {}: element {} is {} (overflow of the "
        "input's range); expected finite values",
        pass, name, index_string(*i, shape), exact_string(data[*i])));
}

// g = dL/dz of one token: dy itself (activation none), or dy·silu'(z) with
// z = bias + Σ_k wt[k]·ext(k) recomputed (wt: the weight transposed, [W][D];
// ext(k): the token's k-th input row of the W it reads).
template <class T, class Ext>
void pre_activation_grad(const Tensors<T>& in, const double* wt, std::size_t d, std::size_t w, Ext&& ext,
                         const T* dy, double* g) {
  if (in.activation != Activation::silu) {
    for (std::size_t c = 0; c < d; ++c) g[c] = static_cast<double>(dy[c]);
    return;
  }
  for (std::size_t c = 0; c < d; ++c) g[c] = in.bias ? static_cast<double>(in.bias[c]) : 0.0;
  for (std::size_t k = 0; k < w; ++k) {
    const T* src = ext(k);
    const double* wk = wt + k * d;
    for (std::size_t c = 0; c < d; ++c) g[c] += wk[c] * static_cast<double>(src[c]);
  }
  for (std::size_t c = 0; c < d; ++c) {
    const double z = g[c], s = sigmoid(z);
    g[c] = static_cast<double>(dy[c]) * (s * (1.0 + z * (1.0 - s)));
  }
}

// The backward's results, each finite (NumericalError naming it otherwise):
// dx [B,T_local,D], dweight [D,W], dbias and dinitial_state when given.
template <class T>
void require_finite_grads(const Tensors<T>& in, const Grads<T>& grads, std::size_t batch, std::size_t tokens,
                          std::size_t d, std::size_t w, std::size_t sequences) {
  require_finite_result<T>({grads.dx, batch * tokens * d}, {batch, tokens, d}, "dx", "backward");
  require_finite_result<T>({grads.dweight, d * w}, {d, w}, "dweight", "backward");
  if (grads.dbias && in.bias) require_finite_result<T>({grads.dbias, d}, {d}, "dbias", "backward");
  if (in.initial_state)
    require_finite_result<T>({grads.dinitial_state, sequences * d * w}, {sequences, d, w}, "dinitial_state",
                             "backward");
}

// Where the gradients of a piece's extended rows [history; tokens] go.
template <class T>
struct PieceTarget {
  T* dx;                 // the piece's first token's dx
  std::size_t len;       // its tokens
  std::size_t seq;       // its sequence (state row)
  std::size_t seq_end;   // that sequence's end (global token)
  std::size_t end;       // the piece's end (global token)
  bool continues_in;     // it continues a sequence from an earlier part
  bool continues_out;    // its sequence goes on in a later part
};

}  // namespace kdacp::conv::detail
