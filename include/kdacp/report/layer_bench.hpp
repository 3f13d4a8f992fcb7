// The KDA layer's speed per algorithm (`kdacp bench layer`): forward and
// backward with every kda::Algorithm asked for, on the same inputs, on one
// rank and on P in-process ranks (the context-parallel layer), timed in one
// run beside the FP32 FMA peak measured in that run, with each algorithm's
// relative error against the first one (so a wrong fast path shows). Part of
// kdacp_testing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kdacp/defaults.hpp"
#include "kdacp/exchange.hpp"
#include "kdacp/job.hpp"
#include "kdacp/kda.hpp"
#include "kdacp/report/bench.hpp"

namespace kdacp::report {

struct LayerBenchConfig {
  kda::Shape shape{1, 8192, 4, 4, 128, 128};
  // In this order; the first is the baseline of the speed-ups and errors.
  std::vector<kda::Algorithm> algorithms{kda::Algorithm::recurrent, kda::Algorithm::chunk};
  bool single = true;                // run the layer on one rank
  std::size_t ranks = 4;             // P of the context-parallel runs; 0: none
  std::string method = "p2p";        // their state exchange (make_state_exchange)
  long long group_size = 1;
  ExchangeOptions exchange;          // expected_shape defaults to the layer's summary shape
  std::size_t threads = 0;           // threads of the one-rank runs (0: hardware threads)
  std::size_t threads_per_rank = 0;  // of the context-parallel runs (0: hardware threads / P, at least 1)
  // Timed runs per algorithm and mode, interleaved over the algorithms; the
  // run with the median forward+backward time is reported.
  std::size_t repeats = 3;
  std::uint64_t seed = 0;            // synthetic inputs and d_o (kdacp/testing/synthetic.hpp)
  double peak_seconds = 0.2;         // measure_fma_peak on the hardware threads
  double timeout_s = defaults::kTimeoutSeconds;  // of a context-parallel rank waiting for a peer
  bool keep_forward = defaults::kKeepForward;  // LayerJob::keep_forward (chunk: the forward keeps its states)
  std::size_t warmup_steps = 1;      // LayerJob::warmup_steps: each timed step follows one untimed
  // Also time, once per repeat before the warm run, each algorithm's first
  // step on a fresh layer (no untimed step: new layer, forward cache and
  // outputs; the process's allocator is warm after the first): a training
  // loop's first step, LayerBenchRecord::cold_seconds.
  bool cold = false;
  // `--phases`: the report adds where each run's time went (LayerBenchRecord::phases).
  bool phases = false;
  // `--deterministic`: after the context-parallel runs, the same in the
  // deterministic mode (LayerJob::deterministic), run "cp deterministic",
  // its cost beside the default (errors against the first algorithm, as every run).
  bool deterministic = false;
  // `--ulysses`: after the context-parallel runs, the same with the Ulysses
  // layer (kda::UlyssesLayer) over head groups of this width, run
  // "cp ulysses", its time beside plain state CP's in the same run: 1 (the
  // default) none; job::kUlyssesAuto the cost model's width
  // (job::resolve_ulysses; needs method auto). Must divide P, H and HV.
  std::size_t ulysses = 1;
  // Pack the T tokens into this many documents (0: none, each row one
  // sequence): B = 1 and cu_seqlens of a random packing seeded by `seed`,
  // the one `kdacp run --docs` draws (report::packed_cu_seqlens).
  std::size_t docs = 0;
};

struct LayerBenchRecord {
  std::string mode;  // "single" or "cp"
  kda::Algorithm algorithm = kda::Algorithm::recurrent;
  std::size_t ranks = 1;
  std::size_t threads_per_rank = 1;
  std::string method = "none";  // the exchange's method (auto: its choice); "none" on one rank
  std::size_t ulysses = 1;      // the run's head-group width U ("cp ulysses"); 1: plain state CP
  double forward_seconds = 0, backward_seconds = 0;  // slowest rank
  double exchange_seconds = 0;                       // slowest rank, forward + backward
  double summary_seconds = 0;  // slowest rank, the summary + the G pass (CP only; part of local work)
  double cold_seconds = 0;     // with LayerBenchConfig::cold: the median first step's forward+backward, else 0
  // The recurrent algorithm's flops on one device, 34·B·T·HV·K·V
  // (kda::forward_flops + backward_flops), for every algorithm and mode: a
  // rate of the same work.
  double flops = 0;
  double gflops = 0;         // flops / (forward + backward seconds) / 1e9
  double peak_fraction = 0;  // gflops / the measured peak
  double speedup = 1;        // the first algorithm's forward+backward time / this one's, same mode
  // Relative Frobenius errors against the first algorithm in the same mode:
  // o, dq, dk, dv, dg, dbeta (relative_errors in kdacp/job.hpp).
  std::vector<double> rel_errors;
  double max_rel_error = 0;  // NaN when any of them is
  // What rel_errors may reach: layer_error_tolerance (kdacp/job.hpp) of
  // the run's method, kLayerFloat32Tolerance on one rank.
  double tolerance = 0;
  // The median run's phases, of its slowest rank (they sum to its forward +
  // backward); with LayerBenchConfig::cold also the median first step's: the
  // difference is what allocation and first touch cost.
  job::LayerPhases phases;
  job::LayerPhases cold_phases;
};

struct LayerBenchResult {
  PeakResult peak;                       // FP32 FMA peak on every hardware thread, this run
  std::vector<LayerBenchRecord> records;  // "single" then "cp", each in config.algorithms order
};

// Called after each timed run: the algorithm, mode, its forward+backward
// seconds, runs done and total.
using LayerBenchProgress =
    std::function<void(const std::string& mode, kda::Algorithm, double seconds, std::size_t done, std::size_t total)>;

// Runs the sweep in float32 (packed sequences only with config.docs, zero h0
// and dht): every algorithm on the same synthetic inputs and d_o. Throws
// InvalidArgument for a bad shape, no algorithms, repeats = 0, neither mode,
// a P larger than T, docs with B > 1 or more documents than tokens, or a
// Ulysses width without CP runs or not dividing P, H and HV, before anything
// runs; what the layer throws otherwise.
// The name of a LayerBenchRecord::mode for people: "one rank",
// "context-parallel", "deterministic CP", "Ulysses U=2 x CP".
std::string layer_run_label(const std::string& mode, std::size_t ulysses);

LayerBenchResult bench_layer(const LayerBenchConfig& config, const LayerBenchProgress& progress = {});

// The records whose errors are NaN or above their tolerance, one line each:
// "context-parallel chunk vs recurrent: dg 1.9, dq nan"; empty when none.
std::vector<std::string> layer_bench_failures(const LayerBenchResult& result);

// Bytes bench_layer allocates at most: the job, one kept output set per
// algorithm plus the one being produced, and the larger of a one-rank run
// and a context-parallel run (layer_run_bytes with the exchange's rank bytes).
double layer_bench_bytes(const LayerBenchConfig& config);

}  // namespace kdacp::report
