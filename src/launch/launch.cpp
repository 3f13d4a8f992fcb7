#include "kdacp/launch.hpp"

#include <chrono>

#include <fmt/format.h>

#include "kdacp/error.hpp"

namespace kdacp {

std::string resolve_backend(const LaunchOptions& options, const ProcessLauncher* launcher) {
  if (options.backend != "auto") return options.backend;
  if (launcher && launcher->started()) return launcher->name;
  return "inprocess";
}

void launch(const LaunchOptions& options, const RankFn& fn, const ProcessLauncher* launcher) {
  const std::string backend = resolve_backend(options, launcher);
  if (backend != "inprocess") {
    if (!launcher || launcher->name != backend)
      throw InvalidArgument(fmt::format("--backend {}: this kdacp was built without the {} backend", backend,
                                        backend == "mpi" ? std::string("MPI") : backend));
    launcher->run(options, fn);
    return;
  }
  InProcessOptions o;
  o.timeout = std::chrono::milliseconds(static_cast<long long>(options.timeout_s * 1000));
  run_in_process(options.ranks, fn, o);
}

std::size_t ranks_per_process(const LaunchOptions& options, const ProcessLauncher* launcher) {
  return resolve_backend(options, launcher) == "inprocess" ? options.ranks : 1;
}

}  // namespace kdacp
