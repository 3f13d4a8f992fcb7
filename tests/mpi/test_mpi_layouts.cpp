// Layouts with several parts per rank (SPEC §10) under MPI: every registry
// row and every valid knob, with zigzag (rank r holds parts r and 2P-1-r) and
// an irregular part list, with and without cuts, gives on every rank the bits
// the same configuration gives on in-process ranks; exact rows also the bits
// of the in-process chain (p2p). The in-process references are computed in
// every process from the same seeded inputs (inputs.hpp).
#include <gtest/gtest.h>

#include <cstring>
#include <mutex>
#include <string>

#include "inputs.hpp"
#include "kdacp/exchange.hpp"
#include "kdacp/inprocess.hpp"
#include "kdacp/mesh.hpp"
#include "kdacp/mpi.hpp"
#include "kdacp/protocol.hpp"

namespace kdacp {
namespace {

using mpitest::Inputs;
using mpitest::make_inputs;

bool same_bits(const State& a, const State& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

struct PartResults {
  std::vector<State> fwd, bwd;  // per chain position (only own ones on MPI)
};

// Runs `config` over `comm` with the layout; fills the positions this rank holds.
void run_parts(const std::shared_ptr<Communicator>& comm, const Inputs& in, const ProtocolConfig& config,
               const PartOwners& owners, const std::vector<char>& cuts,
               PartResults& out, std::mutex* mu) {
  const std::size_t p = comm->size();
  ExchangeOptions o;
  o.part_owners = owners;
  o.segments = config.segments;
  const DeviceMesh mesh = DeviceMesh::create(comm, {p}, {"cp"});
  auto ex = make_state_exchange(mesh, config.method, static_cast<long long>(config.group_size), o);
  std::vector<PartSummary> fwd, bwd;
  for (std::size_t j : ex->own_parts()) {
    fwd.push_back({in.s[j].view(), in.m[j].view(), PartFlags{cuts[j] != 0}});
    bwd.push_back({in.g[j].view(), in.m[j].view(), PartFlags{cuts[j] != 0}});
  }
  std::vector<State> f = ex->forward(fwd);
  std::vector<State> b = ex->backward(bwd);
  std::unique_lock<std::mutex> lock;
  if (mu) lock = std::unique_lock<std::mutex>(*mu);
  for (std::size_t i = 0; i < ex->own_parts().size(); ++i) {
    out.fwd[ex->own_parts()[i]] = std::move(f[i]);
    out.bwd[ex->own_parts()[i]] = std::move(b[i]);
  }
}

PartResults in_process_parts(const Inputs& in, std::size_t p, const ProtocolConfig& config,
                             const PartOwners& owners, const std::vector<char>& cuts) {
  PartResults out{std::vector<State>(owners.size()), std::vector<State>(owners.size())};
  std::mutex mu;
  run_in_process(p, [&](const std::shared_ptr<Communicator>& comm) {
    run_parts(comm, in, config, owners, cuts, out, &mu);
  });
  return out;
}

std::vector<std::size_t> irregular(std::size_t p) {
  std::vector<std::size_t> owners;
  for (std::size_t r = 0; r < p; ++r) owners.push_back(r);
  for (std::size_t i = 0; i < 2 * p; ++i) owners.push_back((i * 5 + 1) % p);
  return owners;
}

TEST(MpiLayouts, EveryRowWithZigzagAndCutsIsBitwiseInProcess) {
  auto comm = mpi_world(MpiOptions{});
  const std::size_t p = comm->size(), me = comm->rank();
  const SummaryShape shape{1, 2, 16, 32};
  struct Case {
    std::string name;
    PartOwners owners;
    bool cuts;
  };
  const Case cases[] = {{"zigzag", PartOwners::zigzag(p), false},
                        {"zigzag", PartOwners::zigzag(p), true},
                        {"irregular", PartOwners(p, irregular(p)), true}};
  std::uint64_t seed = 300;
  for (const Case& c : cases) {
    const std::size_t n = c.owners.size();
    const Inputs in = make_inputs(shape, n, seed++);
    std::vector<char> cuts(n, 0);
    for (std::size_t j = 0; j < n; ++j) cuts[j] = c.cuts && j % 3 == 1;
    const PartResults chain = in_process_parts(in, p, {"p2p", 1, 0}, c.owners, cuts);
    for (const ProtocolDescriptor* row : protocol_registry()) {
      if (row->chooser()) continue;
      ASSERT_TRUE(row->takes_layouts) << row->name;
      for (const ProtocolConfig& config : valid_configs(*row, p, shape.value_dim)) {
        SCOPED_TRACE(c.name + (c.cuts ? " with cuts " : " ") + protocol_label(config) + " P=" +
                     std::to_string(p) + " rank " + std::to_string(me));
        const PartResults ref = in_process_parts(in, p, config, c.owners, cuts);
        PartResults got{std::vector<State>(n), std::vector<State>(n)};
        run_parts(comm, in, config, c.owners, cuts, got, nullptr);
        const bool exact = find_protocol(config.method).exact();
        for (std::size_t j = 0; j < n; ++j) {
          if (c.owners[j] != me) continue;
          EXPECT_TRUE(same_bits(got.fwd[j], ref.fwd[j])) << "part " << j << " forward differs from in-process";
          EXPECT_TRUE(same_bits(got.bwd[j], ref.bwd[j])) << "part " << j << " backward differs from in-process";
          if (exact) {
            EXPECT_TRUE(same_bits(got.fwd[j], chain.fwd[j])) << "part " << j << " forward differs from the chain";
            EXPECT_TRUE(same_bits(got.bwd[j], chain.bwd[j])) << "part " << j << " backward differs from the chain";
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace kdacp
