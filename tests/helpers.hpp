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

// The float chain with cuts, serially, with the library's step kernel: what
// every exact protocol must reproduce bit for bit (SPEC §5, §10). A cut sends
// its offset itself; so does the chain's first position.
inline std::vector<State> serial_fold(const World& w, const std::vector<char>& cuts, Direction dir) {
  const std::size_t p = w.size(), k = w.shape.key_dim, v = w.shape.value_dim;
  std::vector<State> out;
  for (std::size_t r = 0; r < p; ++r) out.emplace_back(w.shape.batch, w.shape.heads, k, v);
  const bool fwd = dir == Direction::forward;
  for (std::size_t step = 1; step < p; ++step) {
    const std::size_t from = fwd ? step - 1 : p - step, to = fwd ? step : p - 1 - step;
    const State& off = fwd ? w.s[from] : w.g[from];
    for (std::size_t slab = 0; slab < w.shape.slabs(); ++slab) {
      if (step == 1 || cuts[from]) {
        std::memcpy(out[to].data() + slab * k * v, off.data() + slab * k * v, k * v * sizeof(float));
      } else {
        affine_step(w.m[from].data() + slab * k * k, k, out[from].data() + slab * k * v, v,
                    off.data() + slab * k * v, v, out[to].data() + slab * k * v, v, k, v, dir);
      }
    }
  }
  return out;
}

// The same chain in FP64, for the reassociating rows' bound.
inline std::vector<std::vector<double>> fp64_chain(const World& w, const std::vector<char>& cuts, Direction dir) {
  const std::size_t p = w.size(), k = w.shape.key_dim, v = w.shape.value_dim;
  std::vector<std::vector<double>> out(p, std::vector<double>(w.shape.state_elems(), 0.0));
  const bool fwd = dir == Direction::forward;
  for (std::size_t step = 1; step < p; ++step) {
    const std::size_t from = fwd ? step - 1 : p - step, to = fwd ? step : p - 1 - step;
    const float* off = (fwd ? w.s[from] : w.g[from]).data();
    const float* m = w.m[from].data();
    for (std::size_t slab = 0; slab < w.shape.slabs(); ++slab)
      for (std::size_t i = 0; i < k; ++i)
        for (std::size_t j = 0; j < v; ++j) {
          double acc = off[slab * k * v + i * v + j];
          if (!cuts[from])
            for (std::size_t q = 0; q < k; ++q)
              acc += double(fwd ? m[slab * k * k + i * k + q] : m[slab * k * k + q * k + i]) *
                     out[from][slab * k * v + q * v + j];
          out[to][slab * k * v + i * v + j] = acc;
        }
  }
  return out;
}

}  // namespace kdacp::test
