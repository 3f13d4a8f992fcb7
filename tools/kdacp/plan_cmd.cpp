// kdacp plan: the cost model's table for a hypothetical cluster, auto's
// choice, and optionally a gnuplot chart of time vs P per protocol.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "commands.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/error.hpp"
#include "kdacp/job.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/testing/plot.hpp"
#include "flags.hpp"
#include "layer_flags.hpp"
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
    if (c.packing.docs > 0) {
      std::ostringstream what;
      what << "--docs " << c.packing.docs << " needs --tokens T, the stream the documents are packed into";
      throw InvalidArgument(what.str());
    }
    if (!c.layout.split.empty()) throw InvalidArgument("--split needs --tokens T (or --seqlens), the tokens it splits");
  }
  if (st.tokens > 0) st.cu_seqlens = packing(c.packing, c.batch, st.tokens, c.seed);
  return st;
}

// The shape at P = `ranks`: the layout's part owners (as the layer gives
// them to its exchange) and, with a token count, which parts are cuts.
ProblemShape shape_at(const PlanConfig& c, const PlanStream& st, std::size_t ranks) {
  ProblemShape shape{ranks, c.batch * c.heads, c.key_dim, c.value_dim, 4};
  if (st.tokens == 0) {
    if (c.layout.layout == "zigzag") shape.part_owners = PartOwners::zigzag(ranks);
    return shape;
  }
  const kda::Layout layout = layout_spec(c.layout, st.tokens, ranks).build(st.tokens, ranks);
  shape.part_owners = layout.owners();
  shape.part_cuts = layout.cuts(st.cu_seqlens.empty() ? Sequences(c.batch, st.tokens)
                                                      : Sequences(1, st.tokens, st.cu_seqlens));
  return shape;
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
  testing::PlotPanel panel{"kdacp plan: B*H=" + std::to_string(base.slabs) + " K=" + std::to_string(base.key_dim) +
                               " V=" + std::to_string(base.value_dim) + " (" + params.source + ")",
                           "P (ranks)", "predicted time (ms)", true, true, false, {}, NAN, ""};
  for (const ProtocolDescriptor* row : protocol_registry())
    if (!row->chooser()) panel.series.push_back({std::string(row->name), {}, false});
  for (std::size_t p = 2; p <= std::max<std::size_t>(base.ranks, 2); p *= 2) {
    // A layout that does not fit P (zigzag with T < 2P, --split of another
    // P) has no points there.
    std::vector<Prediction> best;
    try {
      best = best_per_protocol(params, shape_at(cfg, st, p));
    } catch (const InvalidArgument&) {
    }
    for (auto& series : panel.series) {
      const auto it = std::find_if(best.begin(), best.end(), [&](const auto& b) { return b.config.method == series.title; });
      series.points.emplace_back(double(p), it == best.end() ? NAN : it->seconds * 1e3);
    }
  }
  testing::draw_plot({panel}, cfg.plot, 900, 600, true);
  std::printf("plot written to %s (gnuplot script with the data: %s.gp)\n", cfg.plot.c_str(), cfg.plot.c_str());
}

// The layout line: parts, parts per rank, cuts and the critical stretch.
void print_chain(const PlanConfig& cfg, const PlanStream& st, const ProblemShape& shape) {
  const ChainProfile prof = chain_profile(shape, 1);
  std::ostringstream line;
  line << "layout: " << cfg.layout.layout << ", " << prof.parts << " parts (at most " << prof.per_rank
       << " per rank)";
  if (!st.cu_seqlens.empty()) {
    const std::size_t cuts =
        static_cast<std::size_t>(std::count(shape.part_cuts.begin(), shape.part_cuts.end(), true));
    line << "; " << st.cu_seqlens.size() - 1 << " packed sequences in T=" << st.tokens << ", " << cuts
         << " parts are cuts";
  } else if (st.tokens > 0) {
    line << "; T=" << st.tokens << ", one sequence per row";
  }
  line << "; critical stretch " << prof.steps << " steps (of " << prof.parts - 1 << " without cuts)";
  std::printf("%s\n", line.str().c_str());
}

void run_plan(const PlanConfig& cfg, bool tokens_given) {
  const CostParams params = params_of(cfg);
  const PlanStream st = plan_stream(cfg, tokens_given);
  const ProblemShape shape = shape_at(cfg, st, cfg.ranks);
  // With a layout only the rows that take one run it (auto chooses among them).
  const bool layouts_only = has_layout(shape);
  const std::size_t budget = cfg.memory_budget.empty() ? 0 : parse_bytes(cfg.memory_budget, "--memory-budget");
  std::printf("cluster: P=%zu, B*H=%zu, K=%zu, V=%zu; alpha %s, bandwidth %.3g GB/s, %.6g GFLOP/s (%s)\n",
              shape.ranks, shape.slabs, shape.key_dim, shape.value_dim,
              fmt_time(params.alpha_s).c_str(), 1e-9 / params.beta_s_per_byte, params.gflops,
              params.source.c_str());
  print_chain(cfg, st, shape);
  std::vector<Prediction> all;
  std::vector<std::string> without_layouts;
  for (Prediction& p : predict_all(params, shape, true)) {
    if (layouts_only && !find_protocol(p.config.method).takes_layouts) {
      if (without_layouts.empty() || without_layouts.back() != p.config.method)
        without_layouts.push_back(p.config.method);
    } else {
      all.push_back(std::move(p));
    }
  }
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
  if (!without_layouts.empty()) {
    std::string names;
    for (const std::string& n : without_layouts) {
      if (!names.empty()) names += ", ";
      names += n;
    }
    std::printf("not listed: %s (do not take layouts with several parts per rank or parts out of rank order)\n",
                names.c_str());
  }
  const Prediction exact = choose_protocol(params, shape, budget, false, layouts_only);
  std::printf("\nauto (exact): %s, predicted %s, %.2fx faster than allgather\n",
              config_name(exact).c_str(), fmt_time(exact.seconds).c_str(),
              exact.seconds > 0 ? allgather / exact.seconds : 1.0);
  const Prediction any = choose_protocol(params, shape, budget, true, layouts_only);
  std::printf("auto --allow-reassociation: %s, predicted %s, %.2fx faster than allgather\n",
              config_name(any).c_str(), fmt_time(any.seconds).c_str(),
              any.seconds > 0 ? allgather / any.seconds : 1.0);
  if (std::count(shape.part_cuts.begin(), shape.part_cuts.end(), true) > 1) {
    // A run's auto chooses when the layer is built, from the layout alone:
    // the cuts come with each call.
    ProblemShape uncut = shape;
    uncut.part_cuts.clear();
    const Prediction built = choose_protocol(params, uncut, budget, false, layouts_only);
    if (protocol_label(built.config) != protocol_label(exact.config))
      std::printf("note: in a run, auto (exact) chooses before the cuts are known: %s\n",
                  config_name(built).c_str());
  }
  if (!cfg.plot.empty()) write_plot(cfg, st, params, shape);
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
