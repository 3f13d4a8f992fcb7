#include "kdacp/report/exchange_flags.hpp"

#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kdacp/admission.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/error.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/units.hpp"

namespace kdacp::report {

namespace {

// The protocols whose registry row takes a knob, "a and b".
std::string taking(bool ProtocolDescriptor::*knob) {
  std::vector<std::string_view> names;
  for (const ProtocolDescriptor* r : protocol_registry())
    if (r->*knob) names.push_back(r->name);
  return fmt::format("{}", fmt::join(names, " and "));
}

}  // namespace

// The factory refuses the same in its own terms (allgather_group_size,
// segments, V); checked here first so that the message names the flags.
void check_exchange_flags(const ExchangeFlags& f, const SummaryShape& shape) {
  const ProtocolDescriptor& row = find_protocol(f.protocol);
  if (f.group_size != 1 && !row.takes_group_size)
    throw InvalidArgument(fmt::format("--group-size {} with --protocol {}, expected 1 (leave it out): only {} take a "
                                      "group size",
                                      f.group_size, f.protocol, taking(&ProtocolDescriptor::takes_group_size)));
  if (f.segments != 0 && !row.takes_segments)
    throw InvalidArgument(fmt::format("--segments {} with --protocol {}, expected 0 (leave it out): only {} take "
                                      "segments",
                                      f.segments, f.protocol, taking(&ProtocolDescriptor::takes_segments)));
  if (f.segments > max_segments(shape.value_dim))
    throw InvalidArgument(fmt::format("--segments {} with --value-dim {}, expected at most ceil(V/16) = {} (0: the "
                                      "cost model's choice)",
                                      f.segments, shape.value_dim, max_segments(shape.value_dim)));
}

ExchangeOptions exchange_options(const ExchangeFlags& f, const SummaryShape& shape) {
  check_exchange_flags(f, shape);
  ExchangeOptions o;
  o.segments = f.segments;
  o.allow_reassociation = f.allow_reassociation;
  if (!f.memory_budget.empty()) o.memory_budget_bytes = parse_bytes(f.memory_budget, "--memory-budget");
  if (!f.calibration.empty()) o.cost = load_cost_params(f.calibration);
  o.expected_shape = shape;
  return o;
}

std::string describe_method(const std::string& method, const std::optional<Prediction>& pred,
                            const ExchangeFlags& flags) {
  if (!pred) return method;
  return fmt::format("{} -> {} (predicted {:.3g} ms per call, {} extra per rank, {})", flags.protocol,
                     protocol_label(pred->config), pred->seconds * 1e3,
                     format_bytes(static_cast<double>(pred->peak_extra_bytes)),
                     pred->exact ? "exact" : "reassociating");
}

}  // namespace kdacp::report
