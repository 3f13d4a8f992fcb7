// kdacp calibrate: measures the cost model's α, β and γ on a backend (threads
// of this process, or one process per rank under mpirun) and saves them as
// JSON for `kdacp plan --calibration` and auto. With --validate it then runs
// every configuration the model weighs on the same backend and prints the
// predicted time beside the measured one. The measurements are
// kdacp/calibrate.hpp, the command's flow kdacp/report/model_validation.hpp
// (run_calibration); this file parses the flags.
#include <memory>
#include <string>
#include <vector>

#include "backend.hpp"
#include "commands.hpp"
#include "flags.hpp"
#include "kdacp/calibrate.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/error.hpp"
#include "kdacp/report/model_validation.hpp"
#include "kdacp/thread_pool.hpp"

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

void run_calibrate(const CalibrateConfig& cfg) {
  if (!cfg.calibration.empty() && !cfg.validate)
    throw InvalidArgument("--calibration loads parameters for --validate; pass --validate too");
  const std::size_t threads =
      cfg.threads ? cfg.threads : ThreadPool::default_threads(ranks_per_process(cfg.backend));
  report::CalibrateRequest request;
  request.backend = cfg.backend;
  request.out = cfg.out;
  if (!cfg.calibration.empty()) request.loaded = load_cost_params(cfg.calibration);
  request.calibration = {cfg.repeat, cfg.large_mib << 20, threads, cfg.gamma_time,
                         SummaryShape{cfg.batch, cfg.heads, cfg.key_dim, cfg.value_dim}};
  request.validate = cfg.validate;
  request.validate_ranks = cfg.validate_ranks;
  request.min_time = cfg.min_time;
  request.json = cfg.json;
  report::run_calibration(request, launcher());
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
