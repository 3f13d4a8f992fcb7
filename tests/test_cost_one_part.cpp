// One part per rank is a layout like any other (exchange.cpp makes the owners
// explicit, and every protocol runs the same code for it): a plain call and a
// call with PartOwners::one_per_rank run alike, and the cost model prices a
// plain shape and its one-part-per-rank layout alike, every term, every row,
// knob, P, machine and cut pattern. The terms the rows share with layouts are
// pinned here where they are what the code does for one part per rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "helpers.hpp"
#include "protocol_run.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/layout.hpp"
#include "kdacp/protocol.hpp"

namespace kdacp {
namespace {

// Cut patterns over P parts: none, every other, one in the middle, a fixed
// pseudo-random one.
std::vector<std::vector<bool>> one_part_cuts(std::size_t p) {
  std::vector<std::vector<bool>> out(4, std::vector<bool>(p, false));
  for (std::size_t r = 0; r < p; ++r) {
    out[1][r] = r % 2 == 1;
    out[3][r] = ((r * 2654435761u) >> 7) % 3 == 0;
  }
  out[2][p / 2] = true;
  return out;
}

// Machines: no nodes; nodes of 4; nodes of 4 in leaves of 8 at 4:1; nodes of
// 8 in leaves of 16 at 2:1 (nodes that do not divide P count as unknown).
std::vector<CostParams> one_part_machines() {
  std::vector<CostParams> out(4);
  for (CostParams& c : out) {
    c.group_alpha_s = 3e-6;
    c.group_beta_s_per_byte = 1 / 370e9;
  }
  out[1].node_ranks = 4;
  out[2].node_ranks = 4, out[2].leaf_ranks = 8, out[2].oversubscription = 4;
  out[3].node_ranks = 8, out[3].leaf_ranks = 16, out[3].oversubscription = 2;
  return out;
}

void expect_same_terms(const CostTerms& a, const CostTerms& b) {
  EXPECT_EQ(a.messages, b.messages);
  EXPECT_EQ(a.bytes, b.bytes);
  EXPECT_EQ(a.group_messages, b.group_messages);
  EXPECT_EQ(a.group_bytes, b.group_bytes);
  EXPECT_EQ(a.contention_bytes, b.contention_bytes);
  EXPECT_EQ(a.folds, b.folds);
  EXPECT_EQ(a.products, b.products);
  EXPECT_EQ(a.work_folds, b.work_folds);
  EXPECT_EQ(a.work_products, b.work_products);
  EXPECT_EQ(a.peak_extra_bytes, b.peak_extra_bytes);
}

// The model prices one CostTerms per configuration, for a forward and a
// backward alike; the profile it reads counts both directions.
TEST(CostOnePart, APlainShapeIsPricedAsItsOnePartPerRankLayout) {
  std::size_t compared = 0;
  for (std::size_t p : {1u, 2u, 3u, 4u, 5u, 6u, 8u, 12u, 16u, 48u, 64u, 256u}) {
    for (const CostParams& machine : one_part_machines()) {
      for (const std::vector<bool>& cuts : one_part_cuts(p)) {
        ProblemShape plain{p, 4, 32, 64, 4};
        plain.part_cuts = cuts;
        plain.ranks_per_node = machine.node_ranks;
        plain.ranks_per_leaf = machine.leaf_ranks;
        plain.leaf_oversubscription = machine.oversubscription;
        ProblemShape laid = plain;
        laid.part_owners = PartOwners::one_per_rank(p);
        EXPECT_FALSE(needs_layout_rows(laid));
        const std::string where = "P=" + std::to_string(p) + " node=" + std::to_string(machine.node_ranks) +
                                  " leaf=" + std::to_string(machine.leaf_ranks) +
                                  " cuts=" + std::to_string(std::count(cuts.begin(), cuts.end(), true));
        for (const ProtocolDescriptor* row : protocol_registry()) {
          if (row->chooser()) continue;
          EXPECT_EQ(error_bound(*row, plain), error_bound(*row, laid)) << where;
          for (const ProtocolConfig& config : valid_configs(*row, p, plain.value_dim)) {
            SCOPED_TRACE(protocol_label(config) + " " + where);
            expect_same_terms(row->cost(plain, config), row->cost(laid, config));
            ++compared;
          }
        }
        // What auto and plan read: the same predictions, the same choice.
        const auto a = predict_all(machine, plain, true), b = predict_all(machine, laid, true);
        ASSERT_EQ(a.size(), b.size());
        for (std::size_t i = 0; i < a.size(); ++i) {
          EXPECT_EQ(protocol_label(a[i].config), protocol_label(b[i].config)) << where;
          EXPECT_EQ(a[i].seconds, b[i].seconds) << where << " " << protocol_label(a[i].config);
          EXPECT_EQ(a[i].peak_extra_bytes, b[i].peak_extra_bytes) << where << " " << protocol_label(a[i].config);
        }
        for (bool any : {false, true}) {
          const Prediction x = choose_protocol(machine, plain, 0, any, needs_layout_rows(plain));
          const Prediction y = choose_protocol(machine, laid, 0, any, needs_layout_rows(laid));
          EXPECT_EQ(protocol_label(x.config), protocol_label(y.config)) << where;
        }
      }
    }
  }
  EXPECT_GT(compared, 1000u);
}

// The same execution: a call without owners and one with one part per rank
// give the same bits and the same traffic and memory on every rank, forward
// and backward. Its price is what it holds: exactly, for the rows whose
// buffers the model counts one by one; within one state for pipelined_p2p
// c = 1 (priced for c >= 2: it receives into the result) and
// grouped_allgather_rd (the scan's result state is priced beside its pairs).
TEST(CostOnePart, OnePartPerRankRunsThePlainCallAndHoldsWhatItIsPriced) {
  const SummaryShape shape{1, 2, 16, 32};
  const std::size_t state = shape.state_elems() * sizeof(float);
  for (std::size_t p : {1u, 2u, 3u, 4u, 5u, 8u}) {
    const test::World w(p, shape, 4400 + p);
    const ProblemShape ps{p, shape.slabs(), shape.key_dim, shape.value_dim, sizeof(float)};
    std::vector<char> none(p, 0), some(p, 0);
    for (std::size_t r = 1; r < p; r += 2) some[r] = 1;
    for (const ProtocolDescriptor* row : protocol_registry()) {
      for (const ProtocolConfig& config : valid_configs(*row, p, shape.value_dim)) {
        SCOPED_TRACE(protocol_label(config) + " P=" + std::to_string(p));
        for (const std::vector<char>* cuts : {&none, &some}) {
          const test::ConfigRun plain = test::run_config(w, config, *cuts, false);
          const test::ConfigRun laid = test::run_config(w, config, *cuts, true);
          EXPECT_EQ(plain.method, laid.method);
          std::size_t peak = 0;
          for (std::size_t r = 0; r < p; ++r) {
            EXPECT_TRUE(test::bitwise_equal(plain.fwd[r], laid.fwd[r])) << "rank " << r;
            EXPECT_TRUE(test::bitwise_equal(plain.bwd[r], laid.bwd[r])) << "rank " << r;
            for (const auto& [a, b] : {std::pair{plain.fwd_stats[r], laid.fwd_stats[r]},
                                       std::pair{plain.bwd_stats[r], laid.bwd_stats[r]}}) {
              EXPECT_EQ(a.bytes_sent, b.bytes_sent) << "rank " << r;
              EXPECT_EQ(a.bytes_received, b.bytes_received) << "rank " << r;
              EXPECT_EQ(a.peak_extra_bytes, b.peak_extra_bytes) << "rank " << r;
              peak = std::max(peak, std::size_t{a.peak_extra_bytes});
            }
          }
          if (cuts != &none) continue;  // cuts never add buffers; priced without them
          const std::size_t priced = predict(CostParams{}, ps, config).peak_extra_bytes;
          const bool loose = (config.method == "pipelined_p2p" && config.segments == 1) ||
                             (plain.method == "grouped_allgather_rd");
          if (loose) {
            EXPECT_LE(peak, priced);
            EXPECT_LE(priced, peak + state);
          } else {
            EXPECT_EQ(peak, priced);
          }
        }
      }
    }
  }
}

const ProblemShape kOnePart{64, 32, 128, 128, 4};
constexpr double kOneState = 32.0 * 128 * 128 * 4, kOnePacked = 32.0 * 128 * 256 * 4 + 64;

ProblemShape one_part_shape(std::size_t p) {
  ProblemShape s = kOnePart;
  s.ranks = p;
  return s;
}

CostTerms one_part_terms(const std::string& method, const ProblemShape& s, std::size_t w = 1) {
  return find_protocol(method).cost(s, {method, w, 0});
}

// The scan composes a position's outgoing pair before it sends and its
// prefix after it receives (rd_exclusive_scan_parts): two compositions a
// round on the critical path, the last round one fold on each side. Where
// the last round's only sender is position 0, which holds no prefix and
// sends its own pair, that round folds once.
TEST(CostOnePart, TheScanComposesBeforeItSendsAndAfterItReceives) {
  const auto folds = [](std::size_t p) { return one_part_terms("recursive_doubling", one_part_shape(p)).folds; };
  const auto products = [](std::size_t p) {
    return one_part_terms("recursive_doubling", one_part_shape(p)).products;
  };
  EXPECT_EQ(folds(2), 0);  // one round: position 0's pair as it is
  EXPECT_EQ(folds(3), 1);
  EXPECT_EQ(folds(4), 2);
  EXPECT_EQ(products(4), 0);
  EXPECT_EQ(folds(5), 2 + 1);
  EXPECT_EQ(products(5), 2);
  EXPECT_EQ(folds(8), 2 + 2);
  EXPECT_EQ(folds(64), 2 * 4 + 2);  // rounds 1-4 two compositions each, the last two folds
  EXPECT_EQ(products(64), 2 * 4);
  // Nothing is packed and the scan's states are the results: three pairs.
  EXPECT_EQ(one_part_terms("recursive_doubling", one_part_shape(64)).peak_extra_bytes, 3 * kOnePacked);
  EXPECT_EQ(one_part_terms("recursive_doubling", one_part_shape(2)).peak_extra_bytes, 2 * kOnePacked);
}

// A carrier holds the state it receives and the one it sends: two in a
// middle block, one when there are two blocks.
TEST(CostOnePart, ACarrierHoldsTheStatesItRelays) {
  EXPECT_EQ(one_part_terms("grouped_allgather_p2p", one_part_shape(8), 4).peak_extra_bytes,
            4 * kOnePacked + kOneState);
  EXPECT_EQ(one_part_terms("grouped_allgather_p2p", one_part_shape(12), 4).peak_extra_bytes,
            4 * kOnePacked + 2 * kOneState);
  EXPECT_EQ(chain_profile(one_part_shape(8), 4).relay_states, 1u);
  // The chain's buffers: p2p sends one state from a middle rank, none at
  // P = 2 (the first rank sends its offset); the pipeline a receive and a
  // send buffer, one at the ends.
  EXPECT_EQ(chain_profile(one_part_shape(2), 1).chain_sends, 0u);
  EXPECT_EQ(chain_profile(one_part_shape(3), 1).chain_sends, 1u);
  EXPECT_EQ(chain_profile(one_part_shape(2), 1).stream_buffers, 1u);
  EXPECT_EQ(chain_profile(one_part_shape(3), 1).stream_buffers, 2u);
  EXPECT_FALSE(chain_profile(one_part_shape(3), 1).split_folds);
  // Zigzag at P = 2 (parts 0 1 2 3 on ranks 0 1 1 0): rank 1 hands part 1's
  // state to part 2 and sends part 2's; it receives into parts 1 and 2 and
  // sends from part 2. allgather's slots hold the parts rank by rank
  // (0 3 | 1 2): rank 0 folds part 3 from part 0 over slots 0, 2, 3, two
  // stretches, so with a temporary.
  ProblemShape zig = one_part_shape(2);
  zig.part_owners = PartOwners::zigzag(2);
  const ChainProfile z = chain_profile(zig, 1);
  EXPECT_EQ(z.chain_sends, 2u);
  EXPECT_EQ(z.stream_buffers, 3u);
  EXPECT_TRUE(z.split_folds);
  // Two consecutive parts per rank: the slots are the chain's order.
  ProblemShape pairs = one_part_shape(2);
  pairs.part_owners = PartOwners(2, {0, 0, 1, 1});
  EXPECT_FALSE(chain_profile(pairs, 1).split_folds);
}

// The degenerate widths build p2p and allgather (recursive_doubling for the
// doubling row at width 1) and are priced as them.
TEST(CostOnePart, DegenerateWidthsArePricedAsWhatTheyBuild) {
  for (std::size_t p : {4u, 8u}) {
    const ProblemShape s = one_part_shape(p);
    expect_same_terms(one_part_terms("grouped_allgather_p2p", s, 1), one_part_terms("p2p", s));
    expect_same_terms(one_part_terms("grouped_allgather_p2p", s, p), one_part_terms("allgather", s));
    expect_same_terms(one_part_terms("grouped_allgather_rd", s, 1), one_part_terms("recursive_doubling", s));
    expect_same_terms(one_part_terms("grouped_allgather_rd", s, p), one_part_terms("allgather", s));
  }
}

// Leaves of 32 ranks at 4:1 on nodes of 4: the scan's round at distance d
// sends d of a leaf's ranks across, which the uplinks (8 ranks' worth) carry
// at full speed up to d = 8; at d = 16 at half speed (one pair's bytes
// more), at d = 32 (the last round, states) at a quarter.
TEST(CostOnePart, AScanRoundCrossesLeavesWithItsSenders) {
  ProblemShape s = one_part_shape(64);
  s.ranks_per_node = 4;
  s.ranks_per_leaf = 32;
  s.leaf_oversubscription = 4;
  EXPECT_DOUBLE_EQ(one_part_terms("recursive_doubling", s).contention_bytes, kOnePacked + 3 * kOneState);
}

// A block's relay goes from carrier to carrier (their blocks' last ranks):
// P = 48 on nodes of 8 in blocks of 6, carriers 5 11 17 23 29 35 41 47 on
// nodes 0 1 2 2 3 4 5 5: 5 of the 7 relays cross.
TEST(CostOnePart, RelaysCrossNodesBetweenCarriers) {
  ProblemShape s = one_part_shape(48);
  s.ranks_per_node = 8;
  EXPECT_EQ(chain_profile(s, 6).node_relays, 5u);
  EXPECT_DOUBLE_EQ(one_part_terms("grouped_allgather_p2p", s, 6).messages, 5);
  s.part_owners = PartOwners::one_per_rank(48);
  EXPECT_DOUBLE_EQ(one_part_terms("grouped_allgather_p2p", s, 6).messages, 5);
}

}  // namespace
}  // namespace kdacp
