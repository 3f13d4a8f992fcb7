// Layouts with several parts per rank (SPEC §10): contiguous, two
// consecutive parts per rank, zigzag (rank r holds parts r and 2P-1-r) and
// irregular part lists, with cut patterns, for every registry row and every
// valid knob. Exact rows must give, for each of a rank's parts, the bits of
// the serial chain over the parts in chain order; reassociating rows must
// stay within their bound over n parts; every row's measured peak memory must
// stay within its cost model's for the layout.
#include <gtest/gtest.h>

#include <algorithm>
#include <mutex>
#include <sstream>

#include "helpers.hpp"
#include "kdacp/protocol.hpp"

namespace kdacp {
namespace {

using test::World;

std::vector<std::size_t> contiguous(std::size_t p) {
  std::vector<std::size_t> owners;
  for (std::size_t r = 0; r < p; ++r) owners.push_back(r);
  return owners;
}

// Two consecutive parts per rank: a rank's parts form one run.
std::vector<std::size_t> pairs(std::size_t p) {
  std::vector<std::size_t> owners;
  for (std::size_t r = 0; r < p; ++r) owners.insert(owners.end(), {r, r});
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
  PartOwners owners;
};

std::vector<Layout> layouts(std::size_t p) {
  return {{"contiguous", PartOwners(p, contiguous(p))}, {"pairs", PartOwners(p, pairs(p))},
          {"zigzag", PartOwners::zigzag(p)}, {"irregular", PartOwners(p, irregular(p))}};
}

// Cut patterns over n parts: none, every third, the middle one, and a fixed
// pseudo-random one.
std::vector<std::vector<char>> cut_patterns(std::size_t n) {
  std::vector<std::vector<char>> out(4, std::vector<char>(n, 0));
  for (std::size_t j = 0; j < n; ++j) {
    out[1][j] = j % 3 == 2;
    out[2][j] = j == n / 2;
    out[3][j] = ((j * 2654435761u) >> 9) % 3 == 0;
  }
  return out;
}

// Runs `config` over a layout: results per chain position.
struct PartsRun {
  std::vector<State> fwd, bwd;
  std::size_t peak = 0;
  std::string method;  // what the factory built
  std::optional<Prediction> prediction;
};

PartsRun run_layout(const World& w, const ProtocolConfig& config,
                    const PartOwners& owners, const std::vector<char>& cuts,
                    std::size_t p) {
  const std::size_t n = owners.size();
  PartsRun res{std::vector<State>(n), std::vector<State>(n), 0, {}, {}};
  std::mutex mu;
  run_in_process(p, [&](const std::shared_ptr<Communicator>& comm) {
    ExchangeOptions o;
    o.part_owners = owners;
    o.segments = config.segments;
    o.expected_shape = w.shape;  // for auto
    auto mesh = DeviceMesh::create(comm, {p}, {"cp"});
    auto ex = make_state_exchange(mesh, config.method, static_cast<long long>(config.group_size), o);
    std::vector<PartSummary> fwd_parts, bwd_parts;
    for (std::size_t j : ex->own_parts()) {
      fwd_parts.push_back({w.s[j].view(), w.m[j].view(), PartFlags{cuts[j] != 0}});
      bwd_parts.push_back({w.g[j].view(), w.m[j].view(), PartFlags{cuts[j] != 0}});
    }
    std::vector<State> f = ex->forward(fwd_parts);
    const std::size_t peak_f = ex->last_stats().peak_extra_bytes;
    std::vector<State> b = ex->backward(bwd_parts);
    const std::size_t peak_b = ex->last_stats().peak_extra_bytes;
    std::lock_guard lock(mu);
    res.peak = std::max({res.peak, peak_f, peak_b});
    res.method = ex->method();
    res.prediction = ex->prediction();
    for (std::size_t i = 0; i < ex->own_parts().size(); ++i) {
      res.fwd[ex->own_parts()[i]] = std::move(f[i]);
      res.bwd[ex->own_parts()[i]] = std::move(b[i]);
    }
  });
  return res;
}

// Every configuration the factory takes at P: the rows' valid knobs, and
// auto once.
std::vector<ProtocolConfig> configs(std::size_t p, std::size_t value_dim) {
  std::vector<ProtocolConfig> out;
  for (const ProtocolDescriptor* row : protocol_registry()) {
    if (row->chooser()) {
      out.push_back({std::string(row->name), 1, 0});
      continue;
    }
    for (const ProtocolConfig& c : valid_configs(*row, p, value_dim)) out.push_back(c);
  }
  return out;
}

class Layouts : public ::testing::TestWithParam<std::size_t> {};

TEST_P(Layouts, EveryRowAndKnobGivesTheChainBitsOrStaysWithinItsBound) {
  const std::size_t p = GetParam();
  const SummaryShape shape{1, 2, 16, 32};  // two column segments, B·H > 1
  std::size_t runs = 0;
  for (const Layout& layout : layouts(p)) {
    const std::size_t n = layout.owners.size();
    World w(n, shape, 500 + p);
    for (const auto& cuts : cut_patterns(n)) {
      const std::vector<State> fold_f = test::serial_fold(w, cuts, Direction::forward);
      const std::vector<State> fold_b = test::serial_fold(w, cuts, Direction::backward);
      const auto ref_f = test::fp64_chain(w, cuts, Direction::forward);
      const auto ref_b = test::fp64_chain(w, cuts, Direction::backward);
      ProblemShape ps{p, shape.slabs(), shape.key_dim, shape.value_dim, sizeof(float)};
      ps.part_owners = layout.owners;
      ps.part_cuts.assign(cuts.begin(), cuts.end());
      for (const ProtocolConfig& config : configs(p, shape.value_dim)) {
        ++runs;
        std::ostringstream what;
        what << layout.name << " P=" << p << " " << protocol_label(config) << " cuts ";
        for (char c : cuts) what << (c ? '1' : '0');
        SCOPED_TRACE(what.str());
        const PartsRun res = run_layout(w, config, layout.owners, cuts, p);
        const ProtocolDescriptor& built = find_protocol(res.method);
        EXPECT_TRUE(built.takes_layouts) << res.method;
        const double bound = error_bound(built, ps);
        EXPECT_GE(bound, error_bound(built, n, shape.key_dim));
        for (std::size_t j = 0; j < n; ++j) {
          SCOPED_TRACE(::testing::Message() << "part " << j << " built " << res.method);
          if (built.exact()) {
            EXPECT_TRUE(test::bitwise_equal(res.fwd[j], fold_f[j]));
            EXPECT_TRUE(test::bitwise_equal(res.bwd[j], fold_b[j]));
          } else {
            EXPECT_LE(reference::compare(res.fwd[j].data(), ref_f[j]).rel_fro, bound);
            EXPECT_LE(reference::compare(res.bwd[j].data(), ref_b[j]).rel_fro, bound);
          }
        }
        // The model of the configuration that ran bounds what any rank held.
        const Prediction pred = res.prediction ? *res.prediction
                                               : predict(CostParams{}, ps, config);
        EXPECT_LE(res.peak, pred.peak_extra_bytes);
      }
    }
  }
  EXPECT_GT(runs, 0u);
}

INSTANTIATE_TEST_SUITE_P(Ranks, Layouts, ::testing::Values(1, 2, 3, 4, 5, 8),
                         [](const auto& info) {
                           std::ostringstream name;
                           name << "P" << info.param;
                           return name.str();
                         });

TEST(Layouts, RowsWithoutLayoutsAndBadLayoutsAreRefusedBeforeAnyMessage) {
  run_in_process(3, [](const std::shared_ptr<Communicator>& comm) {
    auto mesh = DeviceMesh::create(comm, {3}, {"cp"});
    ExchangeOptions o;
    o.part_owners = PartOwners::zigzag(3);
    for (const ProtocolDescriptor* row : protocol_registry()) {
      if (row->takes_layouts || row->chooser()) continue;
      try {
        make_state_exchange(mesh, std::string(row->name), 1, o);
        ADD_FAILURE() << row->name << " accepted a layout";
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find("does not take a layout"), std::string::npos) << e.what();
      }
    }
    EXPECT_THROW(PartOwners(3, {0, 2, 0}), InvalidArgument);     // rank 1 holds nothing
    EXPECT_THROW(PartOwners(3, {0, 1, 2, 3}), InvalidArgument);  // rank 3 of P = 3
    ExchangeOptions other_p;
    other_p.part_owners = PartOwners::zigzag(2);
    EXPECT_THROW(make_state_exchange(mesh, "allgather", 1, other_p), InvalidArgument);
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
