// The fields of the KDA layers' agreements (kdacp/agreement.hpp): what
// every rank must build a layer with and pass to each call. One definition
// for the context-parallel layer (context_parallel.cpp) and the Ulysses layer
// (ulysses.cpp), so that both compare the same things under the same names.
#pragma once

#include <chrono>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "kdacp/agreement.hpp"
#include "kdacp/exchange.hpp"
#include "kdacp/kda.hpp"
#include "kdacp/kda_cp.hpp"
#include "kdacp/layout.hpp"

namespace kdacp::kda::agreed {

// What every rank must build the layer with (the layer's doc lists it).
template <class T>
inline Fingerprint construction_fields(const std::string& method, long long group_size,
                                const ExchangeOptions& o, const Layout* layout,
                                std::chrono::milliseconds timeout) {
  Fingerprint f;
  f.add_text("call", "construction");
  f.add_text("dtype", std::is_same_v<T, double> ? "float64" : "float32");
  f.add_text("method", method);
  f.add_int("allgather_group_size", group_size);
  f.add_int("options.segments", static_cast<long long>(o.segments));
  f.add_int("options.memory_budget_bytes", static_cast<long long>(o.memory_budget_bytes));
  f.add_flag("options.allow_reassociation", o.allow_reassociation);
  f.add_hash("options.cost", fnv1a64(to_json(o.cost)));
  f.add_text("options.expected_shape", o.expected_shape ? to_string(*o.expected_shape) : "none");
  const std::vector<std::size_t> owners = o.part_owners ? o.part_owners->list() : std::vector<std::size_t>{};
  f.add_bytes("options.part_owners", std::as_bytes(std::span(owners)),
              list_text(std::span<const std::size_t>(owners)));
  const std::vector<std::size_t> cuts(o.expected_cuts.begin(), o.expected_cuts.end());
  f.add_bytes("options.expected_cuts", std::as_bytes(std::span(cuts)), list_text(std::span<const std::size_t>(cuts)));
  const std::vector<std::size_t> lengths = layout ? layout->part_lengths() : std::vector<std::size_t>{};
  f.add_bytes("layout part lengths", std::as_bytes(std::span(lengths)),
              list_text(std::span<const std::size_t>(lengths)));
  f.add_int("timeout ms", static_cast<long long>(timeout.count()));
  return f;
}

// The arguments of a call that every rank shares: all but T_local (each
// rank's own) and the tensors' contents.
template <class T>
inline Fingerprint call_fields(const char* call, const Inputs<T>& in, Algorithm algorithm) {
  const Shape& s = in.shape;
  const std::size_t dims[5] = {s.batch, s.heads, s.value_heads, s.key_dim, s.value_dim};
  Fingerprint f;
  f.add_text("call", call);
  f.add_bytes("shape B,H,HV,K,V", std::as_bytes(std::span(dims)), list_text(std::span<const std::size_t>(dims)));
  f.add_real("scale", in.scale);
  f.add_text("algorithm", algorithm_name(algorithm));
  return f;
}

template <class T>
inline Fingerprint call_fields(const char* call, const Inputs<T>& in, Algorithm algorithm, bool deterministic) {
  Fingerprint f = call_fields(call, in, algorithm);
  f.add_flag("deterministic", deterministic);
  return f;
}

// A stream's fields: its sequences (B, T, the exact cu_seqlens) and layout.
inline void add_stream(Fingerprint& f, const Stream& stream) {
  const Sequences& seqs = stream.sequences;
  const std::size_t bt[2] = {seqs.batch(), seqs.tokens()};
  f.add_bytes("stream B,T", std::as_bytes(std::span(bt)), list_text(std::span<const std::size_t>(bt)));
  f.add_flag("packed (cu_seqlens given)", seqs.packed());
  const std::vector<std::size_t>& bounds = seqs.boundaries();
  f.add_bytes("cu_seqlens", std::as_bytes(std::span(bounds)), list_text(std::span<const std::size_t>(bounds)));
  const std::vector<std::size_t> owners = stream.layout.owners().list(), lengths = stream.layout.part_lengths();
  f.add_bytes("layout part owners", std::as_bytes(std::span(owners)), list_text(std::span<const std::size_t>(owners)));
  f.add_bytes("layout part lengths", std::as_bytes(std::span(lengths)),
              list_text(std::span<const std::size_t>(lengths)));
}

}  // namespace kdacp::kda::agreed
