#include <algorithm>
#include <chrono>
#include <cstdint>
#include <span>

#include "kdacp/calibrate.hpp"
#include "kdacp/exchange.hpp"
#include "kdacp/mesh.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct RankInputs {
  StateView offset, transfer, gradient;
};

// Median over iterations of forward + backward time of one configuration,
// each the slowest rank's (every call starts after a barrier). Collective.
double measure_config(const std::shared_ptr<Communicator>& comm, const DeviceMesh& mesh,
                      const ProtocolConfig& config, const RankInputs& in, ThreadPool& pool,
                      double min_time, std::size_t* iterations) {
  const std::size_t p = comm->size(), r = comm->rank();
  ExchangeOptions opts;
  opts.exec.pool = &pool;
  opts.segments = config.segments;
  auto ex = make_state_exchange(mesh, config.method, static_cast<long long>(config.group_size), opts);
  std::vector<double> mine;
  auto once = [&](bool record) {
    comm->barrier();
    const auto t0 = Clock::now();
    State incoming = ex->forward(in.offset, in.transfer);
    const double f = seconds_since(t0);
    comm->barrier();
    const auto t2 = Clock::now();
    State grad = ex->backward(in.gradient, in.transfer);
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

}  // namespace

std::vector<ModelCheck> validate_cost_model(const std::shared_ptr<Communicator>& comm,
                                            const CostParams& params, StateView offset,
                                            StateView transfer, StateView gradient,
                                            const ValidationOptions& options) {
  const std::size_t p = comm->size(), r = comm->rank();
  const ProblemShape ps{p, offset.slabs(), offset.rows, offset.cols, 4};
  const auto predictions = predict_all(params, ps, true);
  ThreadPool pool(options.threads);
  const DeviceMesh mesh = DeviceMesh::create(comm, {p}, {"cp"});
  const RankInputs in{offset, transfer, gradient};
  std::vector<ModelCheck> checks;
  for (const Prediction& pred : predictions) {
    std::size_t iters = 0;
    const double measured = measure_config(comm, mesh, pred.config, in, pool, options.min_time, &iters);
    if (r != 0) continue;
    ModelCheck check;
    check.config = pred.config;
    check.ranks = p;
    check.predicted_seconds = 2 * pred.seconds;  // forward + backward
    check.measured_seconds = measured;
    check.iterations = iters;
    if (options.on_check) options.on_check(check);
    checks.push_back(std::move(check));
  }
  return checks;
}

}  // namespace kdacp
