#include "kdacp/report/kernel_bench.hpp"

#include <algorithm>
#include <map>
#include <optional>
#include <thread>

#include "kdacp/calibrate.hpp"
#include "kdacp/testing/synthetic.hpp"

namespace kdacp::report {

namespace {

constexpr std::size_t kSlotBudgetBytes = std::size_t{64} << 20;

double best(const std::vector<double>& runs) { return *std::min_element(runs.begin(), runs.end()); }

}  // namespace

FoldChain::FoldChain(std::size_t k_, std::size_t v_, std::size_t slabs_, std::size_t chain)
    : k(k_), v(v_), slabs(slabs_) {
  const std::size_t slot_bytes = slabs * k * (k + v) * sizeof(float);
  distinct = std::clamp<std::size_t>(kSlotBudgetBytes / slot_bytes, 1, std::max<std::size_t>(chain, 1));
  offsets = State(distinct, slabs, k, v);
  transfers = State(distinct, slabs, k, k);
  incoming = State(1, slabs, k, v);
  out_a = State(1, slabs, k, v);
  out_b = State(1, slabs, k, v);
  Rng rng(k * 131 + slabs);
  const float scale = 0.5f / float(k);
  for (std::size_t i = 0; i < transfers.size(); ++i) transfers.data()[i] = rng.uniform(-1, 1) * scale;
  for (std::size_t i = 0; i < offsets.size(); ++i) offsets.data()[i] = rng.uniform(-1, 1);
  for (std::size_t i = 0; i < incoming.size(); ++i) incoming.data()[i] = rng.uniform(-1, 1);
}

Slots FoldChain::slots() const {
  Slots s;
  s.offsets.base = StateView::dense(offsets.data(), 1, slabs, k, v);
  s.offsets.ranks = distinct;
  s.offsets.rank_stride = slabs * k * v;
  s.transfers.base = StateView::dense(transfers.data(), 1, slabs, k, k);
  s.transfers.ranks = distinct;
  s.transfers.rank_stride = slabs * k * k;
  return s;
}

void run_fold_chain(const FoldChain& d, std::size_t chain, Direction dir, const ExecPolicy& policy) {
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

std::vector<KernelRecord> bench_kernels(const KernelBenchConfig& cfg, const KernelBenchHooks& hooks) {
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
    if (hooks.on_peak) hooks.on_peak(peaks.back());
  }
  const std::size_t total = cfg.dims.size() * cfg.chains.size() * thread_counts.size() * cfg.directions.size();
  std::map<std::pair<std::size_t, Direction>, double> scalar_step_s;  // per (threads, direction) of one K
  std::vector<KernelRecord> records;
  for (std::size_t kd : cfg.dims) {
    scalar_step_s.clear();
    for (std::size_t chain : cfg.chains) {
      const FoldChain data(kd, kd, cfg.slabs, chain);
      const double flops = 2.0 * double(kd * kd * kd) * double(chain) * double(cfg.slabs);
      for (std::size_t ti = 0; ti < thread_counts.size(); ++ti) {
        const std::size_t threads = thread_counts[ti];
        ThreadPool pool(threads);
        for (const Direction dir : cfg.directions) {
          ExecPolicy simd{&pool, KernelKind::best};
          run_fold_chain(data, chain, dir, simd);  // warm-up: page faults, caches
          const double t_simd = best(time_runs(cfg.min_time, 3, [&] { run_fold_chain(data, chain, dir, simd); }));
          double t_base = 0;
          if (hooks.baseline) {
            hooks.baseline(data, chain, dir, &pool);
            t_base = best(time_runs(cfg.min_time, 3, [&] { hooks.baseline(data, chain, dir, &pool); }));
          }
          // The scalar kernel's speed per step does not depend on the chain
          // length; timing it once per (K, threads, direction) on one step
          // keeps the sweep short.
          const auto key = std::pair{threads, dir};
          if (!scalar_step_s.count(key)) {
            ExecPolicy scalar{&pool, KernelKind::scalar};
            scalar_step_s[key] = best(time_runs(cfg.min_time / 4, 1, [&] { run_fold_chain(data, 1, dir, scalar); }));
          }
          KernelRecord rec;
          rec.k = kd, rec.chain = chain, rec.threads = threads, rec.slabs = cfg.slabs, rec.direction = dir;
          rec.seconds = t_simd;
          rec.gflops = flops / t_simd * 1e-9;
          rec.baseline_gflops = t_base > 0 ? flops / t_base * 1e-9 : 0;
          rec.scalar_gflops = flops / (scalar_step_s[key] * double(chain)) * 1e-9;
          rec.peak = peaks[ti];
          records.push_back(rec);
          if (hooks.on_record) hooks.on_record(records.back(), records.size(), total);
        }
      }
    }
  }
  return records;
}

}  // namespace kdacp::report
