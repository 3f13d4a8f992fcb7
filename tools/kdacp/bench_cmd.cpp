// `kdacp bench kernels|protocols|layer`: how close the fold kernels, the
// protocols and the KDA layer (per algorithm) come to what the host can do,
// as ratios measured in one run.
// Human table by default, --json for scripts (one array of flat records),
// --plot FILE for a PNG or SVG drawn by gnuplot from those records.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench.hpp"
#include "commands.hpp"
#include "exchange_flags.hpp"
#include "flags.hpp"
#include "kdacp/admission.hpp"
#include "kdacp/error.hpp"
#include "kdacp/job.hpp"
#include "layer_flags.hpp"
#include "kdacp/testing/plot.hpp"
#include "table.hpp"

namespace kdacp::cli {
namespace {

struct BenchArgs {
  testing::KernelBenchConfig kernels{{64, 128, 256}, {1, 4, 16, 64}, {1, 0}, 16, {}, 0.2};
  testing::ProtocolBenchConfig protocols{{2, 4, 8, 16}, {1, 16, 64}, 128, {}, 0.2};
  std::vector<std::string> directions{"forward", "backward"};
  double min_time = 0.2;  // each timing repeats this long (at least three runs)
  bool json = false;
  bool quick = false;
  bool quiet = false;
  std::string plot;
};

std::string num(const nlohmann::json& v, const char* format) { return fmt(format, v.get<double>()); }

void print_kernels(const nlohmann::json& recs) {
  Table t({"K=V", "chain", "threads", "direction", "kdacp GFLOP/s", "peak GFLOP/s", "% peak",
           "OpenBLAS GFLOP/s", "x OpenBLAS", "scalar GFLOP/s", "x scalar"});
  for (const auto& r : recs)
    t.add({std::to_string(r["K"].get<std::size_t>()), std::to_string(r["chain"].get<std::size_t>()),
           std::to_string(r["threads"].get<std::size_t>()), r["direction"].get<std::string>(),
           num(r["gflops"], "%.1f"), num(r["peak_gflops"], "%.1f"),
           fmt("%.0f%%", 100 * r["fraction_of_peak"].get<double>()), num(r["openblas_gflops"], "%.1f"),
           num(r["speedup_vs_openblas"], "%.2f"), num(r["scalar_gflops"], "%.2f"),
           num(r["speedup_vs_scalar"], "%.0f")});
  std::printf("kdacp bench kernels: fused fold C = op(M)·X + S over a chain, B·H=%zu, SIMD target %s\n\n",
              recs.empty() ? std::size_t{0} : recs[0]["BH"].get<std::size_t>(),
              recs.empty() ? "-" : recs[0]["target"].get<std::string>().c_str());
  t.print();
  std::printf("\npeak: measured FP32 FMA throughput of the same SIMD target and thread count;\n"
              "OpenBLAS: memcpy S into C then cblas_sgemm(beta=1) per step; best of repeated runs\n");
}

void print_protocols(const nlohmann::json& recs) {
  Table t({"protocol", "P", "B·H", "direction", "ms", "floor ms", "x floor", "host floor ms",
           "x host floor", "peak extra", "theoretical", "x theory"});
  for (const auto& r : recs)
    t.add({r["protocol"].get<std::string>(), std::to_string(r["P"].get<std::size_t>()),
           std::to_string(r["BH"].get<std::size_t>()), r["direction"].get<std::string>(),
           fmt("%.3f", r["seconds"].get<double>() * 1e3), fmt("%.3f", r["floor_seconds"].get<double>() * 1e3),
           num(r["ratio_to_floor"], "%.2f"), fmt("%.3f", r["host_floor_seconds"].get<double>() * 1e3),
           num(r["ratio_to_host_floor"], "%.2f"), fmt_bytes(r["peak_extra_bytes"].get<double>()),
           fmt_bytes(r["theoretical_extra_bytes"].get<double>()), num(r["memory_ratio"], "%.3f")});
  std::printf("kdacp bench protocols: in-process ranks, K=V=%zu, median of the slowest rank per call\n\n",
              recs.empty() ? std::size_t{0} : recs[0]["K"].get<std::size_t>());
  t.print();
  std::printf("\nfloor: the P-2 sequenced steps at the measured kernel speed + the bytes received on the\n"
              "critical path at the measured memcpy speed (a core per rank); host floor: all ranks'\n"
              "steps and copies spread over this host's cores, when that is larger\n");
}

// Kernels: one panel per thread count, GFLOP/s against chain length per K
// with the OpenBLAS loop dashed and the measured peak as a flat line.
// Protocols: one panel per B·H, time over floor against P per protocol.
// Both of the first direction swept.
void plot(const std::string& mode, const nlohmann::json& recs, const std::string& file) {
  const bool kernels = mode == "kernels";
  const std::string dir = recs.empty() ? "forward" : recs[0]["direction"].get<std::string>();
  std::vector<testing::PlotPanel> panels;
  auto series = [](testing::PlotPanel& panel, const std::string& title, bool dashed) -> testing::PlotSeries& {
    for (auto& s : panel.series)
      if (s.title == title) return s;
    return panel.series.emplace_back(testing::PlotSeries{title, {}, dashed});
  };
  for (const auto& r : recs) {
    if (r["direction"] != dir) continue;
    const std::string key = std::to_string(r[kernels ? "threads" : "BH"].get<std::size_t>());
    const std::string title = kernels ? dir + ", " + key + " thread(s)" : dir + ", B·H = " + key;
    auto it = std::find_if(panels.begin(), panels.end(), [&](const auto& p) { return p.title == title; });
    if (it == panels.end()) {
      panels.push_back({title, kernels ? "chain length" : "P (in-process ranks)", kernels ? "GFLOP/s" : "time / floor",
                        true, false, true, {}, kernels ? r["peak_gflops"].get<double>() : 1.15,
                        kernels ? "measured FMA peak" : "target 1.15"});
      it = panels.end() - 1;
    }
    if (kernels) {
      const std::string k = std::to_string(r["K"].get<std::size_t>());
      const double x = double(r["chain"].get<std::size_t>());
      series(*it, "kdacp K=V=" + k, false).points.emplace_back(x, r["gflops"].get<double>());
      series(*it, "OpenBLAS K=V=" + k, true).points.emplace_back(x, r["openblas_gflops"].get<double>());
    } else {
      series(*it, r["protocol"].get<std::string>(), false)
          .points.emplace_back(double(r["P"].get<std::size_t>()), r["ratio_to_floor"].get<double>());
    }
  }
  testing::draw_plot(panels, file, 1200 / int(std::max<std::size_t>(panels.size(), 1)), 500);
}

void run(const std::string& mode, BenchArgs& args) {
  auto& kc = args.kernels;
  auto& pc = args.protocols;
  kc.min_time = pc.min_time = args.min_time;
  if (args.quick) {
    // A smoke-test sweep: every code path, seconds instead of minutes.
    kc.dims = {64};
    kc.chains = {1, 4};
    kc.slabs = 2;
    pc.ranks = {2, 4};
    pc.slabs = {1};
    pc.key_dim = 32;
    kc.min_time = pc.min_time = 0.005;
  }
  // Kernels sweep the directions as given; protocols forward first.
  for (const std::string& d : args.directions)
    kc.directions.push_back(d == "forward" ? Direction::forward : Direction::backward);
  for (Direction d : {Direction::forward, Direction::backward})
    if (std::count(kc.directions.begin(), kc.directions.end(), d) > 0) pc.directions.push_back(d);
  const bool progress = !args.quiet;
  const nlohmann::json recs = mode == "kernels" ? run_kernel_bench(kc, progress) : run_protocol_bench(pc, progress);
  if (args.json) std::printf("%s\n", recs.dump(2).c_str());
  else if (mode == "kernels") print_kernels(recs);
  else print_protocols(recs);
  if (!args.plot.empty()) {
    plot(mode, recs, args.plot);
    if (progress) std::fprintf(stderr, "kdacp bench: wrote %s\n", args.plot.c_str());
  }
}

// `kdacp bench layer`: the CLI's side of testing::bench_layer.
struct LayerArgs {
  testing::LayerBenchConfig layer;
  std::size_t value_heads = 0;  // 0: H
  std::vector<std::string> algorithms{"recurrent", "chunk"};
  ExchangeFlags exchange;
  bool json = false, quick = false, quiet = false, recompute = !defaults::kKeepForward;
  std::string max_memory;
};

// "3.2e-07", or "-" for the baseline itself, "nan" for a NaN.
std::string err_text(const nlohmann::json& v, bool baseline) {
  if (baseline) return "-";
  return v.is_null() ? "nan" : fmt("%.1e", v.get<double>());
}

void print_layer(const nlohmann::json& recs) {
  Table t({"run", "algorithm", "P x threads", "protocol", "fwd ms", "bwd ms", "fwd+bwd ms", "summary+G",
           "exchange", "GFLOP/s", "% peak", "speed-up", "err o", "err grads"});
  for (const auto& r : recs) {
    const bool base = r["algorithm"] == r["baseline"];
    double grads = 0;
    bool nan = false;
    for (const char* f : {"rel_error_dq", "rel_error_dk", "rel_error_dv", "rel_error_dg", "rel_error_dbeta"}) {
      if (r[f].is_null()) nan = true;
      else grads = std::max(grads, r[f].get<double>());
    }
    t.add({r["run"] == "cp" ? "context-parallel" : "one rank", r["algorithm"].get<std::string>(),
           std::to_string(r["P"].get<std::size_t>()) + " x " + std::to_string(r["threads_per_rank"].get<std::size_t>()),
           r["protocol"].get<std::string>(), fmt("%.1f", r["forward_seconds"].get<double>() * 1e3),
           fmt("%.1f", r["backward_seconds"].get<double>() * 1e3), fmt("%.1f", r["seconds"].get<double>() * 1e3),
           r["run"] == "cp" ? fmt("%.1f", r["summary_seconds"].get<double>() * 1e3) : "-",
           r["run"] == "cp" ? fmt("%.1f", r["exchange_seconds"].get<double>() * 1e3) : "-",
           num(r["gflops"], "%.1f"), fmt("%.1f%%", 100 * r["fraction_of_peak"].get<double>()),
           fmt("%.2fx", r["speedup"].get<double>()), err_text(r["rel_error_o"], base),
           base ? "-" : nan ? "nan" : fmt("%.1e", grads)});
  }
  if (recs.empty()) return;
  const auto& r0 = recs[0];
  std::printf("kdacp bench layer: KDA layer forward+backward, float32, B=%zu T=%zu H=%zu HV=%zu K=%zu V=%zu, "
              "chunk size %zu, median of %zu runs (each after %zu untimed step%s on the same layer), chunk forward %s\n\n",
              r0["B"].get<std::size_t>(), r0["T"].get<std::size_t>(), r0["H"].get<std::size_t>(),
              r0["HV"].get<std::size_t>(), r0["K"].get<std::size_t>(), r0["V"].get<std::size_t>(),
              r0["chunk_size"].get<std::size_t>(), r0["repeats"].get<std::size_t>(),
              r0["warmup_steps"].get<std::size_t>(), r0["warmup_steps"].get<std::size_t>() == 1 ? "" : "s",
              r0["keep_forward"].get<bool>() ? "kept for the backward (kda::ForwardCache)" : "recomputed (--recompute)");
  t.print();
  std::printf("\nGFLOP/s: 34*B*T*HV*K*V flops (the recurrent algorithm's count on one device, %.2f GFLOP) per "
              "forward+backward wall time,\nthe same count for every algorithm and run; %% peak: of the FP32 FMA "
              "peak measured in this run, %.1f GFLOP/s on %zu threads (%s);\nspeed-up: %s's fwd+bwd time / this "
              "one's, same run; err: relative Frobenius error vs %s, same run (grads: max of dq, dk, dv, dg, dbeta);\n"
              "summary+G, exchange (CP, slowest rank, ms): the chunk summary and the G pass, and the exchanges; "
              "fwd+bwd minus both is the forward and backward proper;\nan error above %.0e relative (plus a "
              "reassociating protocol's documented bound), or NaN, fails the command\n",
              r0["flops"].get<double>() / 1e9, r0["peak_gflops"].get<double>(), r0["peak_threads"].get<std::size_t>(),
              r0["target"].get<std::string>().c_str(), r0["baseline"].get<std::string>().c_str(),
              r0["baseline"].get<std::string>().c_str(), job::kLayerFloat32Tolerance);
}

void run_layer(LayerArgs& a) {
  testing::LayerBenchConfig& c = a.layer;
  c.keep_forward = !a.recompute;
  c.algorithms.clear();
  for (const std::string& name : a.algorithms) c.algorithms.push_back(parse_algorithm_flag(name, "--algorithms"));
  if (a.quick) {
    // A smoke-test size: every code path (several chunks per rank, a
    // partial last chunk), seconds instead of minutes.
    c.shape = kda::Shape{1, 300, 1, 1, 32, 32};
    a.value_heads = 0;
    c.ranks = 2;
    c.repeats = 1;
    c.peak_seconds = 0.02;
  }
  check_value_heads(c.shape.heads, a.value_heads);
  c.shape.value_heads = a.value_heads ? a.value_heads : c.shape.heads;
  kda::validate(c.shape);
  if (c.ranks > c.shape.tokens) {
    std::ostringstream what;
    what << "--ranks " << c.ranks << " is more ranks than T = " << c.shape.tokens << " tokens";
    throw InvalidArgument(what.str());
  }
  check_threads(std::max<std::size_t>(c.ranks, 1), c.threads_per_rank);
  c.method = a.exchange.protocol;
  c.group_size = a.exchange.group_size;
  c.exchange = exchange_options(a.exchange, job::layer_summary_shape(c.shape));
  std::ostringstream what;
  what << "kdacp bench layer on " << c.ranks << " ranks";
  require_memory(testing::layer_bench_bytes(c), max_memory_bytes(a.max_memory), what.str(),
                 max_memory_name(a.max_memory));
  std::vector<std::string> failures;
  const nlohmann::json recs = run_layer_bench(c, !a.quiet, &failures);
  if (a.json) std::printf("%s\n", recs.dump(2).c_str());
  else print_layer(recs);
  if (!failures.empty()) {
    std::string what;
    for (const std::string& f : failures) what += "; " + f;
    throw Error("kdacp bench layer: errors are NaN or above their tolerance (" +
                fmt("%.0e", job::kLayerFloat32Tolerance) + " plus a reassociating protocol's bound)" + what);
  }
}

void add_layer_command(CLI::App& bench) {
  auto a = std::make_shared<LayerArgs>();
  a->exchange.protocol = "p2p";
  CLI::App* cmd = bench.add_subcommand(
      "layer", "the KDA layer's forward+backward per algorithm (recurrent, chunk) on one rank and in CP: "
               "time, GFLOP/s vs the FP32 peak, speed-up and error against the first algorithm");
  testing::LayerBenchConfig& c = a->layer;
  add_int(*cmd, "--batch,-B", c.shape.batch, "batch size", kSizeRange);
  add_int(*cmd, "--tokens,-T", c.shape.tokens, "sequence length", IntRange{1, 1 << 24});
  add_int(*cmd, "--heads,-H", c.shape.heads, "query/key heads", kSizeRange);
  add_int(*cmd, "--value-heads", a->value_heads, "value heads (multiple of --heads; 0: same)",
          IntRange{0, kSizeRange.max});
  add_int(*cmd, "--key-dim,-K", c.shape.key_dim, "key dim", kDimRange);
  add_int(*cmd, "--value-dim,-V", c.shape.value_dim, "value dim", kDimRange);
  add_int(*cmd, "--ranks,-P", c.ranks, "in-process ranks of the context-parallel runs (0: one rank only)",
          IntRange{0, kRanksRange.max});
  add_exchange_flags(*cmd, a->exchange);
  cmd->add_option("--algorithms", a->algorithms,
                  "algorithms to run, in this order; the first is the baseline of speed-ups and errors "
                  "(recurrent, chunk)")
      ->capture_default_str();
  add_int(*cmd, "--threads", c.threads_per_rank,
          "threads per rank of the context-parallel runs (0: hardware threads / ranks); the one-rank runs use "
          "every hardware thread",
          kThreadsRange);
  add_int(*cmd, "--repeat", c.repeats, "timed runs per algorithm and run, interleaved; the median is reported",
          IntRange{1, 1000});
  add_int(*cmd, "--warmup", c.warmup_steps,
          "untimed forward+backward steps before each timed one, on the same layer and buffers (a training "
          "loop's steady state)",
          IntRange{0, 100});
  add_recompute_flag(*cmd, a->recompute);
  add_int(*cmd, "--seed", c.seed, "input seed", IntRange{});
  add_max_memory(*cmd, a->max_memory);
  cmd->add_flag("--json", a->json, "print one JSON array of flat records instead of a table");
  cmd->add_flag("--quick", a->quick, "tiny shape for smoke tests (T=300, H=1, K=V=32, P=2, one run)");
  cmd->add_flag("--quiet,-q", a->quiet, "no progress lines on stderr");
  cmd->callback([a] { run_layer(*a); });
}

void add_common(CLI::App& cmd, BenchArgs& a) {
  cmd.add_flag("--json", a.json, "print one JSON array of flat records instead of a table");
  add_path(cmd, "--plot", a.plot, "also draw the records with gnuplot into FILE (.png or .svg)", "a file name");
  cmd.add_flag("--quick", a.quick, "tiny sweep for smoke tests (seconds)");
  cmd.add_flag("--quiet,-q", a.quiet, "no progress lines on stderr");
  add_real(cmd, "--min-time", a.min_time, "seconds each timing repeats for (at least 3 runs)", kMinTimeRange);
  cmd.add_option("--direction", a.directions, "forward and/or backward")
      ->check(CLI::IsMember({"forward", "backward"}))
      ->capture_default_str();
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto args = std::make_shared<BenchArgs>();
  CLI::App* bench = app.add_subcommand("bench", "measure kernels, protocols and the KDA layer against the host's limits");
  bench->require_subcommand(1);
  CLI::App* kern = bench->add_subcommand(
      "kernels", "GFLOP/s of the fused fold vs the measured FMA peak, an OpenBLAS loop and the scalar kernel");
  add_common(*kern, *args);
  add_ints(*kern, "--dims", args->kernels.dims, "K = V values", kDimRange);
  add_ints(*kern, "--chains", args->kernels.chains, "chain lengths", IntRange{1, 1 << 20});
  add_ints(*kern, "--threads", args->kernels.threads, "thread counts (0: all hardware threads)", kThreadsRange);
  add_int(*kern, "--bh", args->kernels.slabs, "B·H slabs folded in parallel", kSizeRange);
  kern->callback([args] { run("kernels", *args); });
  CLI::App* prot = bench->add_subcommand(
      "protocols", "each protocol's time vs its floor and its peak extra memory vs the theoretical one");
  add_common(*prot, *args);
  add_ints(*prot, "--ranks,-P", args->protocols.ranks, "in-process CP sizes", IntRange{1, 1024});
  add_ints(*prot, "--bh", args->protocols.slabs, "B·H values", kSizeRange);
  add_int(*prot, "--key-dim,-K", args->protocols.key_dim, "K = V", kDimRange);
  prot->callback([args] { run("protocols", *args); });
  add_layer_command(*bench);
}

}  // namespace kdacp::cli
