// `kdacp plan`'s report: the cost model's predictions (kdacp/job_plan.hpp)
// for a hypothetical cluster and stream as a table with auto's choices on
// stdout, and optionally a gnuplot chart of time against P per protocol.
// Part of kdacp_testing (tables and plots); the CLI parses the flags.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kdacp/cost_model.hpp"
#include "kdacp/layout.hpp"

namespace kdacp::testing {

struct PlanRequest {
  std::size_t ranks = 1024, batch = 1, heads = 32, key_dim = 128, value_dim = 128;
  bool zigzag = false;  // the layout: zigzag, else contiguous
  // The stream: without a token count only the layout's owners are known,
  // and there are no cuts.
  std::size_t tokens = 0;                // 0: none given
  std::vector<std::int64_t> cu_seqlens;  // a packing of the tokens; empty: one sequence per row
  // The layout of `tokens` tokens on P ranks (called only with tokens > 0);
  // throws InvalidArgument for a layout that does not fit P.
  std::function<Layout(std::size_t ranks)> layout_at;
};

// The exchange's problem at P = `ranks`: the layout's part owners (as the
// layer gives them to its exchange) and, with a token count, which parts
// are cuts (job::plan_problem_shape).
ProblemShape plan_shape_at(const PlanRequest& request, std::size_t ranks);

// "0", "12.3 us", "4.56 ms" or "1.234 s".
std::string format_seconds(double seconds);

// Prints the cluster and layout lines, one row per protocol that runs on the
// layout (time, speed-up over allgather, peak memory per rank, within
// `budget_bytes`; 0: no budget) and auto's choices (job::plan_predictions).
// With a `plot` file name, also draws each protocol's best time against
// P = 2, 4, ... up to request.ranks (job::plan_series) into it, keeping the
// gnuplot script as `plot`.gp.
void print_plan(const PlanRequest& request, const CostParams& params, std::size_t budget_bytes,
                const std::string& plot);

}  // namespace kdacp::testing
