// kdacp calibrate: measures the cost model's α, β and γ on the in-process
// backend and saves them as JSON for `kdacp plan --calibration` and auto.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <vector>

#include "commands.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/inprocess.hpp"
#include "kdacp/kernels.hpp"
#include "kdacp/tensor.hpp"

namespace kdacp::cli {

namespace {

using Clock = std::chrono::steady_clock;

struct CalibrateConfig {
  std::string out = "kdacp_calibration.json";
  std::size_t repeat = 2000;        // small-message round trips
  std::size_t large_mib = 16;       // bandwidth message size
};

// Seconds per one-way message of `bytes`, from `rounds` ping-pongs between
// two in-process ranks (half a round trip each).
double one_way(std::size_t bytes, std::size_t rounds) {
  double seconds = 0;
  run_in_process(2, [&](const std::shared_ptr<Communicator>& comm) {
    std::vector<std::byte> buf(bytes);
    const std::size_t peer = 1 - comm->rank();
    auto once = [&] {
      if (comm->rank() == 0) {
        comm->isend(buf, peer, 1)->wait();
        comm->irecv(buf, peer, 1)->wait();
      } else {
        comm->irecv(buf, peer, 1)->wait();
        comm->isend(buf, peer, 1)->wait();
      }
    };
    for (std::size_t i = 0; i < std::min<std::size_t>(rounds, 10); ++i) once();  // warm-up
    comm->barrier();
    const auto t0 = Clock::now();
    for (std::size_t i = 0; i < rounds; ++i) once();
    if (comm->rank() == 0)
      seconds = std::chrono::duration<double>(Clock::now() - t0).count() / (2.0 * static_cast<double>(rounds));
  });
  return seconds;
}

// GFLOP/s of the fold kernel on one thread: K = V = 128 steps over 32 slabs.
double fold_gflops() {
  constexpr std::size_t k = 128, v = 128, slabs = 32;
  State m(1, slabs, k, k), x(1, slabs, k, v), s(1, slabs, k, v), c(1, slabs, k, v);
  for (std::size_t i = 0; i < m.size(); ++i) m.data()[i] = 1e-3f * static_cast<float>(i % 97);
  for (std::size_t i = 0; i < x.size(); ++i) x.data()[i] = 1e-3f * static_cast<float>(i % 89);
  std::size_t reps = 0;
  const auto t0 = Clock::now();
  double elapsed = 0;
  while (elapsed < 0.3) {
    for (std::size_t b = 0; b < slabs; ++b)
      affine_step(m.data() + b * k * k, k, x.data() + b * k * v, v, s.data() + b * k * v, v,
                  c.data() + b * k * v, v, k, v, Direction::forward);
    ++reps;
    elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  return 2.0 * k * k * v * slabs * static_cast<double>(reps) / elapsed / 1e9;
}

void run_calibrate(const CalibrateConfig& cfg) {
  CostParams p;
  p.source = "kdacp calibrate (in-process backend)";
  p.alpha_s = one_way(64, cfg.repeat);
  const std::size_t large = cfg.large_mib << 20;
  const double t_large = one_way(large, 8);
  // The per-byte time net of the latency; floor it so that β stays positive
  // when a tiny message is slower than its share of a large one.
  p.beta_s_per_byte = std::max(t_large - p.alpha_s, t_large * 0.01) / static_cast<double>(large);
  p.gflops = fold_gflops();
  save_cost_params(p, cfg.out);
  std::printf("alpha %.3g us, bandwidth %.3g GB/s, fold %.3g GFLOP/s (one thread)\nsaved to %s\n",
              p.alpha_s * 1e6, 1e-9 / p.beta_s_per_byte, p.gflops, cfg.out.c_str());
}

}  // namespace

void add_calibrate_command(CLI::App& app) {
  auto cfg = std::make_shared<CalibrateConfig>();
  CLI::App* cmd = app.add_subcommand(
      "calibrate", "measure the cost model's alpha, beta and gamma on the in-process backend");
  cmd->add_option("--out,-o", cfg->out, "JSON file to write")->capture_default_str();
  cmd->add_option("--repeat", cfg->repeat, "small-message round trips")
      ->check(CLI::Range(1, 10000000))
      ->capture_default_str();
  cmd->add_option("--large-mib", cfg->large_mib, "bandwidth message size in MiB")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  cmd->callback([cfg] { run_calibrate(*cfg); });
}

}  // namespace kdacp::cli
