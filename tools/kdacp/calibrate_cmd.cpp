// kdacp calibrate: measures the cost model's α, β and γ on a backend (threads
// of this process, or one process per rank under mpirun) and saves them as
// JSON for `kdacp plan --calibration` and auto. With --validate it then runs
// every configuration the model weighs on the same backend and prints the
// predicted time beside the measured one. The measurements are
// kdacp/calibrate.hpp; this file parses, launches and prints.
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend.hpp"
#include "commands.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/calibrate.hpp"
#include "kdacp/error.hpp"
#include "kdacp/output.hpp"
#include "kdacp/testing/model_validation.hpp"
#include "kdacp/thread_pool.hpp"
#include "flags.hpp"

namespace kdacp::cli {

namespace {

struct CalibrateConfig {
  LaunchOptions backend;
  std::string out = "kdacp_calibration.json";
  std::size_t repeat = 2000;        // small-message round trips
  std::size_t large_mib = 64;       // bandwidth message size (CalibrationOptions::large_bytes)
  std::size_t threads = 0;          // per rank; 0: ThreadPool::default_threads
  double gamma_time = 0.3;          // seconds spent measuring γ
  // --validate
  bool validate = false;
  std::string calibration;          // load instead of measuring
  std::vector<std::size_t> validate_ranks{2, 4, 8};
  std::size_t batch = 1, heads = 16, key_dim = 128, value_dim = 128;
  double min_time = 0.3;            // seconds of timed calls per configuration
  bool json = false;
};

using testing::ModelRow;

SummaryShape shape_of(const CalibrateConfig& cfg) {
  return SummaryShape{cfg.batch, cfg.heads, cfg.key_dim, cfg.value_dim};
}

CalibrationOptions calibration_options(const CalibrateConfig& cfg, std::size_t threads) {
  return {cfg.repeat, cfg.large_mib << 20, threads, cfg.gamma_time, shape_of(cfg)};
}

// Each configuration's line on stderr as rank 0 finishes it.
ValidationOptions validation_options(const CalibrateConfig& cfg, std::size_t threads) {
  ValidationOptions o;
  o.threads = threads;
  o.min_time = cfg.min_time;
  o.on_check = [](const ModelCheck& c) {
    std::fprintf(stderr, "kdacp calibrate: P=%zu %s: predicted %.3f ms, measured %.3f ms (%zu iterations)\n",
                 c.ranks, protocol_label(c.config).c_str(), c.predicted_seconds * 1e3,
                 c.measured_seconds * 1e3, c.iterations);
  };
  return o;
}

void print_params(const CalibrateConfig& cfg, const CostParams& p, std::size_t threads) {
  std::FILE* out = cfg.json ? stderr : stdout;
  std::fprintf(out,
               "alpha %.3g us, bandwidth %.3g GB/s, fold %.3g GFLOP/s per rank (%zu thread(s)), "
               "%zu rank(s) fold at once (%s)\nsaved to %s\n",
               p.alpha_s * 1e6, 1e-9 / p.beta_s_per_byte, p.gflops, threads, p.concurrent_ranks,
               p.source.c_str(), cfg.out.c_str());
  std::fflush(out);
}

void run_calibrate(const CalibrateConfig& cfg) {
  if (!cfg.calibration.empty() && !cfg.validate)
    throw InvalidArgument("--calibration loads parameters for --validate; pass --validate too");
  const std::size_t threads =
      cfg.threads ? cfg.threads : ThreadPool::default_threads(ranks_per_process(cfg.backend));
  const std::optional<CostParams> loaded =
      cfg.calibration.empty() ? std::nullopt : std::optional<CostParams>(load_cost_params(cfg.calibration));

  // The first job measures (or loads) the parameters; under MPI it also
  // validates, since MPI starts once per process.
  bool root = false, mpi = false;
  std::vector<ModelRow> rows;
  // The parameters file appears when the whole command succeeded.
  std::optional<StagedOutput> saved;
  const std::filesystem::path out(cfg.out);
  run_ranks(cfg.backend, [&](const std::shared_ptr<Communicator>& comm) {
    const CostParams p = loaded ? *loaded : measure_cost_params(*comm, calibration_options(cfg, threads));
    if (comm->rank() == 0) {
      root = true;
      mpi = comm->backend() == "mpi";
      if (!loaded) {
        saved.emplace(out.parent_path().string(), std::vector<std::string>{out.filename().string()});
        save_cost_params(p, saved->path(out.filename().string()));
        print_params(cfg, p, threads);
      }
    }
    if (cfg.validate && comm->backend() == "mpi") {
      auto mine = testing::validate_synthetic(comm, p, shape_of(cfg), validation_options(cfg, threads));
      rows.insert(rows.end(), mine.begin(), mine.end());
    }
  });
  if (!root) return;
  if (cfg.validate && !mpi)
    rows = testing::validate_in_process(cfg.validate_ranks, cfg.backend, loaded, calibration_options(cfg, threads),
                                        shape_of(cfg), validation_options(cfg, threads));
  if (cfg.validate && cfg.json) std::printf("%s\n", testing::to_json(rows, shape_of(cfg)).c_str());
  else if (cfg.validate) testing::print_model_validation(rows, shape_of(cfg), mpi ? "mpi" : "inprocess");
  if (saved) saved->commit();
}

}  // namespace

void add_calibrate_command(CLI::App& app) {
  auto cfg = std::make_shared<CalibrateConfig>();
  cfg->backend.ranks = 2;  // in-process: the ping-pong pair
  CLI::App* cmd = app.add_subcommand(
      "calibrate",
      "measure the cost model's alpha, beta and gamma on a backend (in-process threads, or MPI "
      "under mpirun); --validate compares its predictions with measured times");
  add_backend_flags(*cmd, cfg->backend);
  add_path(*cmd, "--out,-o", cfg->out, "JSON file to write (rank 0)", "a file name")->default_str(cfg->out);
  add_int(*cmd, "--repeat", cfg->repeat, "small-message round trips", IntRange{1, 10000000});
  add_int(*cmd, "--large-mib", cfg->large_mib, "bandwidth message size in MiB", IntRange{1, 4096});
  add_int(*cmd, "--threads", cfg->threads, "threads per rank for the fold (0: hardware threads / ranks in this process)",
          kThreadsRange);
  add_real(*cmd, "--gamma-time", cfg->gamma_time, "seconds spent measuring the fold speed", kMinTimeRange);
  cmd->add_flag("--validate", cfg->validate,
                "then run every configuration the model weighs (predict_all, reassociating "
                "included) and print predicted vs measured forward+backward time");
  add_path(*cmd, "--calibration", cfg->calibration,
           "with --validate: load these parameters instead of measuring them", "a JSON file name");
  add_ints(*cmd, "--validate-ranks", cfg->validate_ranks,
           "in-process: the P values to validate (under MPI, P is the number of processes)",
           IntRange{2, kRanksRange.max})
      ->delimiter(',');
  add_int(*cmd, "--batch,-B", cfg->batch, "validation batch B", kSizeRange);
  add_int(*cmd, "--heads,-H", cfg->heads, "validation heads H", kSizeRange);
  add_int(*cmd, "--key-dim,-K", cfg->key_dim, "validation key dim K (also the fold calibration's)", kDimRange);
  add_int(*cmd, "--value-dim,-V", cfg->value_dim, "validation value dim V", kDimRange);
  add_real(*cmd, "--min-time", cfg->min_time, "seconds of timed calls per configuration", kMinTimeRange);
  cmd->add_flag("--json", cfg->json, "print the validation as flat JSON records");
  cmd->callback([cfg] { run_calibrate(*cfg); });
}

}  // namespace kdacp::cli
