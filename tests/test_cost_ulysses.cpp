// The cost model of Ulysses × state CP (predict_ulysses, all_to_all_seconds;
// docs/protocols.md, "Ulysses × state CP"): the all-to-alls by hand, the
// exchange over the P/U ranks of a head slice on islands and nodes, where
// Ulysses wins and loses, what it refuses.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kdacp/cost_model.hpp"
#include "kdacp/error.hpp"
#include "kdacp/layout.hpp"
#include "kdacp/protocol.hpp"

namespace kdacp {
namespace {

// Ulysses × state CP: U = 1 is plain state CP, so its exchange is auto's
// exact choice on the same shape (layout and budget included) and it moves
// no activations; the list holds U = 1 and every U >= 2 dividing H and P.
TEST(CostModel, UlyssesAtOneIsPlainStateCp) {
  const CostParams c;
  UlyssesOptions o;
  o.tokens_per_rank = 1024;
  for (std::size_t p : {8u, 64u, 1024u}) {
    const ProblemShape s{p, 32, 128, 128, 4};
    const auto widths = predict_ulysses(c, s, o);
    ASSERT_FALSE(widths.empty());
    const Prediction plain = choose_protocol(c, s, 0, false);
    EXPECT_EQ(widths[0].width, 1u);
    EXPECT_EQ(widths[0].state_ranks, p);
    EXPECT_EQ(widths[0].all_to_all_seconds, 0);
    EXPECT_EQ(protocol_label(widths[0].exchange.config), protocol_label(plain.config));
    EXPECT_EQ(widths[0].exchange.seconds, plain.seconds);
    EXPECT_EQ(widths[0].seconds, plain.seconds);
    std::vector<std::size_t> us;
    for (const UlyssesPrediction& u : widths) {
      us.push_back(u.width);
      EXPECT_EQ(u.state_ranks * u.width, p);
      EXPECT_DOUBLE_EQ(u.seconds, u.all_to_all_seconds + u.exchange.seconds);
      EXPECT_TRUE(u.exchange.exact);
    }
    std::vector<std::size_t> expected{1};
    for (std::size_t u = 2; u <= std::min<std::size_t>(32, p); ++u)
      if (32 % u == 0 && p % u == 0) expected.push_back(u);
    EXPECT_EQ(us, expected) << "P=" << p;
  }
  // With a layout and a budget: the same choice auto makes among the rows
  // that take layouts, and every U's exchange on the layout over P/U ranks.
  ProblemShape zig{64, 32, 128, 128, 4};
  zig.part_owners = PartOwners::zigzag(64);
  o.memory_budget_bytes = 8 << 20;
  std::vector<std::size_t> asked;
  const auto widths = predict_ulysses(c, zig, o, [&](std::size_t ranks) {
    asked.push_back(ranks);
    ProblemShape at{ranks, 32, 128, 128, 4};
    at.part_owners = PartOwners::zigzag(ranks);
    return at;
  });
  const Prediction plain = choose_protocol(c, zig, 8 << 20, false, true);
  EXPECT_EQ(protocol_label(widths[0].exchange.config), protocol_label(plain.config));
  EXPECT_EQ(widths[0].exchange.seconds, plain.seconds);
  EXPECT_EQ(asked, (std::vector<std::size_t>{32, 16, 8, 4, 2}));
  for (const UlyssesPrediction& u : widths) EXPECT_LE(u.exchange.peak_extra_bytes, std::size_t{8} << 20);
}

// The all-to-all by hand: P = 4, B = 1, H = 2, K = V = 16, T/P = 8, bf16.
// A rank holds 8 tokens x 2 heads x (3K+V+1 = 65) x 2 bytes = 2080 bytes of
// q, k, v, g, beta and 8 x 2 x 16 x 2 = 512 bytes of o; U = 2 sends half of
// each to its one peer.
TEST(CostModel, UlyssesAllToAllByHand) {
  CostParams c;
  c.alpha_s = 1e-6;
  c.beta_s_per_byte = 1e-9;
  UlyssesOptions o;
  o.tokens_per_rank = 8;
  const ProblemShape s{4, 2, 16, 16, 4};
  const auto widths = predict_ulysses(c, s, o);
  ASSERT_EQ(widths.size(), 2u);  // U = 1, 2
  const UlyssesPrediction& u2 = widths[1];
  EXPECT_EQ(u2.width, 2u);
  EXPECT_EQ(u2.state_ranks, 2u);
  EXPECT_DOUBLE_EQ(u2.in_bytes, 2080);
  EXPECT_DOUBLE_EQ(u2.out_bytes, 512);
  EXPECT_DOUBLE_EQ(u2.all_to_all_seconds, (1e-6 + 1040e-9) + (1e-6 + 256e-9));
  const Prediction sub = choose_protocol(c, ProblemShape{2, 1, 16, 16, 4}, 0, false);
  EXPECT_EQ(protocol_label(u2.exchange.config), protocol_label(sub.config));
  EXPECT_DOUBLE_EQ(u2.exchange.seconds, sub.seconds);
  // 4-byte activations double the bytes, not the messages.
  o.activation_bytes = 4;
  EXPECT_DOUBLE_EQ(predict_ulysses(c, s, o)[1].all_to_all_seconds, 2e-6 + 2 * (1040e-9 + 256e-9));

  // Islands: a group inside one island at the group's alpha/beta; a group
  // over several islands at the network's in every step (the rank at an
  // island's edge receives from, or sends to, another island in each one;
  // simulated: U = 16 over two nodes of 8 read 1.66 of the model that
  // counted 7 steps inside), as is a width that does not fit the islands.
  CostParams g = c;
  g.group_alpha_s = 1e-7;
  g.group_beta_s_per_byte = 1e-10;
  const double n = 1600;
  EXPECT_DOUBLE_EQ(all_to_all_seconds(g, 4, n, 8), 3 * (1e-7 + 1e-10 * n / 4));
  EXPECT_DOUBLE_EQ(all_to_all_seconds(g, 16, n, 8), 15 * (1e-6 + 1e-9 * n / 16));
  EXPECT_DOUBLE_EQ(all_to_all_seconds(g, 3, n, 8), 2 * (1e-6 + 1e-9 * n / 3));
  EXPECT_DOUBLE_EQ(all_to_all_seconds(g, 4, n, 1), 3 * (1e-6 + 1e-9 * n / 4));
  EXPECT_EQ(all_to_all_seconds(g, 1, n, 8), 0);
  // Without group values the islands change nothing.
  EXPECT_DOUBLE_EQ(all_to_all_seconds(c, 16, n, 8), all_to_all_seconds(c, 16, n, 1));
}

// One head slice's P/U ranks are U apart: below the island size some share
// an island (the group alpha/beta stay for the grouped rows), from it on none
// do (the exchange is priced on the network alone).
// NVLink islands of 8 (with node_ranks when `nodes`), the same machine on
// the network alone, and T/P = 1024 at P = 1024, H = 32.
struct IslandCase {
  CostParams g, network;
  UlyssesOptions o;
  ProblemShape s{1024, 32, 128, 128, 4};
  explicit IslandCase(bool nodes) {
    g.group_alpha_s = 3e-6;
    g.group_beta_s_per_byte = 1 / 370e9;
    if (nodes) g.node_ranks = 8;
    network = g;
    network.group_alpha_s = network.group_beta_s_per_byte = 0;
    o.tokens_per_rank = 1024;
    o.node_size = 8;
  }
};

TEST(CostModel, UlyssesExchangeLeavesTheIslandsAtTheirSize) {
  const IslandCase c(false);
  const CostParams &g = c.g, &network = c.network;
  const UlyssesOptions& o = c.o;
  const ProblemShape& s = c.s;
  for (const UlyssesPrediction& u : predict_ulysses(g, s, o)) {
    SCOPED_TRACE("U=" + std::to_string(u.width));
    const ProblemShape sub{s.ranks / u.width, 32 / u.width, 128, 128, 4};
    const CostParams& expected = u.width < 8 ? g : network;
    EXPECT_EQ(u.exchange.seconds, choose_protocol(expected, sub, 0, false).seconds);
  }
  // The grouped rows gain from the islands, so the exchange at U = 4 is
  // cheaper with them than on the network alone.
  EXPECT_LT(predict_ulysses(g, s, o)[2].exchange.seconds, predict_ulysses(network, s, o)[2].exchange.seconds);
}

// With nodes in the parameters (node_ranks) the exchange over P/U prices
// each message by where its ranks are: a node holds node_size/U of one head
// slice's ranks, or one of them from U = node_size on.
TEST(CostModel, UlyssesExchangeOnNodes) {
  const IslandCase c(true);
  const CostParams &g = c.g, &network = c.network;
  UlyssesOptions o = c.o;
  const ProblemShape& s = c.s;
  for (const UlyssesPrediction& u : predict_ulysses(g, s, o)) {
    SCOPED_TRACE("U=" + std::to_string(u.width));
    ProblemShape sub{s.ranks / u.width, 32 / u.width, 128, 128, 4};
    if (u.width > 1) sub.ranks_per_node = u.width < 8 ? 8 / u.width : 1;
    EXPECT_EQ(u.exchange.seconds, choose_protocol(u.width < 8 ? g : network, sub, 0, false).seconds);
  }
  o.node_size = 4;
  EXPECT_THROW(predict_ulysses(g, s, o), InvalidArgument);
}

// Ulysses pays when the state exchange over P ranks costs more than the
// all-to-alls: many ranks and few tokens per rank (P = 1024, T/P = 1024),
// not few ranks and many tokens (P = 64, T/P = 16384).
TEST(CostModel, UlyssesWinsAtLargePAndLosesAtLargeTokens) {
  const CostParams c;
  UlyssesOptions o;
  o.tokens_per_rank = 1024;
  const auto large = predict_ulysses(c, ProblemShape{1024, 32, 128, 128, 4}, o);
  const UlyssesPrediction win = best_ulysses(large);
  EXPECT_GT(win.width, 1u);
  EXPECT_LT(win.seconds * 3, large[0].seconds);
  for (const UlyssesPrediction& u : large) EXPECT_GE(u.seconds, win.seconds);
  o.tokens_per_rank = 16384;
  const auto small = predict_ulysses(c, ProblemShape{64, 32, 128, 128, 4}, o);
  const UlyssesPrediction lose = best_ulysses(small);
  EXPECT_EQ(lose.width, 1u);
  for (std::size_t i = 1; i < small.size(); ++i) EXPECT_GT(small[i].seconds, small[0].seconds);
  // Ties go to the smaller U.
  std::vector<UlyssesPrediction> tie(2);
  tie[0].width = 2;
  tie[1].width = 4;
  tie[0].seconds = tie[1].seconds = 1;
  EXPECT_EQ(best_ulysses(tie).width, 2u);
  EXPECT_THROW(best_ulysses({}), InvalidArgument);
}

TEST(CostModel, UlyssesRejectsWhatItCannotPrice) {
  const CostParams c;
  const ProblemShape s{8, 6, 128, 128, 4};  // B = 2, H = 3
  UlyssesOptions o;
  o.tokens_per_rank = 16;
  o.heads = 3;
  EXPECT_EQ(predict_ulysses(c, s, o).size(), 1u);  // 3 does not divide P = 8
  o.heads = 4;
  EXPECT_THROW(predict_ulysses(c, s, o), InvalidArgument);  // 4 does not divide B*H = 6
  o.heads = 3;
  for (std::size_t UlyssesOptions::*field :
       {&UlyssesOptions::tokens_per_rank, &UlyssesOptions::activation_bytes, &UlyssesOptions::node_size}) {
    UlyssesOptions bad = o;
    bad.*field = 0;
    EXPECT_THROW(predict_ulysses(c, s, bad), InvalidArgument);
  }
  ProblemShape zig = s;
  zig.part_owners = PartOwners::zigzag(8);
  try {
    predict_ulysses(c, zig, o);
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("shape_at"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kdacp
