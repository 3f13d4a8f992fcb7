#include "kdacp/report/bench_report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kdacp/admission.hpp"
#include "kdacp/error.hpp"
#include "kdacp/job.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/report/plot.hpp"
#include "kdacp/report/table.hpp"

namespace kdacp::report {
namespace {

using nlohmann::json;

const char* direction_name(Direction dir) { return dir == Direction::forward ? "forward" : "backward"; }

// JSON has no NaN: a NaN error is written as null (and fails the command).
json number(double x) { return std::isnan(x) ? json(nullptr) : json(x); }

std::size_t size(const json& v) { return v.get<std::size_t>(); }
double real(const json& v) { return v.get<double>(); }
std::string ms(const json& seconds, const char* spec = "{:.1f}") { return fmt::format(fmt::runtime(spec), real(seconds) * 1e3); }

}  // namespace

void make_quick(KernelBenchConfig& kc) {
  kc.dims = {64};
  kc.chains = {1, 4};
  kc.slabs = 2;
  kc.min_time = 0.005;
}

void make_quick(ProtocolBenchConfig& pc) {
  pc.ranks = {2, 4};
  pc.slabs = {1};
  pc.key_dim = 32;
  pc.min_time = 0.005;
}

void make_quick(LayerBenchConfig& c) {
  c.shape = kda::Shape{1, 300, 1, 1, 32, 32};
  c.ranks = 2;
  c.repeats = 1;
  c.peak_seconds = 0.02;
}

json kernel_bench_records(const KernelBenchConfig& kc, bool progress) {
  KernelBenchHooks hooks;
  hooks.baseline = openblas_baseline();
  if (progress) {
    hooks.on_peak = [](const PeakResult& p) {
      std::fprintf(stderr, "kdacp bench: FP32 FMA peak, %zu thread(s), %s: %.1f GFLOP/s\n", p.threads,
                   p.target.c_str(), p.gflops);
    };
    hooks.on_record = [](const KernelRecord& r, std::size_t done, std::size_t total) {
      const double blas = r.baseline_gflops;
      std::fprintf(stderr,
                   "kdacp bench: [%zu/%zu] K=V=%zu chain=%zu threads=%zu %s: %.1f GFLOP/s "
                   "(%.0f%% of peak, %.2fx OpenBLAS)\n",
                   done, total, r.k, r.chain, r.threads, direction_name(r.direction), r.gflops,
                   100 * r.gflops / r.peak.gflops, blas > 0 ? r.gflops / blas : 0.0);
    };
  }
  json records = json::array();
  for (const KernelRecord& r : bench_kernels(kc, hooks)) {
    const double blas = r.baseline_gflops;
    records.push_back({{"mode", "kernels"},
                       {"K", r.k}, {"V", r.k}, {"chain", r.chain}, {"threads", r.threads}, {"BH", r.slabs},
                       {"direction", direction_name(r.direction)}, {"target", r.peak.target}, {"seconds", r.seconds},
                       {"gflops", r.gflops}, {"peak_gflops", r.peak.gflops}, {"openblas_gflops", blas},
                       {"scalar_gflops", r.scalar_gflops}, {"fraction_of_peak", r.gflops / r.peak.gflops},
                       {"speedup_vs_openblas", blas > 0 ? r.gflops / blas : 0.0},
                       {"speedup_vs_scalar", r.gflops / r.scalar_gflops}});
  }
  return records;
}

json protocol_bench_records(const ProtocolBenchConfig& pc, bool show_progress) {
  ProtocolBenchProgress progress;
  if (show_progress)
    progress = [](const ProtocolConfig& c, std::size_t p, std::size_t bh, double f, double b, std::size_t done,
                  std::size_t total) {
      std::fprintf(stderr, "kdacp bench: [%zu/%zu] P=%zu B·H=%zu %s: fwd %.3f ms, bwd %.3f ms\n", done, total, p,
                   bh, protocol_label(c).c_str(), f * 1e3, b * 1e3);
    };
  json records = json::array();
  for (const ProtocolRecord& r : bench_protocols(pc, progress)) {
    const double peak = double(r.peak_extra_bytes), theory = double(r.theoretical_extra_bytes);
    const std::string label = protocol_label(r.config);
    records.push_back({{"mode", "protocols"},
                       {"protocol", r.layout == "contiguous" ? label : fmt::format("{} [{}]", label, r.layout)},
                       {"method", r.config.method}, {"layout", r.layout}, {"chain_steps", r.chain_steps},
                       {"vs_contiguous", r.vs_contiguous},
                       {"group_size", r.config.group_size}, {"P", r.ranks}, {"BH", r.slabs}, {"K", r.key_dim},
                       {"V", r.key_dim}, {"threads_per_rank", r.threads_per_rank},
                       {"direction", direction_name(r.direction)},
                       {"seconds", r.seconds}, {"floor_seconds", r.floor_seconds},
                       {"ratio_to_floor", r.floor_seconds > 0 ? r.seconds / r.floor_seconds : 0.0},
                       {"host_floor_seconds", r.host_floor_seconds},
                       {"ratio_to_host_floor", r.host_floor_seconds > 0 ? r.seconds / r.host_floor_seconds : 0.0},
                       {"peak_extra_bytes", r.peak_extra_bytes},
                       {"theoretical_extra_bytes", r.theoretical_extra_bytes},
                       {"memory_ratio", theory > 0 ? json(peak / theory) : peak == 0 ? json(1.0) : json(nullptr)}});
  }
  return records;
}

namespace {

// --phases: the slowest rank's phases of the median run ("phase_*"), and with
// --cold those of the median first step ("cold_phase_*") and their difference
// in total ("allocation_seconds": allocation and first touch).
void add_layer_phases(json& j, const LayerBenchRecord& r, bool cold) {
  const auto add = [&](const std::string& prefix, const job::LayerPhases& p) {
    j[prefix + "rank"] = p.rank;
    j[prefix + "summary_seconds"] = p.summary;
    j[prefix + "g_seconds"] = p.incoming_grad;
    j[prefix + "exchange_seconds"] = p.exchange;
    j[prefix + "forward_seconds"] = p.forward;
    j[prefix + "backward_seconds"] = p.backward;
    j[prefix + "total_seconds"] = p.total();
  };
  add("phase_", r.phases);
  if (cold) add("cold_phase_", r.cold_phases);
  j["allocation_seconds"] = cold ? json(r.cold_phases.total() - r.phases.total()) : json(nullptr);
}

// A layer record's run as the tables name it.
std::string run_label(const json& r) { return layer_run_label(r["run"].get<std::string>(), size(r["ulysses"])); }

// The --phases table: a row per run and step (warm; cold with --cold).
void print_layer_phases(const json& recs) {
  Table t({"run", "algorithm", "step", "rank", "summary", "G pass", "exchange", "forward", "backward", "total",
           "cold - warm"});
  for (const auto& r : recs) {
    const bool cp = r["run"] != "single";
    for (const std::string prefix : {"phase_", "cold_phase_"}) {
      if (!r.contains(prefix + "rank")) continue;
      const bool cold = prefix == "cold_phase_";
      const auto f = [&](const char* name) { return ms(r[prefix + name]); };
      t.add({run_label(r), r["algorithm"].get<std::string>(), cold ? "cold" : "warm",
             fmt::format("{} of {}", size(r[prefix + "rank"]), size(r["P"])), cp ? f("summary_seconds") : "-",
             cp ? f("g_seconds") : "-", cp ? f("exchange_seconds") : "-", f("forward_seconds"),
             f("backward_seconds"), f("total_seconds"), cold ? ms(r["allocation_seconds"]) : "-"});
    }
  }
  std::printf("\nwhere the time goes (ms, the slowest rank of the median run): summary: the chunk summary before the "
              "forward's exchange;\nG pass: the incoming gradient before the backward's exchange; exchange: the state "
              "exchanges and the dht/ht/dh0 collectives\n(waiting for peers included); forward, backward: the rest of "
              "each (the walk over the chunks, checks); the five sum to total;\ncold - warm: the first step's total "
              "minus the warm one's, what allocation and first touch cost\n\n");
  t.print();
}

}  // namespace

json layer_bench_records(const LayerBenchConfig& lc, bool show_progress, std::vector<std::string>* failures) {
  LayerBenchProgress progress;
  if (show_progress)
    progress = [](const std::string& mode, kda::Algorithm a, double seconds, std::size_t done, std::size_t total) {
      std::fprintf(stderr, "kdacp bench: [%zu/%zu] %s %s: forward+backward %.1f ms\n", done, total,
                   (mode == "cp ulysses" ? std::string("Ulysses x CP") : layer_run_label(mode, 1)).c_str(),
                   kda::algorithm_name(a), seconds * 1e3);
    };
  const LayerBenchResult res = bench_layer(lc, progress);
  const kda::Shape& s = lc.shape;
  json records = json::array();
  for (const LayerBenchRecord& r : res.records) {
    json j = {{"mode", "layer"}, {"run", r.mode}, {"algorithm", kda::algorithm_name(r.algorithm)},
              {"baseline", kda::algorithm_name(lc.algorithms.front())},
              {"P", r.ranks}, {"threads_per_rank", r.threads_per_rank}, {"protocol", r.method},
              {"ulysses", r.ulysses},
              {"B", s.batch}, {"T", s.tokens}, {"H", s.heads}, {"HV", s.value_heads},
              {"K", s.key_dim}, {"V", s.value_dim}, {"chunk_size", kda::kChunkSize},
              {"forward_seconds", r.forward_seconds}, {"backward_seconds", r.backward_seconds},
              {"seconds", r.forward_seconds + r.backward_seconds},
              {"exchange_seconds", r.exchange_seconds}, {"summary_seconds", r.summary_seconds},
              {"cold_seconds", lc.cold ? json(r.cold_seconds) : json(nullptr)},
              {"flops", r.flops}, {"gflops", r.gflops},
              {"peak_gflops", res.peak.gflops}, {"peak_threads", res.peak.threads},
              {"target", res.peak.target}, {"fraction_of_peak", r.peak_fraction},
              {"speedup", r.speedup}, {"repeats", lc.repeats},
              {"warmup_steps", lc.warmup_steps}, {"keep_forward", lc.keep_forward},
              {"docs", lc.docs > 0 ? json(lc.docs) : json(nullptr)},
              {"max_rel_error", number(r.max_rel_error)}, {"tolerance", r.tolerance}};
    for (std::size_t i = 0; i < r.rel_errors.size() && i < 6; ++i)
      j["rel_error_" + job::kLayerErrorNames[i]] = number(r.rel_errors[i]);
    if (lc.phases) add_layer_phases(j, r, lc.cold);
    records.push_back(std::move(j));
  }
  if (failures) *failures = layer_bench_failures(res);
  return records;
}

void print_kernel_bench(const json& recs) {
  Table t({"K=V", "chain", "threads", "direction", "kdacp GFLOP/s", "peak GFLOP/s", "% peak",
           "OpenBLAS GFLOP/s", "x OpenBLAS", "scalar GFLOP/s", "x scalar"});
  for (const auto& r : recs)
    t.add({fmt::format("{}", size(r["K"])), fmt::format("{}", size(r["chain"])), fmt::format("{}", size(r["threads"])),
           r["direction"].get<std::string>(), fmt::format("{:.1f}", real(r["gflops"])),
           fmt::format("{:.1f}", real(r["peak_gflops"])), fmt::format("{:.0f}%", 100 * real(r["fraction_of_peak"])),
           fmt::format("{:.1f}", real(r["openblas_gflops"])), fmt::format("{:.2f}", real(r["speedup_vs_openblas"])),
           fmt::format("{:.2f}", real(r["scalar_gflops"])), fmt::format("{:.0f}", real(r["speedup_vs_scalar"]))});
  std::printf("kdacp bench kernels: fused fold C = op(M)·X + S over a chain, B·H=%zu, SIMD target %s\n\n",
              recs.empty() ? std::size_t{0} : size(recs[0]["BH"]),
              recs.empty() ? "-" : recs[0]["target"].get<std::string>().c_str());
  t.print();
  std::printf("\npeak: measured FP32 FMA throughput of the same SIMD target and thread count;\n"
              "OpenBLAS: memcpy S into C then cblas_sgemm(beta=1) per step; best of repeated runs\n");
}

void print_protocol_bench(const json& recs) {
  Table t({"protocol", "P", "B·H", "direction", "ms", "floor ms", "x floor", "host floor ms",
           "x host floor", "peak extra", "theoretical", "x theory"});
  for (const auto& r : recs)
    t.add({r["protocol"].get<std::string>(), fmt::format("{}", size(r["P"])), fmt::format("{}", size(r["BH"])),
           r["direction"].get<std::string>(), ms(r["seconds"], "{:.3f}"), ms(r["floor_seconds"], "{:.3f}"),
           fmt::format("{:.2f}", real(r["ratio_to_floor"])), ms(r["host_floor_seconds"], "{:.3f}"),
           fmt::format("{:.2f}", real(r["ratio_to_host_floor"])), format_bytes(real(r["peak_extra_bytes"])),
           format_bytes(real(r["theoretical_extra_bytes"])), fmt::format("{:.3f}", real(r["memory_ratio"]))});
  std::printf("kdacp bench protocols: in-process ranks, K=V=%zu, median of the slowest rank per call\n\n",
              recs.empty() ? std::size_t{0} : size(recs[0]["K"]));
  t.print();
  std::printf("\nfloor: the P-2 sequenced steps at the measured kernel speed + the bytes received on the\n"
              "critical path at the measured memcpy speed (a core per rank); host floor: all ranks'\n"
              "steps and copies spread over this host's cores, when that is larger\n");
}

void print_layer_bench(const json& recs) {
  Table t({"run", "algorithm", "P x threads", "protocol", "fwd ms", "bwd ms", "fwd+bwd ms", "cold / warm",
           "summary+G", "exchange", "GFLOP/s", "% peak", "speed-up", "err o", "err grads"});
  for (const auto& r : recs) {
    const bool base = r["algorithm"] == r["baseline"], cp = r["run"] != "single";
    double grads = 0;
    bool nan = false;
    for (const char* f : {"rel_error_dq", "rel_error_dk", "rel_error_dv", "rel_error_dg", "rel_error_dbeta"}) {
      if (r[f].is_null()) nan = true;
      else grads = std::max(grads, real(r[f]));
    }
    const json& o = r["rel_error_o"];
    t.add({run_label(r), r["algorithm"].get<std::string>(),
           fmt::format("{} x {}", size(r["P"]), size(r["threads_per_rank"])), r["protocol"].get<std::string>(),
           ms(r["forward_seconds"]), ms(r["backward_seconds"]), ms(r["seconds"]),
           r["cold_seconds"].is_null() ? "-"
                                       : fmt::format("{} ms = {:.2f}x", ms(r["cold_seconds"]),
                                                     real(r["cold_seconds"]) / real(r["seconds"])),
           cp ? ms(r["summary_seconds"]) : "-", cp ? ms(r["exchange_seconds"]) : "-",
           fmt::format("{:.1f}", real(r["gflops"])), fmt::format("{:.1f}%", 100 * real(r["fraction_of_peak"])),
           fmt::format("{:.2f}x", real(r["speedup"])),
           base ? "-" : o.is_null() ? "nan" : fmt::format("{:.1e}", real(o)),
           base ? "-" : nan ? "nan" : fmt::format("{:.1e}", grads)});
  }
  if (recs.empty()) return;
  const auto& r0 = recs[0];
  std::printf("kdacp bench layer: KDA layer forward+backward, float32, B=%zu T=%zu H=%zu HV=%zu K=%zu V=%zu, "
              "chunk size %zu, median of %zu runs (each after %zu untimed step%s on the same layer), chunk forward %s\n\n",
              size(r0["B"]), size(r0["T"]), size(r0["H"]), size(r0["HV"]), size(r0["K"]), size(r0["V"]),
              size(r0["chunk_size"]), size(r0["repeats"]), size(r0["warmup_steps"]),
              size(r0["warmup_steps"]) == 1 ? "" : "s",
              r0["keep_forward"].get<bool>() ? "kept for the backward (kda::ForwardCache)" : "recomputed (--recompute)");
  if (r0.contains("docs") && !r0["docs"].is_null())
    std::printf("packed: the T tokens are %zu documents of random lengths (--docs, cu_seqlens)\n\n", size(r0["docs"]));
  t.print();
  std::printf("\nGFLOP/s: 34*B*T*HV*K*V flops (the recurrent algorithm's count on one device, %.2f GFLOP) per "
              "forward+backward wall time,\nthe same count for every algorithm and run; %% peak: of the FP32 FMA "
              "peak measured in this run, %.1f GFLOP/s on %zu threads (%s);\nspeed-up: %s's fwd+bwd time / this "
              "one's, same run; err: relative Frobenius error vs %s, same run (grads: max of dq, dk, dv, dg, dbeta);\n"
              "summary+G, exchange (CP, slowest rank, ms): the chunk summary and the G pass, and the exchanges; "
              "fwd+bwd minus both is the forward and backward proper;\nan error above %.0e relative (plus a "
              "reassociating protocol's documented bound), or NaN, fails the command\n",
              real(r0["flops"]) / 1e9, real(r0["peak_gflops"]), size(r0["peak_threads"]),
              r0["target"].get<std::string>().c_str(), r0["baseline"].get<std::string>().c_str(),
              r0["baseline"].get<std::string>().c_str(), job::kLayerFloat32Tolerance);
  for (const auto& r : recs) {
    if (r["run"] != "cp ulysses") continue;
    for (const auto& plain : recs)
      if (plain["run"] == "cp" && plain["algorithm"] == r["algorithm"])
        std::printf("%s, %s: fwd+bwd %s ms = %.2fx the time of plain state CP over the same %zu ranks (%s ms; "
                    "head groups of %zu, state CP over %zu ranks of %zu head%s)\n",
                    run_label(r).c_str(), r["algorithm"].get<std::string>().c_str(), ms(r["seconds"]).c_str(),
                    real(r["seconds"]) / real(plain["seconds"]), size(r["P"]), ms(plain["seconds"]).c_str(),
                    size(r["ulysses"]), size(r["P"]) / size(r["ulysses"]), size(r["HV"]) / size(r["ulysses"]),
                    size(r["HV"]) / size(r["ulysses"]) == 1 ? "" : "s");
  }
  if (r0.contains("phase_rank")) print_layer_phases(recs);
}

void plot_bench(bool kernels, const json& recs, const std::string& file) {
  const std::string dir = recs.empty() ? "forward" : recs[0]["direction"].get<std::string>();
  std::vector<PlotPanel> panels;
  auto series = [](PlotPanel& panel, const std::string& title, bool dashed) -> PlotSeries& {
    for (auto& s : panel.series)
      if (s.title == title) return s;
    return panel.series.emplace_back(PlotSeries{title, {}, dashed});
  };
  for (const auto& r : recs) {
    if (r["direction"] != dir) continue;
    const std::size_t key = size(r[kernels ? "threads" : "BH"]);
    const std::string title =
        kernels ? fmt::format("{}, {} thread(s)", dir, key) : fmt::format("{}, B·H = {}", dir, key);
    auto it = std::find_if(panels.begin(), panels.end(), [&](const auto& p) { return p.title == title; });
    if (it == panels.end()) {
      panels.push_back({title, kernels ? "chain length" : "P (in-process ranks)", kernels ? "GFLOP/s" : "time / floor",
                        true, false, true, {}, kernels ? real(r["peak_gflops"]) : 1.15,
                        kernels ? "measured FMA peak" : "target 1.15"});
      it = panels.end() - 1;
    }
    if (kernels) {
      const std::size_t k = size(r["K"]);
      const double x = double(size(r["chain"]));
      series(*it, fmt::format("kdacp K=V={}", k), false).points.emplace_back(x, real(r["gflops"]));
      series(*it, fmt::format("OpenBLAS K=V={}", k), true).points.emplace_back(x, real(r["openblas_gflops"]));
    } else {
      series(*it, r["protocol"].get<std::string>(), false).points.emplace_back(double(size(r["P"])),
                                                                                real(r["ratio_to_floor"]));
    }
  }
  draw_plot(panels, file, 1200 / int(std::max<std::size_t>(panels.size(), 1)), 500);
}

namespace {

// The records of a kernel or protocol sweep as the command prints and draws them.
void report_sweep(bool kernels, const json& recs, const BenchOutput& output) {
  if (output.json) std::printf("%s\n", recs.dump(2).c_str());
  else if (kernels) print_kernel_bench(recs);
  else print_protocol_bench(recs);
  if (output.plot.empty()) return;
  plot_bench(kernels, recs, output.plot);
  if (output.progress) std::fprintf(stderr, "kdacp bench: wrote %s\n", output.plot.c_str());
}

}  // namespace

void run_kernel_bench(const KernelBenchConfig& cfg, const BenchOutput& output) {
  report_sweep(true, kernel_bench_records(cfg, output.progress), output);
}

void run_protocol_bench(const ProtocolBenchConfig& cfg, const BenchOutput& output) {
  report_sweep(false, protocol_bench_records(cfg, output.progress), output);
}

void run_layer_bench(const LayerBenchConfig& cfg, const std::string& max_memory, const BenchOutput& output) {
  require_memory(layer_bench_bytes(cfg), max_memory_bytes(max_memory),
                 fmt::format("kdacp bench layer on {} ranks", cfg.ranks), max_memory_name(max_memory));
  std::vector<std::string> failures;
  const json recs = layer_bench_records(cfg, output.progress, &failures);
  if (output.json) std::printf("%s\n", recs.dump(2).c_str());
  else print_layer_bench(recs);
  if (!failures.empty())
    throw Error(fmt::format("kdacp bench layer: errors are NaN or above their tolerance ({:.0e} plus a "
                            "reassociating protocol's bound); {}",
                            job::kLayerFloat32Tolerance, fmt::join(failures, "; ")));
}

}  // namespace kdacp::report
