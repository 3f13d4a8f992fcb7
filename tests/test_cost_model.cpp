// The α-β-γ model: parameters round-trip through JSON, predictions follow the
// formulas' shape, auto's rule respects the budget.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

#include "kdacp/cost_model.hpp"
#include "kdacp/error.hpp"

namespace kdacp {
namespace {

const ProblemShape kLarge{1024, 32, 128, 128, 4};

TEST(CostModel, JsonRoundTripAndRejection) {
  CostParams c;
  c.source = "test";
  c.alpha_s = 3e-6;
  c.beta_s_per_byte = 1 / 370e9;
  c.gflops = 123;
  c.group_alpha_s = 1e-6;
  const CostParams back = cost_params_from_json(to_json(c));
  EXPECT_EQ(back.source, "test");
  EXPECT_DOUBLE_EQ(back.alpha_s, c.alpha_s);
  EXPECT_DOUBLE_EQ(back.beta_s_per_byte, c.beta_s_per_byte);
  EXPECT_DOUBLE_EQ(back.gflops, 123);
  EXPECT_DOUBLE_EQ(back.group_alpha_s, 1e-6);
  EXPECT_THROW(cost_params_from_json("[1,2]"), InvalidArgument);
  EXPECT_THROW(cost_params_from_json("{not json"), InvalidArgument);
  try {
    cost_params_from_json(R"({"alpha_s": -1})");
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("alpha_s"), std::string::npos);
  }
  EXPECT_THROW(cost_params_from_json(R"({"gflops": "fast"})"), InvalidArgument);
  const auto path = std::filesystem::temp_directory_path() / "kdacp_cost_model_test.json";
  save_cost_params(c, path.string());
  EXPECT_DOUBLE_EQ(load_cost_params(path.string()).alpha_s, 3e-6);
  std::filesystem::remove(path);
  EXPECT_THROW(load_cost_params("/nonexistent/kdacp.json"), IoError);
}

TEST(CostModel, PredictionsFollowTheFormulas) {
  const CostParams c;
  ProblemShape s = kLarge;
  // One segment is the chain; the model's c is at least as fast.
  const Prediction chain = predict(c, s, {"p2p", 1, 0});
  EXPECT_DOUBLE_EQ(predict(c, s, {"pipelined_p2p", 1, 1}).seconds, chain.seconds);
  const Prediction piped = predict(c, s, {"pipelined_p2p", 1, 0});
  EXPECT_LE(piped.seconds, chain.seconds);
  EXPECT_GE(piped.config.segments, 1u);
  EXPECT_LE(piped.config.segments, 8u);
  EXPECT_EQ(piped.config.segments, best_segments(c, s, "pipelined_p2p"));
  EXPECT_EQ(best_segments(c, s, "p2p"), 0u);
  // The chain is linear in P, recursive doubling logarithmic.
  s.ranks = 512;
  const double half = predict(c, s, {"p2p", 1, 0}).seconds;
  EXPECT_NEAR(chain.seconds / half, 1023.0 / 511.0, 0.01);
  const Prediction rd = predict(c, kLarge, {"recursive_doubling", 1, 0});
  EXPECT_FALSE(rd.exact);
  EXPECT_LT(rd.seconds * 10, chain.seconds);
  // Memory: allgather holds P packed slots (each with its 64-byte flags), the
  // chain one state.
  const std::size_t state = 32 * 128 * 128 * 4, packed = 32 * 128 * 256 * 4 + 64;
  EXPECT_EQ(predict(c, kLarge, {"allgather", 1, 0}).peak_extra_bytes, 1024 * packed);
  EXPECT_EQ(chain.peak_extra_bytes, state);
  EXPECT_EQ(predict(c, kLarge, {"grouped_allgather_p2p", 8, 0}).peak_extra_bytes,
            8 * packed + 2 * state);
  // P = 1 costs nothing.
  EXPECT_EQ(predict(c, ProblemShape{1, 1, 16, 16, 4}, {"recursive_doubling", 1, 0}).seconds, 0);
  EXPECT_THROW(predict(c, s, {"ring", 1, 0}), InvalidArgument);
  EXPECT_THROW(predict(c, s, {"grouped_allgather_p2p", 3, 0}), InvalidArgument);
  EXPECT_THROW(predict(c, s, {"pipelined_p2p", 1, 9}), InvalidArgument);
}

// Ranks sharing cores: the compute term becomes max(critical path, all
// ranks' folds / concurrent_ranks); 0 (or enough slots) changes nothing.
TEST(CostModel, SharedCoresStretchOnlyWhenRanksOutnumberThem) {
  CostParams c;
  c.gflops = 100;  // CPU-like: compute dominates the small network terms
  const ProblemShape s{8, 16, 128, 128, 4};
  for (const char* m : {"p2p", "allgather", "recursive_doubling"}) {
    const double alone = predict(c, s, {m, 1, 0}).seconds;
    CostParams roomy = c;
    roomy.concurrent_ranks = 8;
    EXPECT_DOUBLE_EQ(predict(roomy, s, {m, 1, 0}).seconds, alone) << m;
    CostParams shared = c;
    shared.concurrent_ranks = 2;
    EXPECT_GE(predict(shared, s, {m, 1, 0}).seconds, alone) << m;
  }
  // allgather: ranks fold 0, 0, 1, ..., P-2 steps; on 2 slots the total work
  // (21 steps) beats the last rank's 6 steps on the critical path.
  CostParams shared = c;
  shared.concurrent_ranks = 2;
  EXPECT_GT(predict(shared, s, {"allgather", 1, 0}).seconds,
            predict(c, s, {"allgather", 1, 0}).seconds * 1.5);
  const CostParams back = cost_params_from_json(to_json(shared));
  EXPECT_EQ(back.concurrent_ranks, 2u);
  EXPECT_THROW(cost_params_from_json(R"({"concurrent_ranks": -1})"), InvalidArgument);
  EXPECT_THROW(cost_params_from_json(R"({"concurrent_ranks": 1.5})"), InvalidArgument);
}

TEST(CostModel, ChoiceRespectsBudgetAndReassociationFlag) {
  const CostParams c;
  const auto all = predict_all(c, kLarge, true);
  EXPECT_EQ(all.size(), 3 + 9 + 1 + 9u);  // 9 proper divisors of 1024
  const Prediction exact = choose_protocol(c, kLarge, 0, false);
  EXPECT_TRUE(exact.exact);
  const Prediction any = choose_protocol(c, kLarge, 0, true);
  EXPECT_LE(any.seconds, exact.seconds);
  for (const Prediction& p : predict_all(c, kLarge, false)) EXPECT_GE(p.seconds, exact.seconds);
  const std::size_t budget = 4 * 32 * 128 * 128 * 4;
  const Prediction tight = choose_protocol(c, kLarge, budget, true);
  EXPECT_LE(tight.peak_extra_bytes, budget);
  EXPECT_THROW(choose_protocol(c, kLarge, 16, false), InvalidArgument);
}

}  // namespace
}  // namespace kdacp
