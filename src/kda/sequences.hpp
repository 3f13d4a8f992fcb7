// KDA over packed sequences with initial and final states (SPEC §10): the
// single-rank path over a whole stream. Private to kdacp (the job module and
// the Python binding call it); a program embedding kdacp runs a stream
// through ContextParallelLayer (kda_cp.hpp), one rank or many. The per-part
// math each context-parallel rank runs is private to the layer
// (src/kda/parts.hpp). Definitions: docs/sequences.md.
//
// Every call slices the tokens of each piece (below) out of the caller's
// tensors and runs kda::chunk_summary / forward / backward / incoming_grad on
// them, so layouts, element types, threading (Exec: bitwise
// independent of the pool's size) and exactness are those of kda.hpp.
// Both calls are entry points: every argument is validated once
// (kda/validate.hpp), and InvalidArgument thrown, before anything is written.
//
// Terms:
//  - stream: the T tokens of the layer's inputs. With cu_seqlens (B = 1) it
//    holds N packed sequences; without, each of the B rows is one sequence of
//    T tokens (N = B) and everything below applies to all rows at once.
//  - part: a contiguous token range [begin, end) of the stream. A rank holds
//    its parts concatenated in token order in its local tensors
//    [B,T_local,...]; Part::local_begin says where the part starts there.
//  - piece: the part cut at every sequence start inside it. A piece that
//    starts a sequence n runs from h0[n]; only the part's first piece can
//    continue a sequence, from the part's incoming state.
//  - cut: a part holding a sequence start at any of its tokens. Its outgoing
//    state does not depend on its incoming state (A = 0 in SPEC §10).
#pragma once

#include <cstddef>

#include "kdacp/kda.hpp"
#include "kdacp/layout.hpp"

namespace kdacp::kda {

// The single-rank path: one part covering the whole stream
// (in.shape.tokens = seqs.tokens()). Writes o and, when requested, ht.
template <class T>
void forward_sequences(const Inputs<T>& in, const Sequences& seqs,
                       SequenceStates<const Elem<T>> h0, Elem<T>* o,
                       SequenceStates<Elem<T>> ht, const Exec& exec = {},
                       ForwardCache<Elem<T>>* keep = nullptr);

// Its gradients: dq, dk, dv, dg, dbeta and, when requested, dh0.
// grads.d_incoming must be null (the incoming states are h0).
template <class T>
void backward_sequences(const Inputs<T>& in, const Sequences& seqs,
                        SequenceStates<const Elem<T>> h0, const Elem<T>* d_o,
                        SequenceStates<const Elem<T>> dht, const Grads<Elem<T>>& grads,
                        SequenceStates<Elem<T>> dh0, const Exec& exec = {},
                        std::size_t checkpoint_interval = kDefaultCheckpointInterval,
                        ForwardCache<Elem<T>>* kept = nullptr);

}  // namespace kdacp::kda
