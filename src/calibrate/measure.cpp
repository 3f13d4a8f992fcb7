#include <algorithm>
#include <chrono>
#include <optional>
#include <span>
#include <thread>

#include <fmt/format.h>

#include "kdacp/calibrate.hpp"
#include "kdacp/error.hpp"
#include "kdacp/kernels.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Seconds per one-way message of `bytes`, from `rounds` ping-pongs between
// ranks 0 and 1 of `comm` (half a round trip each). Every rank takes part in
// the closing barrier; only ranks 0 and 1 send. Rank 0's value counts.
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

// Deterministic values in [-1, 1) without a generator: the fold's speed does
// not depend on them as long as they stay normal and bounded.
float pattern(std::size_t i) {
  return static_cast<float>((i * 2654435761u) % 2048) / 1024.0f - 1.0f;
}

}  // namespace

std::vector<double> time_runs(double min_time, std::size_t min_runs, const std::function<void()>& fn) {
  std::vector<double> runs;
  const auto start = Clock::now();
  while (runs.size() < min_runs || seconds_since(start) < min_time) {
    const auto t0 = Clock::now();
    fn();
    runs.push_back(seconds_since(t0));
  }
  return runs;
}

double measure_fold_gflops(const SummaryShape& shape, std::size_t threads, double seconds) {
  constexpr std::size_t kSteps = 4;
  const std::size_t slabs = shape.slabs(), k = shape.key_dim, v = shape.value_dim;
  const std::size_t off = slabs * k * v, tr = slabs * k * k;
  Buffer offsets(kSteps * off * sizeof(float)), transfers(kSteps * tr * sizeof(float));
  float* o = offsets.as<float>();
  float* t = transfers.as<float>();
  // Entries below 1/(2K) in magnitude: every transfer is a contraction, so
  // the chain stays bounded and no denormal or overflow path is timed.
  for (std::size_t i = 0; i < kSteps * tr; ++i) t[i] = pattern(i) / static_cast<float>(2 * k);
  for (std::size_t i = 0; i < kSteps * off; ++i) o[i] = pattern(i + 1);
  State in(1, slabs, k, v), out(1, slabs, k, v);
  Slots slots;
  slots.offsets = {StateView::dense(o, 1, slabs, k, v), kSteps, off};
  slots.transfers = {StateView::dense(t, 1, slabs, k, k), kSteps, tr};
  ThreadPool pool(threads);
  const ExecPolicy policy{&pool, KernelKind::best};
  const StateView iv = in.view();
  double step = 0;
  for (Direction dir : {Direction::forward, Direction::backward}) {
    const std::size_t first = dir == Direction::forward ? 0 : kSteps - 1;
    auto run = [&] { scan(slots, first, kSteps, dir, &iv, out.view(), std::nullopt, nullptr, policy); };
    run();
    const auto runs = time_runs(seconds / 2, 3, run);
    step += *std::min_element(runs.begin(), runs.end()) / static_cast<double>(kSteps) / 2;
  }
  const double flops = 2.0 * static_cast<double>(slabs) * static_cast<double>(k) *
                       static_cast<double>(k) * static_cast<double>(v);
  return flops / step / 1e9;
}

CostParams measure_cost_params(Communicator& comm, const CalibrationOptions& options) {
  if (comm.size() < 2)
    throw InvalidArgument(fmt::format("kdacp calibrate needs at least 2 ranks for the ping-pong, got {}", comm.size()));
  const double alpha = one_way(comm, 64, options.repeat);
  const std::size_t large = options.large_bytes;
  const double t_large = one_way(comm, large, 8);
  std::vector<double> v(3, 0.0);
  if (comm.rank() == 0) {
    v[0] = alpha;
    // The per-byte time net of the latency; floor it so that β stays positive
    // when a tiny message is slower than its share of a large one.
    v[1] = std::max(t_large - alpha, t_large * 0.01) / static_cast<double>(large);
    v[2] = measure_fold_gflops(options.fold_shape, options.threads, options.gamma_seconds);
  }
  comm.barrier();
  comm.broadcast(std::as_writable_bytes(std::span(v)), 0);
  CostParams p;
  p.source = fmt::format("kdacp calibrate ({} backend, {} ranks, {} thread(s) per rank)", comm.backend(),
                         comm.size(), options.threads);
  p.alpha_s = v[0];
  p.beta_s_per_byte = v[1];
  p.gflops = v[2];
  const std::size_t hw = std::max<std::size_t>(std::thread::hardware_concurrency(), 1);
  p.concurrent_ranks = std::max<std::size_t>(1, hw / std::max<std::size_t>(options.threads, 1));
  return p;
}

}  // namespace kdacp
