// The state exchange as the commands' flags choose it (--protocol,
// --group-size, --segments, --memory-budget, --allow-reassociation,
// --calibration): the method, its knobs and what auto weighs, turned into the
// factory's options (kdacp/exchange.hpp) with errors naming the flags.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

#include "kdacp/cost_model.hpp"
#include "kdacp/exchange.hpp"
#include "kdacp/units.hpp"

namespace kdacp::report {

// P of a run the commands start (--ranks, --validate-ranks; the files' P of
// `kdacp exchange --summaries`).
inline constexpr IntRange kRanksRange{1, 4096};

struct ExchangeFlags {
  std::string protocol = "auto";
  long long group_size = 1;
  std::size_t segments = 0;          // pipelined_p2p / auto: 0 = the model's c
  std::string memory_budget;         // auto: per-rank budget, e.g. "2GiB"; empty = none
  bool allow_reassociation = false;  // auto: weigh the reassociating protocols too
  std::string calibration;           // auto: CostParams JSON from `kdacp calibrate`
};

// Throws InvalidArgument naming the flags for knobs the protocol's registry
// row does not take (--group-size, --segments) and for more --segments than
// ceil(V/16) of `shape`.
void check_exchange_flags(const ExchangeFlags& flags, const SummaryShape& shape);

// The factory's options for calls of `shape` (auto needs the shape to choose),
// after check_exchange_flags. Reads the calibration file when one is named;
// bad values throw, naming the flag.
ExchangeOptions exchange_options(const ExchangeFlags& flags, const SummaryShape& shape);

// "auto -> pipelined_p2p c=4 (predicted 1.20 ms per call, 256 KiB extra per
// rank, exact)" for an auto executor (one with a prediction), the method name
// otherwise.
std::string describe_method(const std::string& method, const std::optional<Prediction>& prediction,
                            const ExchangeFlags& flags);

}  // namespace kdacp::report
