// `kdacp bench layer`: the sweep of kdacp/testing/layer_bench.hpp (both KDA
// algorithms, one rank and in-process CP) as flat JSON records.
#include <cmath>
#include <cstdio>

#include "bench.hpp"
#include "kdacp/testing/layer_bench.hpp"

namespace kdacp::cli {

namespace {

// JSON has no NaN: a NaN error is written as null (and fails the command).
nlohmann::json number(double x) { return std::isnan(x) ? nlohmann::json(nullptr) : nlohmann::json(x); }

}  // namespace

nlohmann::json run_layer_bench(const testing::LayerBenchConfig& lc, bool show_progress,
                               std::vector<std::string>* failures) {
  testing::LayerBenchProgress progress;
  if (show_progress)
    progress = [](const std::string& mode, kda::Algorithm a, double seconds, std::size_t done, std::size_t total) {
      std::fprintf(stderr, "kdacp bench: [%zu/%zu] %s %s: forward+backward %.1f ms\n", done, total,
                   mode == "cp" ? "context-parallel" : "one rank", kda::algorithm_name(a), seconds * 1e3);
    };
  const testing::LayerBenchResult res = testing::bench_layer(lc, progress);
  const kda::Shape& s = lc.shape;
  nlohmann::json records = nlohmann::json::array();
  const char* names[] = {"o", "dq", "dk", "dv", "dg", "dbeta"};
  for (const testing::LayerBenchRecord& r : res.records) {
    nlohmann::json j = {{"mode", "layer"}, {"run", r.mode}, {"algorithm", kda::algorithm_name(r.algorithm)},
                        {"baseline", kda::algorithm_name(lc.algorithms.front())},
                        {"P", r.ranks}, {"threads_per_rank", r.threads_per_rank}, {"protocol", r.method},
                        {"B", s.batch}, {"T", s.tokens}, {"H", s.heads}, {"HV", s.value_heads},
                        {"K", s.key_dim}, {"V", s.value_dim}, {"chunk_size", kda::kChunkSize},
                        {"forward_seconds", r.forward_seconds}, {"backward_seconds", r.backward_seconds},
                        {"seconds", r.forward_seconds + r.backward_seconds},
                        {"exchange_seconds", r.exchange_seconds}, {"summary_seconds", r.summary_seconds},
                        {"flops", r.flops}, {"gflops", r.gflops},
                        {"peak_gflops", res.peak.gflops}, {"peak_threads", res.peak.threads},
                        {"target", res.peak.target}, {"fraction_of_peak", r.peak_fraction},
                        {"speedup", r.speedup}, {"repeats", lc.repeats},
                        {"warmup_steps", lc.warmup_steps}, {"keep_forward", lc.keep_forward},
                        {"max_rel_error", number(r.max_rel_error)}, {"tolerance", r.tolerance}};
    for (std::size_t i = 0; i < r.rel_errors.size() && i < 6; ++i)
      j[std::string("rel_error_") + names[i]] = number(r.rel_errors[i]);
    records.push_back(std::move(j));
  }
  if (failures) *failures = testing::layer_bench_failures(res);
  return records;
}

}  // namespace kdacp::cli
