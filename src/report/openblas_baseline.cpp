// The OpenBLAS loop `kdacp bench kernels` times beside the fused fold. Only
// kdacp_report links OpenBLAS; the core library never depends on BLAS.
#include <cstring>

#include "kdacp/report/kernel_bench.hpp"

#ifdef KDACP_HAVE_OPENBLAS
#include <cblas.h>
#endif

namespace kdacp::report {

#ifdef KDACP_HAVE_OPENBLAS
namespace {

void run_openblas(const FoldChain& d, std::size_t chain, Direction dir, ThreadPool* pool) {
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

}  // namespace

FoldBaseline openblas_baseline() {
  // The slabs are the parallelism; an OpenBLAS pool beside ours would
  // oversubscribe the cores.
  openblas_set_num_threads(1);
  return run_openblas;
}
#else
FoldBaseline openblas_baseline() { return {}; }
#endif

}  // namespace kdacp::report
