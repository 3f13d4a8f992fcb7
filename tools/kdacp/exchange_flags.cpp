#include "exchange_flags.hpp"

#include "flags.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/units.hpp"

namespace kdacp::cli {

void add_exchange_flags(CLI::App& cmd, ExchangeFlags& f) {
  add_choice(cmd, "--protocol", f.protocol,
             "state exchange method; auto picks the predicted-fastest exact protocol (see kdacp plan)",
             exchange_methods());
  add_int(cmd, "--group-size", f.group_size,
          "group width w for the protocols that take one (must divide P; see kdacp protocols)",
          IntRange{1, kRanksRange.max});
  add_int(cmd, "--segments", f.segments,
          "column segments c of pipelined_p2p (and auto when it picks it), at most ceil(V/16); "
          "0: the cost model's choice",
          IntRange{0, kMaxDim / kSegmentColumns});
  add_quantity(cmd, "--memory-budget", f.memory_budget,
               "auto: per-rank budget for the exchange's extra memory, e.g. 512MiB (default: none)",
               Quantity::bytes);
  cmd.add_flag("--allow-reassociation", f.allow_reassociation,
               "auto: also weigh the reassociating protocols (not bitwise equal to the chain; "
               "error bound in kdacp protocols)");
  add_path(cmd, "--calibration", f.calibration,
           "auto: cost parameters from `kdacp calibrate` (default: the built-in InfiniBand-like machine)",
           "a JSON file name");
}

}  // namespace kdacp::cli
