// Internal to the context-parallel layer: the local math each rank runs on
// its parts of a stream (layer/context_parallel.cpp), implemented beside the single-rank path
// in sequences.cpp. Terms (stream, part, piece, cut): kda/sequences.hpp.
#pragma once

#include <cstddef>

#include "kdacp/kda.hpp"
#include "kda/sequences.hpp"
#include "kdacp/layout.hpp"

namespace kdacp::kda {

// The part_* calls do not validate: the layer checked its call's arguments
// once (kda/validate.hpp) and passes parts of its layout. Common to them: `local` is the rank's local tensors (shape.batch
// = seqs.batch(), local_begin + end - begin <= shape.tokens); `incoming`,
// `d_end`, `state`, `transfer` and `g_state` are [B,HV,K,V] (transfer
// [B,HV,K,K]) like the exchange's summaries; outputs of token fields are
// written for the part's tokens only, in place in the local tensors.
// `keep` / `kept` (optional): the ForwardCache of kda::forward / backward,
// one record per piece of the part, so a backward reads the records its
// forward wrote when it runs the same parts in the same order.

// The part's affine map for the forward exchange, outgoing = A·incoming + b.
// Not a cut: `state` = S and `transfer` = M of kda::chunk_summary over the
// part. A cut: `state` = b, the state after the part's last token when its
// last piece runs from that piece's h0 row, the very bits part_forward
// produces there; `transfer` is not written and may be null.
template <class T>
PartInfo part_summary(const Inputs<T>& local, const Sequences& seqs, const Part& part,
                      SequenceStates<const Elem<T>> h0, Elem<T>* state, Elem<T>* transfer,
                      const Exec& exec = {});

// Writes o [B,T_local,HV,V] for the part's tokens and ht rows of the
// sequences ending in the part (ht.data null: none), each exactly the state
// after the sequence's last token. `incoming` (the state entering the part's
// first token) is required unless the part starts a sequence, then unused.
// `outgoing` (null: not produced): the state after the part's last token
// when that token does not end a sequence (unused otherwise), the bits the
// walk carries on there on one device when the part starts on a chunk
// boundary of its sequence: the deterministic mode's chain (docs/determinism.md).
template <class T>
PartInfo part_forward(const Inputs<T>& local, const Sequences& seqs, const Part& part,
                      const Elem<T>* incoming, SequenceStates<const Elem<T>> h0, Elem<T>* o,
                      SequenceStates<Elem<T>> ht, const Exec& exec = {},
                      ForwardCache<Elem<T>>* keep = nullptr, Elem<T>* outgoing = nullptr);

// G for the backward exchange: the gradient w.r.t. the part's incoming state
// of the loss on the part's own outputs (o of its tokens, given by d_o, and ht
// of a sequence ending in its first piece, given by dht), written to g_state.
// Zero when the part starts a sequence. Does not depend on the incoming state.
// Cost: kda::incoming_grad over the first piece, or kda::backward over it when
// that piece ends a sequence and dht is given.
template <class T>
PartInfo part_incoming_grad(const Inputs<T>& local, const Sequences& seqs, const Part& part,
                            const Elem<T>* d_o, SequenceStates<const Elem<T>> dht,
                            Elem<T>* g_state, const Exec& exec = {});

// Gradients of the loss given d_o [B,T_local,HV,V] for the part's tokens, dht,
// and d_end = the backward exchange's out-gradient for the part's end (the
// gradient w.r.t. the state after its last token through later parts; null:
// zero). At the end of each piece the state gradient entering the reverse
// sweep is dht[n] when the piece ends sequence n, else d_end; so d_end is
// unused when the part ends a sequence. Writes dq, dk, dv, dg, dbeta for the
// part's tokens, dh0 rows of the sequences starting in the part (dh0.data
// null: none) and, when grads.d_incoming is set, the gradient w.r.t. the
// part's incoming state (= G + Aᵀ·d_end; when the part starts a sequence n
// that is dh0[n], the same bits). `incoming` as in part_forward.
template <class T>
PartInfo part_backward(const Inputs<T>& local, const Sequences& seqs, const Part& part,
                       const Elem<T>* incoming, SequenceStates<const Elem<T>> h0,
                       const Elem<T>* d_o, const Elem<T>* d_end,
                       SequenceStates<const Elem<T>> dht, const Grads<Elem<T>>& grads,
                       SequenceStates<Elem<T>> dh0, const Exec& exec = {},
                       std::size_t checkpoint_interval = kDefaultCheckpointInterval,
                       ForwardCache<Elem<T>>* kept = nullptr);

}  // namespace kdacp::kda
