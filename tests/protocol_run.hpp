// One protocol configuration run over an in-process world: every rank's
// forward and backward results and stats, and what the factory built. Shared
// by the protocol matrix, the head-size and the one-part cost tests.
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "helpers.hpp"
#include "kdacp/layout.hpp"
#include "kdacp/protocol.hpp"

namespace kdacp::test {

struct ConfigRun {
  std::vector<State> fwd, bwd;
  std::vector<ExchangeStats> fwd_stats, bwd_stats;
  std::string method;  // what the factory built (degenerate widths build another row)
  bool exact = true;

  // The most extra memory any rank held in either direction.
  std::size_t peak() const {
    std::size_t out = 0;
    for (std::size_t r = 0; r < fwd_stats.size(); ++r)
      out = std::max({out, fwd_stats[r].peak_extra_bytes, bwd_stats[r].peak_extra_bytes});
    return out;
  }
};

// Runs `config` on every rank of `w` (cuts[r]: part r contains a sequence
// start; one_part_per_rank: the options name that layout's owners
// explicitly); every rank must build the same method.
inline ConfigRun run_config(const World& w, const ProtocolConfig& config, const std::vector<char>& cuts,
                            bool one_part_per_rank = false) {
  const std::size_t p = w.size();
  ConfigRun res{std::vector<State>(p), std::vector<State>(p), std::vector<ExchangeStats>(p),
                std::vector<ExchangeStats>(p), {}, true};
  std::vector<std::string> methods(p);
  std::vector<char> exact(p);
  run_in_process(p, [&](const std::shared_ptr<Communicator>& comm) {
    const std::size_t r = comm->rank();
    ExchangeOptions o;
    o.segments = config.segments;
    if (one_part_per_rank) o.part_owners = PartOwners::one_per_rank(p);
    auto mesh = DeviceMesh::create(comm, {p}, {"cp"});
    auto ex = make_state_exchange(mesh, config.method, static_cast<long long>(config.group_size), o);
    const PartFlags part{cuts[r] != 0};
    res.fwd[r] = ex->forward(w.s[r].view(), w.m[r].view(), part);
    res.fwd_stats[r] = ex->last_stats();
    res.bwd[r] = ex->backward(w.g[r].view(), w.m[r].view(), part);
    res.bwd_stats[r] = ex->last_stats();
    methods[r] = ex->method();
    exact[r] = ex->exact();
  });
  for (std::size_t r = 1; r < p; ++r) {
    EXPECT_EQ(methods[r], methods[0]) << "rank " << r;
    EXPECT_EQ(exact[r], exact[0]) << "rank " << r;
  }
  res.method = methods[0];
  res.exact = exact[0] != 0;
  return res;
}

}  // namespace kdacp::test
