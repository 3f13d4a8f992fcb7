#include "kdacp/job_plan.hpp"

#include <algorithm>
#include <cmath>

#include "kdacp/error.hpp"
#include "kdacp/protocol.hpp"

namespace kdacp::job {

ProblemShape plan_problem_shape(std::size_t slabs, std::size_t key_dim, std::size_t value_dim,
                                const Layout& layout, const std::optional<Sequences>& seqs) {
  ProblemShape shape{layout.ranks(), slabs, key_dim, value_dim, 4};
  shape.part_owners = layout.owners();
  if (seqs) shape.part_cuts = layout.cuts(*seqs);
  return shape;
}

PlanPredictions plan_predictions(const CostParams& params, const ProblemShape& shape, std::size_t budget) {
  PlanPredictions out;
  const bool layouts_only = needs_layout_rows(shape);
  for (Prediction& p : predict_all(params, shape, true)) {
    if (layouts_only && !find_protocol(p.config.method).takes_layouts) {
      if (out.without_layouts.empty() || out.without_layouts.back() != p.config.method)
        out.without_layouts.push_back(p.config.method);
    } else {
      if (p.config.method == kBaselineProtocol) out.allgather_seconds = p.seconds;
      out.rows.push_back(std::move(p));
    }
  }
  out.exact = choose_protocol(params, shape, budget, false, layouts_only);
  out.any = choose_protocol(params, shape, budget, true, layouts_only);
  return out;
}

std::vector<PlanSeries> plan_series(const CostParams& params, std::size_t max_ranks,
                                    const std::function<ProblemShape(std::size_t)>& shape_at) {
  std::vector<PlanSeries> series;
  for (const ProtocolDescriptor* row : protocol_registry())
    if (!row->chooser()) series.push_back({std::string(row->name), {}});
  for (std::size_t p = 2; p <= std::max<std::size_t>(max_ranks, 2); p *= 2) {
    std::vector<Prediction> best;
    try {
      best = best_per_protocol(params, shape_at(p));
    } catch (const InvalidArgument&) {
    }
    for (PlanSeries& s : series) {
      const auto it = std::find_if(best.begin(), best.end(), [&](const auto& b) { return b.config.method == s.method; });
      s.points.emplace_back(double(p), it == best.end() ? NAN : it->seconds * 1e3);
    }
  }
  return series;
}

}  // namespace kdacp::job
