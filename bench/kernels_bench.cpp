// Google Benchmark micro-benchmarks of the fold kernels, for profiling:
//   kdacp_bench_kernels --benchmark_filter=Merge
//   perf stat -e cycles,instructions ./kdacp_bench_kernels --benchmark_filter=Step/128
// Counters: GFLOP/s (2·K·K·V flops per step and slab).
#include <benchmark/benchmark.h>

#include <vector>

#include "kdacp/kernels.hpp"
#include "kdacp/testing/synthetic.hpp"
#include "kdacp/tensor.hpp"

namespace {

using kdacp::Direction;

std::vector<float> random(std::size_t n, float scale, std::uint64_t seed) {
  kdacp::Rng rng(seed);
  std::vector<float> v(n);
  for (auto& e : v) e = rng.uniform(-1, 1) * scale;
  return v;
}

// One slab step C = op(M)·X + S, K = V = range(0); range(1): 1 = transposed.
void Step(benchmark::State& state) {
  const auto k = static_cast<std::size_t>(state.range(0));
  const Direction dir = state.range(1) ? Direction::backward : Direction::forward;
  const auto m = random(k * k, 0.5f / float(k), 1), x = random(k * k, 1, 2), s = random(k * k, 1, 3);
  std::vector<float> c(k * k);
  for (auto _ : state) {
    kdacp::affine_step(m.data(), k, x.data(), k, s.data(), k, c.data(), k, k, k, dir);
    benchmark::DoNotOptimize(c.data());
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * double(k * k * k), benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::OneK::kIs1000);
}
BENCHMARK(Step)->ArgsProduct({{64, 128, 256}, {0, 1}});

// The allgather merge of the last rank: P-1 slots, P-2 steps per slab, B·H = 16.
void Merge(benchmark::State& state) {
  const auto k = static_cast<std::size_t>(state.range(0));
  const auto p = static_cast<std::size_t>(state.range(1));
  constexpr std::size_t kSlabs = 16;
  const std::size_t slot = kSlabs * k * k;
  auto offsets = random(p * slot, 1, 4), transfers = random(p * slot, 0.5f / float(k), 5);
  kdacp::Slots slots;
  slots.offsets = {kdacp::StateView::dense(offsets.data(), 1, kSlabs, k, k), p, slot};
  slots.transfers = {kdacp::StateView::dense(transfers.data(), 1, kSlabs, k, k), p, slot};
  kdacp::State out(1, kSlabs, k, k);
  for (auto _ : state) {
    kdacp::merge(slots, p - 1, Direction::forward, out.view());
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * double(k * k * k) * double(p - 2) * kSlabs,
                                                 benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::OneK::kIs1000);
}
BENCHMARK(Merge)->ArgsProduct({{128}, {4, 10, 18}})->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
