// Breaks one rank of an MPI exchange on purpose, for the failure-behaviour
// tests (check_fault.cmake asserts exit code, messages, duration and that no
// output file appeared):
//   kdacp_mpi_fault MODE METHOD WIDTH [OUT]
//   shape     rank 1's summaries have V = 32, its peers 16
//   validate  rank 2 passes FP64 data (fails validation alone)
//   kill      rank 1 SIGKILLs itself after 20 exchanges; the others would keep
//             exchanging for 90 s
//   killmid   rank 1 SIGKILLs itself inside its first forward, at its second
//             communicator operation, while its peers wait for it
//   stop      rank 1 SIGSTOPs itself there instead: alive but silent
//   disagree  rank 1 runs allgather while the others run METHOD
// Rank 0 writes OUT ("ok") only when every rank finished. Any error is
// printed with the rank and ends the job (MPI_Abort); where a peer went
// silent, only after one more timeout, so that the other ranks, whose waits
// end about as late, print theirs too.
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#include "inputs.hpp"
#include "kdacp/exchange.hpp"
#include "kdacp/mpi.hpp"
#include "kdacp/testing/faulty_comm.hpp"

int main(int argc, char** argv) {
  using namespace kdacp;
  MpiSession session(&argc, &argv);
  const std::size_t me = session.world_rank();
  if (argc != 4 && argc != 5) {
    std::fprintf(stderr,
                 "usage: kdacp_mpi_fault shape|validate|kill|killmid|stop|disagree METHOD WIDTH "
                 "[OUT]\n");
    MpiSession::abort(2);
  }
  const std::string mode = argv[1];
  std::string method = argv[2];
  long long width = std::atoll(argv[3]);
  // The scenarios where a peer stops answering wait for a timeout: a short
  // one keeps them quick. The others fail without waiting.
  const bool silent_peer = mode == "stop" || mode == "disagree";
  MpiOptions options;
  options.timeout = silent_peer ? std::chrono::seconds(2) : std::chrono::seconds(20);
  try {
    auto world = mpi_world(options);
    const std::size_t p = world->size();
    testing::FaultInjector injector(p, {});
    if (mode == "killmid" || mode == "stop") {
      injector = testing::FaultInjector(
          p, {{1, testing::FaultOp::any, 1, testing::FaultAction::signal, {},
               mode == "stop" ? SIGSTOP : SIGKILL}});
    }
    if (mode == "disagree" && me == 1) {
      method = "allgather";
      width = 1;
    }
    const DeviceMesh mesh = DeviceMesh::create(injector.wrap(world), {p}, {"cp"});
    auto ex = make_state_exchange(mesh, method, width);
    SummaryShape shape{1, 2, 16, 16};
    if (mode == "shape" && me == 1) shape.value_dim = 32;
    const mpitest::Inputs in = mpitest::make_inputs(shape, p, 5);
    StateView s = in.s[me].view(), m = in.m[me].view(), g = in.g[me].view();
    if (mode == "validate" && me == 2) s.dtype = DType::f64;
    injector.arm(me);
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
    // Every rank is done before rank 0 writes: an output means a complete run.
    world->barrier();
    if (me == 0) {
      if (argc == 5) std::ofstream(argv[4]) << "ok\n";
      std::printf("kdacp_mpi_fault: %s: no failure\n", mode.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kdacp_mpi_fault: rank %zu: %s\n", me, e.what());
    std::fflush(stderr);
    if (silent_peer) std::this_thread::sleep_for(options.timeout);
    MpiSession::abort(3);
  }
  return 0;
}
