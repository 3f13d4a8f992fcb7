// The KDA module's input checks, one function per input kind, written once.
//
// Entry points validate their arguments once, before anything is written, then
// call internals that trust them:
//  - kda::chunk_summary / forward / backward / incoming_grad (kda.hpp): prefix
//    "kda::<op>: "; kda::validate(Inputs, op) is the same Inputs check;
//  - kda::forward_sequences / backward_sequences (kda/sequences.hpp);
//  - ContextParallelLayer::forward / backward (kda_cp.hpp): prefix "", the
//    layer names itself and the rank (on_rank, layer/context_parallel.cpp).
// Internal, unchecked: detail::*_on (kda.cpp / recurrent.cpp, also per target in
// tests/test_kda_dispatch.cpp), the part_* calls (kda/parts.hpp) and the
// per-piece calls of sequences.cpp.
//
// `where` prefixes every message; an error is InvalidArgument.
#pragma once

#include <cstddef>
#include <string_view>

#include "kdacp/kda.hpp"
#include "kdacp/layout.hpp"

namespace kdacp::kda::check {

// `field` is null: "<where><field> is null, expected a pointer to its tensor".
void pointer(const void* ptr, std::string_view where, std::string_view field);

// validate(in.shape), every tensor pointer set, scale finite and > 0.
template <class T>
void inputs(const Inputs<T>& in, std::string_view where);

// dq, dk, dv, dg and dbeta set (d_incoming is optional).
template <class T>
void grads(const Grads<T>& g, std::string_view where);

// Algorithm::recurrent or Algorithm::chunk.
void algorithm(Algorithm algorithm, std::string_view where);

// backward's checkpoint interval, >= 1.
void checkpoint_interval(std::size_t interval, std::string_view where);

// Absent states (data == nullptr) pass; present ones are [N,HV,K,V] for the
// sequences `seqs` and inputs of shape `s`.
template <class T>
void states(const SequenceStates<T>& st, const Sequences& seqs, const Shape& s,
            std::string_view where, std::string_view field);

// The inputs' batch is the sequences' B.
void batch(const Shape& s, const Sequences& seqs, std::string_view where);

// The inputs cover the whole stream: batch() and T = the sequences' T.
void whole_stream(const Shape& s, const Sequences& seqs, std::string_view where);

// The deterministic mode with Algorithm::chunk: every part of `layout` that
// continues a sequence starts a multiple of kChunkSize tokens into it (the
// first offender named), so its walk is one device's.
void chunk_boundaries(const Sequences& seqs, const Layout& layout);

}  // namespace kdacp::kda::check
