// `kdacp bench kernels`: GFLOP/s of the fused fold (kdacp::scan, the loop
// behind merge) beside, in the same run, the measured FP32 FMA peak, an
// OpenBLAS cblas_sgemm loop doing the same work, and the scalar kernel.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <thread>

#include "bench.hpp"
#include "kdacp/bench.hpp"
#include "kdacp/kernels.hpp"
#include "kdacp/synthetic.hpp"
#include "kdacp/thread_pool.hpp"

#ifdef KDACP_HAVE_OPENBLAS
#include <cblas.h>
#endif

namespace kdacp::cli {

std::vector<double> time_runs(double min_time, std::size_t min_runs, const std::function<void()>& fn) {
  using clock = std::chrono::steady_clock;
  std::vector<double> runs;
  const auto start = clock::now();
  while (runs.size() < min_runs ||
         std::chrono::duration<double>(clock::now() - start).count() < min_time) {
    const auto t0 = clock::now();
    fn();
    runs.push_back(std::chrono::duration<double>(clock::now() - t0).count());
  }
  return runs;
}

namespace {

// Distinct slots per configuration are capped so that a long chain of large
// heads stays within this many bytes; longer chains run several scans back
// to back over the same slots (the state carried from one to the next), so
// the kernel still streams fresh M and S from memory at every step once the
// working set exceeds the last-level cache.
constexpr std::size_t kSlotBudgetBytes = std::size_t{64} << 20;

// One configuration's inputs: `distinct` stacked slots of S [.,1,slabs,K,V]
// and M [.,1,slabs,K,K], an incoming state and two outputs to alternate.
struct ChainData {
  std::size_t k, v, slabs, distinct;
  Buffer offsets, transfers;
  State incoming, out_a, out_b;

  ChainData(std::size_t k_, std::size_t v_, std::size_t slabs_, std::size_t chain)
      : k(k_), v(v_), slabs(slabs_) {
    const std::size_t slot_bytes = slabs * k * (k + v) * sizeof(float);
    distinct = std::clamp<std::size_t>(kSlotBudgetBytes / slot_bytes, 1, std::max<std::size_t>(chain, 1));
    offsets = Buffer(distinct * slabs * k * v);
    transfers = Buffer(distinct * slabs * k * k);
    incoming = State(1, slabs, k, v);
    out_a = State(1, slabs, k, v);
    out_b = State(1, slabs, k, v);
    // Contractions with O(1) offsets: the chain stays bounded and normal, so
    // no denormal or overflow slow path is timed.
    Rng rng(k * 131 + slabs);
    const float scale = 0.5f / float(k);
    for (std::size_t i = 0; i < transfers.size(); ++i) transfers.data()[i] = rng.uniform(-1, 1) * scale;
    for (std::size_t i = 0; i < offsets.size(); ++i) offsets.data()[i] = rng.uniform(-1, 1);
    for (std::size_t i = 0; i < incoming.size(); ++i) incoming.data()[i] = rng.uniform(-1, 1);
  }

  Slots slots() const {
    Slots s;
    s.offsets.base = StateView::dense(offsets.data(), 1, slabs, k, v);
    s.offsets.ranks = distinct;
    s.offsets.rank_stride = slabs * k * v;
    s.transfers.base = StateView::dense(transfers.data(), 1, slabs, k, k);
    s.transfers.ranks = distinct;
    s.transfers.rank_stride = slabs * k * k;
    return s;
  }
};

// `chain` steps per slab with the library's fold, from the incoming state.
void run_kdacp(const ChainData& d, std::size_t chain, Direction dir, const ExecPolicy& policy) {
  const Slots slots = d.slots();
  const StateView in0 = d.incoming.view(), a = d.out_a.view(), b = d.out_b.view();
  const StateView* in = &in0;
  bool to_a = true;
  for (std::size_t done = 0; done < chain;) {
    const std::size_t n = std::min(chain - done, d.distinct);
    const std::size_t first = dir == Direction::forward ? 0 : d.distinct - 1;
    scan(slots, first, n, dir, in, to_a ? a : b, std::nullopt, nullptr, policy);
    in = to_a ? &a : &b;
    to_a = !to_a;
    done += n;
  }
}

#ifdef KDACP_HAVE_OPENBLAS
// What a user would otherwise write: per slab and step, copy S into C and
// C = op(M)·X + C with cblas_sgemm (beta = 1), ping-ponging C as the next X.
// Parallel over slabs with the same pool, OpenBLAS itself single-threaded.
void run_openblas(const ChainData& d, std::size_t chain, Direction dir, ThreadPool* pool) {
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

double best(const std::vector<double>& runs) { return *std::min_element(runs.begin(), runs.end()); }

}  // namespace

nlohmann::json run_kernel_bench(const BenchConfig& cfg) {
#ifdef KDACP_HAVE_OPENBLAS
  openblas_set_num_threads(1);
#endif
  const std::size_t hw = std::max<std::size_t>(std::thread::hardware_concurrency(), 1);
  std::vector<std::size_t> thread_counts;
  for (std::size_t t : cfg.threads) {
    const std::size_t n = t == 0 ? hw : t;
    if (std::find(thread_counts.begin(), thread_counts.end(), n) == thread_counts.end())
      thread_counts.push_back(n);
  }
  // The peak per thread count, measured once, at the start of the same run.
  std::vector<PeakResult> peaks;
  for (std::size_t t : thread_counts) {
    peaks.push_back(measure_fma_peak(t, std::max(cfg.min_time / 2, 0.02)));
    if (cfg.progress)
      std::fprintf(stderr, "kdacp bench: FP32 FMA peak, %zu thread(s), %s: %.1f GFLOP/s\n", t,
                   peaks.back().target.c_str(), peaks.back().gflops);
  }
  const std::size_t total =
      cfg.dims.size() * cfg.chains.size() * thread_counts.size() * cfg.directions.size();
  std::size_t done = 0;
  std::map<std::string, double> scalar_step_s;
  nlohmann::json records = nlohmann::json::array();
  for (std::size_t kd : cfg.dims) {
    for (std::size_t chain : cfg.chains) {
      const ChainData data(kd, kd, cfg.slabs, chain);
      const double flops = 2.0 * double(kd * kd * kd) * double(chain) * double(cfg.slabs);
      for (std::size_t ti = 0; ti < thread_counts.size(); ++ti) {
        const std::size_t threads = thread_counts[ti];
        ThreadPool pool(threads);
        for (const std::string& dname : cfg.directions) {
          const Direction dir = dname == "forward" ? Direction::forward : Direction::backward;
          ExecPolicy simd{&pool, KernelKind::best};
          run_kdacp(data, chain, dir, simd);  // warm-up: page faults, caches
          const double t_simd = best(time_runs(cfg.min_time, 3, [&] { run_kdacp(data, chain, dir, simd); }));
          double t_blas = 0;
#ifdef KDACP_HAVE_OPENBLAS
          run_openblas(data, chain, dir, &pool);
          t_blas = best(time_runs(cfg.min_time, 3, [&] { run_openblas(data, chain, dir, &pool); }));
#endif
          // The scalar kernel's speed per step does not depend on the chain
          // length; timing it once per (K, threads, direction) on one step
          // keeps the sweep short.
          const std::string key = std::to_string(kd) + "/" + std::to_string(threads) + "/" + dname;
          if (!scalar_step_s.count(key)) {
            ExecPolicy scalar{&pool, KernelKind::scalar};
            scalar_step_s[key] = best(time_runs(cfg.min_time / 4, 1, [&] { run_kdacp(data, 1, dir, scalar); }));
          }
          const double t_scalar = scalar_step_s[key] * double(chain);
          const double gflops = flops / t_simd * 1e-9;
          const double blas = t_blas > 0 ? flops / t_blas * 1e-9 : 0;
          const double scal = flops / t_scalar * 1e-9;
          nlohmann::json rec = {{"mode", "kernels"},
                                {"K", kd},
                                {"V", kd},
                                {"chain", chain},
                                {"threads", threads},
                                {"BH", cfg.slabs},
                                {"direction", dname},
                                {"target", peaks[ti].target},
                                {"seconds", t_simd},
                                {"gflops", gflops},
                                {"peak_gflops", peaks[ti].gflops},
                                {"openblas_gflops", blas},
                                {"scalar_gflops", scal},
                                {"fraction_of_peak", gflops / peaks[ti].gflops},
                                {"speedup_vs_openblas", blas > 0 ? gflops / blas : 0.0},
                                {"speedup_vs_scalar", gflops / scal}};
          records.push_back(rec);
          ++done;
          if (cfg.progress)
            std::fprintf(stderr,
                         "kdacp bench: [%zu/%zu] K=V=%zu chain=%zu threads=%zu %s: %.1f GFLOP/s "
                         "(%.0f%% of peak, %.2fx OpenBLAS)\n",
                         done, total, kd, chain, threads, dname.c_str(), gflops,
                         100 * gflops / peaks[ti].gflops, blas > 0 ? gflops / blas : 0.0);
        }
      }
    }
  }
  return records;
}

}  // namespace kdacp::cli
