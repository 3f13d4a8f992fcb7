// `kdacp bench`: measurements behind the two modes. Each returns one flat
// JSON record per measured configuration (the --json output is their array);
// tables and plots are drawn from the same records.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace kdacp::cli {

struct BenchConfig {
  // kernels: K = V values, chain lengths, thread counts (0 = all hardware threads).
  std::vector<std::size_t> dims{64, 128, 256};
  std::vector<std::size_t> chains{1, 4, 16, 64};
  std::vector<std::size_t> threads{1, 0};
  std::size_t slabs = 16;  // B·H of the kernel sweep
  // protocols: in-process P, B·H (B = 1, H = B·H), K = V.
  std::vector<std::size_t> ranks{2, 4, 8, 16};
  std::vector<std::size_t> bhs{1, 16, 64};
  std::size_t key_dim = 128;
  std::vector<std::string> directions{"forward", "backward"};
  // Each timing repeats until this many seconds (at least three runs) and keeps the best
  // (kernels) or the median (protocols).
  double min_time = 0.2;
  bool progress = true;  // one line per configuration on stderr
};

nlohmann::json run_kernel_bench(const BenchConfig& cfg);
nlohmann::json run_protocol_bench(const BenchConfig& cfg);

}  // namespace kdacp::cli
