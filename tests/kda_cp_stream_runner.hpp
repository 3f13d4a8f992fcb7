// The context-parallel layer over a stream on P in-process ranks, forward +
// backward, outputs assembled in the global layout, every rank's ht and dh0:
// the runner of the sequence-layer tests (test_kda_cp_sequences.cpp) and the
// deterministic mode's (test_deterministic.cpp), and the registry's protocol
// configurations to run it with.
#pragma once

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kdacp/inprocess.hpp"
#include "kdacp/kda_cp.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/thread_pool.hpp"
#include "kda_sequence_reference.hpp"

namespace kdacp::kda::test {

// A protocol configuration of the registry.
struct RowConfig {
  ProtocolConfig config;
  bool exact = true;
  double bound = 0;  // the documented error bound of a reassociating row
};

inline std::vector<RowConfig> row_configs(std::size_t p, const Shape& s) {
  std::vector<RowConfig> out;
  for (const ProtocolDescriptor* row : protocol_registry()) {
    if (row->chooser()) continue;
    for (const ProtocolConfig& c : valid_configs(*row, p, s.value_dim))
      out.push_back({c, row->exact(), error_bound(*row, p, s.key_dim)});
  }
  return out;
}

// What the P ranks of one layer call produce: token outputs assembled from
// the ranks' ranges, and every rank's copy of ht and dh0.
template <class T>
struct CpRun {
  Result<T> r;
  std::vector<std::vector<T>> ht, dh0;
  explicit CpRun(const Case& c) : r(c) {}
};

// A rank's parts of a [B,T,inner] tensor, concatenated in token order into
// its local [B,T_local,inner] tensor, and back.
template <class T>
std::vector<T> gather_parts(const std::vector<T>& full, std::size_t batch, std::size_t tokens,
                            std::size_t inner, const std::vector<Part>& parts,
                            std::size_t local_tokens) {
  std::vector<T> local(batch * local_tokens * inner);
  for (std::size_t b = 0; b < batch; ++b)
    for (const Part& part : parts)
      std::copy_n(full.begin() + (b * tokens + part.begin) * inner, (part.end - part.begin) * inner,
                  local.begin() + (b * local_tokens + part.local_begin) * inner);
  return local;
}

template <class T>
void scatter_parts(const std::vector<T>& local, std::size_t batch, std::size_t tokens,
                   std::size_t inner, const std::vector<Part>& parts, std::size_t local_tokens,
                   std::vector<T>& full) {
  for (std::size_t b = 0; b < batch; ++b)
    for (const Part& part : parts)
      std::copy_n(local.begin() + (b * local_tokens + part.local_begin) * inner,
                  (part.end - part.begin) * inner,
                  full.begin() + (b * tokens + part.begin) * inner);
}

inline Sequences stream_sequences(const Case& c) {
  return c.cu.empty() ? Sequences(c.shape.batch, c.shape.tokens)
                      : Sequences(c.shape.batch, c.shape.tokens, std::span(c.cu));
}

// One rank's tokens of a problem under a layout (its parts, concatenated in
// token order), and its token outputs, which scatter() writes back into the
// whole result at the parts' places.
template <class T>
struct RankData {
  Shape shape;  // [B, T_local, ...]
  std::vector<Part> parts;
  std::size_t tokens;  // the stream's T
  std::vector<T> q, k, v, g, beta, d_o, o, dq, dk, dv, dg, dbeta;
  T scale;

  RankData(const Problem<T>& p, const Layout& layout, std::size_t rank)
      : shape(p.c.shape), parts(layout.local_parts(rank)), tokens(p.c.shape.tokens), scale(p.scale) {
    const Shape& s = p.c.shape;
    shape.tokens = layout.local_tokens(rank);
    auto local = [&](const std::vector<T>& full, std::size_t inner) {
      return gather_parts(full, s.batch, s.tokens, inner, parts, shape.tokens);
    };
    q = local(p.q, qk()), k = local(p.k, qk()), v = local(p.v, vv()), g = local(p.g, gk());
    beta = local(p.beta, s.value_heads), d_o = local(p.d_o, vv());
    o.resize(shape.v_elems()), dq.resize(shape.qk_elems()), dk.resize(shape.qk_elems());
    dv.resize(shape.v_elems()), dg.resize(shape.g_elems()), dbeta.resize(shape.beta_elems());
  }
  std::size_t qk() const { return shape.heads * shape.key_dim; }
  std::size_t vv() const { return shape.value_heads * shape.value_dim; }
  std::size_t gk() const { return shape.value_heads * shape.key_dim; }
  Inputs<T> inputs() const { return {q.data(), k.data(), v.data(), g.data(), beta.data(), shape, scale}; }
  Grads<T> grads() { return {dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data()}; }
  // This rank's token outputs into `r` (ranks hold disjoint tokens).
  void scatter(Result<T>& r) const {
    auto put = [&](const std::vector<T>& x, std::size_t inner, std::vector<T>& full) {
      scatter_parts(x, shape.batch, tokens, inner, parts, shape.tokens, full);
    };
    put(o, vv(), r.o);
    put(dq, qk(), r.dq);
    put(dk, qk(), r.dk);
    put(dv, vv(), r.dv);
    put(dg, gk(), r.dg);
    put(dbeta, shape.value_heads, r.dbeta);
  }
};

// How run_layer's ranks compute: kda::Exec, and the layer's deterministic
// mode (ContextParallelLayer::deterministic).
struct RunExec : kda::Exec {
  bool deterministic = false;
};

// One forward + backward through the layer. dht[r] is rank r's loss's
// gradient on ht (empty: none). Without a layout, the layer of the plain
// constructor over contiguous_stream(counts); with one, the layer built for it.
// Each rank runs with `exec`, and with its own pool of `threads` workers
// when threads > 0; keep_forward as ContextParallelLayer::keep_forward.
template <class T>
CpRun<T> run_layer(const Problem<T>& p, const std::vector<std::vector<T>>& dht, std::size_t ranks,
                   const std::vector<std::size_t>& counts, const RowConfig& m,
                   const std::optional<Layout>& layout = std::nullopt, const RunExec& exec = {},
                   std::size_t threads = 0, bool keep_forward = true) {
  const Case& c = p.c;
  const Shape& s = c.shape;
  CpRun<T> out(c);
  out.ht.assign(ranks, std::vector<T>(c.states()));
  out.dh0.assign(ranks, std::vector<T>(c.states()));
  run_in_process(ranks, [&](const std::shared_ptr<Communicator>& comm) {
    const std::size_t rank = comm->rank();
    auto mesh = DeviceMesh::create(comm, {ranks}, {"cp"});
    ExchangeOptions options;
    options.segments = m.config.segments;
    const auto group = static_cast<long long>(m.config.group_size);
    std::optional<ThreadPool> pool;
    kda::Exec mine = exec;
    if (threads > 0) mine.pool = &pool.emplace(threads);
    std::optional<ContextParallelLayer<T>> built;
    if (layout)
      built.emplace(mesh, m.config.method, *layout, group, options, mine);
    else
      built.emplace(mesh, m.config.method, group, options, mine);
    ContextParallelLayer<T>& layer = *built;
    layer.keep_forward(keep_forward);
    layer.deterministic(exec.deterministic);
    const Stream stream =
        layout ? Stream{stream_sequences(c), *layout}
               : layer.contiguous_stream(s.batch, s.tokens, std::span(c.cu), counts);
    RankData<T> d(p, stream.layout, rank);
    const Sequences& seqs = stream.sequences;
    const Saved saved = layer.forward(d.inputs(), stream, p.states(p.h0), d.o.data(),
                                      sequence_states(out.ht[rank].data(), seqs, d.shape));
    layer.backward(d.inputs(), saved, p.states(p.h0), d.d_o.data(),
                   dht.empty() ? SequenceStates<const T>{} : p.states(dht[rank]), d.grads(),
                   sequence_states(out.dh0[rank].data(), seqs, d.shape));
    // Disjoint token ranges: ranks write their own parts of the outputs.
    d.scatter(out.r);
  });
  out.r.ht = out.ht.front();
  out.r.dh0 = out.dh0.front();
  return out;
}

template <class T>
std::vector<std::vector<T>> cast_all(const std::vector<std::vector<double>>& x) {
  std::vector<std::vector<T>> out;
  for (const auto& e : x) out.emplace_back(e.begin(), e.end());
  return out;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

template <class T>
bool same_bits(const Result<T>& a, const Result<T>& b) {
  return same_bits(a.o, b.o) && same_bits(a.ht, b.ht) && same_bits(a.dq, b.dq) &&
         same_bits(a.dk, b.dk) && same_bits(a.dv, b.dv) && same_bits(a.dg, b.dg) &&
         same_bits(a.dbeta, b.dbeta) && same_bits(a.dh0, b.dh0);
}

}  // namespace kdacp::kda::test
