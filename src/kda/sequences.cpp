// Packed sequences, initial and final states on top of the chunk kernels of
// kda_math.cpp: each piece of a part is one call of those kernels on the
// piece's tokens, so no recurrence is written twice and a piece's results
// are the bits the kernels give for it.
#include "kda/sequences.hpp"

#include "kda/kda_kernels.hpp"
#include "kda/parts.hpp"
#include "kda/validate.hpp"

#include <algorithm>
#include <deque>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "kdacp/error.hpp"
#include "kdacp/layout.hpp"

namespace kdacp::kda {
namespace {

// Segment n's row block of [N,HV,K,V] states: [1,HV,K,V] of sequence n when
// packed, all [B,HV,K,V] otherwise.
template <class T>
T* slot(const SequenceStates<T>& st, const Shape& s, std::size_t n) {
  return st.data ? st.data + n * s.state_elems() : nullptr;
}

// Tokens [lo, lo + count) of the local [B,T_local,...] tensors as the dense
// chunk the kernels take: views when those tokens are contiguous in memory
// (one row, or the whole tensor), copies otherwise; commit() copies outputs
// written to copies back into place.
template <class T>
class Window {
 public:
  Window(const Inputs<T>& local, std::size_t lo, std::size_t count)
      : local_(local.shape), lo_(lo), count_(count),
        direct_(local.shape.batch == 1 || (lo == 0 && count == local.shape.tokens)) {
    const Shape& s = local.shape;
    in_ = local;
    in_.shape.tokens = count;
    in_.q = input(local.q, s.heads * s.key_dim);
    in_.k = input(local.k, s.heads * s.key_dim);
    in_.v = input(local.v, s.value_heads * s.value_dim);
    in_.g = input(local.g, s.value_heads * s.key_dim);
    in_.beta = input(local.beta, s.value_heads);
  }

  // Inputs and pending outputs point into owned_.
  Window(const Window&) = delete;
  Window& operator=(const Window&) = delete;

  const Inputs<T>& inputs() const { return in_; }

  const T* input(const T* full, std::size_t inner) {
    if (direct_) return full + lo_ * inner;
    std::vector<T>& buf = owned_.emplace_back(local_.batch * count_ * inner);
    slice_tokens(full, local_.batch, local_.tokens, inner, TokenSplit{lo_, count_}, buf.data());
    return buf.data();
  }

  T* output(T* full, std::size_t inner) {
    if (direct_) return full + lo_ * inner;
    std::vector<T>& buf = owned_.emplace_back(local_.batch * count_ * inner);
    pending_.push_back({&buf, full, inner});
    return buf.data();
  }

  void commit() {
    for (const Pending& p : pending_)
      unslice_tokens(p.buf->data(), local_.batch, local_.tokens, p.inner,
                     TokenSplit{lo_, count_}, p.full);
    pending_.clear();
  }

 private:
  struct Pending {
    const std::vector<T>* buf;
    T* full;
    std::size_t inner;
  };
  Shape local_;
  std::size_t lo_, count_;
  bool direct_;
  Inputs<T> in_{};
  std::deque<std::vector<T>> owned_;  // a deque: growing it keeps earlier buffers in place
  std::vector<Pending> pending_;
};

template <class T>
Window<T> window_of(const Inputs<T>& local, const Part& part, const Piece& piece) {
  return Window<T>(local, part.local_begin + (piece.begin - part.begin), piece.end - piece.begin);
}

template <class T>
PartInfo forward_impl(const Inputs<T>& local, const Sequences& seqs, const Part& part,
                      const T* incoming, SequenceStates<const T> h0, T* o,
                      SequenceStates<T> ht, const ExecPolicy& exec, ForwardCache<T>* keep) {
  const std::vector<Piece> pieces = kdacp::pieces(seqs, part);
  const PartInfo info = part_info(seqs, part);
  const Shape& s = local.shape;
  for (const Piece& piece : pieces) {
    Window<T> w = window_of(local, part, piece);
    T* piece_o = w.output(o, s.value_heads * s.value_dim);
    detail::forward_on(detail::chosen_kernels<T>(), w.inputs(),
                       piece.starts ? slot(h0, s, *piece.starts) : incoming, piece_o,
                       piece.ends ? slot(ht, s, *piece.ends) : nullptr, exec, keep);
    w.commit();
  }
  return info;
}

template <class T>
PartInfo backward_impl(const Inputs<T>& local, const Sequences& seqs, const Part& part,
                       const T* incoming, SequenceStates<const T> h0,
                       const T* d_o, const T* d_end, SequenceStates<const T> dht,
                       const Grads<T>& grads, SequenceStates<T> dh0, const ExecPolicy& exec,
                       std::size_t checkpoint_interval, ForwardCache<T>* kept) {
  const std::vector<Piece> pieces = kdacp::pieces(seqs, part);
  const PartInfo info = part_info(seqs, part);
  const Shape& s = local.shape;
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    const Piece& piece = pieces[i];
    Window<T> w = window_of(local, part, piece);
    T* d_start = piece.starts ? slot(dh0, s, *piece.starts) : grads.d_incoming;
    if (i == 0 && d_start == nullptr) d_start = grads.d_incoming;
    const Grads<T> piece_grads{w.output(grads.dq, s.heads * s.key_dim),
                               w.output(grads.dk, s.heads * s.key_dim),
                               w.output(grads.dv, s.value_heads * s.value_dim),
                               w.output(grads.dg, s.value_heads * s.key_dim),
                               w.output(grads.dbeta, s.value_heads),
                               d_start};
    detail::backward_on(detail::chosen_kernels<T>(), w.inputs(),
                        piece.starts ? slot(h0, s, *piece.starts) : incoming,
                        w.input(d_o, s.value_heads * s.value_dim),
                        piece.ends ? slot(dht, s, *piece.ends) : d_end, piece_grads, exec,
                        checkpoint_interval, kept);
    w.commit();
    if (i == 0 && grads.d_incoming != nullptr && d_start != grads.d_incoming)
      std::copy_n(d_start, s.state_elems(), grads.d_incoming);
  }
  return info;
}

}  // namespace

template <class T>
PartInfo part_summary(const Inputs<T>& local, const Sequences& seqs, const Part& part,
                      SequenceStates<const Elem<T>> h0, Elem<T>* state, Elem<T>* transfer,
                      const ExecPolicy& exec) {
  const std::vector<Piece> pieces = kdacp::pieces(seqs, part);
  const PartInfo info = part_info(seqs, part);
  if (!info.cut) {
    Window<T> w = window_of(local, part, pieces.front());
    detail::chunk_summary_on(detail::chosen_kernels<T>(), w.inputs(), state, transfer, exec);
    return info;
  }
  // The last piece starts at the part's last sequence start: the part's
  // outgoing state is that sequence's state, run from its h0 row.
  const Piece& last = pieces.back();
  Window<T> w = window_of(local, part, last);
  const Shape& piece = w.inputs().shape;
  std::vector<T> o(piece.v_elems());
  detail::forward_on(detail::chosen_kernels<T>(), w.inputs(), slot(h0, local.shape, *last.starts),
                     o.data(), state, exec);
  return info;
}

template <class T>
PartInfo part_forward(const Inputs<T>& local, const Sequences& seqs, const Part& part,
                      const Elem<T>* incoming, SequenceStates<const Elem<T>> h0, Elem<T>* o,
                      SequenceStates<Elem<T>> ht, const ExecPolicy& exec, ForwardCache<Elem<T>>* keep) {
  return forward_impl(local, seqs, part, incoming, h0, o, ht, exec, keep);
}

template <class T>
PartInfo part_incoming_grad(const Inputs<T>& local, const Sequences& seqs, const Part& part,
                            const Elem<T>* d_o, SequenceStates<const Elem<T>> dht,
                            Elem<T>* g_state, const ExecPolicy& exec) {
  const std::vector<Piece> pieces = kdacp::pieces(seqs, part);
  const PartInfo info = part_info(seqs, part);
  const Shape& s = local.shape;
  if (info.starts_sequence) {
    std::fill_n(g_state, s.state_elems(), T(0));
    return info;
  }
  const Piece& first = pieces.front();
  Window<T> w = window_of(local, part, first);
  const T* piece_do = w.input(d_o, s.value_heads * s.value_dim);
  const T* d_final = first.ends ? slot(dht, s, *first.ends) : nullptr;
  if (d_final == nullptr) {
    detail::incoming_grad_on(detail::chosen_kernels<T>(), w.inputs(), piece_do, g_state, exec);
    return info;
  }
  // ht of the sequence ending in this piece is one of the part's outputs: its
  // gradient reaches the incoming state through the piece's transfer, which
  // backward's state sweep applies; the parameter gradients are not needed.
  const Shape& ps = w.inputs().shape;
  std::vector<T> dq(ps.qk_elems()), dk(ps.qk_elems()), dv(ps.v_elems()), dg(ps.g_elems()),
      dbeta(ps.beta_elems());
  detail::backward_on(detail::chosen_kernels<T>(), w.inputs(), static_cast<const T*>(nullptr),
                      piece_do, d_final,
                      Grads<T>{dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data(), g_state},
                      exec, kDefaultCheckpointInterval);
  return info;
}

template <class T>
PartInfo part_backward(const Inputs<T>& local, const Sequences& seqs, const Part& part,
                       const Elem<T>* incoming, SequenceStates<const Elem<T>> h0,
                       const Elem<T>* d_o, const Elem<T>* d_end,
                       SequenceStates<const Elem<T>> dht, const Grads<Elem<T>>& grads,
                       SequenceStates<Elem<T>> dh0, const ExecPolicy& exec,
                       std::size_t checkpoint_interval, ForwardCache<Elem<T>>* kept) {
  return backward_impl(local, seqs, part, incoming, h0, d_o, d_end, dht, grads, dh0, exec,
                       checkpoint_interval, kept);
}

template <class T>
void forward_sequences(const Inputs<T>& in, const Sequences& seqs,
                       SequenceStates<const Elem<T>> h0, Elem<T>* o,
                       SequenceStates<Elem<T>> ht, const ExecPolicy& exec, ForwardCache<Elem<T>>* keep) {
  const std::string_view where = "kda::forward_sequences: ";
  check::inputs(in, where);
  check::algorithm(exec.algorithm, where);
  check::whole_stream(in.shape, seqs, where);
  check::pointer(o, where, "o");
  check::states(h0, seqs, in.shape, where, "h0");
  check::states(ht, seqs, in.shape, where, "ht");
  forward_impl(in, seqs, Part{0, seqs.tokens(), 0}, static_cast<const T*>(nullptr), h0, o, ht,
               exec, keep);
}

template <class T>
void backward_sequences(const Inputs<T>& in, const Sequences& seqs,
                        SequenceStates<const Elem<T>> h0, const Elem<T>* d_o,
                        SequenceStates<const Elem<T>> dht, const Grads<Elem<T>>& grads,
                        SequenceStates<Elem<T>> dh0, const ExecPolicy& exec,
                        std::size_t checkpoint_interval, ForwardCache<Elem<T>>* kept) {
  const std::string_view where = "kda::backward_sequences: ";
  check::inputs(in, where);
  check::algorithm(exec.algorithm, where);
  check::whole_stream(in.shape, seqs, where);
  check::pointer(d_o, where, "d_o");
  check::grads(grads, where);
  if (grads.d_incoming != nullptr)
    throw InvalidArgument(fmt::format("{}grads.d_incoming is set, expected null (the incoming "
                                      "states are h0; their gradient is dh0)",
                                      where));
  check::checkpoint_interval(checkpoint_interval, where);
  check::states(h0, seqs, in.shape, where, "h0");
  check::states(dht, seqs, in.shape, where, "dht");
  check::states(dh0, seqs, in.shape, where, "dh0");
  backward_impl(in, seqs, Part{0, seqs.tokens(), 0}, static_cast<const T*>(nullptr), h0,
                d_o, static_cast<const T*>(nullptr), dht, grads, dh0, exec,
                checkpoint_interval, kept);
}

#define KDACP_SEQUENCES_INSTANTIATE(T)                                                         \
  template PartInfo part_summary<T>(const Inputs<T>&, const Sequences&, const Part&,            \
                                    SequenceStates<const T>, T*, T*, const ExecPolicy&);        \
  template PartInfo part_forward<T>(const Inputs<T>&, const Sequences&, const Part&, const T*,  \
                                    SequenceStates<const T>, T*, SequenceStates<T>,             \
                                    const ExecPolicy&, ForwardCache<T>*);                       \
  template PartInfo part_incoming_grad<T>(const Inputs<T>&, const Sequences&, const Part&,      \
                                          const T*, SequenceStates<const T>, T*,                \
                                          const ExecPolicy&);                                   \
  template PartInfo part_backward<T>(const Inputs<T>&, const Sequences&, const Part&, const T*, \
                                     SequenceStates<const T>, const T*, const T*,               \
                                     SequenceStates<const T>, const Grads<T>&,                  \
                                     SequenceStates<T>, const ExecPolicy&, std::size_t,         \
                                     ForwardCache<T>*);                                         \
  template void forward_sequences<T>(const Inputs<T>&, const Sequences&,                        \
                                     SequenceStates<const T>, T*, SequenceStates<T>,            \
                                     const ExecPolicy&, ForwardCache<T>*);                      \
  template void backward_sequences<T>(const Inputs<T>&, const Sequences&,                       \
                                      SequenceStates<const T>, const T*,                        \
                                      SequenceStates<const T>, const Grads<T>&,                 \
                                      SequenceStates<T>, const ExecPolicy&, std::size_t,        \
                                      ForwardCache<T>*);

KDACP_SEQUENCES_INSTANTIATE(float)
KDACP_SEQUENCES_INSTANTIATE(double)
#undef KDACP_SEQUENCES_INSTANTIATE

}  // namespace kdacp::kda
