// Layouts with several parts per rank (SPEC §10): zigzag (rank r holds parts
// r and 2P-1-r) and irregular part lists, with cut patterns. Every registry
// row that takes layouts must give, for each of a rank's parts, the bits of
// the serial chain over the parts in chain order; the others must refuse the
// layout before any message.
#include <gtest/gtest.h>

#include <mutex>
#include <sstream>

#include "helpers.hpp"
#include "kdacp/protocol.hpp"

namespace kdacp {
namespace {

using test::World;

std::vector<std::size_t> zigzag(std::size_t p) {
  std::vector<std::size_t> owners;
  for (std::size_t r = 0; r < p; ++r) owners.push_back(r);
  for (std::size_t r = p; r-- > 0;) owners.push_back(r);
  return owners;
}

// 3P parts: every rank once in order, then a fixed scramble of 2P more.
std::vector<std::size_t> irregular(std::size_t p) {
  std::vector<std::size_t> owners;
  for (std::size_t r = 0; r < p; ++r) owners.push_back(r);
  for (std::size_t i = 0; i < 2 * p; ++i) owners.push_back((i * 7 + 3) % p);
  return owners;
}

struct Layout {
  std::string name;
  std::vector<std::size_t> owners;
};

// Runs `method` over a layout: results per chain position.
struct PartsRun {
  std::vector<State> fwd, bwd;
};

PartsRun run_layout(const World& w, const std::string& method, const std::vector<std::size_t>& owners,
                    const std::vector<char>& cuts, std::size_t p) {
  const std::size_t n = owners.size();
  PartsRun res{std::vector<State>(n), std::vector<State>(n)};
  std::mutex mu;
  run_in_process(p, [&](const std::shared_ptr<Communicator>& comm) {
    ExchangeOptions o;
    o.part_owners = owners;
    o.expected_shape = w.shape;  // for auto
    auto mesh = DeviceMesh::create(comm, {p}, {"cp"});
    auto ex = make_state_exchange(mesh, method, 1, o);
    std::vector<PartSummary> fwd_parts, bwd_parts;
    for (std::size_t j : ex->own_parts()) {
      fwd_parts.push_back({w.s[j].view(), w.m[j].view(), PartFlags{cuts[j] != 0}});
      bwd_parts.push_back({w.g[j].view(), w.m[j].view(), PartFlags{cuts[j] != 0}});
    }
    std::vector<State> f = ex->forward(fwd_parts);
    std::vector<State> b = ex->backward(bwd_parts);
    std::lock_guard lock(mu);
    for (std::size_t i = 0; i < ex->own_parts().size(); ++i) {
      res.fwd[ex->own_parts()[i]] = std::move(f[i]);
      res.bwd[ex->own_parts()[i]] = std::move(b[i]);
    }
  });
  return res;
}

class Layouts : public ::testing::TestWithParam<std::size_t> {};

TEST_P(Layouts, EveryRowThatTakesLayoutsGivesTheChainBits) {
  const std::size_t p = GetParam();
  const SummaryShape shape{1, 2, 16, 32};
  std::vector<Layout> layouts = {{"zigzag", zigzag(p)}, {"irregular", irregular(p)}};
  std::size_t runs = 0;
  for (const Layout& layout : layouts) {
    const std::size_t n = layout.owners.size();
    World w(n, shape, 500 + p);
    std::vector<std::vector<char>> patterns(3, std::vector<char>(n, 0));
    for (std::size_t j = 0; j < n; ++j) {
      patterns[1][j] = j % 3 == 2;
      patterns[2][j] = j == n / 2;
    }
    for (const auto& cuts : patterns) {
      const std::vector<State> fold_f = test::serial_fold(w, cuts, Direction::forward);
      const std::vector<State> fold_b = test::serial_fold(w, cuts, Direction::backward);
      for (const ProtocolDescriptor* row : protocol_registry()) {
        // auto must choose among the rows that take layouts.
        if (!row->takes_layouts && !row->chooser()) continue;
        ++runs;
        const PartsRun res = run_layout(w, std::string(row->name), layout.owners, cuts, p);
        for (std::size_t j = 0; j < n; ++j) {
          SCOPED_TRACE(::testing::Message() << layout.name << " P=" << p << " " << row->name
                                            << " part " << j << " cut pattern " << (&cuts - &patterns[0]));
          EXPECT_TRUE(test::bitwise_equal(res.fwd[j], fold_f[j]));
          EXPECT_TRUE(test::bitwise_equal(res.bwd[j], fold_b[j]));
        }
      }
    }
  }
  EXPECT_GT(runs, 0u);
}

INSTANTIATE_TEST_SUITE_P(Ranks, Layouts, ::testing::Values(1, 2, 3, 4, 5),
                         [](const auto& info) {
                           std::ostringstream name;
                           name << "P" << info.param;
                           return name.str();
                         });

TEST(Layouts, RowsWithoutLayoutsAndBadLayoutsAreRefusedBeforeAnyMessage) {
  run_in_process(3, [](const std::shared_ptr<Communicator>& comm) {
    auto mesh = DeviceMesh::create(comm, {3}, {"cp"});
    ExchangeOptions o;
    o.part_owners = zigzag(3);
    for (const ProtocolDescriptor* row : protocol_registry()) {
      if (row->takes_layouts || row->chooser()) continue;
      try {
        make_state_exchange(mesh, std::string(row->name), 1, o);
        ADD_FAILURE() << row->name << " accepted a layout";
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find("does not take a layout"), std::string::npos) << e.what();
      }
    }
    ExchangeOptions missing;
    missing.part_owners = {0, 2, 0};  // rank 1 holds nothing
    EXPECT_THROW(make_state_exchange(mesh, "p2p", 1, missing), InvalidArgument);
    ExchangeOptions outside;
    outside.part_owners = {0, 1, 2, 3};
    EXPECT_THROW(make_state_exchange(mesh, "allgather", 1, outside), InvalidArgument);
    // The wrong number of parts for this rank.
    auto ex = make_state_exchange(mesh, "p2p", 1, o);
    State s(1, 1, 16, 16), m(1, 1, 16, 16);
    const std::vector<PartSummary> one{{s.view(), m.view(), {}}};
    EXPECT_THROW(ex->forward(one), InvalidArgument);
    EXPECT_EQ(comm->stats().messages_sent, 0u);
  });
}

}  // namespace
}  // namespace kdacp
