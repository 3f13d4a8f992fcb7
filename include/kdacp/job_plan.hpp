// `kdacp plan`'s arithmetic, for a hypothetical cluster and stream: the
// exchange's problem on a layout (with the cuts of a packing), the cost
// model's rows that run on it, auto's choices, and each protocol's best time
// against P. The job module of the core library; the CLI parses and prints.
#pragma once

#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "kdacp/cost_model.hpp"
#include "kdacp/layout.hpp"

namespace kdacp::job {

// The problem of `slabs` = B·H float32 K×V states on `layout`: its part
// owners and, with `seqs` (T = layout.tokens()), which parts are cuts.
ProblemShape plan_problem_shape(std::size_t slabs, std::size_t key_dim, std::size_t value_dim,
                                const Layout& layout, const std::optional<Sequences>& seqs);

struct PlanPredictions {
  // predict_all's rows (reassociating included); with a layout (needs_layout_rows)
  // only those of protocols that take layouts.
  std::vector<Prediction> rows;
  std::vector<std::string> without_layouts;  // the methods left out, in registry order
  double allgather_seconds = 0;              // kBaselineProtocol's time (0: not among the rows)
  Prediction exact, any;                     // auto's choice, exact only and with reassociation
};

// The predictions of `shape` under `params`; budget_bytes: auto's per-rank
// budget (0: none).
PlanPredictions plan_predictions(const CostParams& params, const ProblemShape& shape, std::size_t budget_bytes);

// One series per protocol but auto, in registry order: the predicted time in
// ms of its best configuration (best_per_protocol) at P = 2, 4, ... up to
// max(max_ranks, 2), from shape_at(P); NaN where shape_at throws
// InvalidArgument (a layout that does not fit that P).
struct PlanSeries {
  std::string method;
  std::vector<std::pair<double, double>> points;  // (P, ms)
};
std::vector<PlanSeries> plan_series(const CostParams& params, std::size_t max_ranks,
                                    const std::function<ProblemShape(std::size_t)>& shape_at);

}  // namespace kdacp::job
