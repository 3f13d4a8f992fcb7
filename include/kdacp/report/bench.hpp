// Measurement helpers behind `kdacp bench` and `kdacp run`: what the hardware
// can do and how much work the layer is, so that timings can be printed as
// ratios of it in the same run. Part of kdacp_report; the exchange never
// uses them.
#pragma once

#include <cstddef>
#include <string>

#include "kdacp/kda.hpp"

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

namespace kdacp::kda {

// Flops of the recurrence as this implementation runs it on `shape`. The
// context-parallel layer adds the summary (forward) and the G pass (backward)
// to what one device runs.
double forward_flops(const Shape& shape, bool context_parallel);
double backward_flops(const Shape& shape, bool context_parallel);

}  // namespace kdacp::kda
