// `kdacp bench kernels|protocols`: how close the fold kernels and the
// protocols come to what the host can do, as ratios measured in one run.
// Human table by default, --json for scripts (one array of flat records),
// --plot FILE for a PNG or SVG drawn by gnuplot from those records.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>

#include "bench.hpp"
#include "commands.hpp"
#include "flags.hpp"
#include "kdacp/error.hpp"
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

void add_common(CLI::App& cmd, BenchArgs& a) {
  cmd.add_flag("--json", a.json, "print one JSON array of flat records instead of a table");
  cmd.add_option("--plot", a.plot, "also draw the records with gnuplot into FILE (.png or .svg)");
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
  CLI::App* bench = app.add_subcommand("bench", "measure kernels and protocols against the host's limits");
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
}

}  // namespace kdacp::cli
