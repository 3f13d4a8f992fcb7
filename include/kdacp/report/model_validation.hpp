// The cost model's validation (kdacp/calibrate.hpp) on synthetic summaries,
// as `kdacp calibrate --validate` runs it: on a given world, or in-process at
// several P, each in a world of its own. Part of kdacp_report.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kdacp/calibrate.hpp"
#include "kdacp/comm.hpp"
#include "kdacp/launch.hpp"
#include "kdacp/summary.hpp"

namespace kdacp::report {

// One validated configuration and the parameters that predicted it.
struct ModelRow {
  ModelCheck check;
  CostParams params;
};

// validate_cost_model(comm, params, ...) with every rank's synthetic_summary
// of `shape` (seed 0) as its inputs. Collective; rank 0 returns one row per
// configuration in predict_all's order, the other ranks none.
std::vector<ModelRow> validate_synthetic(const std::shared_ptr<Communicator>& comm, const CostParams& params,
                                         const SummaryShape& shape, const ValidationOptions& options);

// validate_synthetic in-process at each P of `ranks`, in that order, each in
// a world of its own (launch's options `world` with its backend and ranks
// replaced). The parameters are `params` when given; otherwise each world
// measures its own (measure_cost_params with `calibration`), since α and β
// of in-process ranks grow with the ranks sharing the host.
std::vector<ModelRow> validate_in_process(const std::vector<std::size_t>& ranks, const LaunchOptions& world,
                                          const std::optional<CostParams>& params,
                                          const CalibrationOptions& calibration, const SummaryShape& shape,
                                          const ValidationOptions& options);

// The measured time over the predicted one; 0 when nothing was predicted.
double measured_over_predicted(const ModelCheck& check);

// `kdacp calibrate --validate --json`: one flat record per row ("mode":
// "model", the configuration's label, P, B·H, K and V of `shape`, the
// parameters, both times, their ratio and the iterations), as a JSON array
// indented by two spaces, without a final newline.
std::string to_json(const std::vector<ModelRow>& rows, const SummaryShape& shape);

// `kdacp calibrate --validate`'s text on stdout: the shape and `backend`,
// each P's parameters, one table row per check (predicted, measured, their
// ratio) and how many ratios fall outside [0.70, 1.30].
void print_model_validation(const std::vector<ModelRow>& rows, const SummaryShape& shape, const std::string& backend);

// `kdacp calibrate`: what it measures, where it saves, what it validates.
struct CalibrateRequest {
  LaunchOptions backend;             // where the ranks run (launch's options)
  std::string out;                   // the parameters' JSON file (save_cost_params)
  std::optional<CostParams> loaded;  // with validate: these parameters instead of measured ones
  // α, β, γ's measurement; calibration.threads per rank also run the
  // validation's exchanges, calibration.fold_shape is the validated shape.
  CalibrationOptions calibration;
  bool validate = false;
  std::vector<std::size_t> validate_ranks;  // in-process: the P values to validate
  double min_time = 0.3;                    // seconds of timed calls per configuration
  bool json = false;                        // the validation as to_json's records
};

// Runs `kdacp calibrate` on request.backend (one process per rank with
// `launcher`, which may be null): rank 0 of the first world measures the
// parameters (or takes request.loaded), prints them (on stderr with json)
// and saves them to request.out, which appears only once the whole command
// succeeded (StagedOutput). With validate, each configuration's predicted
// and measured times follow, one line per configuration on stderr as rank 0
// finishes it: under a launcher in the same world, in-process at each P of
// validate_ranks (validate_in_process); then print_model_validation or, with
// json, to_json on stdout. The processes other than rank 0's return after
// their share of the work.
void run_calibration(const CalibrateRequest& request, const ProcessLauncher* launcher);

}  // namespace kdacp::report
