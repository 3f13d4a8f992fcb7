// `kdacp bench layer`'s measurement (kdacp/report/layer_bench.hpp): records
// per algorithm and run, cold steps timed beside the warm ones, and the
// phases summing to the slowest rank's step.
#include <algorithm>
#include <cstddef>
#include <string>

#include <gtest/gtest.h>

#include "kdacp/kda.hpp"
#include "kdacp/report/bench_report.hpp"
#include "kdacp/report/layer_bench.hpp"

namespace kdacp {
namespace {

// A progress callback that checks each call: a positive time, `done`
// counting up from 1 in `calls`, and `total`.
report::LayerBenchProgress counting_progress(std::size_t& calls, std::size_t total) {
  return [&calls, total](const std::string&, kda::Algorithm, double s, std::size_t done, std::size_t all) {
    EXPECT_GT(s, 0);
    EXPECT_EQ(done, ++calls);
    EXPECT_EQ(all, total);
  };
}

// A bench of `shape` on one rank and `ranks`, `repeats` runs, a short peak.
report::LayerBenchConfig small_bench(const kda::Shape& shape, std::size_t ranks, std::size_t repeats) {
  report::LayerBenchConfig c;
  c.shape = shape;
  c.ranks = ranks;
  c.repeats = repeats;
  c.peak_seconds = 0.01;
  return c;
}

// `kdacp bench layer`'s measuring code: one record per algorithm and run in
// order, the baseline at speed-up 1 and error 0, the other within float's
// tolerance but not bitwise equal, rates of the recurrent flop count.
TEST(LayerBench, RecordsPerAlgorithmAndRun) {
  report::LayerBenchConfig c = small_bench(kda::Shape{1, 150, 1, 2, 16, 32}, 3, 2);
  std::size_t calls = 0;
  const report::LayerBenchResult res = report::bench_layer(c, counting_progress(calls, 8));
  EXPECT_EQ(calls, 8u);
  EXPECT_GT(res.peak.gflops, 0);
  ASSERT_EQ(res.records.size(), 4u);
  const double flops = 34.0 * 150 * 2 * 16 * 32;
  for (std::size_t i = 0; i < 4; ++i) {
    const report::LayerBenchRecord& r = res.records[i];
    EXPECT_EQ(r.mode, i < 2 ? "single" : "cp");
    EXPECT_EQ(r.algorithm, i % 2 ? kda::Algorithm::chunk : kda::Algorithm::recurrent);
    EXPECT_EQ(r.ranks, i < 2 ? 1u : 3u);
    EXPECT_EQ(r.method, i < 2 ? "none" : "p2p");
    EXPECT_DOUBLE_EQ(r.flops, flops);
    EXPECT_GT(r.forward_seconds, 0);
    EXPECT_GT(r.backward_seconds, 0);
    EXPECT_NEAR(r.gflops, flops / (r.forward_seconds + r.backward_seconds) / 1e9, 1e-9 * r.gflops);
    EXPECT_NEAR(r.peak_fraction, r.gflops / res.peak.gflops, 1e-12);
    ASSERT_EQ(r.rel_errors.size(), 6u);
    if (i % 2 == 0) {
      EXPECT_EQ(r.speedup, 1.0);
      EXPECT_EQ(r.max_rel_error, 0.0);
    } else {
      EXPECT_GT(r.speedup, 0);
      EXPECT_GT(r.max_rel_error, 0.0);  // a different computation, not the baseline's bits
      EXPECT_LT(r.max_rel_error, 5e-5);
    }
  }
  for (const report::LayerBenchRecord& r : res.records) EXPECT_EQ(r.cold_seconds, 0.0);  // not asked for
  EXPECT_GT(report::layer_bench_bytes(c), 0);
  report::LayerBenchConfig bad = c;
  bad.repeats = 0;
  EXPECT_THROW(report::bench_layer(bad), InvalidArgument);
  bad = c;
  bad.algorithms.clear();
  EXPECT_THROW(report::bench_layer(bad), InvalidArgument);
  bad = c;
  bad.ranks = 151;
  EXPECT_THROW(report::bench_layer(bad), InvalidArgument);
}


// Issue 18 ("Trust"): a value in a message is the value, to the last digit.

TEST(LayerBench, ColdStepsAreTimedBesideTheWarmOnes) {
  report::LayerBenchConfig c = small_bench(kda::Shape{1, 100, 1, 1, 16, 16}, 2, 1);
  c.cold = true;
  std::size_t calls = 0;
  const report::LayerBenchResult res = report::bench_layer(c, counting_progress(calls, 8));
  EXPECT_EQ(calls, 8u);
  ASSERT_EQ(res.records.size(), 4u);
  for (const report::LayerBenchRecord& r : res.records) EXPECT_GT(r.cold_seconds, 0.0);
}

// --phases: each record's slowest rank's summary, G pass, exchange, forward
// and backward, warm and cold; they sum to that rank's forward+backward, the
// summary and G only in CP, and cold minus warm is the allocation column.
TEST(LayerBench, PhasesSumToTheSlowestRanksStep) {
  report::LayerBenchConfig c = small_bench(kda::Shape{1, 120, 1, 2, 16, 16}, 3, 1);
  c.cold = true;
  c.phases = true;
  const report::LayerBenchResult res = report::bench_layer(c);
  ASSERT_EQ(res.records.size(), 4u);
  const double eps = 1e-9;
  for (const report::LayerBenchRecord& r : res.records) {
    const bool cp = r.mode == "cp";
    for (const job::LayerPhases& p : {r.phases, r.cold_phases}) {
      for (double x : {p.summary, p.incoming_grad, p.exchange, p.forward, p.backward}) EXPECT_GE(x, 0.0);
      EXPECT_GT(p.forward, 0.0);
      EXPECT_GT(p.backward, 0.0);
      EXPECT_LT(p.rank, r.ranks);
      if (cp) {
        EXPECT_GT(p.summary, 0.0);
        EXPECT_GT(p.incoming_grad, 0.0);
        EXPECT_GT(p.exchange, 0.0);
      } else {
        EXPECT_EQ(p.summary + p.incoming_grad + p.exchange, 0.0);
      }
    }
    // The warm phases are of the median run: one rank's part of its figures.
    const job::LayerPhases& p = r.phases;
    if (cp) {
      // The slowest rank's step: at most the slowest forward plus the slowest
      // backward, at least either.
      EXPECT_LE(p.total(), r.forward_seconds + r.backward_seconds + eps);
      EXPECT_GE(p.total(), std::max(r.forward_seconds, r.backward_seconds) - eps);
      EXPECT_LE(p.summary + p.incoming_grad, r.summary_seconds + eps);
      EXPECT_LE(p.exchange, r.exchange_seconds + eps);
    } else {
      EXPECT_NEAR(p.forward, r.forward_seconds, eps);
      EXPECT_NEAR(p.backward, r.backward_seconds, eps);
      EXPECT_NEAR(r.cold_phases.total(), r.cold_seconds, eps);
    }
  }
  // In the JSON records: the same fields, and allocation = cold - warm.
  const nlohmann::json recs = report::layer_bench_records(c, false, nullptr);
  ASSERT_EQ(recs.size(), 4u);
  for (const nlohmann::json& j : recs) {
    for (const char* prefix : {"phase_", "cold_phase_"}) {
      const std::string pre = prefix;
      double sum = 0;
      for (const char* f : {"summary_seconds", "g_seconds", "exchange_seconds", "forward_seconds", "backward_seconds"})
        sum += j.at(pre + f).get<double>();
      EXPECT_NEAR(sum, j.at(pre + "total_seconds").get<double>(), eps) << pre;
      EXPECT_TRUE(j.contains(pre + "rank"));
    }
    EXPECT_NEAR(j.at("allocation_seconds").get<double>(),
                j.at("cold_phase_total_seconds").get<double>() - j.at("phase_total_seconds").get<double>(), eps);
  }
  c.phases = false;  // without --phases the records stay as they were
  c.cold = false;
  c.ranks = 0;
  for (const nlohmann::json& j : report::layer_bench_records(c, false, nullptr))
    EXPECT_FALSE(j.contains("phase_total_seconds"));
}

// `kdacp run` and `kdacp bench layer` fail when an error is NaN or above its
// tolerance: 5e-5 in float32, plus a reassociating protocol's bound.

}  // namespace
}  // namespace kdacp
