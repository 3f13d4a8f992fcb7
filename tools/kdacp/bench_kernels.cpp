// `kdacp bench kernels`: the sweep of kdacp/testing/kernel_bench.hpp with its
// OpenBLAS baseline, as records.
#include <cstdio>

#include "bench.hpp"
#include "kdacp/testing/kernel_bench.hpp"

namespace kdacp::cli {

namespace {

const char* direction_name(Direction dir) { return dir == Direction::forward ? "forward" : "backward"; }

nlohmann::json to_json(const testing::KernelRecord& r) {
  const double blas = r.baseline_gflops;
  return {{"mode", "kernels"},
          {"K", r.k}, {"V", r.k}, {"chain", r.chain}, {"threads", r.threads}, {"BH", r.slabs},
          {"direction", direction_name(r.direction)}, {"target", r.peak.target}, {"seconds", r.seconds},
          {"gflops", r.gflops}, {"peak_gflops", r.peak.gflops}, {"openblas_gflops", blas},
          {"scalar_gflops", r.scalar_gflops}, {"fraction_of_peak", r.gflops / r.peak.gflops},
          {"speedup_vs_openblas", blas > 0 ? r.gflops / blas : 0.0},
          {"speedup_vs_scalar", r.gflops / r.scalar_gflops}};
}

}  // namespace

nlohmann::json run_kernel_bench(const testing::KernelBenchConfig& kc, bool progress) {
  testing::KernelBenchHooks hooks;
  hooks.baseline = testing::openblas_baseline();
  if (progress) {
    hooks.on_peak = [](const PeakResult& p) {
      std::fprintf(stderr, "kdacp bench: FP32 FMA peak, %zu thread(s), %s: %.1f GFLOP/s\n", p.threads,
                   p.target.c_str(), p.gflops);
    };
    hooks.on_record = [](const testing::KernelRecord& r, std::size_t done, std::size_t total) {
      const double blas = r.baseline_gflops;
      std::fprintf(stderr,
                   "kdacp bench: [%zu/%zu] K=V=%zu chain=%zu threads=%zu %s: %.1f GFLOP/s "
                   "(%.0f%% of peak, %.2fx OpenBLAS)\n",
                   done, total, r.k, r.chain, r.threads, direction_name(r.direction), r.gflops,
                   100 * r.gflops / r.peak.gflops, blas > 0 ? r.gflops / blas : 0.0);
    };
  }
  nlohmann::json records = nlohmann::json::array();
  for (const testing::KernelRecord& r : testing::bench_kernels(kc, hooks)) records.push_back(to_json(r));
  return records;
}

}  // namespace kdacp::cli
