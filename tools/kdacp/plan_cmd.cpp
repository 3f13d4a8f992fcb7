// kdacp plan: the cost model's table for a hypothetical cluster, auto's
// choice, and optionally a gnuplot chart of time vs P per protocol.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>

#include "commands.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/error.hpp"
#include "table.hpp"
#include "units.hpp"

namespace kdacp::cli {

namespace {

std::string fmt_time(double s) {
  if (s == 0) return "0";
  if (s < 1e-3) return fmt("%.1f us", s * 1e6);
  if (s < 1) return fmt("%.2f ms", s * 1e3);
  return fmt("%.3f s", s);
}

std::string config_name(const Prediction& p) {
  std::string name = p.config.method;
  if (p.config.group_size > 1) name += " w=" + std::to_string(p.config.group_size);
  if (p.config.segments > 0) name += " c=" + std::to_string(p.config.segments);
  return name;
}

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

// The best configuration of each protocol (grouped: over w) for one P.
std::map<std::string, Prediction> best_per_method(const CostParams& params, ProblemShape s) {
  std::map<std::string, Prediction> best;
  for (const Prediction& p : predict_all(params, s, true)) {
    auto it = best.find(p.config.method);
    if (it == best.end() || p.seconds < it->second.seconds) best[p.config.method] = p;
  }
  return best;
}

void write_plot(const PlanConfig& cfg, const CostParams& params, const ProblemShape& base) {
  const std::vector<std::string> methods = {"p2p", "pipelined_p2p", "allgather",
                                            "grouped_allgather_p2p", "recursive_doubling",
                                            "grouped_allgather_rd"};
  const std::string data = cfg.plot + ".dat";
  {
    std::ofstream out(data);
    out << "# P";
    for (const auto& m : methods) out << " " << m;
    out << "\n";
    for (std::size_t p = 2; p <= std::max<std::size_t>(base.ranks, 2); p *= 2) {
      ProblemShape s = base;
      s.ranks = p;
      const auto best = best_per_method(params, s);
      out << p;
      for (const auto& m : methods) {
        const auto it = best.find(m);
        out << " " << (it == best.end() ? std::string("NaN") : fmt("%.9g", it->second.seconds * 1e3));
      }
      out << "\n";
    }
    if (!out) throw IoError("cannot write '" + data + "'");
  }
  const std::string script = cfg.plot + ".gp";
  {
    std::ofstream gp(script);
    gp << "set terminal png size 900,600 noenhanced\nset output '" << cfg.plot << "'\n"
       << "set logscale xy\nset xlabel 'P (ranks)'\nset ylabel 'predicted time (ms)'\n"
       << "set key left top\nset grid\nset title 'kdacp plan: B*H=" << base.slabs
       << " K=" << base.key_dim << " V=" << base.value_dim << " (" << params.source << ")'\n"
       << "plot";
    for (std::size_t i = 0; i < methods.size(); ++i)
      gp << (i ? "," : "") << " '" << data << "' using 1:" << i + 2 << " with linespoints title '"
         << methods[i] << "'";
    gp << "\n";
  }
  const std::string cmd = "gnuplot '" + script + "'";
  if (std::system(cmd.c_str()) != 0) throw IoError("gnuplot failed on '" + script + "'");
  std::printf("plot written to %s (data %s)\n", cfg.plot.c_str(), data.c_str());
}

void run_plan(const PlanConfig& cfg) {
  const CostParams params = params_of(cfg);
  const ProblemShape shape{cfg.ranks, cfg.batch * cfg.heads, cfg.key_dim, cfg.value_dim, 4};
  const std::size_t budget =
      cfg.memory_budget.empty() ? 0
                                : static_cast<std::size_t>(parse_bytes(cfg.memory_budget, "--memory-budget"));
  std::printf("cluster: P=%zu, B*H=%zu, K=%zu, V=%zu; alpha %s, bandwidth %.3g GB/s, %.6g GFLOP/s (%s)\n",
              shape.ranks, shape.slabs, shape.key_dim, shape.value_dim,
              fmt_time(params.alpha_s).c_str(), 1e-9 / params.beta_s_per_byte, params.gflops,
              params.source.c_str());
  const auto all = predict_all(params, shape, true);
  double allgather = 0;
  for (const auto& p : all)
    if (p.config.method == "allgather") allgather = p.seconds;
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
  cmd->add_option("--ranks,-P", cfg->ranks, "CP size P")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--batch,-B", cfg->batch, "batch size B")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--heads,-H", cfg->heads, "heads H")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--key-dim,-K", cfg->key_dim, "key dim K")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--value-dim,-V", cfg->value_dim, "value dim V")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--alpha", cfg->alpha, "per-message latency, e.g. 5us (default 5us)");
  cmd->add_option("--bandwidth", cfg->bandwidth, "per-rank bandwidth, e.g. 50GB/s (default 45GB/s)");
  cmd->add_option("--gflops", cfg->gflops, "fold throughput per rank in GFLOP/s (default 40000)");
  cmd->add_option("--group-alpha", cfg->group_alpha, "latency inside an all-gather group (NVLink)");
  cmd->add_option("--group-bandwidth", cfg->group_bandwidth, "bandwidth inside an all-gather group");
  cmd->add_option("--calibration", cfg->calibration, "JSON from `kdacp calibrate` (flags override it)");
  cmd->add_option("--memory-budget", cfg->memory_budget, "per-rank budget for auto, e.g. 2GiB");
  cmd->add_option("--plot", cfg->plot, "write a PNG of time vs P per protocol (gnuplot)");
  cmd->callback([cfg] { run_plan(*cfg); });
}

}  // namespace kdacp::cli
