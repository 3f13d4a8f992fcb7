// `kdacp plan`'s report: the cost model's predictions (kdacp/job_plan.hpp)
// for a hypothetical cluster and stream as a table with auto's choices on
// stdout, and optionally a gnuplot chart of time against P per protocol.
// Part of kdacp_report (tables and plots); the CLI parses the flags into a
// PlanFlags and calls run_plan.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "kdacp/cost_model.hpp"
#include "kdacp/layout.hpp"
#include "kdacp/report/packing.hpp"

namespace kdacp::report {

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
  // Also price Ulysses × state CP (predict_ulysses) with these options
  // (heads and memory budget are taken from the request and the budget).
  std::optional<UlyssesOptions> ulysses{};
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
// gnuplot script as `plot`.gp. With request.ulysses, a second table: per
// head-group width U the all-to-alls' time, the state exchange's over P/U
// ranks with its protocol, their total and the speed-up over U = 1, and the
// U the model picks. With `json`, the same as one JSON object instead
// (plan_json).
void print_plan(const PlanRequest& request, const CostParams& params, std::size_t budget_bytes,
                const std::string& plot, bool json = false);

// `kdacp plan --json`: {"cluster": {P, B, H, BH, K, V, alpha_s,
// beta_s_per_byte, gflops, group_alpha_s, group_beta_s_per_byte,
// concurrent_ranks, source}, "layout": {zigzag, parts, max_parts_per_rank,
// tokens, cuts, critical_steps}, "memory_budget_bytes", "rows": [{protocol, method,
// group_size, segments, exact, seconds, vs_allgather, peak_extra_bytes,
// within_budget}], "not_listed": [...], "auto_exact", "auto_any" (each
// {protocol, seconds, vs_allgather}; a run's auto weighs the same cuts), and with
// request.ulysses "ulysses": {tokens_per_rank, activation_bytes, node_size,
// in_bytes_per_rank, out_bytes_per_rank, "options": [{U, state_ranks,
// heads_per_rank, all_to_all_seconds, exchange_seconds, exchange_protocol,
// exchange_peak_extra_bytes, seconds, speedup_vs_plain}], "pick": U}.
std::string plan_json(const PlanRequest& request, const CostParams& params, std::size_t budget_bytes);

// `kdacp plan`'s flags as given: quantities as text (parse_seconds,
// parse_rate, parse_bytes read them, naming the flag), empty or 0 when not
// given.
struct PlanFlags {
  std::size_t ranks = 1024, batch = 1, heads = 32, key_dim = 128, value_dim = 128;
  std::string alpha, bandwidth, group_alpha, group_bandwidth, calibration, memory_budget, plot;
  double gflops = 0;
  // The layout and the cut pattern: without a token count (--tokens,
  // --seqlens) only the layout's owners are known, and there are no cuts.
  LayoutFlags layout;
  Packing packing;
  std::size_t tokens = 0;  // 0: none given
  std::uint64_t seed = 0;
  // Ulysses × state CP (--tokens-per-rank asks for it).
  std::size_t tokens_per_rank = 0, activation_bytes = 2, node_size = 8;
  bool json = false;
  // Which of the flags that need another were given.
  bool tokens_given = false, tokens_per_rank_given = false, activation_bytes_given = false, node_size_given = false;
};

// The most tokens `kdacp plan` takes (a hypothetical stream, never allocated).
inline constexpr std::size_t kPlanMaxTokens = std::size_t{1} << 40;

// The request and cost parameters the flags describe, checked once: throws
// InvalidArgument naming the flags that do not fit together (--docs or
// --split without --tokens, --node-size without --tokens-per-rank, ...).
PlanRequest plan_request(const PlanFlags& flags);
CostParams plan_params(const PlanFlags& flags);

// `kdacp plan`: print_plan of the flags' request, parameters and budget.
void run_plan(const PlanFlags& flags);

}  // namespace kdacp::report
