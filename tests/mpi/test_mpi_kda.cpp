// The context-parallel KDA layer over MPI: each
// process holds its tokens, runs the layer over the MPI CP mesh, and compares
// its slice of o and of every gradient with one device, computed in the same
// process from the same seeded inputs; exact protocols agree bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kdacp/exchange.hpp"
#include "kdacp/kda_cp.hpp"
#include "kdacp/mesh.hpp"
#include "kdacp/mpi.hpp"
#include "kda_helpers.hpp"

namespace kdacp::kda {
namespace {

using test::alloc;
using test::rel;
template <class T>
using Outputs = test::LayerResult<T>;

template <class T>
std::vector<const std::vector<T>*> fields(const Outputs<T>& r) {
  return {&r.o, &r.dq, &r.dk, &r.dv, &r.dg, &r.dbeta};
}

// One device's outputs, cut to this rank's tokens.
template <class T>
Outputs<T> single_slice(const LayerData<T>& d, const std::vector<T>& d_o, TokenSplit range) {
  const Shape& s = d.shape;
  Outputs<T> full = alloc<T>(s);
  const auto in = d.inputs(default_scale<T>(s.key_dim));
  forward(in, nullptr, full.o.data(), nullptr);
  backward(in, nullptr, d_o.data(), nullptr,
           Grads<T>{full.dq.data(), full.dk.data(), full.dv.data(), full.dg.data(), full.dbeta.data(), nullptr});
  Shape ls = s;
  ls.tokens = range.count;
  Outputs<T> part = alloc<T>(ls);
  slice_tokens(full.o.data(), s.batch, s.tokens, s.value_heads * s.value_dim, range, part.o.data());
  slice_tokens(full.dq.data(), s.batch, s.tokens, s.heads * s.key_dim, range, part.dq.data());
  slice_tokens(full.dk.data(), s.batch, s.tokens, s.heads * s.key_dim, range, part.dk.data());
  slice_tokens(full.dv.data(), s.batch, s.tokens, s.value_heads * s.value_dim, range, part.dv.data());
  slice_tokens(full.dg.data(), s.batch, s.tokens, s.value_heads * s.key_dim, range, part.dg.data());
  slice_tokens(full.dbeta.data(), s.batch, s.tokens, s.value_heads, range, part.dbeta.data());
  return part;
}

template <class T>
void check(double tol) {
  auto comm = mpi_world();
  const std::size_t p = comm->size(), rank = comm->rank();
  // T not a multiple of P, grouped value heads, K != V.
  const Shape shape{1, 37, 1, 2, 16, 32};
  const auto data = synthetic_layer<T>(shape, 21);
  const auto d_o = synthetic_tensor<T>(shape.v_elems(), 22);
  const TokenSplit range = split_tokens(shape.tokens, p, rank);
  const LayerData<T> local = data.slice(range);
  std::vector<T> ldo(local.shape.v_elems());
  slice_tokens(d_o.data(), shape.batch, shape.tokens, shape.value_heads * shape.value_dim, range, ldo.data());
  const Outputs<T> want = single_slice(data, d_o, range);
  const DeviceMesh mesh = DeviceMesh::create(comm, {p}, {"cp"});

  Outputs<T> chain;
  bool have_chain = false;
  for (const ProtocolDescriptor* row : protocol_registry()) {
    if (row->chooser()) continue;
    const std::string name(row->name);
    std::vector<long long> widths{1};
    if (row->takes_group_size)
      for (std::size_t w = 2; w <= p; ++w)
        if (p % w == 0) widths.push_back(static_cast<long long>(w));
    for (long long w : widths) {
      SCOPED_TRACE(name + " w=" + std::to_string(w) + " rank " + std::to_string(rank) + " of " +
                   std::to_string(p));
      ContextParallelLayer<T> layer(mesh, name, w);
      const auto in = local.inputs(default_scale<T>(shape.key_dim));
      Outputs<T> got = alloc<T>(local.shape);
      const Saved saved = layer.forward(in, got.o.data());
      layer.backward(in, saved, ldo.data(),
                     Grads<T>{got.dq.data(), got.dk.data(), got.dv.data(), got.dg.data(), got.dbeta.data(),
                              nullptr});
      const auto g = fields(got), e = fields(want);
      const char* names[] = {"o", "dq", "dk", "dv", "dg", "dbeta"};
      for (std::size_t i = 0; i < g.size(); ++i) EXPECT_LT(rel(*g[i], *e[i]), tol) << names[i];
      if (!layer.exchange().exact()) continue;
      if (!have_chain) {
        chain = got;
        have_chain = true;
        continue;
      }
      const auto c = fields(chain);
      for (std::size_t i = 0; i < g.size(); ++i)
        EXPECT_EQ(std::memcmp(g[i]->data(), c[i]->data(), g[i]->size() * sizeof(T)), 0)
            << names[i] << " differs bitwise from p2p";
    }
  }
}

TEST(MpiKda, DoubleLayerEqualsOneDeviceOverEveryProtocol) { check<double>(1e-12); }
TEST(MpiKda, FloatLayerEqualsOneDeviceAndExactProtocolsAgreeBitwise) { check<float>(2e-5); }

}  // namespace
}  // namespace kdacp::kda
