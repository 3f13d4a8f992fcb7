// The KDA layer's math on one rank, both algorithms (kda::Algorithm):
// forward (o + final state), backward (all gradients), chunk summary and G
// pass at B=1, T=8192, H=4, K=V=128 (or the shape on the command line), in
// float. Prints median wall times, the speed-up of chunk over recurrent, and
// effective rates: the recurrent flop count (kda::forward_flops /
// backward_flops, src/testing/flops.cpp) per second beside the measured FP32
// FMA peak of the same threads. Not a test: nothing here asserts.
//
//   kdacp_bench_layer [threads=1] [reps=5] [T=8192] [H=4] [K=128] [V=128] [cpu] [algos] [calls]
//
// `cpu` (7th argument 1) times CPU time of the process instead of wall time:
// with one thread on a busy shared machine that is the steadier number.
// `algos` (8th argument): a mask of the runs, 1 recurrent, 2 chunk, 4 chunk
// with the forward's ForwardCache (default 7: all; one alone for profiling). `calls` (9th): a mask of the calls timed,
// 1 forward, 2 backward, 4 summary, 8 G pass (default 15: all).
#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

#include "kdacp/kda.hpp"
#include "kdacp/report/bench.hpp"
#include "kdacp/thread_pool.hpp"

namespace {

using namespace kdacp;
using namespace kdacp::kda;

// Seconds of one call: wall time, or with `cpu` the process's CPU time (on
// a shared machine, time slices lost to other processes do not count; equal
// to wall time for one thread on an idle machine).
bool g_cpu_time = false;

double now_seconds() {
  if (g_cpu_time) return static_cast<double>(std::clock()) / CLOCKS_PER_SEC;
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median_seconds(std::size_t reps, const std::function<void()>& fn) {
  fn();  // warm-up: page faults, scratch caches
  std::vector<double> t;
  for (std::size_t r = 0; r < reps; ++r) {
    const double a = now_seconds();
    fn();
    t.push_back(now_seconds() - a);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

std::vector<float> uniform(std::size_t n, float lo, float hi, std::mt19937& rng) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> x(n);
  for (auto& e : x) e = d(rng);
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  auto arg = [&](int i, std::size_t dflt) {
    return argc > i ? static_cast<std::size_t>(std::strtoull(argv[i], nullptr, 10)) : dflt;
  };
  const std::size_t threads = arg(1, 1), reps = arg(2, 5);
  g_cpu_time = arg(7, 0) != 0;
  const std::size_t algos = arg(8, 7);
  // Which calls to time (bit 0 forward, 1 backward, 2 summary, 3 G pass):
  // one alone makes a profile of that call (perf record) readable.
  const std::size_t calls = arg(9, 15);
  const Shape s{1, arg(3, 8192), arg(4, 4), arg(4, 4), arg(5, 128), arg(6, 128)};
  std::mt19937 rng(1);
  std::vector<float> q = uniform(s.qk_elems(), -1, 1, rng), k = uniform(s.qk_elems(), -1, 1, rng);
  for (std::size_t r = 0; r < s.qk_elems(); r += s.key_dim) {
    float n = 0;
    for (std::size_t i = 0; i < s.key_dim; ++i) n += k[r + i] * k[r + i];
    for (std::size_t i = 0; i < s.key_dim; ++i) k[r + i] /= std::sqrt(n);
  }
  std::vector<float> v = uniform(s.v_elems(), -1, 1, rng), g = uniform(s.g_elems(), -0.1f, 0, rng);
  std::vector<float> beta = uniform(s.beta_elems(), 0.1f, 0.9f, rng);
  std::vector<float> d_o = uniform(s.v_elems(), -1, 1, rng);
  std::vector<float> o(s.v_elems()), fin(s.state_elems()), st(s.state_elems()),
      tr(s.transfer_elems()), gs(s.state_elems());
  std::vector<float> dq(s.qk_elems()), dk(s.qk_elems()), dv(s.v_elems()), dg(s.g_elems()),
      db(s.beta_elems()), dinc(s.state_elems());

  ThreadPool pool(threads);
  const PeakResult peak = measure_fma_peak(threads, 0.2);
  const double ff = forward_flops(s, false), bf = backward_flops(s, false);
  std::printf("KDA layer math, float, B=%zu T=%zu H=%zu HV=%zu K=%zu V=%zu, %zu thread(s), "
              "median of %zu, %s time\n",
              s.batch, s.tokens, s.heads, s.value_heads, s.key_dim, s.value_dim, threads, reps,
              g_cpu_time ? "CPU" : "wall");
  std::printf("FP32 FMA peak: %.1f GFLOP/s (%s)\n", peak.gflops, peak.target.c_str());
  std::printf("%-10s %10s %10s %10s %10s %10s %9s %9s\n", "algorithm", "fwd ms", "bwd ms",
              "f+b ms", "summary", "G pass", "GFLOP/s", "% peak");
  // The runs: recurrent, chunk recomputing its forward in the backward, and
  // chunk with the forward's ForwardCache (the backward skips its first pass).
  struct Run {
    Algorithm algorithm;
    bool keep;
    const char* name;
  };
  double fb[3] = {0, 0, 0};
  const Run runs[] = {{Algorithm::recurrent, false, "recurrent"},
                      {Algorithm::chunk, false, "chunk"},
                      {Algorithm::chunk, true, "chunk+keep"}};
  for (std::size_t r = 0; r < 3; ++r) {
    const Run& run = runs[r];
    if ((algos & (1u << r)) == 0) continue;
    const Inputs<float> in{q.data(), k.data(), v.data(), g.data(), beta.data(), s,
                           default_scale<float>(s.key_dim)};
    const kda::Exec exec{{&pool, KernelKind::best}, run.algorithm};
    ForwardCache<float> cache;
    ForwardCache<float>* kept = run.keep ? &cache : nullptr;
    const auto timed = [&](std::size_t bit, const std::function<void()>& f) {
      return (calls >> bit) & 1u ? median_seconds(reps, f) : 0.0;
    };
    const double tf = timed(0, [&] {
      cache.clear();
      forward(in, nullptr, o.data(), fin.data(), exec, kept);
    });
    if (run.keep && cache.records() == 0) forward(in, nullptr, o.data(), fin.data(), exec, kept);
    const double tb = timed(1, [&] {
      cache.rewind();
      backward(in, nullptr, d_o.data(), nullptr,
               Grads<float>{dq.data(), dk.data(), dv.data(), dg.data(), db.data(), dinc.data()},
               exec, kDefaultCheckpointInterval, kept);
    });
    const double ts = timed(2, [&] { chunk_summary(in, st.data(), tr.data(), exec); });
    const double tg = timed(3, [&] { incoming_grad(in, d_o.data(), gs.data(), exec); });
    const double rate = (ff + bf) / (tf + tb) / 1e9;
    fb[r] = tf + tb;
    std::printf("%-10s %10.2f %10.2f %10.2f %10.2f %10.2f %9.1f %8.1f%%\n", run.name,
                tf * 1e3, tb * 1e3, (tf + tb) * 1e3, ts * 1e3, tg * 1e3, rate,
                100 * rate / peak.gflops);
    if (run.keep)
      std::printf("chunk+keep: the forward keeps %.1f MiB for the backward\n", double(cache.bytes()) / (1 << 20));
  }
  for (std::size_t r = 1; r < 3; ++r)
    if (fb[0] > 0 && fb[r] > 0) std::printf("%s speed-up, forward+backward: %.2fx\n", runs[r].name, fb[0] / fb[r]);
  return 0;
}
