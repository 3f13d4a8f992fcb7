// `kdacp bench kernels`: the sweep of kdacp/testing/kernel_bench.hpp with an
// OpenBLAS cblas_sgemm loop doing the same work as its baseline, as records.
#include <cstdio>
#include <cstring>

#include "bench.hpp"
#include "kdacp/testing/kernel_bench.hpp"

#ifdef KDACP_HAVE_OPENBLAS
#include <cblas.h>
#endif

namespace kdacp::cli {

namespace {

#ifdef KDACP_HAVE_OPENBLAS
// What a user would otherwise write: per slab and step, copy S into C and
// C = op(M)·X + C with cblas_sgemm (beta = 1), ping-ponging C as the next X.
// Parallel over slabs with the same pool, OpenBLAS itself single-threaded.
void run_openblas(const testing::FoldChain& d, std::size_t chain, Direction dir, ThreadPool* pool) {
  const std::size_t k = d.k, v = d.v;
  parallel_ranges(pool, d.slabs, [&](std::size_t begin, std::size_t end, std::size_t) {
    for (std::size_t slab = begin; slab < end; ++slab) {
      const float* x = d.incoming.data() + slab * k * v;
      for (std::size_t t = 0; t < chain; ++t) {
        const std::size_t pos = t % d.distinct;
        const std::size_t j = dir == Direction::forward ? pos : d.distinct - 1 - pos;
        const float* s = d.offsets.data() + (j * d.slabs + slab) * k * v;
        const float* m = d.transfers.data() + (j * d.slabs + slab) * k * k;
        float* c = (t % 2 == 0 ? d.out_a.data() : d.out_b.data()) + slab * k * v;
        std::memcpy(c, s, k * v * sizeof(float));
        cblas_sgemm(CblasRowMajor, dir == Direction::forward ? CblasNoTrans : CblasTrans,
                    CblasNoTrans, int(k), int(v), int(k), 1.0f, m, int(k), x, int(v), 1.0f, c,
                    int(v));
        x = c;
      }
    }
  });
}
#endif

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
#ifdef KDACP_HAVE_OPENBLAS
  openblas_set_num_threads(1);
  hooks.baseline = run_openblas;
#endif
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
