// kdacp plan: the cost model's table for a hypothetical cluster, auto's
// choice, and optionally a gnuplot chart of time vs P per protocol.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>

#include "commands.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/testing/plot.hpp"
#include "flags.hpp"
#include "kdacp/units.hpp"
#include "table.hpp"

namespace kdacp::cli {

namespace {

std::string fmt_time(double s) {
  if (s == 0) return "0";
  if (s < 1e-3) return fmt("%.1f us", s * 1e6);
  if (s < 1) return fmt("%.2f ms", s * 1e3);
  return fmt("%.3f s", s);
}

std::string config_name(const Prediction& p) { return protocol_label(p.config); }

struct PlanConfig {
  std::size_t ranks = 1024, batch = 1, heads = 32, key_dim = 128, value_dim = 128;
  std::string alpha, bandwidth, group_alpha, group_bandwidth, calibration, memory_budget, plot;
  double gflops = 0;
};

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
void write_plot(const PlanConfig& cfg, const CostParams& params, const ProblemShape& base) {
  testing::PlotPanel panel{"kdacp plan: B*H=" + std::to_string(base.slabs) + " K=" + std::to_string(base.key_dim) +
                               " V=" + std::to_string(base.value_dim) + " (" + params.source + ")",
                           "P (ranks)", "predicted time (ms)", true, true, false, {}, NAN, ""};
  for (const ProtocolDescriptor* row : protocol_registry())
    if (!row->chooser()) panel.series.push_back({std::string(row->name), {}, false});
  for (std::size_t p = 2; p <= std::max<std::size_t>(base.ranks, 2); p *= 2) {
    ProblemShape s = base;
    s.ranks = p;
    const auto best = best_per_protocol(params, s);
    for (auto& series : panel.series) {
      const auto it = std::find_if(best.begin(), best.end(), [&](const auto& b) { return b.config.method == series.title; });
      series.points.emplace_back(double(p), it == best.end() ? NAN : it->seconds * 1e3);
    }
  }
  testing::draw_plot({panel}, cfg.plot, 900, 600, true);
  std::printf("plot written to %s (gnuplot script with the data: %s.gp)\n", cfg.plot.c_str(), cfg.plot.c_str());
}

void run_plan(const PlanConfig& cfg) {
  const CostParams params = params_of(cfg);
  const ProblemShape shape{cfg.ranks, cfg.batch * cfg.heads, cfg.key_dim, cfg.value_dim, 4};
  const std::size_t budget = cfg.memory_budget.empty() ? 0 : parse_bytes(cfg.memory_budget, "--memory-budget");
  std::printf("cluster: P=%zu, B*H=%zu, K=%zu, V=%zu; alpha %s, bandwidth %.3g GB/s, %.6g GFLOP/s (%s)\n",
              shape.ranks, shape.slabs, shape.key_dim, shape.value_dim,
              fmt_time(params.alpha_s).c_str(), 1e-9 / params.beta_s_per_byte, params.gflops,
              params.source.c_str());
  const auto all = predict_all(params, shape, true);
  double allgather = 0;
  for (const auto& p : all)
    if (p.config.method == kBaselineProtocol) allgather = p.seconds;
  Table t({"protocol", "exact", "time", "vs allgather", "peak memory/rank", "within budget"});
  for (const auto& p : all) {
    t.add({config_name(p), p.exact ? "yes" : "no", fmt_time(p.seconds),
           p.seconds > 0 ? fmt("%.2fx", allgather / p.seconds) : "-", fmt_bytes(static_cast<double>(p.peak_extra_bytes)),
           budget == 0 || p.peak_extra_bytes <= budget ? "yes" : "no"});
  }
  t.print();
  const Prediction exact = choose_protocol(params, shape, budget, false);
  std::printf("\nauto (exact): %s, predicted %s, %.2fx faster than allgather\n",
              config_name(exact).c_str(), fmt_time(exact.seconds).c_str(),
              exact.seconds > 0 ? allgather / exact.seconds : 1.0);
  const Prediction any = choose_protocol(params, shape, budget, true);
  std::printf("auto --allow-reassociation: %s, predicted %s, %.2fx faster than allgather\n",
              config_name(any).c_str(), fmt_time(any.seconds).c_str(),
              any.seconds > 0 ? allgather / any.seconds : 1.0);
  if (!cfg.plot.empty()) write_plot(cfg, params, shape);
}

}  // namespace

void add_plan_command(CLI::App& app) {
  auto cfg = std::make_shared<PlanConfig>();
  CLI::App* cmd = app.add_subcommand(
      "plan", "predict every protocol's time and memory for a hypothetical cluster (cost model)");
  // P is hypothetical here, so larger than any run; the shape limits are the runs'.
  add_int(*cmd, "--ranks,-P", cfg->ranks, "CP size P", IntRange{1, 1 << 20});
  add_int(*cmd, "--batch,-B", cfg->batch, "batch size B", kSizeRange);
  add_int(*cmd, "--heads,-H", cfg->heads, "heads H", kSizeRange);
  add_int(*cmd, "--key-dim,-K", cfg->key_dim, "key dim K", kDimRange);
  add_int(*cmd, "--value-dim,-V", cfg->value_dim, "value dim V", kDimRange);
  add_quantity(*cmd, "--alpha", cfg->alpha, "per-message latency, e.g. 5us (default 5us)", Quantity::seconds);
  add_quantity(*cmd, "--bandwidth", cfg->bandwidth, "per-rank bandwidth, e.g. 50GB/s (default 45GB/s)",
               Quantity::rate);
  add_real(*cmd, "--gflops", cfg->gflops, "fold throughput per rank in GFLOP/s", kPositive)->default_str("40000");
  add_quantity(*cmd, "--group-alpha", cfg->group_alpha, "latency inside an all-gather group (NVLink)",
               Quantity::seconds);
  add_quantity(*cmd, "--group-bandwidth", cfg->group_bandwidth, "bandwidth inside an all-gather group",
               Quantity::rate);
  cmd->add_option("--calibration", cfg->calibration, "JSON from `kdacp calibrate` (flags override it)");
  add_quantity(*cmd, "--memory-budget", cfg->memory_budget, "per-rank budget for auto, e.g. 2GiB", Quantity::bytes);
  cmd->add_option("--plot", cfg->plot, "write a PNG of time vs P per protocol (gnuplot) and its script FILE.gp");
  cmd->callback([cfg] { run_plan(*cfg); });
}

}  // namespace kdacp::cli
