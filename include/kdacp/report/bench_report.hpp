// `kdacp bench`'s records and their rendering: each sweep (kernel_bench.hpp,
// protocol_bench.hpp, layer_bench.hpp) as one flat JSON record per measured
// configuration (the --json output is their array), the human tables drawn
// from the same records, and the gnuplot chart. nlohmann_json is part of
// this header's interface (a build-tree dependency of kdacp_report).
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kdacp/report/kernel_bench.hpp"
#include "kdacp/report/layer_bench.hpp"
#include "kdacp/report/protocol_bench.hpp"

namespace kdacp::report {

// The smoke-test sweeps of `kdacp bench ... --quick`: every code path,
// seconds instead of minutes.
void make_quick(KernelBenchConfig& cfg);
void make_quick(ProtocolBenchConfig& cfg);
// T=300 (several chunks per rank, a partial last chunk), H = HV = 1,
// K = V = 32, P=2, one run.
void make_quick(LayerBenchConfig& cfg);

// `progress`: one line per configuration on stderr.
nlohmann::json kernel_bench_records(const KernelBenchConfig& cfg, bool progress);
nlohmann::json protocol_bench_records(const ProtocolBenchConfig& cfg, bool progress);
// `failures`: layer_bench_failures of the run (errors NaN or above tolerance).
nlohmann::json layer_bench_records(const LayerBenchConfig& cfg, bool progress, std::vector<std::string>* failures);

// The records as a titled table with its legend on stdout.
void print_kernel_bench(const nlohmann::json& records);
void print_protocol_bench(const nlohmann::json& records);
void print_layer_bench(const nlohmann::json& records);

// Kernels (`kernels`): one panel per thread count, GFLOP/s against chain
// length per K with the OpenBLAS loop dashed and the measured peak as a flat
// line. Protocols: one panel per B·H, time over floor against P per
// protocol. Both of the first direction swept. draw_plot into `file`.
void plot_bench(bool kernels, const nlohmann::json& records, const std::string& file);

// How `kdacp bench` reports a sweep: the records as one JSON array (json)
// or as the table on stdout, progress lines on stderr, and with a `plot`
// file name ("": none) the gnuplot chart of the records.
struct BenchOutput {
  bool json = false;
  bool progress = true;
  std::string plot;
};

// `kdacp bench kernels` and `kdacp bench protocols`: run the sweep and
// report its records (plot_bench draws the chart).
void run_kernel_bench(const KernelBenchConfig& cfg, const BenchOutput& output);
void run_protocol_bench(const ProtocolBenchConfig& cfg, const BenchOutput& output);

// `kdacp bench layer`: refuses to start when layer_bench_bytes(cfg) exceed
// `max_memory` (max_memory_bytes' text; "": what the machine has available),
// then runs and reports (output.plot is not drawn for the layer); throws
// Error naming the rows whose errors are NaN or above their tolerance.
void run_layer_bench(const LayerBenchConfig& cfg, const std::string& max_memory, const BenchOutput& output);

}  // namespace kdacp::report
