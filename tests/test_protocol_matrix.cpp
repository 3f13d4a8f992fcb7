// The protocol matrix, generated from the registry (protocol.hpp): every row ×
// P × every valid group size × every valid segment count × cut patterns
// (SPEC §10: parts that contain a sequence start). Exact rows must give the
// chain-with-cuts bits, which are the serial fold's bits; reassociating rows
// must stay within their documented bound of the FP64 chain with cuts; every
// row's measured peak memory must stay within its cost model's. A protocol
// added to the registry is tested here without a line of this file changing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "helpers.hpp"
#include "protocol_run.hpp"
#include "kdacp/protocol.hpp"

namespace kdacp {
namespace {

using test::World;

using test::ConfigRun;
using test::run_config;

// Cut patterns for P positions: none, every one, the first, the last, every
// third, and a fixed pseudo-random one.
std::vector<std::vector<char>> cut_patterns(std::size_t p) {
  std::vector<std::vector<char>> out(6, std::vector<char>(p, 0));
  for (std::size_t r = 0; r < p; ++r) {
    out[1][r] = 1;
    out[4][r] = r % 3 == 1;
    out[5][r] = ((r * 2654435761u) >> 7) % 4 == 0;
  }
  out[2][0] = 1;
  out[3][p - 1] = 1;
  return out;
}

std::string pattern_name(const std::vector<char>& cuts) {
  std::string out = "cuts ";
  for (char c : cuts) out += c ? '1' : '0';
  return out;
}

class ProtocolMatrix : public ::testing::TestWithParam<std::size_t> {};

TEST_P(ProtocolMatrix, EveryConfigurationMatchesTheChainOrStaysWithinItsBound) {
  const std::size_t p = GetParam();
  const SummaryShape shape{1, 2, 16, 32};  // K != V, B·H > 1, two column segments
  World w(p, shape, 9000 + p);
  const ProblemShape ps{p, shape.slabs(), shape.key_dim, shape.value_dim, sizeof(float)};
  std::size_t configs = 0;
  for (const std::vector<char>& cuts : cut_patterns(p)) {
  SCOPED_TRACE(pattern_name(cuts));
  const std::vector<State> fold_f = test::serial_fold(w, cuts, Direction::forward);
  const std::vector<State> fold_b = test::serial_fold(w, cuts, Direction::backward);
  const auto ref_f = test::fp64_chain(w, cuts, Direction::forward);
  const auto ref_b = test::fp64_chain(w, cuts, Direction::backward);
  for (const ProtocolDescriptor* row : protocol_registry()) {
    for (const ProtocolConfig& config : valid_configs(*row, p, shape.value_dim)) {
      ++configs;
      SCOPED_TRACE(protocol_label(config) + " P=" + std::to_string(p));
      const ConfigRun res = run_config(w, config, cuts);
      const ProtocolDescriptor& built = find_protocol(res.method);
      EXPECT_EQ(res.exact, built.exact());
      // Only the degenerate widths (1 and P) may build another row.
      if (res.method != row->name) {
        EXPECT_TRUE(row->takes_group_size && (config.group_size == 1 || config.group_size == p))
            << "built " << res.method;
      }
      const double bound = error_bound(built, p, shape.key_dim);
      for (std::size_t r = 0; r < p; ++r) {
        SCOPED_TRACE("rank " + std::to_string(r));
        if (built.exact()) {
          EXPECT_TRUE(test::bitwise_equal(res.fwd[r], fold_f[r]));
          EXPECT_TRUE(test::bitwise_equal(res.bwd[r], fold_b[r]));
        } else {
          EXPECT_GT(bound, 0);
          EXPECT_LE(reference::compare(res.fwd[r].data(), ref_f[r]).rel_fro, bound);
          EXPECT_LE(reference::compare(res.bwd[r].data(), ref_b[r]).rel_fro, bound);
          // Position 1 receives S_0 (and P-2 receives G_{P-1}) exactly, in every protocol.
          if (r == 1) {
            EXPECT_TRUE(test::bitwise_equal(res.fwd[r], fold_f[r]));
          }
          if (r + 2 == p) {
            EXPECT_TRUE(test::bitwise_equal(res.bwd[r], fold_b[r]));
          }
        }
      }
      // Memory: the row's model bounds what any rank held; for the row itself
      // (not a degenerate width) it is also tight within one state.
      const std::size_t peak = res.peak();
      // The model sees the cuts (they shorten its time, never its memory).
      ProblemShape with_cuts = ps;
      with_cuts.part_cuts.assign(cuts.begin(), cuts.end());
      const Prediction pred = predict(CostParams{}, with_cuts, config);
      EXPECT_EQ(pred.peak_extra_bytes, predict(CostParams{}, ps, config).peak_extra_bytes);
      EXPECT_LE(pred.seconds, predict(CostParams{}, ps, config).seconds);
      EXPECT_LE(peak, pred.peak_extra_bytes);
      // Cuts only shorten scans, so the bound is tight without them.
      if (res.method == row->name && std::count(cuts.begin(), cuts.end(), 1) == 0) {
        EXPECT_GE(peak + shape.state_elems() * sizeof(float), pred.peak_extra_bytes);
      }
    }
  }
  }
  EXPECT_GT(configs, 0u);
}

#if defined(KDACP_SANITIZER_BUILD)
// Sanitizer builds stop at P = 16: P = 64 runs the same code on more ranks
// (31 s under ASan, 22 s under TSan); the release suite keeps it.
INSTANTIATE_TEST_SUITE_P(Registry, ProtocolMatrix, ::testing::Values(1, 2, 3, 4, 5, 7, 8, 16),
                         [](const auto& info) { return "P" + std::to_string(info.param); });
#else
INSTANTIATE_TEST_SUITE_P(Registry, ProtocolMatrix,
                         ::testing::Values(1, 2, 3, 4, 5, 7, 8, 16, 64),
                         [](const auto& info) { return "P" + std::to_string(info.param); });
#endif

// The registry itself: names unique, knobs and classes consistent, and every
// row reachable through the factory's and the model's public names.
TEST(Registry, RowsAreConsistent) {
  std::vector<std::string> names;
  std::size_t choosers = 0;
  for (const ProtocolDescriptor* row : protocol_registry()) {
    names.emplace_back(row->name);
    EXPECT_EQ(&find_protocol(row->name), row);
    EXPECT_NE(row->build, nullptr) << row->name;
    EXPECT_FALSE(row->memory.empty()) << row->name;
    EXPECT_FALSE(row->use_when.empty()) << row->name;
    if (row->chooser()) {
      ++choosers;
      EXPECT_EQ(row->cost, nullptr);
      EXPECT_TRUE(valid_configs(*row, 4, 32).empty());
      continue;
    }
    EXPECT_NE(row->cost, nullptr) << row->name;
    EXPECT_EQ(row->exact(), row->error_bound == nullptr) << row->name;
    EXPECT_EQ(row->exact(), row->error_bound_text.empty()) << row->name;
    EXPECT_EQ(error_bound(*row, 64, 128) > 0, !row->exact()) << row->name;
  }
  EXPECT_EQ(choosers, 1u);
  EXPECT_EQ(names, exchange_methods());
  std::vector<std::string> sorted = names;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(std::adjacent_find(sorted.begin(), sorted.end()), sorted.end());
  EXPECT_NO_THROW(find_protocol(kBaselineProtocol));
  EXPECT_THROW(find_protocol("ring"), InvalidArgument);
  EXPECT_EQ(protocol_label({"a", 4, 0}), "a w=4");
  EXPECT_EQ(protocol_label({"b", 1, 8}), "b c=8");
  EXPECT_EQ(protocol_label({"c", 1, 0}), "c");
}

}  // namespace
}  // namespace kdacp
