// The context-parallel KDA layer equals one device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <sstream>

#include "kdacp/error.hpp"
#include "kdacp/inprocess.hpp"
#include "kdacp/kda_cp.hpp"
#include "kda_helpers.hpp"

namespace kdacp::kda {
namespace {

using test::LayerResult;
using test::alloc;
using test::expect_close;
using test::same_bits;

template <class T>
LayerResult<T> single_rank(const LayerData<T>& d, const std::vector<T>& d_o) {
  LayerResult<T> r = alloc<T>(d.shape);
  const auto in = d.inputs(default_scale<T>(d.shape.key_dim));
  forward(in, nullptr, r.o.data(), nullptr);
  backward(in, nullptr, d_o.data(), nullptr,
           Grads<T>{r.dq.data(), r.dk.data(), r.dv.data(), r.dg.data(), r.dbeta.data(), r.d_incoming0.data()});
  return r;
}

template <class T>
LayerResult<T> context_parallel(const LayerData<T>& d, const std::vector<T>& d_o, std::size_t p,
                                const std::string& method, long long width) {
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
    ContextParallelLayer<T> layer(mesh, method, width);
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

struct CpCase {
  std::size_t p, batch, tokens, heads, value_heads, k, v;
};

struct Method {
  std::string name;
  long long width;
  bool exact;
};

// Every concrete protocol of the registry (p2p first), every proper width
// (w = 1 and w = P build the chain and the allgather themselves).
std::vector<Method> methods_for(std::size_t p) {
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

template <class T>
void check_case(const CpCase& c, double tol) {
  const Shape s{c.batch, c.tokens, c.heads, c.value_heads, c.k, c.v};
  const auto data = synthetic_layer<T>(s, c.p * 7 + c.tokens);
  const auto d_o = synthetic_tensor<T>(s.v_elems(), c.tokens);
  const auto want = single_rank(data, d_o);
  std::vector<LayerResult<T>> all;
  for (const Method& m : methods_for(c.p)) {
    std::ostringstream what;
    what << m.name << " w=" << m.width << " P=" << c.p;
    all.push_back(context_parallel(data, d_o, c.p, m.name, m.width));
    expect_close(all.back(), want, tol, what.str());
    // Exact protocols: the chain's bits (all.front() is p2p).
    if (m.exact) {
      EXPECT_TRUE(same_bits(all.back(), all.front())) << what.str();
    }
  }
}

class CpLayer : public ::testing::TestWithParam<CpCase> {};

TEST_P(CpLayer, DoubleEqualsOneDevice) { check_case<double>(GetParam(), 1e-12); }
TEST_P(CpLayer, FloatEqualsOneDevice) { check_case<float>(GetParam(), 2e-5); }

INSTANTIATE_TEST_SUITE_P(
    Shapes, CpLayer,
    ::testing::Values(CpCase{2, 1, 24, 1, 1, 16, 16}, CpCase{3, 1, 30, 1, 1, 16, 16},
                      CpCase{4, 2, 37, 1, 2, 16, 32},   // T % P != 0, B > 1, HV = 2H, K != V
                      CpCase{8, 1, 40, 2, 2, 16, 16},   // B·H > 1
                      CpCase{2, 1, 12, 1, 1, 64, 128}), // K = 64, V = 128
    [](const auto& info) {
      std::ostringstream n;
      n << "P" << info.param.p << "_B" << info.param.batch << "_T" << info.param.tokens << "_HV"
        << info.param.value_heads << "_K" << info.param.k << "_V" << info.param.v;
      return n.str();
    });

TEST(CpLayer, TokenSplitAndTooManyRanks) {
  EXPECT_EQ(split_tokens(37, 4, 0).count, 10u);
  EXPECT_EQ(split_tokens(37, 4, 1).begin, 10u);
  EXPECT_EQ(split_tokens(37, 4, 3).begin, 28u);
  EXPECT_EQ(split_tokens(37, 4, 3).count, 9u);
  EXPECT_THROW(split_tokens(3, 4, 0), InvalidArgument);
}

}  // namespace
}  // namespace kdacp::kda
