#include "kdacp/testing/plan_report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kdacp/admission.hpp"
#include "kdacp/job_plan.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/testing/plot.hpp"
#include "kdacp/testing/table.hpp"
#include "kdacp/units.hpp"

namespace kdacp::testing {

namespace {

// Predicted time of each protocol's best configuration against P = 2, 4, ...
void write_plot(const PlanRequest& request, const CostParams& params, const ProblemShape& base,
                const std::string& plot) {
  PlotPanel panel{fmt::format("kdacp plan: B*H={} K={} V={} ({})", base.slabs, base.key_dim, base.value_dim,
                              params.source),
                  "P (ranks)", "predicted time (ms)", true, true, false, {}, NAN, ""};
  for (job::PlanSeries& s :
       job::plan_series(params, base.ranks, [&](std::size_t p) { return plan_shape_at(request, p); }))
    panel.series.push_back({s.method, std::move(s.points), false});
  draw_plot({panel}, plot, 900, 600, true);
  std::printf("plot written to %s (gnuplot script with the data: %s.gp)\n", plot.c_str(), plot.c_str());
}

// The layout line: parts, parts per rank, cuts and the critical stretch.
void print_chain(const PlanRequest& request, const ProblemShape& shape) {
  const ChainProfile prof = chain_profile(shape, 1);
  std::string stream;
  if (!request.cu_seqlens.empty())
    stream = fmt::format("; {} packed sequences in T={}, {} parts are cuts", request.cu_seqlens.size() - 1,
                         request.tokens, std::count(shape.part_cuts.begin(), shape.part_cuts.end(), true));
  else if (request.tokens > 0)
    stream = fmt::format("; T={}, one sequence per row", request.tokens);
  fmt::print("layout: {}, {} parts (at most {} per rank){}; critical stretch {} steps (of {} without cuts)\n",
             request.zigzag ? "zigzag" : "contiguous", prof.parts, prof.per_rank, stream, prof.steps,
             prof.parts - 1);
}

}  // namespace

ProblemShape plan_shape_at(const PlanRequest& request, std::size_t ranks) {
  const std::size_t slabs = request.batch * request.heads;
  if (request.tokens == 0) {
    ProblemShape shape{ranks, slabs, request.key_dim, request.value_dim, 4};
    if (request.zigzag) shape.part_owners = PartOwners::zigzag(ranks);
    return shape;
  }
  return job::plan_problem_shape(slabs, request.key_dim, request.value_dim, request.layout_at(ranks),
                                 request.cu_seqlens.empty() ? Sequences(request.batch, request.tokens)
                                                            : Sequences(1, request.tokens, request.cu_seqlens));
}

std::string format_seconds(double s) {
  if (s == 0) return "0";
  if (s < 1e-3) return fmt::format("{:.1f} us", s * 1e6);
  if (s < 1) return fmt::format("{:.2f} ms", s * 1e3);
  return fmt::format("{:.3f} s", s);
}

void print_plan(const PlanRequest& request, const CostParams& params, std::size_t budget,
                const std::string& plot) {
  const ProblemShape shape = plan_shape_at(request, request.ranks);
  std::printf("cluster: P=%zu, B*H=%zu, K=%zu, V=%zu; alpha %s, bandwidth %.3g GB/s, %.6g GFLOP/s (%s)\n",
              shape.ranks, shape.slabs, shape.key_dim, shape.value_dim, format_seconds(params.alpha_s).c_str(),
              1e-9 / params.beta_s_per_byte, params.gflops, params.source.c_str());
  print_chain(request, shape);
  // With a layout only the rows that take one run it (auto chooses among them).
  const job::PlanPredictions plan = job::plan_predictions(params, shape, budget);
  const double allgather = plan.allgather_seconds;
  Table t({"protocol", "exact", "time", "vs allgather", "peak memory/rank", "within budget"});
  for (const auto& p : plan.rows) {
    t.add({protocol_label(p.config), p.exact ? "yes" : "no", format_seconds(p.seconds),
           p.seconds > 0 ? fmt::format("{:.2f}x", allgather / p.seconds) : "-",
           format_bytes(static_cast<double>(p.peak_extra_bytes)),
           budget == 0 || p.peak_extra_bytes <= budget ? "yes" : "no"});
  }
  t.print();
  if (!plan.without_layouts.empty())
    std::printf("not listed: %s (do not take layouts with several parts per rank or parts out of rank order)\n",
                fmt::format("{}", fmt::join(plan.without_layouts, ", ")).c_str());
  for (const auto& [label, p] : {std::pair{"\nauto (exact)", plan.exact}, std::pair{"auto --allow-reassociation", plan.any}})
    std::printf("%s: %s, predicted %s, %.2fx faster than allgather\n", label, protocol_label(p.config).c_str(),
                format_seconds(p.seconds).c_str(), p.seconds > 0 ? allgather / p.seconds : 1.0);
  if (plan.before_cuts)
    std::printf("note: in a run, auto (exact) chooses before the cuts are known: %s\n",
                protocol_label(plan.before_cuts->config).c_str());
  if (!plot.empty()) write_plot(request, params, shape, plot);
}

}  // namespace kdacp::testing
