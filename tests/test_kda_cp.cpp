// The context-parallel KDA layer equals one device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <sstream>

#include "kdacp/error.hpp"
#include "kdacp/inprocess.hpp"
#include "kdacp/kda_cp.hpp"
#include "kda_cp_runner.hpp"
#include "kda_helpers.hpp"

namespace kdacp::kda {
namespace {

using test::LayerResult;
using test::alloc;
using test::expect_close;
using test::same_bits;
using test::context_parallel;
using test::Method;
using test::methods_for;
using test::single_rank;

struct CpCase {
  std::size_t p, batch, tokens, heads, value_heads, k, v;
};

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
