// `kdacp run`: the main job. The context-parallel KDA layer, forward and
// backward, for every protocol on in-process ranks, against the layer on one
// device: time, the exchange's share, errors of o and every gradient, and
// whether results are bitwise equal across exact protocols.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "kdacp/error.hpp"
#include "kdacp/testing/bench.hpp"
#include "kdacp/testing/layer_runner.hpp"
#include "kdacp/testing/synthetic.hpp"
#include "kdacp/thread_pool.hpp"
#include "flags.hpp"
#include "kdacp/admission.hpp"
#include "table.hpp"

namespace kdacp::cli {
namespace {

using testing::LayerOutputs;

struct RunConfig {
  std::size_t ranks = 4, batch = 1, tokens = 8192, heads = 4, value_heads = 0, key_dim = 128,
              value_dim = 128;
  std::uint64_t seed = 0;
  std::size_t threads = 0;
  double timeout_s = 120;
  bool json = false;
  std::string max_memory;
};

// The table and the JSON records, one row per run, against the single-rank
// layer; the flop counts turn times into GFLOP/s and a share of the peak.
struct Report {
  const LayerOutputs<float>& single;
  double one_flops, cp_flops;
  PeakResult peak;
  Table table{{"protocol", "fwd ms", "bwd ms", "exchange", "GFLOP/s", "% peak", "o", "dq", "dk", "dv", "dg",
               "dbeta", "bitwise"}};
  nlohmann::json records = nlohmann::json::array();
  double worst = 0;

  void add(const std::string& name, const LayerOutputs<float>& o, bool is_single, const std::string& bitwise) {
    const double gflops = (is_single ? one_flops : cp_flops) / (o.forward_seconds + o.backward_seconds) / 1e9;
    const double share = is_single ? 0.0 : o.exchange_seconds / (o.forward_seconds + o.backward_seconds);
    const std::vector<double> errs = testing::relative_errors(o, single);
    if (!is_single)
      for (double e : errs) worst = std::max(worst, e);
    std::vector<std::string> row{name, fmt("%.1f", o.forward_seconds * 1e3), fmt("%.1f", o.backward_seconds * 1e3),
                                 is_single ? "-" : fmt("%.1f%%", share * 100), fmt("%.1f", gflops),
                                 fmt("%.1f%%", 100 * gflops / peak.gflops)};
    for (double e : errs) row.push_back(is_single ? "-" : fmt("%.1e", e));
    row.push_back(bitwise);
    table.add(row);
    records.push_back({{"protocol", name},
                       {"forward_seconds", o.forward_seconds}, {"backward_seconds", o.backward_seconds},
                       {"exchange_share", share}, {"gflops", gflops}, {"peak_fraction", gflops / peak.gflops},
                       {"rel_error", {{"o", errs[0]}, {"dq", errs[1]}, {"dk", errs[2]}, {"dv", errs[3]},
                                      {"dg", errs[4]}, {"dbeta", errs[5]}}},
                       {"bitwise_equal_across_exact", bitwise == "yes"}});
  }
};

void print(const RunConfig& cfg, const kda::Shape& shape, std::size_t per_rank, const Report& rep,
           bool all_bitwise) {
  const PeakResult& peak = rep.peak;
  if (cfg.json) {
    nlohmann::json j = {{"command", "run"},
                        {"P", cfg.ranks}, {"B", shape.batch}, {"T", shape.tokens}, {"H", shape.heads},
                        {"HV", shape.value_heads}, {"K", shape.key_dim}, {"V", shape.value_dim},
                        {"threads_per_rank", per_rank}, {"peak_gflops", peak.gflops},
                        {"peak_threads", peak.threads}, {"simd_target", peak.target},
                        {"layer_flops_context_parallel", rep.cp_flops}, {"layer_flops_single", rep.one_flops},
                        {"protocols", rep.records}, {"max_rel_error", rep.worst},
                        {"bitwise_equal_across_exact", all_bitwise}};
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::printf("kdacp run: KDA layer forward+backward, float32, B=%zu T=%zu H=%zu HV=%zu K=%zu V=%zu, "
              "P=%zu in-process ranks x %zu threads\n\n",
              shape.batch, shape.tokens, shape.heads, shape.value_heads, shape.key_dim,
              shape.value_dim, cfg.ranks, per_rank);
  rep.table.print();
  std::printf("\nerrors: relative Frobenius vs the single-rank layer; exchange: share of layer time in the "
              "state exchange;\nGFLOP/s: recurrence flops per forward+backward (%.2f GFLOP on one device, %.2f "
              "with the CP summaries and G pass) / wall time;\n%% peak: of the FP32 FMA peak measured in this run, "
              "%.1f GFLOP/s on %zu threads (%s)\n",
              rep.one_flops / 1e9, rep.cp_flops / 1e9, peak.gflops, peak.threads, peak.target.c_str());
  std::printf("max rel error %.3e; outputs and gradients bitwise equal across exact protocols: %s\n", rep.worst,
              all_bitwise ? "yes" : "NO");
}

void run(const RunConfig& cfg) {
  const kda::Shape shape{cfg.batch, cfg.tokens, cfg.heads,
                         cfg.value_heads ? cfg.value_heads : cfg.heads, cfg.key_dim, cfg.value_dim};
  kda::validate(shape);
  kda::split_tokens(shape.tokens, cfg.ranks, 0);  // P > T is an error before any work
  check_threads(cfg.ranks, cfg.threads);
  require_memory(testing::compare_protocols_bytes(shape, cfg.ranks), max_memory_bytes(cfg.max_memory),
                 "kdacp run on " + std::to_string(cfg.ranks) + " ranks", max_memory_name(cfg.max_memory));
  const std::size_t hw = ThreadPool::default_threads(1);
  const std::size_t per_rank = cfg.threads ? cfg.threads : ThreadPool::default_threads(cfg.ranks);
  const testing::Progress progress("kdacp run");
  const auto data = kda::synthetic_layer<float>(shape, cfg.seed);
  const auto d_o = kda::synthetic_tensor<float>(shape.v_elems(), cfg.seed + 1);
  const float scale = kda::default_scale<float>(shape.key_dim);
  const auto single = testing::run_single(data, scale, &d_o, hw);
  progress.note("single-rank layer done");
  const auto cmp = testing::compare_protocols(data, scale, d_o, cfg.ranks, per_rank, cfg.timeout_s, progress);

  // The machine's FP32 FMA peak with every hardware thread, measured in this
  // run, so the layer's speed reads as a share of what the cores can do.
  Report rep{single, kda::forward_flops(shape, false) + kda::backward_flops(shape, false),
             kda::forward_flops(shape, true) + kda::backward_flops(shape, true), measure_fma_peak(hw, 0.2)};
  rep.add("single (1 rank)", single, true, "-");
  for (const auto& r : cmp.runs) rep.add(r.label, r.out, false, !r.bitwise ? "n/a" : *r.bitwise ? "yes" : "NO");
  print(cfg, shape, per_rank, rep, cmp.all_bitwise);
  if (!cmp.all_bitwise) throw Error("exact protocols disagree bitwise");
}

}  // namespace

void add_run_command(CLI::App& app) {
  auto cfg = std::make_shared<RunConfig>();
  CLI::App* cmd = app.add_subcommand(
      "run", "the main job: the context-parallel KDA layer for every protocol vs one device");
  add_int(*cmd, "--ranks,-P", cfg->ranks, "in-process ranks", IntRange{1, 1024});
  add_int(*cmd, "--batch,-B", cfg->batch, "batch size", kSizeRange);
  add_int(*cmd, "--tokens,-T", cfg->tokens, "sequence length", IntRange{1, 1 << 24});
  add_int(*cmd, "--heads,-H", cfg->heads, "query/key heads", kSizeRange);
  add_int(*cmd, "--value-heads", cfg->value_heads, "value heads (multiple of --heads; 0: same)",
          IntRange{0, kSizeRange.max});
  add_int(*cmd, "--key-dim,-K", cfg->key_dim, "key dim", kDimRange);
  add_int(*cmd, "--value-dim,-V", cfg->value_dim, "value dim", kDimRange);
  add_int(*cmd, "--seed", cfg->seed, "input seed", IntRange{});
  add_int(*cmd, "--threads", cfg->threads, "threads per rank (0: hardware threads / ranks)", kThreadsRange);
  add_real(*cmd, "--timeout", cfg->timeout_s, "seconds a rank waits for a peer", kTimeoutRange);
  add_max_memory(*cmd, cfg->max_memory);
  cmd->add_flag("--json", cfg->json, "print JSON instead of a table");
  cmd->callback([cfg] { run(*cfg); });
}

}  // namespace kdacp::cli
