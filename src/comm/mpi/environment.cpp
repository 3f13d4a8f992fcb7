// Launcher detection from the environment only, so that `--backend auto` can
// decide before (and without) initialising MPI.
#include <cstdlib>
#include <string_view>

#include "kdacp/mpi.hpp"

#if defined(KDACP_SMPI)
#include <mpi.h>
#endif

namespace kdacp {

#if !defined(KDACP_SMPI)
namespace {

// Variables every supported launcher exports to its processes: Open MPI's
// mpirun (OMPI_*), PMIx-based launchers (PMIX_RANK: Open MPI 5, srun
// --mpi=pmix) and PMI-1/2 launchers (MPICH's hydra, srun --mpi=pmi2).
constexpr const char* kLaunchVars[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK",
                                       "PMI_SIZE"};
constexpr const char* kSizeVars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"};

std::optional<std::size_t> parse_count(std::string_view text) {
  if (text.empty() || text.size() > 9) return std::nullopt;
  std::size_t value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    value = value * 10 + static_cast<std::size_t>(c - '0');
  }
  return value;
}

}  // namespace
#endif

#if defined(KDACP_SMPI)
// The SMPI build (docs/scale.md) only ever runs under smpirun, which starts
// every simulated rank itself and exports no launcher variables.
bool launched_by_mpirun() { return true; }

std::optional<std::size_t> mpi_world_size_from_env() {
  const int size = smpi_global_size();
  if (size < 0) return std::nullopt;
  return static_cast<std::size_t>(size);
}
#else
bool launched_by_mpirun() {
  for (const char* name : kLaunchVars)
    if (std::getenv(name) != nullptr) return true;
  return false;
}

std::optional<std::size_t> mpi_world_size_from_env() {
  for (const char* name : kSizeVars)
    if (const char* value = std::getenv(name)) return parse_count(value);
  return std::nullopt;
}
#endif

}  // namespace kdacp
