// Breaks one rank of an MPI exchange on purpose, for the failure-behaviour
// tests (check_fault.cmake asserts exit code, message and duration):
//   kdacp_mpi_fault shape    METHOD WIDTH  rank 1's summaries have V = 32, its peers 16
//   kdacp_mpi_fault validate METHOD WIDTH  rank 2 passes FP64 data (fails validation alone)
//   kdacp_mpi_fault kill     METHOD WIDTH  rank 1 SIGKILLs itself after 20 exchanges;
//                                          the others would keep exchanging for 90 s
// Any error is printed with the rank and ends the whole job (MPI_Abort), the
// way an application should react to it.
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "inputs.hpp"
#include "kdacp/exchange.hpp"
#include "kdacp/mpi.hpp"

int main(int argc, char** argv) {
  using namespace kdacp;
  MpiSession session(&argc, &argv);
  const std::size_t me = session.world_rank();
  if (argc != 4) {
    std::fprintf(stderr, "usage: kdacp_mpi_fault shape|validate|kill METHOD WIDTH\n");
    MpiSession::abort(2);
  }
  const std::string mode = argv[1], method = argv[2];
  const long long width = std::atoll(argv[3]);
  try {
    MpiOptions options;
    options.timeout = std::chrono::seconds(20);
    auto world = mpi_world(options);
    const std::size_t p = world->size();
    const DeviceMesh mesh = DeviceMesh::create(world, {p}, {"cp"});
    auto ex = make_state_exchange(mesh, method, width);
    SummaryShape shape{1, 2, 16, 16};
    if (mode == "shape" && me == 1) shape.value_dim = 32;
    const mpitest::Inputs in = mpitest::make_inputs(shape, p, 5);
    StateView s = in.s[me].view(), m = in.m[me].view(), g = in.g[me].view();
    if (mode == "validate" && me == 2) s.dtype = DType::f64;
    const auto start = std::chrono::steady_clock::now();
    for (std::size_t iter = 0;; ++iter) {
      if (mode == "kill" && me == 1 && iter == 20) {
        std::fprintf(stderr, "kdacp_mpi_fault: rank 1: killing itself mid-exchange\n");
        std::fflush(stderr);
        std::raise(SIGKILL);
      }
      const State fwd = ex->forward(s, m);
      const State bwd = ex->backward(g, m);
      if (mode != "kill" || std::chrono::steady_clock::now() - start > std::chrono::seconds(90))
        break;
    }
    if (me == 0) std::printf("kdacp_mpi_fault: %s: no failure\n", mode.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kdacp_mpi_fault: rank %zu: %s\n", me, e.what());
    std::fflush(stderr);
    MpiSession::abort(3);
  }
  return 0;
}
