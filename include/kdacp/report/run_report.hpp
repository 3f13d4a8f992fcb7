// `kdacp run`'s synthetic job, and its report: the single-rank layer and every protocol of
// job::compare_protocols in one table (or one JSON document), with times,
// GFLOP/s against the FP32 FMA peak measured in the same run, the exchange's
// share, the relative errors against one device and bitwise agreement.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kdacp/comm.hpp"
#include "kdacp/job.hpp"

namespace kdacp::report {

// `kdacp run`'s job, deterministic in seed: kda::synthetic_layer(shape,
// seed), the default scale, d_o from seed + 1 and, with cu_seqlens (B = 1;
// empty: one sequence per row), h0 and dht of its N sequences from seed + 3
// and seed + 4 and the final states. Checked (LayerJob::sequences) before it
// returns.
job::LayerJob<float> synthetic_layer_job(const kda::Shape& shape, std::vector<std::int64_t> cu_seqlens,
                                         std::uint64_t seed);

// How the run was set up, for the header line and the JSON.
struct LayerRunSetup {
  std::string backend, layout, algorithm;
  std::size_t ranks = 1, per_rank = 1;
  std::vector<std::int64_t> cu_seqlens;  // empty: one sequence per row
  std::size_t warmup_steps = 0;          // untimed steps before each timed one (LayerJob::warmup_steps)
  std::size_t ulysses = 1;               // the Ulysses width of every CP run (LayerRunOptions::ulysses)
};

// Measures the peak on peak_threads threads, then prints the report of
// `single` and `cmp` for `shape` on stdout: the table with its legend, or
// with `json` the JSON document. `states`: ht and dh0 columns. Returns the
// rows with an error that is NaN or above its tolerance
// (job::layer_error_tolerance), as "label: dg 1.9e+00, dq nan".
std::vector<std::string> report_layer_run(const kda::Shape& shape, const LayerRunSetup& setup,
                                          const job::LayerOutputs<float>& single,
                                          const job::ProtocolComparison& cmp, bool states, bool json,
                                          std::size_t peak_threads);

// `kdacp run` on `world`, collective: job::compare_protocols of `job` with
// `base`, then on rank 0 the job on one device with peak_threads threads
// (job::run_single) and report_layer_run of both (`layout` names the layout;
// ht and dh0 columns with packed sequences). Throws Error on rank 0 when an
// error is NaN or above its tolerance, or when the exact protocols disagree
// bitwise.
void run_layer_comparison(const std::shared_ptr<Communicator>& world, const job::LayerJob<float>& job,
                          const job::LayerRunOptions& base, const std::string& layout, bool json,
                          std::size_t peak_threads, const job::Progress& progress);

}  // namespace kdacp::report
