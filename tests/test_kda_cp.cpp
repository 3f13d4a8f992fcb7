// The context-parallel KDA layer equals one device (issue 4).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <sstream>

#include "kdacp/error.hpp"
#include "kdacp/inprocess.hpp"
#include "kdacp/kda_cp.hpp"

namespace kdacp::kda {
namespace {

template <class T>
struct LayerResult {
  std::vector<T> o, dq, dk, dv, dg, dbeta, d_incoming0;
};

template <class T>
LayerResult<T> alloc(const Shape& s) {
  LayerResult<T> r;
  r.o.resize(s.v_elems());
  r.dq.resize(s.qk_elems());
  r.dk.resize(s.qk_elems());
  r.dv.resize(s.v_elems());
  r.dg.resize(s.g_elems());
  r.dbeta.resize(s.beta_elems());
  r.d_incoming0.resize(s.state_elems());
  return r;
}

template <class T>
LayerResult<T> single_rank(const LayerData<T>& d, const std::vector<T>& d_o) {
  LayerResult<T> r = alloc<T>(d.shape);
  const auto in = d.inputs(default_scale<T>(d.shape.key_dim));
  forward(in, nullptr, r.o.data(), nullptr, 1);
  backward(in, nullptr, d_o.data(), nullptr,
           Grads<T>{r.dq.data(), r.dk.data(), r.dv.data(), r.dg.data(), r.dbeta.data(), r.d_incoming0.data()}, 1);
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
    auto ex = make_state_exchange(mesh, method, width);
    ContextParallelLayer<T> layer(*ex, 1);
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

template <class T>
double rel(const std::vector<T>& a, const std::vector<T>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - double(b[i])) * (double(a[i]) - double(b[i]));
    den += double(b[i]) * double(b[i]);
  }
  return std::sqrt(num / den);
}

template <class T>
void expect_close(const LayerResult<T>& got, const LayerResult<T>& want, double tol, const std::string& what) {
  EXPECT_LT(rel(got.o, want.o), tol) << what << " o";
  EXPECT_LT(rel(got.dq, want.dq), tol) << what << " dq";
  EXPECT_LT(rel(got.dk, want.dk), tol) << what << " dk";
  EXPECT_LT(rel(got.dv, want.dv), tol) << what << " dv";
  EXPECT_LT(rel(got.dg, want.dg), tol) << what << " dg";
  EXPECT_LT(rel(got.dbeta, want.dbeta), tol) << what << " dbeta";
  EXPECT_LT(rel(got.d_incoming0, want.d_incoming0), tol) << what << " d_incoming";
}

template <class T>
bool same_bits(const LayerResult<T>& a, const LayerResult<T>& b) {
  auto eq = [](const std::vector<T>& x, const std::vector<T>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(T)) == 0;
  };
  return eq(a.o, b.o) && eq(a.dq, b.dq) && eq(a.dk, b.dk) && eq(a.dv, b.dv) && eq(a.dg, b.dg) &&
         eq(a.dbeta, b.dbeta);
}

struct CpCase {
  std::size_t p, batch, tokens, heads, value_heads, k, v;
};

std::vector<std::pair<std::string, long long>> methods_for(std::size_t p) {
  std::vector<std::pair<std::string, long long>> out{{"p2p", 1}, {"allgather", 1}};
  for (std::size_t w = 2; w < p; ++w)
    if (p % w == 0) out.emplace_back("grouped_allgather_p2p", static_cast<long long>(w));
  return out;
}

template <class T>
void check_case(const CpCase& c, double tol) {
  const Shape s{c.batch, c.tokens, c.heads, c.value_heads, c.k, c.v};
  const auto data = synthetic_layer<T>(s, c.p * 7 + c.tokens);
  const auto d_o = synthetic_tensor<T>(s.v_elems(), c.tokens);
  const auto want = single_rank(data, d_o);
  std::vector<LayerResult<T>> all;
  for (const auto& [method, w] : methods_for(c.p)) {
    std::ostringstream what;
    what << method << " w=" << w << " P=" << c.p;
    all.push_back(context_parallel(data, d_o, c.p, method, w));
    expect_close(all.back(), want, tol, what.str());
    EXPECT_TRUE(same_bits(all.back(), all.front())) << what.str();
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
