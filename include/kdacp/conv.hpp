// The causal short convolution in front of KDA's q, k, v (flash-linear-
// attention's causal_conv1d): depthwise over [B,T,D] with a weight [D,W],
//
//   z[t,d] = bias[d] + sum_{k<W} weight[d,k] * x[t-(W-1)+k, d]
//   y[t,d] = z[t,d]            (activation none)
//          = z * sigmoid(z)    (silu, also called swish)
//
// where x before the first token of a sequence is the sequence's initial
// state (or zero). States follow flash-linear-attention: [N,D,W], column j
// the token W-j before the sequence's end (column W-1 the last token);
// the initial state's columns 1..W-1 are the W-1 tokens before the first one
// (column 0 is never read, its gradient is zero). A final state reaches into
// the initial state (or zeros) when a sequence is shorter than W.
//
// Under context parallelism (SPEC §10) each rank holds the parts of a Layout;
// a part needs the W-1 tokens before its first token (its halo), which one or
// more earlier parts hold (a part shorter than W-1 tokens passes the halo on
// from the parts before it); a sequence start in between cuts the halo. The
// forward receives them from their owners; the backward sends the owners the
// pre-activation gradients of the tokens that read them, whose terms the
// owners add in token order, so y, the final state, dx and dinitial_state
// are one device's bits for every layout.
//
// Module `conv`: includes layout, comm and core only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "kdacp/layout.hpp"

namespace kdacp {

class Communicator;

namespace conv {

// W ranges over [1, kMaxWidth].
inline constexpr std::size_t kMaxWidth = 8;

enum class Activation { none, silu };

// "none" (or empty) -> none; "silu" or "swish" -> silu; anything else throws
// InvalidArgument naming it.
Activation parse_activation(std::string_view name);
std::string_view activation_name(Activation a);

// What the forward keeps for the backward: the history (halo and initial
// state rows, [B][W-1][D]) in front of each local part, in local order.
template <class T>
struct Saved {
  std::vector<T> history;
};

// One call's tensors on this rank. x, y, dx, dy: [B,T_local,D] contiguous;
// weight [D,W]; bias [D] (null: none); states [N,D,W] (null: not given).
template <class T>
struct Tensors {
  const T* x = nullptr;
  const T* weight = nullptr;
  const T* bias = nullptr;
  const T* initial_state = nullptr;
  Activation activation = Activation::none;
};

template <class T>
struct Grads {
  T* dx = nullptr;             // [B,T_local,D], required
  T* dweight = nullptr;        // [D,W], required: this rank's tokens' share
  T* dbias = nullptr;          // [D], when a bias is given
  T* dinitial_state = nullptr; // [N,D,W], when an initial state is given
};

// The convolution of one rank: its parts of the stream, the halo plan, and
// (under CP) the communicator. Built once per layout, sequences and W; the
// calls take the tensors.
class CausalConv {
 public:
  // One device: the whole stream [B,T,D] local (seqs gives B, T and the
  // cu_seqlens cuts). Throws InvalidArgument for D = 0 or W outside [1, 8].
  CausalConv(Sequences seqs, std::size_t dim, std::size_t width);
  // Rank comm->rank() of `layout` (comm->size() == layout.ranks(), T ==
  // seqs.tokens(), else InvalidArgument naming both).
  CausalConv(std::shared_ptr<Communicator> comm, Layout layout, Sequences seqs,
             std::size_t dim, std::size_t width);
  ~CausalConv();
  CausalConv(CausalConv&&) noexcept;
  CausalConv& operator=(CausalConv&&) noexcept;

  std::size_t batch() const;
  std::size_t local_tokens() const;  // T_local
  std::size_t dim() const;
  std::size_t width() const;
  std::size_t sequences() const;  // N: rows of the states
  std::size_t rank() const;

  // y [B,T_local,D]; final_state (null: not wanted) [N,D,W], complete and
  // the same bits on every rank (each row computed by the rank holding its
  // sequence's last token, then all-gathered). Collective under CP: every
  // rank calls it, with initial_state and final_state given on all ranks or
  // none. Throws NumericalError naming y or final_state and the element when
  // a result is not finite (e.g. float32 overflow).
  template <class T>
  Saved<T> forward(const Tensors<T>& in, std::type_identity_t<T>* y,
                   std::type_identity_t<T>* final_state) const;

  // Gradients of the forward that returned `saved` (same tensors). dy
  // [B,T_local,D]; d_final_state [N,D,W] (null: zero; given on all ranks or
  // none): this rank's loss's gradient of the final state; the ranks' are
  // summed in rank order, so its gradient is the sum over ranks. dx: this
  // rank's tokens, including the terms of the later parts' tokens that read
  // them (one device's bits); dweight and dbias: this rank's tokens' share (their sum over the
  // ranks is the one-device gradient); dinitial_state complete and the same
  // bits on every rank (the ranks' shares summed in rank order).
  template <class T>
  void backward(const Tensors<T>& in, const Saved<T>& saved, const std::type_identity_t<T>* dy,
                const std::type_identity_t<T>* d_final_state, const Grads<T>& grads) const;

  // The plan's transfers (for tests and docs): part `to` receives tokens
  // [begin, end) of part `from`.
  struct Transfer {
    std::size_t to = 0, from = 0, begin = 0, end = 0;
  };
  const std::vector<Transfer>& transfers() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace conv
}  // namespace kdacp
