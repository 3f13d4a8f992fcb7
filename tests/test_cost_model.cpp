// The α-β-γ model: parameters round-trip through JSON, predictions follow the
// formulas' shape, auto's rule respects the budget.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "kdacp/cost_model.hpp"
#include "kdacp/error.hpp"
#include "kdacp/layout.hpp"
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

// Segments are whole units of 16 columns: c = 7 over V = 128 (8 units) is
// one segment of 32 columns and six of 16. A pipeline of unequal segments
// takes the sum of their times plus the widest one's on every further hop:
// P = 64 ranks, 63 hops, bytes = 63 · S/4 + 6 · S/8 (not (63 + 6) · S/7).
TEST(CostModel, UnevenSegmentsPayTheWidestOnEveryHop) {
  const ProblemShape s{64, 32, 128, 128, 4};
  const ProtocolDescriptor& row = find_protocol("pipelined_p2p");
  const double state = 32.0 * 128 * 128 * 4;
  const CostTerms seven = row.cost(s, {"pipelined_p2p", 1, 7});
  EXPECT_DOUBLE_EQ(seven.messages, 63 + 6);
  EXPECT_DOUBLE_EQ(seven.bytes, 63 * state / 4 + 6 * state / 8);
  // Even segments are as before: every message S/c.
  const CostTerms eight = row.cost(s, {"pipelined_p2p", 1, 8});
  EXPECT_DOUBLE_EQ(eight.bytes, (63 + 7) * state / 8);
  const CostTerms three = row.cost(s, {"pipelined_p2p", 1, 3});  // 3, 3, 2 units
  EXPECT_DOUBLE_EQ(three.bytes, 63 * state * 3 / 8 + 2 * state * 5 / 16);
  // So c = 7 is never cheaper than c = 8 on a network (same α count + 1 less,
  // but 63 hops of twice the bytes), and the model's choice divides 8 here.
  const CostParams ethernet{.alpha_s = 20e-6, .beta_s_per_byte = 1 / 12e9};
  EXPECT_GT(predict(ethernet, s, {"pipelined_p2p", 1, 7}).seconds,
            predict(ethernet, s, {"pipelined_p2p", 1, 8}).seconds);
  EXPECT_EQ(8 % best_segments(ethernet, s, "pipelined_p2p"), 0u);
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

// Recursive doubling over zigzag's runs at P = 4 (runs [0] [1] [2] [3,4] [5]
// [6] [7] on ranks 0 1 2 3 2 1 0), the compositions counted as
// rd_exclusive_scan_parts does them: round d = 2's busiest rank is rank 2
// (positions 2 and 4: two aggregates, two prefixes, positions 2's last
// round folding only) with 4 folds and 3 products; d = 4 folds states only,
// 2 on ranks 1 and 2; the run [3,4] adds 2 folds and a product (its pair,
// and rank 3's fold into part 4). A scan whose runs are all cuts composes
// nothing (constant maps compose for free), and a run of cut parts folds
// nothing either. A cut at part 4 alone leaves part 3 outside the run's pair
// and rank 3's fold: the run's part of the cost goes.
TEST(CostModel, LayoutScanCountsEachRoundsBusiestCarrierWithCuts) {
  ProblemShape s{4, 4, 64, 64, 4};
  s.part_owners = PartOwners::zigzag(4);
  const CostTerms t = find_protocol("recursive_doubling").cost(s, {"recursive_doubling", 1, 0});
  EXPECT_DOUBLE_EQ(t.folds, 4 + 2 + 2);
  EXPECT_DOUBLE_EQ(t.products, 3 + 1);
  s.part_cuts.assign(8, true);
  const CostTerms cut = find_protocol("recursive_doubling").cost(s, {"recursive_doubling", 1, 0});
  EXPECT_DOUBLE_EQ(cut.folds, 0);
  EXPECT_DOUBLE_EQ(cut.products, 0);
  EXPECT_DOUBLE_EQ(cut.messages, t.messages);  // the same messages move
  EXPECT_DOUBLE_EQ(cut.bytes, t.bytes);
  s.part_cuts.assign(8, false);
  s.part_cuts[4] = true;
  // The run [3,4] is a cut: d = 2 leaves rank 2 an aggregate with a product
  // (position 2), one without (position 4, after the cut) and a prefix fold,
  // and spares the prefixes after the cut their products; d = 4 one fold on
  // ranks 1 and 2, the prefixes after the cut nothing.
  const CostTerms four = find_protocol("recursive_doubling").cost(s, {"recursive_doubling", 1, 0});
  EXPECT_DOUBLE_EQ(four.folds, 3 + 1);
  EXPECT_DOUBLE_EQ(four.products, 1);
}

// A rank streams all c segments of one part before its next part. Zigzag
// over 8 ranks (parts 0-7 on ranks 0-7, 8-15 on ranks 7-0) with a cut at
// part 10: the worst path runs 0-7, the local step 7-8 on rank 7 (one wait:
// part 8 starts after part 7's last segment), 8-10, 9 relays; part 11 waits
// for rank 4's part 4 (8 relays, one wait). Each wait costs pipelined_p2p
// c - 1 more segments.
TEST(CostModel, PipelineWaitsForARanksEarlierPartsSegments) {
  ProblemShape s{8, 4, 64, 64, 4};
  s.part_owners = PartOwners::zigzag(8);
  s.part_cuts.assign(16, false);
  s.part_cuts[10] = true;
  const ChainProfile weighted = chain_profile(s, 1, 7);
  EXPECT_EQ(weighted.relays, 9u);
  EXPECT_EQ(weighted.order_waits, 1u);
  const auto pipelined = [&](std::size_t c) {
    return find_protocol("pipelined_p2p").cost(s, {"pipelined_p2p", 1, c}).messages;
  };
  EXPECT_DOUBLE_EQ(pipelined(8), 9 + 7 * 2);
  EXPECT_DOUBLE_EQ(pipelined(1), 9);  // one segment: nothing more to stream
  // Without the cut: 14 relays and the local step.
  s.part_cuts.clear();
  EXPECT_EQ(chain_profile(s, 1, 7).relays, 14u);
  EXPECT_EQ(chain_profile(s, 1, 7).order_waits, 1u);
  EXPECT_DOUBLE_EQ(pipelined(8), 14 + 7 * 2);
  // One part per rank never waits: relays + c - 1, as before.
  s.part_owners.reset();
  EXPECT_EQ(chain_profile(s, 1, 7).order_waits, 0u);
  EXPECT_DOUBLE_EQ(pipelined(8), 7 + 7);
}

// p2p's stretches run side by side and share ports. Zigzag over 4 ranks
// (parts 0-7 on ranks 0 1 2 3 3 2 1 0) with cuts at parts 1 and 4: both
// cuts send at once, 1 -> 2 (rank 1 to 2) and 4 -> 5 (rank 3 to 2), into
// rank 2's port; one relay later rank 2 sends 2 -> 3 and 5 -> 6 through its
// port. Each of those relays takes two relay times: the worst path 1-2-3
// has 2 relays and 2 waits, 4-5-6-7 3 relays and 2 waits (without the
// ports: 3 relays, the same path). p2p pays each wait as one more state on
// the link, without a latency. Ports are per kind: with nodes of ranks
// {0, 1} and {2, 3}, 1 -> 2 reaches rank 2's NIC and 4 -> 5 its node port,
// 2 -> 3 leaves through the node port and 5 -> 6 through the NIC, so
// nothing waits. Groups and pipelined_p2p's streams count no waits.
TEST(CostModel, StretchesSideBySideShareARanksPort) {
  ProblemShape s{4, 4, 64, 64, 4};
  s.part_owners = PartOwners::zigzag(4);
  s.part_cuts.assign(8, false);
  s.part_cuts[1] = s.part_cuts[4] = true;
  const ChainProfile shared = chain_profile(s, 1);
  EXPECT_EQ(shared.relays, 3u);
  EXPECT_EQ(shared.port_waits, 2u);
  EXPECT_EQ(shared.node_port_waits, 2u);  // no nodes: every relay crosses
  const double state = 4.0 * 64 * 64 * 4;
  const CostTerms t = find_protocol("p2p").cost(s, {"p2p", 1, 0});
  EXPECT_DOUBLE_EQ(t.messages, 3);
  EXPECT_DOUBLE_EQ(t.bytes, 3 * state);
  EXPECT_DOUBLE_EQ(t.contention_bytes, 2 * state);
  const CostTerms one = find_protocol("pipelined_p2p").cost(s, {"pipelined_p2p", 1, 1});
  EXPECT_DOUBLE_EQ(one.contention_bytes, 2 * state);  // c = 1 is p2p
  EXPECT_EQ(chain_profile(s, 1, 1).port_waits, 0u);
  EXPECT_EQ(chain_profile(s, 2).port_waits, 0u);
  s.ranks_per_node = 2;
  const ChainProfile nodes = chain_profile(s, 1);
  EXPECT_EQ(nodes.port_waits, 0u);
  EXPECT_EQ(nodes.relays, 3u);
  s.ranks_per_node = 0;
  s.part_cuts.clear();  // one chain: its relays leave one after the other
  EXPECT_EQ(chain_profile(s, 1).port_waits, 0u);
  EXPECT_DOUBLE_EQ(find_protocol("p2p").cost(s, {"p2p", 1, 0}).contention_bytes, 0);
}

// pipelined_p2p's streams through shared NICs, hop by hop (counted by hand,
// c = 2, zigzag P = 4, cuts at parts 1 and 4, every message between nodes):
// alone the run ends at hop 5; with the NICs rank 2's takes the offsets of
// parts 1 (from rank 1) and 4 (from rank 3) one after the other, then sends
// part 2's second segment before part 5's first, and part 7's last segment
// arrives at hop 7.
TEST(CostModel, StreamsOfSegmentsShareARanksNic) {
  ProblemShape s{4, 4, 64, 64, 4};
  s.part_owners = PartOwners::zigzag(4);
  s.part_cuts.assign(8, false);
  s.part_cuts[1] = s.part_cuts[4] = true;
  StreamWaitsCache cache;
  EXPECT_DOUBLE_EQ(stream_nic_waits(s, 2), 2);
  EXPECT_DOUBLE_EQ(stream_nic_waits(s, 2, &cache), 2);
  const double half = 4.0 * 64 * 32 * 4;  // a segment: 32 of the 64 columns
  const CostTerms two = find_protocol("pipelined_p2p").cost(s, {"pipelined_p2p", 1, 2});
  EXPECT_DOUBLE_EQ(two.contention_bytes, 2 * half);
  EXPECT_DOUBLE_EQ(stream_nic_waits(s, 1), 0);  // c = 1: ChainProfile::port_waits
  // Nodes of two ranks: only the hops into parts 2 (rank 1 to 2) and 6
  // (rank 2 to 1) leave a node, through different NICs, and nothing waits.
  s.ranks_per_node = 2;
  EXPECT_DOUBLE_EQ(stream_nic_waits(s, 2, &cache), 0);
  EXPECT_DOUBLE_EQ(find_protocol("pipelined_p2p").cost(s, {"pipelined_p2p", 1, 2}).contention_bytes, 0);
  s.ranks_per_node = 0;
  EXPECT_DOUBLE_EQ(stream_nic_waits(s, 2, &cache), 2);  // remembered, by nodes too
  s.part_cuts.clear();  // one chain, one stream: nothing to share
  EXPECT_DOUBLE_EQ(stream_nic_waits(s, 2, &cache), 0);
  s.part_cuts.assign(7, false);
  EXPECT_THROW(stream_nic_waits(s, 2), InvalidArgument);
}

// Threads of one planner price at once (its StreamWaitsCache remembers four
// shapes behind a lock): threads pricing eight shapes, which evict each
// other, get each shape's own waits, as found without the cache.
TEST(CostModel, StreamWaitsFromManyThreadsAtOnce) {
  auto shape = [](std::size_t k) {
    ProblemShape s{4, 4, 64, 64, 4};
    s.part_owners = PartOwners::zigzag(4);
    s.part_cuts.assign(8, false);
    const unsigned cuts[] = {0x12, 0x04, 0x22, 0x2e};  // bit j: part j is a cut
    for (std::size_t j = 0; j < 8; ++j) s.part_cuts[j] = ((cuts[k / 2] >> j) & 1) != 0;
    s.ranks_per_node = k % 2 == 1 ? 2 : 0;
    return s;
  };
  std::vector<double> expected;
  for (std::size_t k = 0; k < 8; ++k) expected.push_back(stream_nic_waits(shape(k), 2));  // no cache
  const Planner planner{CostParams{}};
  EXPECT_DOUBLE_EQ(expected[0], 2);  // StreamsOfSegmentsShareARanksNic's, counted by hand
  EXPECT_DOUBLE_EQ(expected[1], 0);
  std::vector<double> values = expected;  // shapes apart, by their waits
  std::sort(values.begin(), values.end());
  EXPECT_GE(std::unique(values.begin(), values.end()) - values.begin(), 3);
  std::vector<int> wrong(4, 0);
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < wrong.size(); ++t) {
    threads.emplace_back([&, t] {
      for (std::size_t i = 0; i < 64; ++i) {
        const std::size_t k = (i * 3 + t) % 8;
        if (planner.stream_nic_waits(shape(k), 2) != expected[k]) ++wrong[t];
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int w : wrong) EXPECT_EQ(w, 0);
}

// A planner prices as each free call does alone (a planner of its own), the
// second time from its cache: every configuration of a zigzag layout with
// cuts, on nodes and without.
TEST(CostModel, APlannerPricesAsEachCallAlone) {
  const CostParams c;
  const Planner planner(c);
  for (std::size_t node : {0u, 2u}) {
    ProblemShape s{8, 4, 64, 64, 4};
    s.part_owners = PartOwners::zigzag(8);
    s.part_cuts.assign(16, false);
    s.part_cuts[3] = s.part_cuts[6] = s.part_cuts[11] = true;
    s.ranks_per_node = node;
    for (int pass = 0; pass < 2; ++pass) {
      const auto alone = predict_all(c, s, true), planned = planner.predict_all(s, true);
      ASSERT_EQ(alone.size(), planned.size());
      for (std::size_t i = 0; i < alone.size(); ++i) {
        EXPECT_EQ(protocol_label(planned[i].config), protocol_label(alone[i].config));
        EXPECT_EQ(planned[i].seconds, alone[i].seconds) << protocol_label(alone[i].config);
        EXPECT_EQ(planned[i].peak_extra_bytes, alone[i].peak_extra_bytes);
      }
      EXPECT_EQ(planner.choose_protocol(s, 0, false, true).seconds, choose_protocol(c, s, 0, false, true).seconds);
      EXPECT_EQ(planner.best_segments(s, "pipelined_p2p"), best_segments(c, s, "pipelined_p2p"));
    }
  }
}

// Cuts shorten what waits along the chain and what a gather folds; the
// doubling scan's rounds and messages do not depend on them, its
// compositions do (a cut pair composes for free: compose() copies it).
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
          const CostTerms ta = row->cost(plain, config, nullptr), tb = row->cost(cut, config, nullptr);
          EXPECT_EQ(ta.messages, tb.messages);
          EXPECT_EQ(ta.bytes, tb.bytes);
          EXPECT_EQ(ta.group_messages, tb.group_messages);
          EXPECT_EQ(ta.group_bytes, tb.group_bytes);
          EXPECT_LT(tb.folds, ta.folds);
          EXPECT_LT(b.seconds, a.seconds);
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
