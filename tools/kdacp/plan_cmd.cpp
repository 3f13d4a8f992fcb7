// kdacp plan: the cost model's table for a hypothetical cluster, auto's
// choice, and optionally a gnuplot chart of time vs P per protocol.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <utility>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "commands.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/error.hpp"
#include "kdacp/admission.hpp"
#include "kdacp/job_plan.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/testing/plot.hpp"
#include "flags.hpp"
#include "layer_flags.hpp"
#include "kdacp/units.hpp"
#include "kdacp/testing/table.hpp"

namespace kdacp::cli {

namespace {

std::string fmt_time(double s) {
  if (s == 0) return "0";
  if (s < 1e-3) return fmt::format("{:.1f} us", s * 1e6);
  if (s < 1) return fmt::format("{:.2f} ms", s * 1e3);
  return fmt::format("{:.3f} s", s);
}

struct PlanConfig {
  std::size_t ranks = 1024, batch = 1, heads = 32, key_dim = 128, value_dim = 128;
  std::string alpha, bandwidth, group_alpha, group_bandwidth, calibration, memory_budget, plot;
  double gflops = 0;
  // The layout and the cut pattern: without a token count (--tokens,
  // --seqlens) only the layout's owners are known, and there are no cuts.
  LayoutFlags layout;
  PackingFlags packing;
  std::size_t tokens = 0;  // 0: none given
  std::uint64_t seed = 0;
};

// The most tokens `kdacp plan` takes (a hypothetical stream, never allocated).
constexpr std::size_t kPlanMaxTokens = std::size_t{1} << 40;

// What the flags say about the stream, checked once: T (0: none) and the
// packing's cu_seqlens (empty: one sequence per row).
struct PlanStream {
  std::size_t tokens = 0;
  std::vector<std::int64_t> cu_seqlens;
};

PlanStream plan_stream(const PlanConfig& c, bool tokens_given) {
  check_layout_flags(c.layout);
  PlanStream st;
  st.tokens = packed_tokens(c.packing, c.tokens, tokens_given, kPlanMaxTokens);
  if (st.tokens == 0) {
    if (c.packing.docs > 0)
      throw InvalidArgument(
          fmt::format("--docs {} needs --tokens T, the stream the documents are packed into", c.packing.docs));
    if (!c.layout.split.empty()) throw InvalidArgument("--split needs --tokens T (or --seqlens), the tokens it splits");
  }
  if (st.tokens > 0) st.cu_seqlens = packing(c.packing, c.batch, st.tokens, c.seed);
  return st;
}

// The shape at P = `ranks`: the layout's part owners (as the layer gives
// them to its exchange) and, with a token count, which parts are cuts.
ProblemShape shape_at(const PlanConfig& c, const PlanStream& st, std::size_t ranks) {
  if (st.tokens == 0) {
    ProblemShape shape{ranks, c.batch * c.heads, c.key_dim, c.value_dim, 4};
    if (c.layout.layout == "zigzag") shape.part_owners = PartOwners::zigzag(ranks);
    return shape;
  }
  return job::plan_problem_shape(c.batch * c.heads, c.key_dim, c.value_dim, layout_of(c.layout, st.tokens, ranks),
                                 st.cu_seqlens.empty() ? Sequences(c.batch, st.tokens)
                                                       : Sequences(1, st.tokens, st.cu_seqlens));
}

CostParams params_of(const PlanConfig& c) {
  CostParams p = c.calibration.empty() ? CostParams{} : load_cost_params(c.calibration);
  if (!c.alpha.empty()) p.alpha_s = parse_seconds(c.alpha, "--alpha");
  if (!c.bandwidth.empty()) p.beta_s_per_byte = 1 / parse_rate(c.bandwidth, "--bandwidth");
  if (!c.group_alpha.empty()) p.group_alpha_s = parse_seconds(c.group_alpha, "--group-alpha");
  if (!c.group_bandwidth.empty())
    p.group_beta_s_per_byte = 1 / parse_rate(c.group_bandwidth, "--group-bandwidth");
  if (c.gflops > 0) p.gflops = c.gflops;
  if (!c.alpha.empty() || !c.bandwidth.empty() || c.gflops > 0) p.source = "command line";
  return p;
}

// Predicted time of each protocol's best configuration against P = 2, 4, ...
void write_plot(const PlanConfig& cfg, const PlanStream& st, const CostParams& params, const ProblemShape& base) {
  testing::PlotPanel panel{fmt::format("kdacp plan: B*H={} K={} V={} ({})", base.slabs, base.key_dim,
                                       base.value_dim, params.source),
                           "P (ranks)", "predicted time (ms)", true, true, false, {}, NAN, ""};
  for (job::PlanSeries& s : job::plan_series(params, base.ranks, [&](std::size_t p) { return shape_at(cfg, st, p); }))
    panel.series.push_back({s.method, std::move(s.points), false});
  testing::draw_plot({panel}, cfg.plot, 900, 600, true);
  std::printf("plot written to %s (gnuplot script with the data: %s.gp)\n", cfg.plot.c_str(), cfg.plot.c_str());
}

// The layout line: parts, parts per rank, cuts and the critical stretch.
void print_chain(const PlanConfig& cfg, const PlanStream& st, const ProblemShape& shape) {
  const ChainProfile prof = chain_profile(shape, 1);
  std::string stream;
  if (!st.cu_seqlens.empty())
    stream = fmt::format("; {} packed sequences in T={}, {} parts are cuts", st.cu_seqlens.size() - 1, st.tokens,
                         std::count(shape.part_cuts.begin(), shape.part_cuts.end(), true));
  else if (st.tokens > 0)
    stream = fmt::format("; T={}, one sequence per row", st.tokens);
  fmt::print("layout: {}, {} parts (at most {} per rank){}; critical stretch {} steps (of {} without cuts)\n",
             cfg.layout.layout, prof.parts, prof.per_rank, stream, prof.steps, prof.parts - 1);
}

void run_plan(const PlanConfig& cfg, bool tokens_given) {
  const CostParams params = params_of(cfg);
  const PlanStream st = plan_stream(cfg, tokens_given);
  const ProblemShape shape = shape_at(cfg, st, cfg.ranks);
  const std::size_t budget = cfg.memory_budget.empty() ? 0 : parse_bytes(cfg.memory_budget, "--memory-budget");
  std::printf("cluster: P=%zu, B*H=%zu, K=%zu, V=%zu; alpha %s, bandwidth %.3g GB/s, %.6g GFLOP/s (%s)\n",
              shape.ranks, shape.slabs, shape.key_dim, shape.value_dim,
              fmt_time(params.alpha_s).c_str(), 1e-9 / params.beta_s_per_byte, params.gflops,
              params.source.c_str());
  print_chain(cfg, st, shape);
  // With a layout only the rows that take one run it (auto chooses among them).
  const job::PlanPredictions plan = job::plan_predictions(params, shape, budget);
  const double allgather = plan.allgather_seconds;
  testing::Table t({"protocol", "exact", "time", "vs allgather", "peak memory/rank", "within budget"});
  for (const auto& p : plan.rows) {
    t.add({protocol_label(p.config), p.exact ? "yes" : "no", fmt_time(p.seconds),
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
                fmt_time(p.seconds).c_str(), p.seconds > 0 ? allgather / p.seconds : 1.0);
  if (plan.before_cuts)
    std::printf("note: in a run, auto (exact) chooses before the cuts are known: %s\n",
                protocol_label(plan.before_cuts->config).c_str());
  if (!cfg.plot.empty()) write_plot(cfg, st, params, shape);
}

}  // namespace

void add_plan_command(CLI::App& app) {
  auto cfg = std::make_shared<PlanConfig>();
  CLI::App* cmd = app.add_subcommand(
      "plan", "predict every protocol's time and memory for a hypothetical cluster (cost model)");
  // P is hypothetical here, so larger than any run; the shape limits are the runs'.
  add_int(*cmd, "--ranks,-P", cfg->ranks, "CP size P", IntRange{1, 1 << 20});
  add_bhkv_flags(*cmd, cfg->batch, cfg->heads, cfg->key_dim, cfg->value_dim);
  add_quantity(*cmd, "--alpha", cfg->alpha, "per-message latency, e.g. 5us (default 5us)", Quantity::seconds);
  add_quantity(*cmd, "--bandwidth", cfg->bandwidth, "per-rank bandwidth, e.g. 50GB/s (default 45GB/s)",
               Quantity::rate);
  add_real(*cmd, "--gflops", cfg->gflops, "fold throughput per rank in GFLOP/s", kPositive)->default_str("40000");
  add_quantity(*cmd, "--group-alpha", cfg->group_alpha, "latency inside an all-gather group (NVLink)",
               Quantity::seconds);
  add_quantity(*cmd, "--group-bandwidth", cfg->group_bandwidth, "bandwidth inside an all-gather group",
               Quantity::rate);
  add_path(*cmd, "--calibration", cfg->calibration, "JSON from `kdacp calibrate` (flags override it)",
           "a JSON file name");
  add_quantity(*cmd, "--memory-budget", cfg->memory_budget, "per-rank budget for auto, e.g. 2GiB", Quantity::bytes);
  add_path(*cmd, "--plot", cfg->plot, "write a PNG of time vs P per protocol (gnuplot) and its script FILE.gp",
           "a file name");
  auto* tokens = add_int(*cmd, "--tokens,-T", cfg->tokens,
                         "tokens of the stream, for the layout's part boundaries and cuts (with --seqlens: their sum)",
                         IntRange{1, kPlanMaxTokens})
                     ->default_str("none");
  add_layout_flags(*cmd, cfg->layout);
  add_packing_flags(*cmd, cfg->packing, kPlanMaxTokens, "; parts where one starts are cuts, which shorten the chain");
  add_int(*cmd, "--seed", cfg->seed, "seed of --docs' packing (as in kdacp run)", IntRange{});
  cmd->callback([cfg, tokens] { run_plan(*cfg, tokens->count() > 0); });
}

}  // namespace kdacp::cli
