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
#include "kdacp/error.hpp"
#include "table.hpp"

namespace kdacp::cli {
namespace {

struct BenchArgs {
  BenchConfig cfg;
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

// gnuplot reads the records as inline data blocks; the terminal follows the
// file's extension.
void plot(const std::string& mode, const nlohmann::json& recs, const std::string& file) {
  const bool svg = file.size() > 4 && file.substr(file.size() - 4) == ".svg";
  std::string script = std::string("set terminal ") + (svg ? "svg size 1200,500 noenhanced" : "pngcairo size 1200,500 noenhanced") +
                       "\nset output '" + file + "'\nset grid\nset key top left\n";
  if (mode == "kernels") {
    // One panel per thread count: GFLOP/s against chain length per K, the
    // OpenBLAS loop dashed, the measured peak as a flat line (forward only).
    std::vector<std::size_t> threads, dims;
    for (const auto& r : recs) {
      const auto t = r["threads"].get<std::size_t>(), k = r["K"].get<std::size_t>();
      if (std::find(threads.begin(), threads.end(), t) == threads.end()) threads.push_back(t);
      if (std::find(dims.begin(), dims.end(), k) == dims.end()) dims.push_back(k);
    }
    std::string dir = recs.empty() ? "forward" : recs[0]["direction"].get<std::string>();
    script += "set logscale x 2\nset xlabel 'chain length'\nset ylabel 'GFLOP/s'\nset yrange [0:*]\n";
    script += "set multiplot layout 1," + std::to_string(threads.size()) + "\n";
    for (std::size_t t : threads) {
      std::string blocks, plots;
      double peak = 0;
      for (std::size_t k : dims) {
        const std::string name = "$k" + std::to_string(k) + "t" + std::to_string(t);
        blocks += name + " << EOD\n";
        for (const auto& r : recs)
          if (r["threads"] == t && r["K"] == k && r["direction"] == dir) {
            blocks += std::to_string(r["chain"].get<std::size_t>()) + " " + num(r["gflops"], "%.3f") + " " +
                      num(r["openblas_gflops"], "%.3f") + "\n";
            peak = r["peak_gflops"].get<double>();
          }
        blocks += "EOD\n";
        plots += (plots.empty() ? "" : ", ") + name + " using 1:2 with linespoints lw 2 title 'kdacp K=V=" +
                 std::to_string(k) + "', " + name + " using 1:3 with linespoints dt 2 title 'OpenBLAS K=V=" +
                 std::to_string(k) + "'";
      }
      script += blocks + "set title '" + dir + ", " + std::to_string(t) + " thread(s)'\nplot " + plots + ", " +
                fmt("%.3f", peak) + " with lines lw 2 lc rgb 'black' title 'measured FMA peak'\n";
    }
    script += "unset multiplot\n";
  } else {
    // One panel per B·H: time over floor against P per protocol (forward).
    std::vector<std::size_t> bhs;
    std::vector<std::string> protos;
    for (const auto& r : recs) {
      const auto b = r["BH"].get<std::size_t>();
      const auto p = r["protocol"].get<std::string>();
      if (std::find(bhs.begin(), bhs.end(), b) == bhs.end()) bhs.push_back(b);
      if (std::find(protos.begin(), protos.end(), p) == protos.end()) protos.push_back(p);
    }
    script += "set logscale x 2\nset xlabel 'P (in-process ranks)'\nset ylabel 'time / floor'\nset yrange [0:*]\n";
    script += "set multiplot layout 1," + std::to_string(bhs.size()) + "\n";
    for (std::size_t b : bhs) {
      std::string blocks, plots;
      for (std::size_t i = 0; i < protos.size(); ++i) {
        const std::string name = "$p" + std::to_string(i) + "b" + std::to_string(b);
        std::string rows;
        for (const auto& r : recs)
          if (r["BH"] == b && r["protocol"] == protos[i] && r["direction"] == "forward")
            rows += std::to_string(r["P"].get<std::size_t>()) + " " + num(r["ratio_to_floor"], "%.4f") + "\n";
        if (rows.empty()) continue;
        blocks += name + " << EOD\n" + rows + "EOD\n";
        plots += (plots.empty() ? "" : ", ") + name + " using 1:2 with linespoints lw 2 title '" + protos[i] + "'";
      }
      if (plots.empty()) continue;
      script += blocks + "set title 'forward, B·H = " + std::to_string(b) + "'\nplot " + plots +
                ", 1.15 with lines dt 2 lc rgb 'black' title 'target 1.15'\n";
    }
    script += "unset multiplot\n";
  }
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> gp(popen("gnuplot", "w"), pclose);
  if (!gp) throw IoError("--plot: cannot start gnuplot (install gnuplot-nox)");
  std::fputs(script.c_str(), gp.get());
  if (pclose(gp.release()) != 0)
    throw IoError("--plot: gnuplot failed to draw " + file + " (is gnuplot installed?)");
}

void run(const std::string& mode, BenchArgs& args) {
  BenchConfig& cfg = args.cfg;
  cfg.progress = !args.quiet;
  if (args.quick) {
    // A smoke-test sweep: every code path, seconds instead of minutes.
    cfg.dims = {64};
    cfg.chains = {1, 4};
    cfg.slabs = 2;
    cfg.ranks = {2, 4};
    cfg.bhs = {1};
    cfg.key_dim = 32;
    cfg.min_time = 0.005;
  }
  const nlohmann::json recs = mode == "kernels" ? run_kernel_bench(cfg) : run_protocol_bench(cfg);
  if (args.json) std::printf("%s\n", recs.dump(2).c_str());
  else if (mode == "kernels") print_kernels(recs);
  else print_protocols(recs);
  if (!args.plot.empty()) {
    plot(mode, recs, args.plot);
    if (cfg.progress) std::fprintf(stderr, "kdacp bench: wrote %s\n", args.plot.c_str());
  }
}

void add_common(CLI::App& cmd, BenchArgs& a) {
  cmd.add_flag("--json", a.json, "print one JSON array of flat records instead of a table");
  cmd.add_option("--plot", a.plot, "also draw the records with gnuplot into FILE (.png or .svg)");
  cmd.add_flag("--quick", a.quick, "tiny sweep for smoke tests (seconds)");
  cmd.add_flag("--quiet,-q", a.quiet, "no progress lines on stderr");
  cmd.add_option("--min-time", a.cfg.min_time, "seconds each timing repeats for (at least 3 runs)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd.add_option("--direction", a.cfg.directions, "forward and/or backward")
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
  kern->add_option("--dims", args->cfg.dims, "K = V values")->capture_default_str();
  kern->add_option("--chains", args->cfg.chains, "chain lengths")->capture_default_str();
  kern->add_option("--threads", args->cfg.threads, "thread counts (0: all hardware threads)")->capture_default_str();
  kern->add_option("--bh", args->cfg.slabs, "B·H slabs folded in parallel")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  kern->callback([args] { run("kernels", *args); });
  CLI::App* prot = bench->add_subcommand(
      "protocols", "each protocol's time vs its floor and its peak extra memory vs the theoretical one");
  add_common(*prot, *args);
  prot->add_option("--ranks,-P", args->cfg.ranks, "in-process CP sizes")->capture_default_str();
  prot->add_option("--bh", args->cfg.bhs, "B·H values")->capture_default_str();
  prot->add_option("--key-dim,-K", args->cfg.key_dim, "K = V")->capture_default_str();
  prot->callback([args] { run("protocols", *args); });
}

}  // namespace kdacp::cli
