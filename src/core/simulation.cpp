#include "core/simulation.hpp"

namespace kdacp::detail {

namespace {
SimulationHooks& hooks() {
  static SimulationHooks h;
  return h;
}
}  // namespace

void set_simulation_hooks(const SimulationHooks& h) noexcept { hooks() = h; }
const SimulationHooks& simulation_hooks() noexcept { return hooks(); }

}  // namespace kdacp::detail
