// Measurement helpers behind `kdacp bench`: what the hardware can do, so that
// kernel and protocol timings can be printed as ratios of it in the same run.
// Not used by the exchange itself.
#pragma once

#include <cstddef>
#include <string>

namespace kdacp {

struct PeakResult {
  double gflops = 0;     // FP32 multiply-adds counted as 2 flops, all threads together
  std::size_t threads = 0;
  std::string target;    // instruction set of the probe (same dispatch as the kernels)
};

// Measured FP32 FMA peak: each of `threads` threads (1 = the caller only) runs
// independent chains of vector fused multiply-adds held in registers, enough
// of them to hide the FMA latency, for about `seconds`. The probe is compiled
// per instruction set and dispatched like the fold kernels, so it measures the
// peak of the very SIMD width the kernels use. Returns the best of a few
// repetitions.
PeakResult measure_fma_peak(std::size_t threads, double seconds = 0.1);

}  // namespace kdacp
