// The SMPI build's folded mode (docs/scale.md): memory and compute folding
// for simulations with more ranks than this host holds. KDACP_SMPI_FOLD=1 in
// smpirun's environment turns it on for the whole run (read once, when
// smpirun loads the program); unset or 0 leaves every rank computing real
// data in its own memory.
//
// Folded: every Buffer block of 64 KiB or more is SimGrid's shared malloc
// (all ranks' blocks of a call site map the same pages, SMPI skips copying
// them in messages; contents meaningless), and each float fold step is
// charged as its 2·K·K·V flops to the simulated clock at the platform
// host's speed (the cost model's rank) instead of running. The messages,
// their sizes, order and timing are the protocol's own. Results, and any
// check of them, are not: bench exchange's timing is the only use.
#pragma once

namespace kdacp::smpi {

// Whether this run is folded; throws InvalidArgument naming
// KDACP_SMPI_FOLD when its value is neither 0 nor 1.
bool folded();

// Charges the calling rank's flops held since its last MPI call to the
// simulated clock. The communicator calls it before each MPI call that
// communicates or reads the clock, so that a rank's fold steps take their
// simulated time before its next message leaves (and not once per step: one
// simulation event per burst). A no-op when not folded.
void charge_pending_compute();

}  // namespace kdacp::smpi
