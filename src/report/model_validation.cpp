#include "kdacp/report/model_validation.hpp"

#include <cstdio>
#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "kdacp/output.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/testing/synthetic.hpp"
#include "kdacp/report/table.hpp"

namespace kdacp::report {

std::vector<ModelRow> validate_synthetic(const std::shared_ptr<Communicator>& comm, const CostParams& params,
                                         const SummaryShape& shape, const ValidationOptions& options) {
  const SyntheticSummary sm = synthetic_summary(shape, 0, comm->rank(), false);
  const SyntheticSummary gm = synthetic_summary(shape, 0, comm->rank(), true);
  std::vector<ModelRow> rows;
  for (ModelCheck& c :
       validate_cost_model(comm, params, sm.offset.view(), sm.transfer.view(), gm.offset.view(), options))
    rows.push_back({std::move(c), params});
  return rows;
}

std::vector<ModelRow> validate_in_process(const std::vector<std::size_t>& ranks, const LaunchOptions& world,
                                          const std::optional<CostParams>& params,
                                          const CalibrationOptions& calibration, const SummaryShape& shape,
                                          const ValidationOptions& options) {
  std::vector<ModelRow> rows;
  for (std::size_t p : ranks) {
    LaunchOptions o = world;
    o.backend = "inprocess";
    o.ranks = p;
    launch(o, [&](const std::shared_ptr<Communicator>& comm) {
      auto mine = validate_synthetic(comm, params ? *params : measure_cost_params(*comm, calibration), shape, options);
      if (comm->rank() == 0) rows.insert(rows.end(), mine.begin(), mine.end());
    }, nullptr);
  }
  return rows;
}

double measured_over_predicted(const ModelCheck& check) {
  return check.predicted_seconds > 0 ? check.measured_seconds / check.predicted_seconds : 0.0;
}

std::string to_json(const std::vector<ModelRow>& rows, const SummaryShape& shape) {
  nlohmann::json records = nlohmann::json::array();
  for (const ModelRow& row : rows)
    records.push_back({{"mode", "model"},
                       {"protocol", protocol_label(row.check.config)}, {"P", row.check.ranks},
                       {"BH", shape.slabs()}, {"K", shape.key_dim}, {"V", shape.value_dim},
                       {"source", row.params.source}, {"alpha_s", row.params.alpha_s},
                       {"beta_s_per_byte", row.params.beta_s_per_byte}, {"gflops", row.params.gflops},
                       {"concurrent_ranks", row.params.concurrent_ranks},
                       {"predicted_seconds", row.check.predicted_seconds},
                       {"measured_seconds", row.check.measured_seconds},
                       {"ratio", measured_over_predicted(row.check)}, {"iterations", row.check.iterations}});
  return records.dump(2);
}

void print_model_validation(const std::vector<ModelRow>& rows, const SummaryShape& shape, const std::string& backend) {
  std::printf("\nmodel validation: forward + backward, B*H=%zu, K=%zu, V=%zu, %s backend\n", shape.batch * shape.heads,
              shape.key_dim, shape.value_dim, backend.c_str());
  std::size_t last_p = 0;
  for (const ModelRow& row : rows) {
    if (row.check.ranks == last_p) continue;
    last_p = row.check.ranks;
    std::printf("P=%zu: alpha %.3g us, bandwidth %.3g GB/s, fold %.3g GFLOP/s, %zu rank(s) fold at once (%s)\n",
                row.check.ranks, row.params.alpha_s * 1e6, 1e-9 / row.params.beta_s_per_byte, row.params.gflops,
                row.params.concurrent_ranks, row.params.source.c_str());
  }
  Table t({"protocol", "P", "predicted ms", "measured ms", "measured/predicted"});
  std::size_t outside = 0;
  for (const ModelRow& row : rows) {
    const double r = measured_over_predicted(row.check);
    if (r < 0.7 || r > 1.3) ++outside;
    t.add({protocol_label(row.check.config), fmt::format("{}", row.check.ranks),
           fmt::format("{:.3f}", row.check.predicted_seconds * 1e3),
           fmt::format("{:.3f}", row.check.measured_seconds * 1e3), fmt::format("{:.2f}", r)});
  }
  t.print();
  std::printf("%zu of %zu ratios outside [0.70, 1.30]\n", outside, rows.size());
}

namespace {

void print_params(const CalibrateRequest& request, const CostParams& p) {
  std::FILE* out = request.json ? stderr : stdout;
  std::fprintf(out,
               "alpha %.3g us, bandwidth %.3g GB/s, fold %.3g GFLOP/s per rank (%zu thread(s)), "
               "%zu rank(s) fold at once (%s)\nsaved to %s\n",
               p.alpha_s * 1e6, 1e-9 / p.beta_s_per_byte, p.gflops, request.calibration.threads, p.concurrent_ranks,
               p.source.c_str(), request.out.c_str());
  std::fflush(out);
}

}  // namespace

void run_calibration(const CalibrateRequest& request, const ProcessLauncher* launcher) {
  const SummaryShape& shape = request.calibration.fold_shape;
  ValidationOptions validation;
  validation.threads = request.calibration.threads;
  validation.min_time = request.min_time;
  validation.on_check = [](const ModelCheck& c) {
    std::fprintf(stderr, "kdacp calibrate: P=%zu %s: predicted %.3f ms, measured %.3f ms (%zu iterations)\n",
                 c.ranks, protocol_label(c.config).c_str(), c.predicted_seconds * 1e3, c.measured_seconds * 1e3,
                 c.iterations);
  };
  // The first world measures (or loads) the parameters; under a launcher it
  // also validates, since the launcher starts once per process.
  bool root = false, mpi = false;
  std::vector<ModelRow> rows;
  // The parameters file appears when the whole command succeeded.
  std::optional<StagedOutput> saved;
  const std::filesystem::path out(request.out);
  launch(request.backend, [&](const std::shared_ptr<Communicator>& comm) {
    const CostParams p = request.loaded ? *request.loaded : measure_cost_params(*comm, request.calibration);
    if (comm->rank() == 0) {
      root = true;
      mpi = comm->backend() == "mpi";
      if (!request.loaded) {
        saved.emplace(out.parent_path().string(), std::vector<std::string>{out.filename().string()});
        save_cost_params(p, saved->path(out.filename().string()));
        print_params(request, p);
      }
    }
    if (request.validate && comm->backend() == "mpi") {
      auto mine = validate_synthetic(comm, p, shape, validation);
      rows.insert(rows.end(), mine.begin(), mine.end());
    }
  }, launcher);
  if (!root) return;
  if (request.validate && !mpi)
    rows = validate_in_process(request.validate_ranks, request.backend, request.loaded, request.calibration, shape,
                               validation);
  if (request.validate && request.json) std::printf("%s\n", to_json(rows, shape).c_str());
  else if (request.validate) print_model_validation(rows, shape, mpi ? "mpi" : "inprocess");
  if (saved) saved->commit();
}

}  // namespace kdacp::report
