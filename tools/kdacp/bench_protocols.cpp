// `kdacp bench protocols`: the sweep of kdacp/testing/protocol_bench.hpp as
// flat JSON records.
#include <cstdio>
#include <string>

#include "bench.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/testing/protocol_bench.hpp"

namespace kdacp::cli {

nlohmann::json run_protocol_bench(const testing::ProtocolBenchConfig& pc, bool show_progress) {
  testing::ProtocolBenchProgress progress;
  if (show_progress)
    progress = [](const ProtocolConfig& c, std::size_t p, std::size_t bh, double f, double b, std::size_t done,
                  std::size_t total) {
      std::fprintf(stderr, "kdacp bench: [%zu/%zu] P=%zu B·H=%zu %s: fwd %.3f ms, bwd %.3f ms\n", done, total, p,
                   bh, protocol_label(c).c_str(), f * 1e3, b * 1e3);
    };
  nlohmann::json records = nlohmann::json::array();
  for (const testing::ProtocolRecord& r : testing::bench_protocols(pc, progress)) {
    const double peak = double(r.peak_extra_bytes), theory = double(r.theoretical_extra_bytes);
    records.push_back({{"mode", "protocols"},
                       {"protocol", r.layout == "contiguous" ? protocol_label(r.config)
                                                             : protocol_label(r.config) + " [" + r.layout + "]"},
                       {"method", r.config.method}, {"layout", r.layout}, {"chain_steps", r.chain_steps},
                       {"vs_contiguous", r.vs_contiguous},
                       {"group_size", r.config.group_size}, {"P", r.ranks}, {"BH", r.slabs}, {"K", r.key_dim},
                       {"V", r.key_dim}, {"threads_per_rank", r.threads_per_rank},
                       {"direction", r.direction == Direction::forward ? "forward" : "backward"},
                       {"seconds", r.seconds}, {"floor_seconds", r.floor_seconds},
                       {"ratio_to_floor", r.floor_seconds > 0 ? r.seconds / r.floor_seconds : 0.0},
                       {"host_floor_seconds", r.host_floor_seconds},
                       {"ratio_to_host_floor", r.host_floor_seconds > 0 ? r.seconds / r.host_floor_seconds : 0.0},
                       {"peak_extra_bytes", r.peak_extra_bytes},
                       {"theoretical_extra_bytes", r.theoretical_extra_bytes},
                       {"memory_ratio", theory > 0   ? nlohmann::json(peak / theory)
                                        : peak == 0 ? nlohmann::json(1.0)
                                                    : nlohmann::json(nullptr)}});
  }
  return records;
}

}  // namespace kdacp::cli
