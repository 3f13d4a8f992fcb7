#include "kdacp/report/exchange_flags.hpp"

#include <fmt/format.h>

#include "kdacp/admission.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/units.hpp"

namespace kdacp::report {

ExchangeOptions exchange_options(const ExchangeFlags& f, const SummaryShape& shape) {
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
