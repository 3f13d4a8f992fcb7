// kdacp calibrate: measures the cost model's α, β and γ on a backend (threads
// of this process, or one process per rank under mpirun) and saves them as
// JSON for `kdacp plan --calibration` and auto. With --validate it then runs
// every configuration the model weighs on the same backend and prints the
// predicted time beside the measured one (docs/protocols.md, "Model
// validation").
//
// α: half the round trip of a 64-byte ping-pong between ranks 0 and 1.
// β: half the round trip of a large ping-pong, net of α, per byte.
// γ: the fold kernel (scan of K×V steps, forward and backward averaged) on
//    rank 0 with the threads one rank gets, while the others wait.
// concurrent_ranks: the host's hardware threads / threads per rank, the ranks
//    that can fold at γ at once when they share this host.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend.hpp"
#include "bench.hpp"
#include "commands.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/error.hpp"
#include "kdacp/exchange.hpp"
#include "kdacp/kernels.hpp"
#include "kdacp/mesh.hpp"
#include "kdacp/synthetic.hpp"
#include "kdacp/tensor.hpp"
#include "kdacp/thread_pool.hpp"
#include "table.hpp"

namespace kdacp::cli {

namespace {

using Clock = std::chrono::steady_clock;

struct CalibrateConfig {
  BackendOptions backend;
  std::string out = "kdacp_calibration.json";
  std::size_t repeat = 2000;        // small-message round trips
  // Bandwidth message size: larger than a last-level cache, so that β is
  // the speed of moving cold data, as an exchange's received states are
  // (16 MiB stayed cache-resident here and gave 29 GB/s instead of ~22).
  std::size_t large_mib = 64;
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

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Seconds per one-way message of `bytes`, from `rounds` ping-pongs between
// ranks 0 and 1 of `comm` (half a round trip each). Every rank takes part in
// the surrounding barriers; only ranks 0 and 1 send. Rank 0's value counts.
double one_way(Communicator& comm, std::size_t bytes, std::size_t rounds) {
  double seconds = 0;
  if (comm.rank() <= 1) {
    std::vector<std::byte> buf(bytes, std::byte{1});
    const std::size_t peer = 1 - comm.rank();
    auto once = [&] {
      if (comm.rank() == 0) {
        comm.isend(buf, peer, 1)->wait();
        comm.irecv(buf, peer, 1)->wait();
      } else {
        comm.irecv(buf, peer, 1)->wait();
        comm.isend(buf, peer, 1)->wait();
      }
    };
    for (std::size_t i = 0; i < std::min<std::size_t>(rounds, 10); ++i) once();  // warm-up
    once();  // both ranks are in step from here
    const auto t0 = Clock::now();
    for (std::size_t i = 0; i < rounds; ++i) once();
    seconds = seconds_since(t0) / (2.0 * static_cast<double>(rounds));
  }
  comm.barrier();
  return seconds;
}

// GFLOP/s of the fold on `threads` threads: scans of 4 K×V steps over the
// shape's slabs, best of several runs, forward and backward averaged.
double fold_gflops(const SummaryShape& shape, std::size_t threads, double min_time) {
  constexpr std::size_t kSteps = 4;
  const std::size_t slabs = shape.slabs(), k = shape.key_dim, v = shape.value_dim;
  const std::size_t off = slabs * k * v, tr = slabs * k * k;
  Buffer offsets(kSteps * off), transfers(kSteps * tr);
  Rng rng(slabs);
  for (std::size_t i = 0; i < transfers.size(); ++i)
    transfers.data()[i] = rng.uniform(-1, 1) / static_cast<float>(2 * k);
  for (std::size_t i = 0; i < offsets.size(); ++i) offsets.data()[i] = rng.uniform(-1, 1);
  State in(1, slabs, k, v), out(1, slabs, k, v);
  Slots slots;
  slots.offsets = {StateView::dense(offsets.data(), 1, slabs, k, v), kSteps, off};
  slots.transfers = {StateView::dense(transfers.data(), 1, slabs, k, k), kSteps, tr};
  ThreadPool pool(threads);
  const ExecPolicy policy{&pool, KernelKind::best};
  const StateView iv = in.view();
  double step = 0;
  for (Direction dir : {Direction::forward, Direction::backward}) {
    const std::size_t first = dir == Direction::forward ? 0 : kSteps - 1;
    auto run = [&] { scan(slots, first, kSteps, dir, &iv, out.view(), std::nullopt, nullptr, policy); };
    run();
    const auto runs = time_runs(min_time / 2, 3, run);
    step += *std::min_element(runs.begin(), runs.end()) / static_cast<double>(kSteps) / 2;
  }
  const double flops = 2.0 * static_cast<double>(slabs) * static_cast<double>(k) *
                       static_cast<double>(k) * static_cast<double>(v);
  return flops / step / 1e9;
}

void broadcast_doubles(Communicator& comm, std::vector<double>& v) {
  comm.broadcast(std::as_writable_bytes(std::span(v)), 0);
}

// α, β, γ measured on `comm` (every rank calls; every rank returns the same).
CostParams measure_params(Communicator& comm, const CalibrateConfig& cfg, const SummaryShape& shape,
                          std::size_t threads) {
  if (comm.size() < 2)
    throw InvalidArgument("kdacp calibrate needs at least 2 ranks for the ping-pong, got " +
                          std::to_string(comm.size()));
  const double alpha = one_way(comm, 64, cfg.repeat);
  const std::size_t large = cfg.large_mib << 20;
  const double t_large = one_way(comm, large, 8);
  std::vector<double> v(3, 0.0);
  if (comm.rank() == 0) {
    v[0] = alpha;
    // The per-byte time net of the latency; floor it so that β stays positive
    // when a tiny message is slower than its share of a large one.
    v[1] = std::max(t_large - alpha, t_large * 0.01) / static_cast<double>(large);
    v[2] = fold_gflops(shape, threads, cfg.gamma_time);
  }
  comm.barrier();
  broadcast_doubles(comm, v);
  CostParams p;
  std::ostringstream src;
  src << "kdacp calibrate (" << comm.backend() << " backend, " << comm.size() << " ranks, "
      << threads << " thread(s) per rank)";
  p.source = src.str();
  p.alpha_s = v[0];
  p.beta_s_per_byte = v[1];
  p.gflops = v[2];
  const std::size_t hw = std::max<std::size_t>(std::thread::hardware_concurrency(), 1);
  p.concurrent_ranks = std::max<std::size_t>(1, hw / std::max<std::size_t>(threads, 1));
  return p;
}

std::string config_label(const ProtocolConfig& c) {
  std::string name = c.method;
  if (c.group_size > 1) name += " w=" + std::to_string(c.group_size);
  if (c.segments > 0) name += " c=" + std::to_string(c.segments);
  return name;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Median over iterations of forward + backward time of one configuration,
// each the slowest rank's (every call starts after a barrier). Collective.
double measure_config(const std::shared_ptr<Communicator>& comm, const DeviceMesh& mesh,
                      const ProtocolConfig& config, const SyntheticSummary& sm,
                      const SyntheticSummary& gm, ThreadPool& pool, double min_time,
                      std::size_t* iterations) {
  const std::size_t p = comm->size(), r = comm->rank();
  ExchangeOptions opts;
  opts.exec.pool = &pool;
  opts.segments = config.segments;
  auto ex = make_state_exchange(mesh, config.method, static_cast<long long>(config.group_size), opts);
  std::vector<double> mine;
  auto once = [&](bool record) {
    comm->barrier();
    const auto t0 = Clock::now();
    State in = ex->forward(sm.offset.view(), sm.transfer.view());
    const double f = seconds_since(t0);
    comm->barrier();
    const auto t2 = Clock::now();
    State g = ex->backward(gm.offset.view(), sm.transfer.view());
    const double b = seconds_since(t2);
    if (record) mine.push_back(f), mine.push_back(b);
    return f + b;
  };
  once(false);
  const double warm = once(false);
  // Rank 0 sizes the run; every rank must make the same number of calls.
  std::uint64_t iters = 0;
  if (r == 0) iters = std::clamp<std::uint64_t>(std::uint64_t(min_time / std::max(warm, 1e-6)), 3, 200);
  comm->broadcast(std::as_writable_bytes(std::span(&iters, 1)), 0);
  for (std::uint64_t it = 0; it < iters; ++it) once(true);
  std::vector<double> all(p * mine.size());
  std::copy(mine.begin(), mine.end(), all.begin() + static_cast<std::ptrdiff_t>(r * mine.size()));
  comm->all_gather(std::as_writable_bytes(std::span(all)));
  std::vector<double> slowest(iters, 0.0);
  for (std::size_t it = 0; it < iters; ++it) {
    double f = 0, b = 0;
    for (std::size_t q = 0; q < p; ++q) {
      f = std::max(f, all[q * mine.size() + 2 * it]);
      b = std::max(b, all[q * mine.size() + 2 * it + 1]);
    }
    slowest[it] = f + b;
  }
  *iterations = static_cast<std::size_t>(iters);
  return median(slowest);
}

struct ModelRow {
  std::string protocol;
  std::size_t ranks = 0;
  double predicted = 0, measured = 0;
  std::size_t iterations = 0;
  CostParams params;  // what predicted it
};

// Every configuration of predict_all on the ranks of `comm`; rank 0 appends
// the rows.
void validate_on(const std::shared_ptr<Communicator>& comm, const CostParams& params,
                 const CalibrateConfig& cfg, std::size_t threads, std::vector<ModelRow>* rows) {
  const std::size_t p = comm->size(), r = comm->rank();
  const SummaryShape shape{cfg.batch, cfg.heads, cfg.key_dim, cfg.value_dim};
  const ProblemShape ps{p, shape.slabs(), shape.key_dim, shape.value_dim, 4};
  const auto predictions = predict_all(params, ps, true);
  const SyntheticSummary sm = synthetic_summary(shape, 0, r, false);
  const SyntheticSummary gm = synthetic_summary(shape, 0, r, true);
  ThreadPool pool(threads);
  const DeviceMesh mesh = DeviceMesh::create(comm, {p}, {"cp"});
  for (const Prediction& pred : predictions) {
    std::size_t iters = 0;
    const double measured = measure_config(comm, mesh, pred.config, sm, gm, pool, cfg.min_time, &iters);
    if (r != 0) continue;
    ModelRow row;
    row.protocol = config_label(pred.config);
    row.ranks = p;
    row.predicted = 2 * pred.seconds;  // forward + backward
    row.measured = measured;
    row.iterations = iters;
    row.params = params;
    std::fprintf(stderr, "kdacp calibrate: P=%zu %s: predicted %.3f ms, measured %.3f ms (%zu iterations)\n",
                 p, row.protocol.c_str(), row.predicted * 1e3, row.measured * 1e3, iters);
    rows->push_back(row);
  }
}

std::string ms(double s) { return fmt("%.3f", s * 1e3); }

void report(const CalibrateConfig& cfg, const std::string& backend, const std::vector<ModelRow>& rows) {
  if (cfg.json) {
    nlohmann::json records = nlohmann::json::array();
    for (const ModelRow& row : rows)
      records.push_back({{"mode", "model"},
                         {"protocol", row.protocol},
                         {"P", row.ranks},
                         {"BH", cfg.batch * cfg.heads},
                         {"K", cfg.key_dim},
                         {"V", cfg.value_dim},
                         {"source", row.params.source},
                         {"alpha_s", row.params.alpha_s},
                         {"beta_s_per_byte", row.params.beta_s_per_byte},
                         {"gflops", row.params.gflops},
                         {"concurrent_ranks", row.params.concurrent_ranks},
                         {"predicted_seconds", row.predicted},
                         {"measured_seconds", row.measured},
                         {"ratio", row.predicted > 0 ? row.measured / row.predicted : 0.0},
                         {"iterations", row.iterations}});
    std::printf("%s\n", records.dump(2).c_str());
    return;
  }
  std::printf("\nmodel validation: forward + backward, B*H=%zu, K=%zu, V=%zu, %s backend\n",
              cfg.batch * cfg.heads, cfg.key_dim, cfg.value_dim, backend.c_str());
  std::size_t last_p = 0;
  for (const ModelRow& row : rows) {
    if (row.ranks == last_p) continue;
    last_p = row.ranks;
    std::printf("P=%zu: alpha %.3g us, bandwidth %.3g GB/s, fold %.3g GFLOP/s, %zu rank(s) fold at once (%s)\n",
                row.ranks, row.params.alpha_s * 1e6, 1e-9 / row.params.beta_s_per_byte, row.params.gflops,
                row.params.concurrent_ranks, row.params.source.c_str());
  }
  Table t({"protocol", "P", "predicted ms", "measured ms", "measured/predicted"});
  std::size_t outside = 0;
  for (const ModelRow& row : rows) {
    const double ratio = row.predicted > 0 ? row.measured / row.predicted : 0.0;
    if (ratio < 0.7 || ratio > 1.3) ++outside;
    t.add({row.protocol, std::to_string(row.ranks), ms(row.predicted), ms(row.measured), fmt("%.2f", ratio)});
  }
  t.print();
  std::printf("%zu of %zu ratios outside [0.70, 1.30]\n", outside, rows.size());
}

void run_calibrate(const CalibrateConfig& cfg) {
  if (!cfg.calibration.empty() && !cfg.validate)
    throw InvalidArgument("--calibration loads parameters for --validate; pass --validate too");
  for (std::size_t p : cfg.validate_ranks)
    if (p < 2)
      throw InvalidArgument("--validate-ranks has " + std::to_string(p) + ", expected every P >= 2");
  const SummaryShape shape{cfg.batch, cfg.heads, cfg.key_dim, cfg.value_dim};
  const std::size_t threads =
      cfg.threads ? cfg.threads : ThreadPool::default_threads(ranks_per_process(cfg.backend));
  const std::optional<CostParams> loaded =
      cfg.calibration.empty() ? std::nullopt : std::optional<CostParams>(load_cost_params(cfg.calibration));

  // The first job measures (or loads) the parameters; under MPI it also
  // validates, since MPI starts once per process.
  CostParams params;
  bool root = false, mpi = false;
  std::vector<ModelRow> rows;
  run_ranks(cfg.backend, [&](const std::shared_ptr<Communicator>& comm) {
    const CostParams p = loaded ? *loaded : measure_params(*comm, cfg, shape, threads);
    if (comm->rank() == 0) {
      params = p;
      root = true;
      mpi = comm->backend() == "mpi";
      if (!loaded) {
        save_cost_params(p, cfg.out);
        std::fprintf(cfg.json ? stderr : stdout,
                     "alpha %.3g us, bandwidth %.3g GB/s, fold %.3g GFLOP/s per rank (%zu thread(s)), "
                     "%zu rank(s) fold at once (%s)\nsaved to %s\n",
                     p.alpha_s * 1e6, 1e-9 / p.beta_s_per_byte, p.gflops, threads, p.concurrent_ranks,
                     p.source.c_str(), cfg.out.c_str());
        std::fflush(cfg.json ? stderr : stdout);
      }
    }
    if (cfg.validate && comm->backend() == "mpi") validate_on(comm, p, cfg, threads, &rows);
  });
  if (!root) return;
  if (cfg.validate && !mpi) {
    for (std::size_t p : cfg.validate_ranks) {
      BackendOptions o = cfg.backend;
      o.backend = "inprocess";
      o.ranks = p;
      // α and β of in-process ranks grow with the ranks in the world (they
      // share the host's cores and one condition variable), so unless a
      // file was given, each P is calibrated in its own world, as mpirun -np P
      // calibrates in the world it validates.
      run_ranks(o, [&](const std::shared_ptr<Communicator>& comm) {
        const CostParams here = loaded ? *loaded : measure_params(*comm, cfg, shape, threads);
        validate_on(comm, here, cfg, threads, &rows);
      });
    }
  }
  if (cfg.validate) report(cfg, mpi ? "mpi" : "inprocess", rows);
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
  cmd->add_option("--out,-o", cfg->out, "JSON file to write (rank 0)")->capture_default_str();
  cmd->add_option("--repeat", cfg->repeat, "small-message round trips")
      ->check(CLI::Range(1, 10000000))
      ->capture_default_str();
  cmd->add_option("--large-mib", cfg->large_mib, "bandwidth message size in MiB")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  cmd->add_option("--threads", cfg->threads,
                  "threads per rank for the fold (0: hardware threads / ranks in this process)")
      ->capture_default_str();
  cmd->add_option("--gamma-time", cfg->gamma_time, "seconds spent measuring the fold speed")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_flag("--validate", cfg->validate,
                "then run every configuration the model weighs (predict_all, reassociating "
                "included) and print predicted vs measured forward+backward time");
  cmd->add_option("--calibration", cfg->calibration,
                  "with --validate: load these parameters instead of measuring them");
  cmd->add_option("--validate-ranks", cfg->validate_ranks,
                  "in-process: the P values to validate (under MPI, P is the number of processes)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--batch,-B", cfg->batch, "validation batch B")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--heads,-H", cfg->heads, "validation heads H")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--key-dim,-K", cfg->key_dim, "validation key dim K (also the fold calibration's)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--value-dim,-V", cfg->value_dim, "validation value dim V")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--min-time", cfg->min_time, "seconds of timed calls per configuration")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_flag("--json", cfg->json, "print the validation as flat JSON records");
  cmd->callback([cfg] { run_calibrate(*cfg); });
}

}  // namespace kdacp::cli
