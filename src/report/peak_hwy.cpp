// FP32 FMA peak probe (kdacp/report/bench.hpp), compiled per target like
// kernels/step_hwy.cpp so that it measures the vector width the fold kernels
// are dispatched to.
#include "kernels/hwy_targets.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "report/peak_hwy.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

#include "kdacp/report/bench.hpp"

HWY_BEFORE_NAMESPACE();
namespace kdacp::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// kChains independent accumulators, each depending only on itself. 16
// covers 2 FMA pipes × up to 8 cycles of latency on current x86 and Arm
// cores and still fits a 32-register file with the two constants; on
// 16-register targets the compiler keeps as many as fit, which is what a
// kernel there can use too.
constexpr std::size_t kChains = 16;

// One round: every chain advances by one FMA. The fold over a constant index
// pack keeps each accumulator in its own register (a runtime loop over an
// array lets the compiler interchange the loops and keep the chains in
// memory, which measures store forwarding, not the FMA units).
template <class V, std::size_t... I>
HWY_INLINE void Round(V* acc, V a, V b, std::index_sequence<I...>) {
  ((acc[I] = hn::MulAdd(acc[I], a, b)), ...);
}

// Runs `iters` rounds and returns the lanes' sum so the work cannot be elided.
float FmaChains(std::uint64_t iters, float seed) {
  const hn::ScalableTag<float> d;
  // Multiplier just below one and addend tiny: values stay finite and
  // normal for any iteration count, so no denormal slow path is measured.
  const auto a = hn::Set(d, 0.999999f);
  const auto b = hn::Set(d, 1e-7f);
  hn::Vec<decltype(d)> acc[kChains];
  for (std::size_t c = 0; c < kChains; ++c) acc[c] = hn::Set(d, seed + float(c));
  for (std::uint64_t it = 0; it < iters; ++it) Round(acc, a, b, std::make_index_sequence<kChains>());
  for (std::size_t c = 1; c < kChains; ++c) acc[0] = hn::Add(acc[0], acc[c]);
  return hn::GetLane(hn::SumOfLanes(d, acc[0]));
}

// Flops of one FmaChains iteration: chains × lanes × 2.
std::size_t FlopsPerIter() { return kChains * hn::Lanes(hn::ScalableTag<float>()) * 2; }

const char* ProbeTarget() { return hwy::TargetName(HWY_TARGET); }

}  // namespace kdacp::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kdacp {
namespace detail {
HWY_EXPORT(FmaChains);
HWY_EXPORT(FlopsPerIter);
HWY_EXPORT(ProbeTarget);

// Dispatch from inside the namespace of the exported functions, which is
// where HWY_DYNAMIC_DISPATCH resolves them (also when only the static target
// is compiled, as in the sanitizer builds).
float (*fma_chains())(std::uint64_t, float) { return HWY_DYNAMIC_DISPATCH(FmaChains); }
std::size_t flops_per_iter() { return HWY_DYNAMIC_DISPATCH(FlopsPerIter)(); }
const char* probe_target() { return HWY_DYNAMIC_DISPATCH(ProbeTarget)(); }
}  // namespace detail

PeakResult measure_fma_peak(std::size_t threads, double seconds) {
  using clock = std::chrono::steady_clock;
  threads = std::max<std::size_t>(threads, 1);
  const auto chains = detail::fma_chains();
  const double flops_per_iter = double(detail::flops_per_iter());
  // Calibrate the iteration count to roughly `seconds` on one thread.
  std::uint64_t iters = 1 << 16;
  for (;;) {
    const auto t0 = clock::now();
    volatile float sink = chains(iters, 1.0f);
    (void)sink;
    const double dt = std::chrono::duration<double>(clock::now() - t0).count();
    if (dt > seconds / 4 || iters > (std::uint64_t{1} << 40)) {
      iters = std::uint64_t(double(iters) * seconds / std::max(dt, 1e-9)) + 1;
      break;
    }
    iters *= 4;
  }
  PeakResult best;
  best.threads = threads;
  best.target = detail::probe_target();
  // Best of three: the host may be shared, and the peak is what the core can
  // do when it is not interrupted.
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<float> sinks(threads);
    const auto t0 = clock::now();
    {
      std::vector<std::jthread> pool;
      for (std::size_t t = 1; t < threads; ++t)
        pool.emplace_back([&, t] { sinks[t] = chains(iters, float(t)); });
      sinks[0] = chains(iters, 0.0f);
    }
    const double dt = std::chrono::duration<double>(clock::now() - t0).count();
    volatile float sink = sinks[0];
    (void)sink;
    best.gflops = std::max(best.gflops, flops_per_iter * double(iters) * double(threads) / dt * 1e-9);
  }
  return best;
}

}  // namespace kdacp
#endif
