// The cost model on nodes (CostParams::node_ranks, docs/scale.md): messages
// between ranks of one node are priced at the group α/β, the others at α/β;
// without nodes every prediction is what it was.
#include <gtest/gtest.h>

#include <string>

#include "kdacp/cost_model.hpp"
#include "kdacp/error.hpp"
#include "kdacp/layout.hpp"
#include "kdacp/protocol.hpp"

namespace kdacp {
namespace {

constexpr std::size_t kSlabs = 32, kDim = 128;
constexpr double kState = double(kSlabs * kDim * kDim * 4);
constexpr double kPacked = double(kSlabs * kDim * 2 * kDim * 4 + 64);

ProblemShape shape(std::size_t p, std::size_t node) {
  ProblemShape s{p, kSlabs, kDim, kDim, 4};
  s.ranks_per_node = node;
  return s;
}

CostTerms terms(const std::string& method, const ProblemShape& s, std::size_t w = 1, std::size_t c = 0) {
  return find_protocol(method).cost(s, {method, w, c});
}

TEST(CostNodes, ChainHopsInsideNodesGoOverTheNode) {
  // P = 16 on nodes of 8: one of the 15 hops crosses the network.
  const CostTerms t = terms("p2p", shape(16, 8));
  EXPECT_DOUBLE_EQ(t.messages, 1);
  EXPECT_DOUBLE_EQ(t.bytes, kState);
  EXPECT_DOUBLE_EQ(t.group_messages, 14);
  EXPECT_DOUBLE_EQ(t.group_bytes, 14 * kState);
  // Unknown nodes: every hop a network one, as before.
  const CostTerms u = terms("p2p", shape(16, 0));
  EXPECT_DOUBLE_EQ(u.messages, 15);
  EXPECT_DOUBLE_EQ(u.group_messages, 0);
  // One node holds every rank: nothing crosses.
  EXPECT_DOUBLE_EQ(terms("p2p", shape(4, 8)).messages, 0);
}

TEST(CostNodes, RecursiveDoublingCrossesANodeEveryRoundOnceItSpansTwo) {
  // P = 64 on nodes of 8: position q sends to q + 2^k, so rank 7 sends to
  // ranks 8, 9, 11, 15, 23 and 39 and waits for each before its next round:
  // every round is a network one; the last moves states only.
  const CostTerms t = terms("recursive_doubling", shape(64, 8));
  EXPECT_DOUBLE_EQ(t.group_messages, 0);
  EXPECT_DOUBLE_EQ(t.messages, 6);
  EXPECT_DOUBLE_EQ(t.bytes, 5 * kPacked + kState);
  const CostTerms u = terms("recursive_doubling", shape(64, 0));
  EXPECT_DOUBLE_EQ(u.messages, t.messages);
  EXPECT_DOUBLE_EQ(u.bytes, t.bytes);
  // A scan inside one node stays at the group α/β.
  const CostTerms one = terms("recursive_doubling", shape(8, 8));
  EXPECT_DOUBLE_EQ(one.messages, 0);
  EXPECT_DOUBLE_EQ(one.group_messages, 3);
  EXPECT_DOUBLE_EQ(one.group_bytes, 2 * kPacked + kState);
  // Grouped (w = 4): the gather and broadcast of a block stay inside a node,
  // the carriers' scan (16 positions over 8 nodes) crosses every round.
  const CostTerms g = terms("grouped_allgather_rd", shape(64, 8), 4);
  const CostTerms g0 = terms("grouped_allgather_rd", shape(64, 0), 4);
  EXPECT_DOUBLE_EQ(g.messages + g.group_messages, g0.messages + g0.group_messages);
  EXPECT_DOUBLE_EQ(g.messages, 4);
  // log2(4) to gather, log2(4) to broadcast, and log2(4) for each one's
  // agreement (add_agreement).
  EXPECT_DOUBLE_EQ(g.group_messages, 4 + 4);
  // w = 4 at P = 8: two carriers in one node, all inside.
  EXPECT_DOUBLE_EQ(terms("grouped_allgather_rd", shape(8, 8), 4).messages, 0);
}

TEST(CostNodes, AllGatherAcrossNodesGathersInsideThenAcross) {
  const CostTerms t = terms("allgather", shape(64, 8));
  EXPECT_DOUBLE_EQ(t.group_bytes, 7 * kPacked);
  EXPECT_DOUBLE_EQ(t.bytes, 56 * kPacked);
  // Each twice: the gather's rounds and its agreement's (add_agreement).
  EXPECT_DOUBLE_EQ(t.group_messages, 3 + 3);
  EXPECT_DOUBLE_EQ(t.messages, 3 + 3);
  // A group of 16 on nodes of 8 spans two nodes.
  const CostTerms g = terms("grouped_allgather_p2p", shape(64, 8), 16);
  EXPECT_DOUBLE_EQ(g.bytes - 3 * kState, 8 * kPacked + kState);  // 3 relays, the broadcast's step across
  // A group inside a node: its gather and broadcast stay there, and of the
  // 15 relays between owners 4 ranks apart, the 7 at node boundaries cross.
  const CostTerms h = terms("grouped_allgather_p2p", shape(64, 8), 4);
  EXPECT_DOUBLE_EQ(h.messages, 7);
  EXPECT_DOUBLE_EQ(h.group_messages, 2 + 8 + 2 + 2 + 2);  // and two agreements over 4
}

// The MPI backend agrees on a header before every collective: an all-reduce
// of a few words, ceil(log2 m) latencies over m members (the simulated
// Ethernet with one head measured exactly these: docs/scale.md). Only the
// protocols with collectives pay them; the chain and the scan have none.
TEST(CostNodes, EveryCollectivePaysItsAgreementsLatencies) {
  // The all-gather over 8 without nodes: 3 rounds to gather, 3 to agree,
  // all at the network's α.
  const CostTerms a = terms("allgather", shape(8, 0));
  EXPECT_DOUBLE_EQ(a.messages, 3 + 3);
  EXPECT_DOUBLE_EQ(a.bytes, 7 * kPacked);  // the agreement's bytes are not counted
  // Over 16 on nodes of 8: 3 rounds inside and 1 across, for each.
  const CostTerms b = terms("allgather", shape(16, 8));
  EXPECT_DOUBLE_EQ(b.group_messages, 3 + 3);
  EXPECT_DOUBLE_EQ(b.messages, 1 + 1);
  // Groups of 2 at P = 8: a gather and a broadcast over 2, one latency each
  // and one per agreement.
  const CostTerms g = terms("grouped_allgather_p2p", shape(8, 0), 2);
  const CostTerms chain = terms("p2p", shape(4, 0));  // the carriers' chain over the 4 blocks
  EXPECT_DOUBLE_EQ(g.group_messages, 1 + 1 + 1 + 1);
  EXPECT_DOUBLE_EQ(g.messages, chain.messages);
  // No collective, no agreement.
  EXPECT_DOUBLE_EQ(terms("p2p", shape(8, 0)).group_messages, 0);
  EXPECT_DOUBLE_EQ(terms("recursive_doubling", shape(8, 0)).group_messages, 0);
}

TEST(CostNodes, PipelineAtTheSlowestHopsPace) {
  // c segments: every hop once, then c - 1 at the network's pace when a hop
  // crosses it.
  const CostTerms t = terms("pipelined_p2p", shape(16, 8), 1, 4);
  EXPECT_DOUBLE_EQ(t.messages, 1 + 3);
  EXPECT_DOUBLE_EQ(t.group_messages, 14);
  EXPECT_DOUBLE_EQ(t.bytes, 4 * kState / 4);
  const CostTerms in_node = terms("pipelined_p2p", shape(8, 8), 1, 4);
  EXPECT_DOUBLE_EQ(in_node.messages, 0);
  EXPECT_DOUBLE_EQ(in_node.group_messages, 7 + 3);
}

TEST(CostNodes, PredictUsesTheParametersNodesAndJsonKeepsThem) {
  CostParams c;
  c.group_alpha_s = 3e-6;
  c.group_beta_s_per_byte = 1 / 370e9;
  const ProblemShape s = shape(16, 0);
  const double flat = predict(c, s, {"p2p", 1, 0}).seconds;
  c.node_ranks = 8;
  const double nodes = predict(c, s, {"p2p", 1, 0}).seconds;
  EXPECT_LT(nodes, flat / 2);  // 14 of 15 hops at NVLink speed
  const CostParams back = cost_params_from_json(to_json(c));
  EXPECT_EQ(back.node_ranks, 8u);
  EXPECT_EQ(to_json(CostParams{}).find("node_ranks"), std::string::npos);
  try {
    cost_params_from_json(R"({"node_ranks": -2})");
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("node_ranks"), std::string::npos);
  }
  EXPECT_THROW(cost_params_from_json(R"({"node_ranks": 1.5})"), InvalidArgument);
}

TEST(CostNodes, ZigzagHopsInsideNodesGoOverTheNode) {
  // P = 16 zigzag on nodes of 8: the chain walks ranks 0..15 and back, 30
  // hops (rank 15 holds parts 15 and 16: a local step), 2 of them between
  // ranks 7 and 8.
  ProblemShape z = shape(16, 8);
  z.part_owners = PartOwners::zigzag(16);
  const CostTerms t = terms("p2p", z);
  EXPECT_DOUBLE_EQ(t.messages, 2);
  EXPECT_DOUBLE_EQ(t.group_messages, 28);
  EXPECT_EQ(chain_profile(z, 1).node_relays, 2u);
  // Cuts: the worst stretch is what counts, its crossings with it.
  z.part_cuts.assign(32, false);
  z.part_cuts[4] = true;  // stretches 0-4 (inside node 0) and 4-31 (both crossings)
  EXPECT_EQ(chain_profile(z, 1).relays, 26u);
  EXPECT_EQ(chain_profile(z, 1).node_relays, 2u);
  // The pipeline: every hop once, then c - 1 segments at the network's pace,
  // and c - 1 more where rank 15 streams part 15 before part 16.
  z.part_cuts.clear();
  const CostTerms q = terms("pipelined_p2p", z, 1, 4);
  EXPECT_DOUBLE_EQ(q.messages, 2 + 3 * 2);
  EXPECT_DOUBLE_EQ(q.group_messages, 28);
  // Groups of 4 relay between carriers 4 ranks apart: 6 relays, 2 across.
  const CostTerms g = terms("grouped_allgather_p2p", z, 4);
  EXPECT_DOUBLE_EQ(g.messages, 2);
  EXPECT_EQ(chain_profile(z, 4).relays, 6u);
  // A rank handles its parts in chain order (p2p.cpp). Cuts at 4 and 28:
  // stretches 0-4, 4-28 (24 steps) and 28-31, whose parts 29-31 wait for
  // ranks 2, 1, 0 to finish parts 2, 1, 0 (early): the middle stretch is
  // the critical path.
  ProblemShape w = shape(16, 8);
  w.part_owners = PartOwners::zigzag(16);
  w.part_cuts.assign(32, false);
  w.part_cuts[4] = w.part_cuts[28] = true;
  EXPECT_EQ(chain_profile(w, 1).steps, 24u);
  // Cuts at 16 and 28: stretches of 16 and 12 steps, but rank 14 takes part
  // 17 only after part 14 (step 14 of the first stretch), rank 13 part 18
  // after part 13...: parts 17-28 finish 14 steps late, 26 steps in all.
  w.part_cuts[4] = false;
  w.part_cuts[16] = true;
  EXPECT_EQ(chain_profile(w, 1).steps, 26u);
  // A block of 16 spans two nodes of 8: with a layout too, its gather moves
  // the other node's 8 ranks' slots over the network (it priced all 15 at
  // NVLink speed: the simulated zigzag run took 3.56x the model).
  const CostTerms wide = terms("grouped_allgather_p2p", z, 16);
  EXPECT_DOUBLE_EQ(wide.bytes, 8 * 2 * kPacked);  // 2 parts per rank, no relay between the block's
  // Recursive doubling over zigzag's 31 runs: rank r holds two positions; in
  // every round one of a rank's messages at most crosses to another node
  // (the other stays inside), so each of the 5 rounds is one network message
  // of the rank's busiest direction; without nodes both of a rank's
  // messages share its port in some rounds.
  const CostTerms rd = terms("recursive_doubling", z);
  EXPECT_DOUBLE_EQ(rd.messages, 5);
  EXPECT_DOUBLE_EQ(rd.bytes, 4 * kPacked + kState);
  EXPECT_DOUBLE_EQ(rd.group_messages, 0);
  ProblemShape flat_rd = z;
  flat_rd.ranks_per_node = 0;
  EXPECT_DOUBLE_EQ(terms("recursive_doubling", flat_rd).messages, 5);
  EXPECT_GT(terms("recursive_doubling", flat_rd).bytes, rd.bytes);
  // Without nodes every relay is a network message, as before.
  ProblemShape flat = z;
  flat.ranks_per_node = 0;
  EXPECT_DOUBLE_EQ(terms("p2p", flat).messages, 30);
  EXPECT_DOUBLE_EQ(terms("p2p", flat).group_messages, 0);
}

// Leaves of 128 ranks with uplinks oversubscribed 2:1 (platforms/nvlink-ib).
ProblemShape leafy(std::size_t p) {
  ProblemShape s = shape(p, 8);
  s.ranks_per_leaf = 128;
  s.leaf_oversubscription = 2;
  return s;
}

TEST(CostLeaves, EveryRankAcrossLeavesGoesAtOneOverO) {
  // Recursive doubling over P = 1024: rounds at distances 128, 256 (packed
  // pairs) and 512 (states only) cross leaves with every rank sending.
  const CostTerms t = terms("recursive_doubling", leafy(1024));
  EXPECT_DOUBLE_EQ(t.contention_bytes, 2 * kPacked + kState);
  EXPECT_DOUBLE_EQ(t.bytes, terms("recursive_doubling", shape(1024, 8)).bytes);  // bytes moved: unchanged
  // P = 128: one leaf, nothing crosses.
  EXPECT_DOUBLE_EQ(terms("recursive_doubling", leafy(128)).contention_bytes, 0);
  // The all-gather of 256: the 128 slots of the other leaf.
  EXPECT_DOUBLE_EQ(terms("allgather", leafy(256)).contention_bytes, 128 * kPacked);
  // Without nodes the model has no leaves either.
  ProblemShape flat = leafy(1024);
  flat.ranks_per_node = 0;
  EXPECT_DOUBLE_EQ(terms("recursive_doubling", flat).contention_bytes, 0);
}

TEST(CostLeaves, AllGatherWithALayoutIsStillACollectiveOverRanks) {
  // Zigzag at P = 256: every rank gives its 2 parts' pairs to the one
  // gather, which splits by node and crosses leaves like one part per
  // rank's, with slots twice the size (it priced every slot at network
  // speed without leaves: the simulated run took 1.44x the model).
  const ProblemShape plain = leafy(256);
  ProblemShape z = plain;
  z.part_owners = PartOwners::zigzag(256);
  const CostTerms t = terms("allgather", z), u = terms("allgather", plain);
  EXPECT_DOUBLE_EQ(t.group_bytes, 7 * 2 * kPacked);
  EXPECT_DOUBLE_EQ(t.bytes, 248 * 2 * kPacked);
  EXPECT_DOUBLE_EQ(t.contention_bytes, 128 * 2 * kPacked);
  EXPECT_DOUBLE_EQ(t.group_messages, u.group_messages);
  EXPECT_DOUBLE_EQ(t.messages, u.messages);
  // A group's gather over ranks too: w = 256 spans both leaves.
  const CostTerms g = terms("grouped_allgather_p2p", z, 256);
  EXPECT_DOUBLE_EQ(g.contention_bytes, 128 * 2 * kPacked);
  // Without leaves, no contention; without nodes, every slot across.
  ProblemShape flat = z;
  flat.ranks_per_leaf = 0;
  EXPECT_DOUBLE_EQ(terms("allgather", flat).contention_bytes, 0);
  flat.ranks_per_node = 0;
  EXPECT_DOUBLE_EQ(terms("allgather", flat).bytes, 255 * 2 * kPacked);
}

TEST(CostLeaves, FewerSendersThanTheUplinksCarryGoAtFullSpeed) {
  // Grouped recursive doubling: only each group's carrier crosses, one rank
  // in w. w = 2 with o = 2: the uplinks carry them all.
  EXPECT_DOUBLE_EQ(terms("grouped_allgather_rd", leafy(1024), 2).contention_bytes, 0);
  // o = 4: half of each crossing round's bytes again.
  ProblemShape four = leafy(1024);
  four.leaf_oversubscription = 4;
  EXPECT_DOUBLE_EQ(terms("grouped_allgather_rd", four, 2).contention_bytes, 2 * kPacked + kState);
  // The chain's hops are one flow each.
  EXPECT_DOUBLE_EQ(terms("p2p", leafy(1024)).contention_bytes, 0);
  EXPECT_DOUBLE_EQ(terms("pipelined_p2p", leafy(1024), 1, 8).contention_bytes, 0);
}

TEST(CostLeaves, ALayoutScanPaysTheBusiestLeafsUplinks) {
  // Zigzag over P = 4 on nodes and leaves of 2 ranks, o = 2 (one port's
  // bandwidth up per leaf): runs [0] [1] [2] [3,4] [5] [6] [7] held by ranks
  // 0 1 2 3 2 1 0. Round d = 1 and d = 4 send one message per leaf across;
  // d = 2 sends ranks 0 -> 2, 1 -> 3, 3 -> 1, 2 -> 0 (position 2 to 4 stays
  // on rank 2): two per leaf and direction through one port, one per rank:
  // one pair's bytes more. (The simulated zigzag scan at P = 4096 on
  // nvlink-ib took 1.31x the model without it: two messages per rank cross.)
  ProblemShape z = shape(4, 2);
  z.ranks_per_leaf = 2;
  z.leaf_oversubscription = 2;
  z.part_owners = PartOwners::zigzag(4);
  EXPECT_DOUBLE_EQ(terms("recursive_doubling", z).contention_bytes, kPacked);
  z.leaf_oversubscription = 1;
  EXPECT_DOUBLE_EQ(terms("recursive_doubling", z).contention_bytes, 0);
  // Cuts alone keep one run per rank: the plain scan's messages, and its
  // contention (every rank across from distance 128 on).
  ProblemShape cut = leafy(1024);
  cut.part_cuts.assign(1024, false);
  cut.part_cuts[300] = true;
  EXPECT_DOUBLE_EQ(terms("recursive_doubling", cut).contention_bytes,
                   terms("recursive_doubling", leafy(1024)).contention_bytes);
  // A group's carrier per w = 2 ranks: the uplinks carry them all.
  EXPECT_DOUBLE_EQ(terms("grouped_allgather_rd", cut, 2).contention_bytes, 0);
}

TEST(CostLeaves, PredictPricesTheContentionAndJsonChecksIt) {
  CostParams c;
  c.node_ranks = 8;
  c.group_alpha_s = 3e-6;
  c.group_beta_s_per_byte = 1 / 370e9;
  const ProblemShape s = shape(1024, 0);
  const double open = predict(c, s, {"recursive_doubling", 1, 0}).seconds;
  c.leaf_ranks = 128;
  c.oversubscription = 2;
  const double blocked = predict(c, s, {"recursive_doubling", 1, 0}).seconds;
  EXPECT_NEAR(blocked - open, (2 * kPacked + kState) * c.beta_s_per_byte, 1e-12);
  const CostParams back = cost_params_from_json(to_json(c));
  EXPECT_EQ(back.leaf_ranks, 128u);
  EXPECT_EQ(back.oversubscription, 2.0);
  EXPECT_EQ(to_json(CostParams{}).find("oversubscription"), std::string::npos);
  for (const char* bad : {R"({"oversubscription": 0.5})", R"({"oversubscription": "2"})",
                          R"({"leaf_ranks": -1})", R"({"node_ranks": 8, "leaf_ranks": 12})"}) {
    try {
      cost_params_from_json(bad);
      ADD_FAILURE() << bad;
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(std::string(e.what()).find("oversubscription") != std::string::npos ||
                  std::string(e.what()).find("leaf_ranks") != std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
}  // namespace kdacp
