#include "kdacp/testing/exchange_bench.hpp"

#include <algorithm>
#include <cstdio>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "kdacp/error.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/testing/table.hpp"
#include "kdacp/admission.hpp"
#include "core/simulation.hpp"

namespace kdacp::testing {

namespace {

constexpr std::size_t kPartTokens = 4096;

PartOwners owners_for(const std::string& layout, std::size_t p) {
  if (layout == "contiguous") return PartOwners::one_per_rank(p);
  if (layout == "zigzag") return PartOwners::zigzag(p);
  throw InvalidArgument(fmt::format("layout '{}', expected contiguous or zigzag", layout));
}

}  // namespace

ExchangeBenchResult bench_exchange(const std::shared_ptr<Communicator>& world, const ExchangeBenchConfig& cfg) {
  const std::size_t p = world->size();
  const PartOwners owners = owners_for(cfg.layout, p);
  const std::size_t parts = owners.size();
  std::vector<bool> cuts;
  if (cfg.docs_mean_tokens > 0)
    cuts = document_cuts(parts, kPartTokens * p / parts, cfg.docs_mean_tokens, cfg.cut_seed);
  ExchangeBenchResult r;
  r.config = cfg;
  r.backend = world->backend();
  r.ranks = p;
  r.parts = parts;
  r.cuts = static_cast<std::size_t>(std::count(cuts.begin(), cuts.end(), true));
  ProblemShape shape{p, cfg.shape.slabs(), cfg.shape.key_dim, cfg.shape.value_dim, sizeof(float)};
  shape.part_owners = owners;
  shape.part_cuts = cuts;
  // The calls' cuts are the expected ones: auto weighs them, as the layer's
  // does (layer_exchange_options).
  ExchangeOptions options = cfg.options;
  if (options.expected_cuts.empty()) options.expected_cuts = cuts;
  r.prediction = predict_exchange(shape, cfg.method, cfg.group_size, options);
  const ProtocolConfig config{cfg.method, static_cast<std::size_t>(cfg.group_size), cfg.options.segments};
  const RankTimes mine =
      time_rank(world, config, cfg.shape, owners, cuts, options, cfg.warmup, cfg.calls, cfg.min_time);
  r.method_run = mine.method;
  if (r.method_run != r.prediction.config.method)
    throw Error(fmt::format("bench exchange: {} ran {}, but the model priced {}", cfg.method, r.method_run,
                            protocol_label(r.prediction.config)));
  r.calls = mine.forward.size();
  r.timing = slowest_rank(*world, mine);
  r.folded = detail::simulation_hooks().compute != nullptr;
  return r;
}

std::string to_json(const ExchangeBenchResult& r) {
  using nlohmann::json;
  const auto& c = r.config;
  const Prediction& pred = r.prediction;
  json j{{"backend", r.backend},
         {"method", c.method},
         {"protocol", r.method_run},
         {"label", protocol_label(pred.config)},
         {"group_size", pred.config.group_size},
         {"segments", pred.config.segments},
         {"ranks", r.ranks},
         {"batch", c.shape.batch},
         {"heads", c.shape.heads},
         {"key_dim", c.shape.key_dim},
         {"value_dim", c.shape.value_dim},
         {"layout", c.layout},
         {"parts", r.parts},
         {"cuts", r.cuts},
         {"calls", r.calls},
         {"forward_seconds", r.timing.forward_seconds},
         {"backward_seconds", r.timing.backward_seconds},
         {"forward_peak_bytes", r.timing.forward_peak},
         {"backward_peak_bytes", r.timing.backward_peak},
         {"forward_received_bytes_all", r.timing.forward_received_all},
         {"backward_received_bytes_all", r.timing.backward_received_all},
         {"predicted_seconds", pred.seconds},
         {"predicted_peak_bytes", pred.peak_extra_bytes},
         {"cost_source", c.options.cost.source},
         {"folded", r.folded}};
  j["forward_over_predicted"] = pred.seconds > 0 ? r.timing.forward_seconds / pred.seconds : 0.0;
  j["backward_over_predicted"] = pred.seconds > 0 ? r.timing.backward_seconds / pred.seconds : 0.0;
  return j.dump();
}

void print_exchange_bench(const ExchangeBenchResult& r) {
  const auto& c = r.config;
  std::printf("kdacp bench exchange: backend=%s P=%zu B=%zu H=%zu K=%zu V=%zu layout=%s parts=%zu cuts=%zu calls=%zu\n"
              "cost model: %s\n\n",
              r.backend.c_str(), r.ranks, c.shape.batch, c.shape.heads, c.shape.key_dim, c.shape.value_dim,
              c.layout.c_str(), r.parts, r.cuts, r.calls, c.options.cost.source.c_str());
  Table table({"protocol", "direction", "measured ms", "model ms", "measured/model", "peak extra", "model peak"});
  const std::string label = c.method == "auto" ? "auto -> " + protocol_label(r.prediction.config)
                                               : protocol_label(r.prediction.config);
  for (const bool fwd : {true, false}) {
    const double s = fwd ? r.timing.forward_seconds : r.timing.backward_seconds;
    table.add({label, fwd ? "forward" : "backward", fmt::format("{:.4f}", s * 1e3),
               fmt::format("{:.4f}", r.prediction.seconds * 1e3),
               r.prediction.seconds > 0 ? fmt::format("{:.2f}", s / r.prediction.seconds) : "n/a",
               format_bytes(double(fwd ? r.timing.forward_peak : r.timing.backward_peak)),
               format_bytes(double(r.prediction.peak_extra_bytes))});
  }
  table.print(stdout);
  std::printf("\ntimes: per call the slowest rank (each call starts after a barrier), median over the calls, on "
              "the backend's clock%s\n",
              r.backend == "mpi" ? " (simulated seconds under smpirun)" : "");
  if (r.folded)
    std::printf("folded (KDACP_SMPI_FOLD=1): every fold step charged as its flops at the platform's speed, no data "
                "computed\n");
}

}  // namespace kdacp::testing
