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

// One forward + backward through the layer. dht[r] is rank r's loss's
// gradient on ht (empty: none). Without a layout, the layer of the plain
// constructor over contiguous_stream(counts); with one, the layer built for it.
// Each rank runs with `exec`, and with its own pool of `threads` workers
// when threads > 0; keep_forward as ContextParallelLayer::keep_forward.
template <class T>
CpRun<T> run_layer(const Problem<T>& p, const std::vector<std::vector<T>>& dht, std::size_t ranks,
                   const std::vector<std::size_t>& counts, const RowConfig& m,
                   const std::optional<Layout>& layout = std::nullopt, const ExecPolicy& exec = {},
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
    ExecPolicy mine = exec;
    if (threads > 0) mine.pool = &pool.emplace(threads);
    std::optional<ContextParallelLayer<T>> built;
    if (layout)
      built.emplace(mesh, m.config.method, *layout, group, options, mine);
    else
      built.emplace(mesh, m.config.method, group, options, mine);
    ContextParallelLayer<T>& layer = *built;
    layer.keep_forward(keep_forward);
    const Stream stream =
        layout ? Stream{stream_sequences(c), *layout}
               : layer.contiguous_stream(s.batch, s.tokens, std::span(c.cu), counts);
    const std::vector<Part> parts = stream.layout.local_parts(rank);
    Shape ls = s;
    ls.tokens = stream.layout.local_tokens(rank);
    const std::size_t qk = s.heads * s.key_dim, vv = s.value_heads * s.value_dim,
                      gk = s.value_heads * s.key_dim, bh = s.value_heads;
    auto local = [&](const std::vector<T>& full, std::size_t inner) {
      return gather_parts(full, s.batch, s.tokens, inner, parts, ls.tokens);
    };
    const std::vector<T> q = local(p.q, qk), k = local(p.k, qk), v = local(p.v, vv),
                         g = local(p.g, gk), beta = local(p.beta, bh), d_o = local(p.d_o, vv);
    const Inputs<T> in{q.data(), k.data(), v.data(), g.data(), beta.data(), ls, p.scale};
    std::vector<T> o(ls.v_elems()), dq(ls.qk_elems()), dk(ls.qk_elems()), dv(ls.v_elems()),
        dg(ls.g_elems()), dbeta(ls.beta_elems());
    const Sequences& seqs = stream.sequences;
    const Saved saved = layer.forward(in, stream, p.states(p.h0), o.data(),
                                      sequence_states(out.ht[rank].data(), seqs, ls));
    layer.backward(in, saved, p.states(p.h0), d_o.data(),
                   dht.empty() ? SequenceStates<const T>{} : p.states(dht[rank]),
                   Grads<T>{dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data()},
                   sequence_states(out.dh0[rank].data(), seqs, ls));
    // Disjoint token ranges: ranks write their own parts of the outputs.
    auto put = [&](const std::vector<T>& x, std::size_t inner, std::vector<T>& full) {
      scatter_parts(x, s.batch, s.tokens, inner, parts, ls.tokens, full);
    };
    put(o, vv, out.r.o);
    put(dq, qk, out.r.dq);
    put(dk, qk, out.r.dk);
    put(dv, vv, out.r.dv);
    put(dg, gk, out.r.dg);
    put(dbeta, bh, out.r.dbeta);
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
