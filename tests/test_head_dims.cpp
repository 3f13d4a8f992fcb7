// Every head size in [1, 256] through every protocol of the registry: odd K
// and V (1, 8, 24, 100, and K != V) give the serial fold's bits on every
// exact row, reassociating rows stay within their bound, pipelined_p2p's
// segments cover V in units of 16 with the remainder in the last, and the
// cost model's memory still bounds what each rank held.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "helpers.hpp"
#include "protocol_run.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/protocol.hpp"

namespace kdacp {
namespace {

using test::World;

class HeadDims : public ::testing::TestWithParam<std::pair<std::size_t, std::size_t>> {};

TEST_P(HeadDims, EveryProtocolGivesTheSerialFoldsBits) {
  const auto [k, v] = GetParam();
  const SummaryShape shape{1, 2, k, v};
  for (const std::size_t p : {std::size_t{2}, std::size_t{3}, std::size_t{5}}) {
    World w(p, shape, 4000 + 17 * k + v + p);
    std::vector<char> cuts(p, 0);
    for (const bool cut : {false, true}) {
      if (cut) cuts[p / 2] = 1;
      const std::vector<State> fold_f = test::serial_fold(w, cuts, Direction::forward);
      const std::vector<State> fold_b = test::serial_fold(w, cuts, Direction::backward);
      const auto ref_f = test::fp64_chain(w, cuts, Direction::forward);
      const auto ref_b = test::fp64_chain(w, cuts, Direction::backward);
      std::size_t configs = 0;
      for (const ProtocolDescriptor* row : protocol_registry()) {
        for (const ProtocolConfig& config : valid_configs(*row, p, v)) {
          ++configs;
          SCOPED_TRACE(protocol_label(config) + " P=" + std::to_string(p) + " K=" + std::to_string(k) +
                       " V=" + std::to_string(v) + (cut ? " cut" : ""));
          const test::ConfigRun res = test::run_config(w, config, cuts);
          const ProtocolDescriptor& built = find_protocol(res.method);
          for (std::size_t r = 0; r < p; ++r) {
            if (built.exact()) {
              EXPECT_TRUE(test::bitwise_equal(res.fwd[r], fold_f[r])) << "rank " << r;
              EXPECT_TRUE(test::bitwise_equal(res.bwd[r], fold_b[r])) << "rank " << r;
            } else {
              const double bound = error_bound(built, p, k);
              EXPECT_LE(reference::compare(res.fwd[r].data(), ref_f[r]).rel_fro, bound) << "rank " << r;
              EXPECT_LE(reference::compare(res.bwd[r].data(), ref_b[r]).rel_fro, bound) << "rank " << r;
            }
          }
          const ProblemShape ps{p, shape.slabs(), k, v, sizeof(float)};
          EXPECT_LE(res.peak(), predict(CostParams{}, ps, config).peak_extra_bytes);
        }
      }
      EXPECT_GT(configs, 0u);
    }
  }
}

using Dims = std::pair<std::size_t, std::size_t>;  // K, V
INSTANTIATE_TEST_SUITE_P(Odd, HeadDims,
                         ::testing::Values(Dims{1, 1}, Dims{8, 8}, Dims{24, 24}, Dims{100, 100}, Dims{16, 8},
                                           Dims{8, 40}, Dims{1, 256}),
                         [](const auto& info) {
                           return "K" + std::to_string(info.param.first) + "V" + std::to_string(info.param.second);
                         });

// pipelined_p2p's segment counts: ceil(V/16), the remainder its own unit;
// more is refused in the user's terms, before any message.
TEST(HeadDims, SegmentsAreWholeUnitsWithTheRemainderLast) {
  EXPECT_EQ(max_segments(1), 1u);
  EXPECT_EQ(max_segments(8), 1u);
  EXPECT_EQ(max_segments(16), 1u);
  EXPECT_EQ(max_segments(24), 2u);
  EXPECT_EQ(max_segments(100), 7u);
  EXPECT_EQ(max_segments(256), 16u);
  const ProblemShape ps{4, 2, 16, 24, sizeof(float)};
  EXPECT_NO_THROW(predict(CostParams{}, ps, ProtocolConfig{"pipelined_p2p", 1, 2}));
  try {
    predict(CostParams{}, ps, ProtocolConfig{"pipelined_p2p", 1, 3});
    ADD_FAILURE() << "3 segments of V = 24 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("expected at most ceil(V/16) = 2"), std::string::npos) << e.what();
  }
  // A summary outside [1, 256] is named with the rule.
  State s(1, 1, 257, 4), m(1, 1, 257, 257);
  try {
    validate_summary(s.view(), m.view(), "S", 0);
    ADD_FAILURE() << "K = 257 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("key dim K (rows) is 257, expected an integer in [1, 256]"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace kdacp
