// The KDA layer on one rank and on P in-process ranks (one part per rank,
// the default token split), forward + backward, outputs in the global layout,
// and every protocol configuration to run it with: the in-process layer
// tests' (test_kda_cp.cpp, test_kda_chunk.cpp) common runner.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kda_helpers.hpp"
#include "kdacp/inprocess.hpp"
#include "kdacp/kda_cp.hpp"
#include "kdacp/protocol.hpp"

namespace kdacp::kda::test {

template <class T>
LayerResult<T> single_rank(const LayerData<T>& d, const std::vector<T>& d_o,
                           Algorithm algorithm = Algorithm::recurrent) {
  LayerResult<T> r = alloc<T>(d.shape);
  const auto in = d.inputs(default_scale<T>(d.shape.key_dim));
  const kda::Exec exec{{nullptr, KernelKind::best}, algorithm};
  forward(in, nullptr, r.o.data(), nullptr, exec);
  backward(in, nullptr, d_o.data(), nullptr,
           Grads<T>{r.dq.data(), r.dk.data(), r.dv.data(), r.dg.data(), r.dbeta.data(), r.d_incoming0.data()},
           exec);
  return r;
}

template <class T>
LayerResult<T> context_parallel(const LayerData<T>& d, const std::vector<T>& d_o, std::size_t p,
                                const std::string& method, long long width,
                                Algorithm algorithm = Algorithm::recurrent) {
  const Shape& s = d.shape;
  LayerResult<T> r = alloc<T>(s);
  run_in_process(p, [&](const std::shared_ptr<Communicator>& comm) {
    const std::size_t rank = comm->rank();
    const TokenSplit range = split_tokens(s.tokens, p, rank);
    const LayerData<T> local = d.slice(range);
    const Shape& ls = local.shape;
    std::vector<T> ldo(ls.v_elems());
    slice_tokens(d_o.data(), s.batch, s.tokens, s.value_heads * s.value_dim, range, ldo.data());
    auto mesh = DeviceMesh::create(comm, {p}, {"cp"});
    ContextParallelLayer<T> layer(mesh, method, width, {}, kda::Exec{{nullptr, KernelKind::best}, algorithm});
    const auto in = local.inputs(default_scale<T>(s.key_dim));
    LayerResult<T> lr = alloc<T>(ls);
    const Saved saved = layer.forward(in, lr.o.data());
    layer.backward(in, saved, ldo.data(),
                   Grads<T>{lr.dq.data(), lr.dk.data(), lr.dv.data(), lr.dg.data(), lr.dbeta.data(),
                            lr.d_incoming0.data()});
    // Disjoint token ranges: ranks write their own parts of the outputs.
    unslice_tokens(lr.o.data(), s.batch, s.tokens, s.value_heads * s.value_dim, range, r.o.data());
    unslice_tokens(lr.dq.data(), s.batch, s.tokens, s.heads * s.key_dim, range, r.dq.data());
    unslice_tokens(lr.dk.data(), s.batch, s.tokens, s.heads * s.key_dim, range, r.dk.data());
    unslice_tokens(lr.dv.data(), s.batch, s.tokens, s.value_heads * s.value_dim, range, r.dv.data());
    unslice_tokens(lr.dg.data(), s.batch, s.tokens, s.value_heads * s.key_dim, range, r.dg.data());
    unslice_tokens(lr.dbeta.data(), s.batch, s.tokens, s.value_heads, range, r.dbeta.data());
    if (rank == 0) r.d_incoming0 = lr.d_incoming0;
  });
  return r;
}

struct Method {
  std::string name;
  long long width;
  bool exact;
};

// Every concrete protocol of the registry (p2p first), every proper width
// (w = 1 and w = P build the chain and the allgather themselves).
inline std::vector<Method> methods_for(std::size_t p) {
  std::vector<Method> out;
  for (const ProtocolDescriptor* row : protocol_registry()) {
    if (row->chooser()) continue;
    if (!row->takes_group_size) {
      out.push_back({std::string(row->name), 1, row->exact()});
      continue;
    }
    for (std::size_t w = 2; w < p; ++w)
      if (p % w == 0) out.push_back({std::string(row->name), static_cast<long long>(w), row->exact()});
  }
  return out;
}

}  // namespace kdacp::kda::test
