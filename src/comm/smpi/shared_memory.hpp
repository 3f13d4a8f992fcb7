// The SMPI build's shared-memory mode (docs/scale.md): simulations with more
// ranks than this host's memory and cores hold. KDACP_SMPI_SHARED_MEMORY=1
// in smpirun's environment turns it on for the whole run (read once, when
// smpirun loads the program); unset or 0 leaves every rank computing real
// data in its own memory.
//
// In that mode every Buffer block of 64 KiB or more is SimGrid's shared
// malloc (all ranks' blocks of a call site map the same pages, SMPI skips
// copying them in messages; contents meaningless), and each float fold step
// (C = op(M)·X + S) is charged as its 2·K·K·V flops to the simulated clock
// at the platform host's speed (the cost model's rank) instead of running. The messages,
// their sizes, order and timing are the protocol's own. Results, and any
// check of them, are not: bench exchange's timing is the only use.
#pragma once

namespace kdacp::smpi {

// Whether this run is in the shared-memory mode; throws InvalidArgument
// naming KDACP_SMPI_SHARED_MEMORY when its value is neither 0 nor 1.
bool shared_memory();

// Charges the calling rank's flops held since its last MPI call to the
// simulated clock. The communicator calls it before each MPI call that
// communicates or reads the clock, so that a rank's fold steps take their
// simulated time before its next message leaves (and not once per step: one
// simulation event per burst). A no-op outside the shared-memory mode.
void charge_pending_compute();

}  // namespace kdacp::smpi
