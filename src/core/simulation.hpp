// Internal: what a network simulator may replace in one process that runs
// every rank (the SMPI build's shared-memory mode, docs/scale.md). It keeps
// the protocols, their messages and their sizes, and drops the data: large
// Buffer blocks come from the simulator (SimGrid's shared malloc, where every
// rank's block maps the same physical pages) and the float fold steps are
// charged to the simulated clock as flops instead of being computed. Results
// are then meaningless bytes; only the simulated times are kept. Nothing in
// the library installs these hooks.
#pragma once

#include <cstddef>

namespace kdacp::detail {

struct SimulationHooks {
  // Both or neither: the large-block cache (kdacp/memory.hpp) then takes the
  // blocks it lacks from allocate and returns those it does not keep to
  // deallocate, instead of the system. The memory needs no initial contents.
  void* (*allocate)(std::size_t bytes) = nullptr;
  void (*deallocate)(void* p, std::size_t bytes) = nullptr;
  // Optional, with allocate: a block (core/flagged_buffer.hpp) whose stripes
  // [i·stride + offset, i·stride + offset + length), for every i whose stripe
  // starts inside it, are this rank's own memory and travel in messages as
  // they are (the flags that decide what a protocol does next); the rest is
  // shared as allocate's blocks are. Freed by deallocate.
  void* (*allocate_flagged)(std::size_t bytes, std::size_t stride, std::size_t offset, std::size_t length) = nullptr;
  // When set, a float step C = op(M)·X + S of a K×K map on K×V states is
  // not computed: compute(2·K·K·V) is called instead and C is left as it is.
  void (*compute)(double flops) = nullptr;
};

// Installs the hooks for the rest of the process. Call it before the first
// Buffer is allocated (a static initializer of the simulator's library):
// a block must be freed by the allocator it came from.
void set_simulation_hooks(const SimulationHooks& hooks) noexcept;
const SimulationHooks& simulation_hooks() noexcept;

}  // namespace kdacp::detail
