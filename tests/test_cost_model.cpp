// The α-β-γ model: parameters round-trip through JSON, predictions follow the
// formulas' shape, auto's rule respects the budget.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

#include "kdacp/cost_model.hpp"
#include "kdacp/error.hpp"
#include "kdacp/protocol.hpp"

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


// Documents of mean length T/(2P) over P ranks: every other part a cut.
std::vector<bool> every_other(std::size_t n) {
  std::vector<bool> cuts(n, false);
  for (std::size_t j = 1; j < n; j += 2) cuts[j] = true;
  return cuts;
}

TEST(CostModel, ChainProfileReadsTheLayoutAndCuts) {
  ProblemShape s{8, 4, 64, 64, 4};
  ChainProfile plain = chain_profile(s, 1);
  EXPECT_EQ(plain.parts, 8u);
  EXPECT_EQ(plain.steps, 7u);
  EXPECT_EQ(plain.relays, 7u);
  EXPECT_EQ(plain.runs, 8u);
  s.part_owners = PartOwners::zigzag(8);
  EXPECT_EQ(s.part_owners->size(), 16u);
  EXPECT_EQ((*s.part_owners)[8], 7u);
  const ChainProfile zig = chain_profile(s, 1);
  EXPECT_EQ(zig.parts, 16u);
  EXPECT_EQ(zig.per_rank, 2u);
  EXPECT_EQ(zig.steps, 15u);
  EXPECT_EQ(zig.relays, 14u);  // parts 7 and 8 are both on rank 7
  EXPECT_EQ(zig.runs, 15u);
  EXPECT_EQ(zig.longest_run, 2u);
  const ChainProfile blocks = chain_profile(s, 4);  // ranks 0-3 and 4-7
  EXPECT_EQ(blocks.runs, 3u);
  EXPECT_EQ(blocks.runs_per_block, 2u);
  EXPECT_EQ(blocks.relays, 2u);
  EXPECT_EQ(blocks.longest_run, 8u);
  // The longest stretch between cuts: cuts at 5 and 12 leave 0-5, 5-12, 12-15.
  s.part_cuts.assign(16, false);
  s.part_cuts[5] = s.part_cuts[12] = true;
  EXPECT_EQ(chain_profile(s, 1).steps, 7u);
  s.part_cuts = every_other(16);
  EXPECT_EQ(chain_profile(s, 1).steps, 2u);
  s.part_cuts.assign(3, false);
  EXPECT_THROW(chain_profile(s, 1), InvalidArgument);
  s.part_cuts.clear();
  EXPECT_THROW(PartOwners(8, {0, 1, 2}), InvalidArgument);  // ranks 3..7 hold nothing
  EXPECT_THROW(PartOwners(8, {0, 1, 2, 3, 4, 5, 6, 9}), InvalidArgument);
  s.part_owners = PartOwners::one_per_rank(3);  // owners over another P
  EXPECT_THROW(chain_profile(s, 1), InvalidArgument);
}

// Cuts shorten what waits along the chain and what a gather folds; the
// doubling scan's rounds do not depend on them.
TEST(CostModel, CutsShortenTheChainsAndTheGathersFolds) {
  const CostParams c;
  for (std::size_t p : {8u, 64u}) {
    ProblemShape plain{p, 32, 128, 128, 4};
    ProblemShape cut = plain;
    cut.part_cuts = every_other(p);
    for (const ProtocolDescriptor* row : protocol_registry()) {
      for (const ProtocolConfig& config : valid_configs(*row, p, 128)) {
        if (config.segments > 1 && config.segments != 8) continue;
        SCOPED_TRACE(protocol_label(config) + " P=" + std::to_string(p));
        const Prediction a = predict(c, plain, config), b = predict(c, cut, config);
        // The plain call's buffers do not depend on the cuts.
        EXPECT_EQ(a.peak_extra_bytes, b.peak_extra_bytes);
        if (!row->exact()) {
          EXPECT_EQ(a.seconds, b.seconds);
        } else {
          // The chains wait along fewer steps, the gathers fold fewer slots;
          // the grouped rows keep their gathers.
          EXPECT_LT(b.seconds, a.seconds);
        }
      }
    }
    // The chain's critical path is the longest run between cuts: P-1 steps
    // cost (P-1)/2 times what 2 steps cost, to within the first fold.
    const Prediction chain = predict(c, plain, {"p2p", 1, 0});
    const Prediction two = predict(c, cut, {"p2p", 1, 0});
    EXPECT_NEAR(chain.seconds / two.seconds, (p - 1) / 2.0, (p - 1) / 2.0 * 0.5);
  }
}

// Zigzag doubles the parts: the chains wait along about twice as many steps,
// the allgather moves twice the slots in the same number of messages, and
// its memory is priced at two slots per rank.
TEST(CostModel, ZigzagIsPriced) {
  const CostParams c;
  const std::size_t p = 64;
  ProblemShape contiguous{p, 32, 128, 128, 4};
  contiguous.part_owners = PartOwners::one_per_rank(p);
  ProblemShape zig = contiguous;
  zig.part_owners = PartOwners::zigzag(p);
  for (const ProtocolDescriptor* row : protocol_registry()) {
    for (const ProtocolConfig& config : valid_configs(*row, p, 128)) {
      if (config.segments > 1 && config.segments != 8) continue;
      SCOPED_TRACE(protocol_label(config));
      EXPECT_GT(predict(c, zig, config).seconds, predict(c, contiguous, config).seconds);
      EXPECT_GE(predict(c, zig, config).peak_extra_bytes, predict(c, contiguous, config).peak_extra_bytes);
    }
  }
  const double p2p = predict(c, zig, {"p2p", 1, 0}).seconds / predict(c, contiguous, {"p2p", 1, 0}).seconds;
  EXPECT_GT(p2p, 1.8);
  EXPECT_LT(p2p, 2.1);
  EXPECT_GT(static_cast<double>(predict(c, zig, {"allgather", 1, 0}).peak_extra_bytes),
            1.9 * static_cast<double>(predict(c, contiguous, {"allgather", 1, 0}).peak_extra_bytes));
  // auto with a layout weighs the layout's costs.
  const Prediction pick = choose_protocol(c, zig, 0, false, true);
  EXPECT_TRUE(find_protocol(pick.config.method).takes_layouts);
  EXPECT_DOUBLE_EQ(pick.seconds, predict(c, zig, pick.config).seconds);
}

}  // namespace
}  // namespace kdacp
