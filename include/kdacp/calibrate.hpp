// Calibration of the cost model (kdacp/cost_model.hpp) on any Communicator:
// measures α, β and γ of the ranks it runs on, and validates the model by
// timing every configuration it weighs beside its prediction
// (docs/protocols.md, "Model validation"). Every call here that takes a
// communicator is collective: all of its ranks call it with the same options.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

#include "kdacp/comm.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/summary.hpp"
#include "kdacp/tensor.hpp"

namespace kdacp {

// Runs fn until `min_time` seconds have passed and at least `min_runs` runs
// were made; returns every run's seconds, in order.
std::vector<double> time_runs(double min_time, std::size_t min_runs, const std::function<void()>& fn);

struct CalibrationOptions {
  std::size_t repeat = 2000;  // small-message (64-byte) round trips behind α
  // β's message size. Larger than a last-level cache, so that β is the speed
  // of moving cold data, as an exchange's received states are (16 MiB stayed
  // cache-resident on a test host and gave 29 GB/s instead of ~22).
  std::size_t large_bytes = std::size_t{64} << 20;
  std::size_t threads = 1;    // threads per rank for γ's fold
  double gamma_seconds = 0.3; // seconds spent measuring γ
  SummaryShape fold_shape{1, 16, 128, 128};  // γ folds this shape's slabs
};

// α: half the round trip of a 64-byte ping-pong between ranks 0 and 1.
// β: half the round trip of a large ping-pong, net of α, per byte.
// γ: the fold (measure_fold_gflops) on rank 0 while the others wait.
// concurrent_ranks: the host's hardware threads / threads per rank.
// Needs at least 2 ranks (InvalidArgument otherwise); every rank returns the
// same parameters, whose `source` names the backend, P and threads.
CostParams measure_cost_params(Communicator& comm, const CalibrationOptions& options);

// GFLOP/s of the fold kernel on `threads` threads: scans of 4 K×V steps over
// the slabs of `shape`, best of runs for about `seconds`, forward and
// backward averaged.
double measure_fold_gflops(const SummaryShape& shape, std::size_t threads, double seconds);

// One configuration of the model: predicted and measured forward + backward.
struct ModelCheck {
  ProtocolConfig config;
  std::size_t ranks = 0;
  double predicted_seconds = 0;
  double measured_seconds = 0;  // median over iterations of the slowest rank's time
  std::size_t iterations = 0;
};

struct ValidationOptions {
  std::size_t threads = 1;  // threads per rank for the exchanges
  double min_time = 0.3;    // seconds of timed calls per configuration (3..200 iterations)
  // Called on rank 0 after each configuration, e.g. to report progress.
  std::function<void(const ModelCheck&)> on_check;
};

// Every configuration of predict_all(params, ..., true) on comm's ranks, run
// with this rank's summaries: offset S [B,H,K,V], transfer M [B,H,K,K] and
// gradient G [B,H,K,V]. Rank 0 returns one check per configuration in
// predict_all's order; the other ranks return none.
std::vector<ModelCheck> validate_cost_model(const std::shared_ptr<Communicator>& comm,
                                            const CostParams& params, StateView offset,
                                            StateView transfer, StateView gradient,
                                            const ValidationOptions& options);

}  // namespace kdacp
