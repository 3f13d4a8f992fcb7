// `kdacp bench kernels`: GFLOP/s of the fused fold (kdacp::scan, the loop
// behind merge) over chains of affine steps, beside the measured FP32 FMA
// peak, the scalar kernel and an optional baseline (an OpenBLAS loop),
// all measured in the same run. Part of kdacp_report.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "kdacp/kernels.hpp"
#include "kdacp/tensor.hpp"
#include "kdacp/report/bench.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp::report {

// One configuration's inputs: `distinct` stacked slots of S [distinct,slabs,K,V]
// and M [distinct,slabs,K,K] (contractions with O(1) offsets, so no denormal
// or overflow path is timed), an incoming state and two outputs to
// alternate. Slots are capped at 64 MiB; longer chains run several scans
// back to back over the same slots, so the kernel still streams fresh M and
// S from memory at every step once the working set exceeds the last-level
// cache.
struct FoldChain {
  std::size_t k, v, slabs, distinct;
  State offsets, transfers;
  State incoming, out_a, out_b;

  FoldChain(std::size_t k, std::size_t v, std::size_t slabs, std::size_t chain);
  Slots slots() const;
};

// `chain` steps per slab with the library's fold, from the incoming state.
void run_fold_chain(const FoldChain& d, std::size_t chain, Direction dir, const ExecPolicy& policy);

// Another implementation of run_fold_chain's work, timed beside it: step t
// uses slot t mod distinct (counted from the last slot backward) and writes
// out_a on even steps, out_b on odd ones.
using FoldBaseline = std::function<void(const FoldChain& d, std::size_t chain, Direction dir, ThreadPool* pool)>;

// What a user would otherwise write, as `kdacp bench kernels` compares it:
// per slab and step, memcpy S into C and C = op(M)·X + C with cblas_sgemm
// (beta = 1), ping-ponging C as the next X; parallel over slabs with the
// given pool, OpenBLAS itself set single-threaded by this call. Empty when
// kdacp_report was built without OpenBLAS.
FoldBaseline openblas_baseline();

struct KernelBenchConfig {
  std::vector<std::size_t> dims;     // K = V values
  std::vector<std::size_t> chains;   // chain lengths
  std::vector<std::size_t> threads;  // thread counts (0 = all hardware threads)
  std::size_t slabs = 16;            // B·H
  std::vector<Direction> directions;
  double min_time = 0.2;  // each timing repeats this long (at least 3 runs) and keeps the best
};

struct KernelRecord {
  std::size_t k = 0, chain = 0, threads = 0, slabs = 0;
  Direction direction = Direction::forward;
  double seconds = 0;  // best fold time of the whole chain
  double gflops = 0, scalar_gflops = 0;
  double baseline_gflops = 0;  // 0 without a baseline
  PeakResult peak;             // of the same thread count
};

struct KernelBenchHooks {
  FoldBaseline baseline;  // may be empty
  // Called once per thread count after its peak is measured, then after
  // every record with (record, records so far, total records).
  std::function<void(const PeakResult&)> on_peak;
  std::function<void(const KernelRecord&, std::size_t, std::size_t)> on_record;
};

// Every dims × chains × threads × directions configuration, in that nesting.
std::vector<KernelRecord> bench_kernels(const KernelBenchConfig& cfg, const KernelBenchHooks& hooks);

}  // namespace kdacp::report
