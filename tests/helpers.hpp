// Shared test utilities: synthetic per-rank inputs and the FP64 chain.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "kdacp/error.hpp"
#include "kdacp/exchange.hpp"
#include "kdacp/inprocess.hpp"
#include "kdacp/testing/reference.hpp"
#include "kdacp/testing/synthetic.hpp"

namespace kdacp::test {

// All ranks' summaries, dense.
struct World {
  SummaryShape shape;
  std::vector<State> s, m, g;

  World(std::size_t p, SummaryShape sh, std::uint64_t seed) : shape(sh) {
    for (std::size_t r = 0; r < p; ++r) {
      auto f = synthetic_summary(sh, seed, r, false);
      s.push_back(std::move(f.offset));
      m.push_back(std::move(f.transfer));
      g.push_back(std::move(synthetic_summary(sh, seed, r, true).offset));
    }
  }
  std::size_t size() const { return s.size(); }
  std::vector<std::vector<double>> reference(Direction dir) const {
    std::vector<const float*> off, maps;
    for (std::size_t r = 0; r < size(); ++r) {
      off.push_back(dir == Direction::forward ? s[r].data() : g[r].data());
      maps.push_back(m[r].data());
    }
    return reference::chain(off, maps, shape, dir);
  }
};

inline bool bitwise_equal(const State& a, const State& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

inline State copy_of(const State& a) {
  State out(a.batch(), a.heads(), a.rows(), a.cols());
  std::memcpy(out.data(), a.data(), a.bytes());
  return out;
}

// forward(s, m) on rank r must throw InvalidArgument naming `fragment` and
// the rank, before this rank sends any message (SPEC §8).
inline void expect_rejected_before_sending(StateExchange& ex, const Communicator& comm,
                                           const StateView& s, const StateView& m,
                                           const std::string& fragment, std::size_t r) {
  const auto before = comm.stats().messages_sent;
  try {
    ex.forward(s, m);
    ADD_FAILURE() << "no error for " << fragment;
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(r)), std::string::npos) << e.what();
  }
  EXPECT_EQ(comm.stats().messages_sent, before);
}

}  // namespace kdacp::test
