#include "backend.hpp"

#include <chrono>

#include "kdacp/error.hpp"

namespace kdacp::cli {

void add_backend_flags(CLI::App& cmd, BackendOptions& opts) {
  cmd.add_option("--backend", opts.backend,
                 "where ranks run: inprocess (threads of this process), mpi (one process per "
                 "rank under mpirun) or auto (mpi when launched by mpirun with more than one "
                 "process)")
      ->check(CLI::IsMember({"auto", "inprocess", "mpi"}))
      ->capture_default_str();
  cmd.add_option("--ranks,-P", opts.ranks, "number of in-process ranks (context-parallel size P)")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  cmd.add_option("--timeout", opts.timeout_s, "seconds any rank waits for a peer before failing")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
}

namespace {
std::string resolve(const BackendOptions& opts) {
  if (opts.backend != "auto") return opts.backend;
  return "inprocess";
}
}  // namespace

void run_ranks(const BackendOptions& opts, const RankFn& fn) {
  const std::string backend = resolve(opts);
  if (backend == "mpi")
    throw InvalidArgument("--backend mpi: this kdacp was built without the MPI backend");
  InProcessOptions o;
  o.timeout = std::chrono::milliseconds(static_cast<long long>(opts.timeout_s * 1000));
  run_in_process(opts.ranks, fn, o);
}

std::size_t ranks_per_process(const BackendOptions& opts) {
  return resolve(opts) == "inprocess" ? opts.ranks : 1;
}

}  // namespace kdacp::cli
