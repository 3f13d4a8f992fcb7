// allow_neg_eigval (flash-linear-attention's flag, beta in [0, 2]): the
// sigmoid transform scaled by 2, forward and reverse, and the flag as part of
// the layer's agreed input transforms. (The chunk and recurrent algorithms
// against the FP64 recurrence, over CP and in the deterministic mode, are
// tests/python/test_neg_eigval.py's.)
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "kdacp/error.hpp"
#include "kdacp/inprocess.hpp"
#include "kdacp/kda.hpp"
#include "kdacp/layer.hpp"

namespace kdacp {
namespace {

template <class T>
void sigmoid_is_scaled_by_two() {
  const std::vector<T> x{T(-800), T(-30), T(-1), T(0), T(0.5), T(30), T(800)};
  const std::vector<T> dy{T(1), T(-2), T(0.5), T(1), T(3), T(-1), T(1)};
  const std::size_t n = x.size();
  std::vector<T> plain(n), wide(n), d_plain(n), d_wide(n);
  kda::sigmoid_forward(x.data(), n, plain.data());
  kda::sigmoid_forward(x.data(), n, wide.data(), true);
  kda::sigmoid_backward(x.data(), dy.data(), n, d_plain.data());
  kda::sigmoid_backward(x.data(), dy.data(), n, d_wide.data(), true);
  for (std::size_t i = 0; i < n; ++i) {
    EXPECT_EQ(wide[i], 2 * plain[i]) << i;  // x2 is exact
    EXPECT_EQ(d_wide[i], 2 * d_plain[i]) << i;
    const double s = 1 / (1 + std::exp(-static_cast<double>(x[i])));
    EXPECT_NEAR(static_cast<double>(wide[i]), 2 * s, 4 * std::numeric_limits<T>::epsilon());
    EXPECT_NEAR(static_cast<double>(d_wide[i]), 2 * s * (1 - s) * static_cast<double>(dy[i]),
                8 * std::numeric_limits<T>::epsilon());
  }
  EXPECT_EQ(wide.front(), T(0));
  EXPECT_EQ(wide.back(), T(2));
  EXPECT_EQ(wide[3], T(1));
  EXPECT_EQ(d_wide[3], T(0.5));
}

TEST(NegEigval, SigmoidIsScaledByTwoFloat) { sigmoid_is_scaled_by_two<float>(); }
TEST(NegEigval, SigmoidIsScaledByTwoDouble) { sigmoid_is_scaled_by_two<double>(); }

// A rank that admits beta in [0, 2] while another does not is named before
// any message, as for every in-kernel transform.
TEST(NegEigval, TheFlagIsAgreedWithTheTransforms) {
  const kda::Shape s{1, 16, 2, 2, 8, 8};
  std::atomic<std::size_t> thrown{0};
  InProcessOptions opts;
  opts.timeout = std::chrono::milliseconds(20000);
  run_in_process(
      2,
      [&](const std::shared_ptr<Communicator>& comm) {
        LayerConfig c;
        c.shape = s;
        c.transforms.beta_sigmoid = true;
        c.transforms.allow_neg_eigval = comm->rank() == 0;
        try {
          make_layer<double>(comm, c);
          ADD_FAILURE() << "rank " << comm->rank() << " returned";
        } catch (const InvalidArgument& e) {
          ++thrown;
          EXPECT_NE(std::string(e.what()).find("in-kernel transforms: rank 0 has sig,neg, rank 1 has sig"),
                    std::string::npos)
              << e.what();
        }
      },
      opts);
  EXPECT_EQ(thrown.load(), 2u);
  // Agreed, it builds (and a layer without the sigmoid may admit beta in [0, 2] too).
  run_in_process(2, [&](const std::shared_ptr<Communicator>& comm) {
    LayerConfig c;
    c.shape = s;
    c.transforms.allow_neg_eigval = true;
    EXPECT_NO_THROW(make_layer<double>(comm, c));
  }, opts);
}

}  // namespace
}  // namespace kdacp
