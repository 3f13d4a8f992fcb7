// The planner (Planner): prices the registry rows' cost terms (protocol.hpp)
// with a machine's parameters, and auto's rule. The parameters (cost_params.cpp),
// the chain profile (chain_profile.cpp), pipelined_p2p's streams
// (pipelined_p2p.cpp), the runs (runs_cost.cpp) and Ulysses
// (ulysses_cost.cpp) each live apart.
#include "kdacp/cost_model.hpp"

#include <algorithm>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "exchange/cost_terms.hpp"
#include "kdacp/error.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/summary.hpp"

namespace kdacp {

using detail::check_cost_params;
using detail::check_cost_shape;

namespace {

// The machine facts a shape leaves unset (0), from the parameters.
void fill_machine(const CostParams& params, ProblemShape& shape) {
  if (shape.ranks_per_node == 0) shape.ranks_per_node = params.node_ranks;
  if (shape.ranks_per_leaf == 0) shape.ranks_per_leaf = params.leaf_ranks;
  if (shape.leaf_oversubscription == 0) shape.leaf_oversubscription = params.oversubscription;
}

}  // namespace

std::size_t max_segments(std::size_t value_dim) {
  return std::max<std::size_t>(1, (value_dim + kSegmentColumns - 1) / kSegmentColumns);
}

namespace {

// The terms priced with the machine's parameters. `work` and `path` are the
// compute seconds of all ranks together and of the critical path: with fewer
// cores than ranks (concurrent_ranks < P) the cores, not the dependency
// chain, bound the time.
double seconds_of(const CostParams& c, const ProblemShape& s, const CostTerms& t) {
  const double group_alpha = c.group_alpha_s > 0 ? c.group_alpha_s : c.alpha_s;
  const double group_beta = c.group_beta_s_per_byte > 0 ? c.group_beta_s_per_byte : c.beta_s_per_byte;
  const double flop_rate = c.gflops * 1e9;
  const double kk = static_cast<double>(s.key_dim) * static_cast<double>(s.key_dim);
  const double slabs = static_cast<double>(s.slabs);
  const double t_fold = 2 * slabs * kk * static_cast<double>(s.value_dim) / flop_rate;
  const double t_mm = 2 * slabs * kk * static_cast<double>(s.key_dim) / flop_rate;
  const double path = t.folds * t_fold + t.products * t_mm;
  double seconds = t.messages * c.alpha_s + (t.bytes + t.contention_bytes) * c.beta_s_per_byte +
                   t.group_messages * group_alpha + t.group_bytes * group_beta + path;
  const std::size_t slots = c.concurrent_ranks;
  if (slots > 0 && slots < s.ranks) {
    const double work = t.work_folds * t_fold + t.work_products * t_mm;
    seconds += std::max(0.0, work / static_cast<double>(slots) - path);
  }
  return seconds;
}

// The row of `config`, with its knobs checked and normalised: the group size
// 1 and segments 0 for rows without those knobs, segments 0 resolved to the
// model's choice.
const ProtocolDescriptor& checked_row(const ProtocolConfig& config, const ProblemShape& shape,
                                      ProtocolConfig& out) {
  const ProtocolDescriptor& row = find_protocol(config.method);
  if (row.chooser())
    throw InvalidArgument(fmt::format(
        "cost model: '{}' chooses among the protocols (choose_protocol), it has no cost of its own", config.method));
  out = config;
  if (!row.takes_group_size) out.group_size = 1;
  if (!row.takes_segments) out.segments = 0;
  if (out.group_size == 0 || shape.ranks % out.group_size != 0) {
    throw InvalidArgument(fmt::format("cost model: group size {} for {} does not divide P = {}, expected a divisor",
                                      out.group_size, config.method, shape.ranks));
  }
  if (out.segments > max_segments(shape.value_dim)) {
    throw InvalidArgument(fmt::format("cost model: segments {} for V = {}, expected at most ceil(V/16) = {}",
                                      out.segments, shape.value_dim, max_segments(shape.value_dim)));
  }
  return row;
}

}  // namespace

Planner::Planner(CostParams params)
    : params_(std::move(params)), waits_(std::make_unique<StreamWaitsCache>()) {}

double Planner::stream_nic_waits(const ProblemShape& shape, std::size_t segments) const {
  return kdacp::stream_nic_waits(shape, segments, waits_.get());
}

std::size_t Planner::best_segments(const ProblemShape& given, const std::string& method) const {
  check_cost_params(params_);
  check_cost_shape(given);
  ProblemShape shape = given;
  fill_machine(params_, shape);
  ProtocolConfig config;
  const ProtocolDescriptor& row = checked_row({method, 1, 0}, shape, config);
  if (!row.takes_segments) return 0;
  std::size_t best = 1;
  double best_time = std::numeric_limits<double>::infinity();
  for (std::size_t c = 1; c <= max_segments(shape.value_dim); ++c) {
    config.segments = c;
    const double time = seconds_of(params_, shape, row.cost(shape, config, waits_.get()));
    if (time < best_time) best = c, best_time = time;
  }
  return best;
}

Prediction Planner::predict(const ProblemShape& given, const ProtocolConfig& config) const {
  check_cost_params(params_);
  check_cost_shape(given);
  ProblemShape shape = given;
  fill_machine(params_, shape);
  Prediction out;
  const ProtocolDescriptor& row = checked_row(config, shape, out.config);
  if (row.takes_segments && out.config.segments == 0) out.config.segments = best_segments(shape, out.config.method);
  const CostTerms terms = row.cost(shape, out.config, waits_.get());
  out.exact = row.exact();
  out.seconds = seconds_of(params_, shape, terms);
  out.peak_extra_bytes = terms.peak_extra_bytes;
  return out;
}

std::vector<Prediction> Planner::predict_all(const ProblemShape& shape, bool include_reassociating) const {
  check_cost_shape(shape);
  std::vector<Prediction> out;
  for (const ProtocolDescriptor* row : protocol_registry()) {
    if (row->chooser() || (!row->exact() && !include_reassociating)) continue;
    if (row->takes_group_size) {
      // w = 1 and w = P are the chain and the allgather: weighed as themselves.
      for (std::size_t w = 2; w < shape.ranks; ++w)
        if (shape.ranks % w == 0) out.push_back(predict(shape, {std::string(row->name), w, 0}));
    } else {
      out.push_back(predict(shape, {std::string(row->name), 1, 0}));
    }
  }
  return out;
}

std::vector<Prediction> Planner::best_per_protocol(const ProblemShape& shape) const {
  std::vector<Prediction> best;
  // predict_all lists a row's configurations next to each other.
  for (const Prediction& p : predict_all(shape, true)) {
    if (best.empty() || best.back().config.method != p.config.method) best.push_back(p);
    else if (p.seconds < best.back().seconds) best.back() = p;
  }
  return best;
}

Prediction Planner::choose_protocol(const ProblemShape& shape, std::size_t memory_budget_bytes,
                                    bool allow_reassociation, bool layouts_only) const {
  const auto all = predict_all(shape, allow_reassociation);
  const Prediction* best = nullptr;
  std::size_t least_memory = std::numeric_limits<std::size_t>::max();
  for (const Prediction& p : all) {
    if (layouts_only && !find_protocol(p.config.method).takes_layouts) continue;
    least_memory = std::min(least_memory, p.peak_extra_bytes);
    if (memory_budget_bytes != 0 && p.peak_extra_bytes > memory_budget_bytes) continue;
    if (best == nullptr || p.seconds < best->seconds) best = &p;
  }
  if (best == nullptr) {
    throw InvalidArgument(fmt::format(
        "memory_budget_bytes is {}, expected at least the smallest protocol's need of {} bytes",
        memory_budget_bytes, least_memory));
  }
  return *best;
}

// The free functions: one call of a planner of their own.

std::size_t best_segments(const CostParams& params, const ProblemShape& shape, const std::string& method) {
  return Planner(params).best_segments(shape, method);
}

Prediction predict(const CostParams& params, const ProblemShape& shape, const ProtocolConfig& config) {
  return Planner(params).predict(shape, config);
}

std::vector<Prediction> predict_all(const CostParams& params, const ProblemShape& shape,
                                    bool include_reassociating) {
  return Planner(params).predict_all(shape, include_reassociating);
}

std::vector<Prediction> best_per_protocol(const CostParams& params, const ProblemShape& shape) {
  return Planner(params).best_per_protocol(shape);
}

Prediction choose_protocol(const CostParams& params, const ProblemShape& shape,
                           std::size_t memory_budget_bytes, bool allow_reassociation,
                           bool layouts_only) {
  return Planner(params).choose_protocol(shape, memory_budget_bytes, allow_reassociation, layouts_only);
}

}  // namespace kdacp
