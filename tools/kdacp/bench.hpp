// `kdacp bench`: measurements behind the three modes. Each returns one flat
// JSON record per measured configuration (the --json output is their array);
// tables and plots are drawn from the same records.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kdacp/testing/kernel_bench.hpp"
#include "kdacp/testing/layer_bench.hpp"
#include "kdacp/testing/protocol_bench.hpp"

namespace kdacp::cli {

// `progress`: one line per configuration on stderr.
nlohmann::json run_kernel_bench(const testing::KernelBenchConfig& cfg, bool progress);
nlohmann::json run_protocol_bench(const testing::ProtocolBenchConfig& cfg, bool show_progress);
// `failures`: testing::layer_bench_failures of the run (errors NaN or above tolerance).
nlohmann::json run_layer_bench(const testing::LayerBenchConfig& cfg, bool show_progress,
                               std::vector<std::string>* failures);

}  // namespace kdacp::cli
