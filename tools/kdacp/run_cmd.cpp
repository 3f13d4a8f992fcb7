// `kdacp run`: the main job. The context-parallel KDA layer, forward and
// backward, for every protocol on in-process ranks, against the layer on one
// device: time, the exchange's share, errors of o and every gradient, and
// whether results are bitwise equal across exact protocols.
#include <chrono>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "kdacp/bench.hpp"
#include "kdacp/error.hpp"
#include "kdacp/exchange.hpp"
#include "kdacp/thread_pool.hpp"
#include "layer_runner.hpp"
#include "table.hpp"

namespace kdacp::cli {
namespace {

struct RunConfig {
  std::size_t ranks = 4, batch = 1, tokens = 8192, heads = 4, value_heads = 0, key_dim = 128,
              value_dim = 128;
  std::uint64_t seed = 0;
  std::size_t threads = 0;
  double timeout_s = 120;
  bool json = false;
};

double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

bool same_bits(const LayerOutputs<float>& a, const LayerOutputs<float>& b) {
  auto eq = [](const std::vector<float>& x, const std::vector<float>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
  };
  return eq(a.o, b.o) && eq(a.dq, b.dq) && eq(a.dk, b.dk) && eq(a.dv, b.dv) && eq(a.dg, b.dg) &&
         eq(a.dbeta, b.dbeta);
}

// Progress on stderr, only once a run has taken more than two seconds.
class Progress {
 public:
  void note(const std::string& what) {
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    if (t > 2.0) std::fprintf(stderr, "kdacp run: %s (%.1f s elapsed)\n", what.c_str(), t);
  }

 private:
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
};

void run(const RunConfig& cfg) {
  const kda::Shape shape{cfg.batch, cfg.tokens, cfg.heads,
                         cfg.value_heads ? cfg.value_heads : cfg.heads, cfg.key_dim, cfg.value_dim};
  kda::validate(shape);
  kda::split_tokens(shape.tokens, cfg.ranks, 0);  // P > T is an error before any work
  const std::size_t hw = ThreadPool::default_threads(1);
  const std::size_t per_rank = cfg.threads ? cfg.threads : ThreadPool::default_threads(cfg.ranks);
  Progress progress;
  const auto data = kda::synthetic_layer<float>(shape, cfg.seed);
  const auto d_o = kda::synthetic_tensor<float>(shape.v_elems(), cfg.seed + 1);
  const float scale = kda::default_scale<float>(shape.key_dim);
  const auto single = run_single(data, scale, &d_o, hw);
  progress.note("single-rank layer done");

  struct Row {
    LayerOutputs<float> out;
    long long width;
  };
  std::vector<Row> rows;
  for (const std::string& method : exchange_methods()) {
    if (method == "auto") continue;
    long long width = 1;
    if (method.find("grouped") != std::string::npos) {
      if (cfg.ranks < 4 || cfg.ranks % 2 != 0) continue;  // needs 1 < w < P dividing P
      width = static_cast<long long>(cfg.ranks / 2);
    }
    progress.note("running " + method);
    rows.push_back({run_context_parallel(data, scale, &d_o, cfg.ranks, method, width, per_rank,
                                         cfg.timeout_s),
                    width});
  }
  const double cp_flops = kda::forward_flops(shape, true) + kda::backward_flops(shape, true);
  const double one_flops = kda::forward_flops(shape, false) + kda::backward_flops(shape, false);
  const LayerOutputs<float>* first_exact = nullptr;
  for (const auto& r : rows)
    if (r.out.exact && !first_exact) first_exact = &r.out;

  nlohmann::json records = nlohmann::json::array();
  // The machine's FP32 FMA peak with every hardware thread, measured in this
  // run, so the layer's speed reads as a share of what the cores can do.
  const PeakResult peak = measure_fma_peak(hw, 0.2);
  Table table({"protocol", "fwd ms", "bwd ms", "exchange", "GFLOP/s", "% peak", "o", "dq", "dk", "dv", "dg",
               "dbeta", "bitwise"});
  double worst = 0;
  auto add = [&](const std::string& name, const LayerOutputs<float>& o, bool is_single, const std::string& bitwise) {
    const double gflops = (is_single ? one_flops : cp_flops) / (o.forward_seconds + o.backward_seconds) / 1e9;
    const double share = is_single ? 0.0 : o.exchange_seconds / (o.forward_seconds + o.backward_seconds);
    std::vector<double> errs;
    for (auto [a, b] : {std::pair{&o.o, &single.o}, {&o.dq, &single.dq}, {&o.dk, &single.dk},
                        {&o.dv, &single.dv}, {&o.dg, &single.dg}, {&o.dbeta, &single.dbeta}})
      errs.push_back(rel_error(*a, *b));
    if (!is_single)
      for (double e : errs) worst = std::max(worst, e);
    std::vector<std::string> row{name, fmt("%.1f", o.forward_seconds * 1e3), fmt("%.1f", o.backward_seconds * 1e3),
                                 is_single ? "-" : fmt("%.1f%%", share * 100), fmt("%.1f", gflops),
                                 fmt("%.1f%%", 100 * gflops / peak.gflops)};
    for (double e : errs) row.push_back(is_single ? "-" : fmt("%.1e", e));
    row.push_back(bitwise);
    table.add(row);
    records.push_back({{"protocol", name},
                       {"forward_seconds", o.forward_seconds},
                       {"backward_seconds", o.backward_seconds},
                       {"exchange_share", share},
                       {"gflops", gflops},
                       {"peak_fraction", gflops / peak.gflops},
                       {"rel_error", {{"o", errs[0]}, {"dq", errs[1]}, {"dk", errs[2]}, {"dv", errs[3]},
                                      {"dg", errs[4]}, {"dbeta", errs[5]}}},
                       {"bitwise_equal_across_exact", bitwise == "yes"}});
  };
  add("single (1 rank)", single, true, "-");
  bool all_bitwise = true;
  for (const auto& r : rows) {
    std::string name = r.out.method;
    if (r.width > 1) name += " w=" + std::to_string(r.width);
    std::string bitwise = "n/a";
    if (r.out.exact) {
      const bool eq = same_bits(r.out, *first_exact);
      all_bitwise = all_bitwise && eq;
      bitwise = eq ? "yes" : "NO";
    }
    add(name, r.out, false, bitwise);
  }
  if (cfg.json) {
    nlohmann::json j = {{"command", "run"},
                        {"P", cfg.ranks},
                        {"B", shape.batch},
                        {"T", shape.tokens},
                        {"H", shape.heads},
                        {"HV", shape.value_heads},
                        {"K", shape.key_dim},
                        {"V", shape.value_dim},
                        {"threads_per_rank", per_rank},
                        {"peak_gflops", peak.gflops},
                        {"peak_threads", peak.threads},
                        {"simd_target", peak.target},
                        {"layer_flops_context_parallel", cp_flops},
                        {"layer_flops_single", one_flops},
                        {"protocols", records},
                        {"max_rel_error", worst},
                        {"bitwise_equal_across_exact", all_bitwise}};
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("kdacp run: KDA layer forward+backward, float32, B=%zu T=%zu H=%zu HV=%zu K=%zu V=%zu, "
                "P=%zu in-process ranks x %zu threads\n\n",
                shape.batch, shape.tokens, shape.heads, shape.value_heads, shape.key_dim,
                shape.value_dim, cfg.ranks, per_rank);
    table.print();
    std::printf("\nerrors: relative Frobenius vs the single-rank layer; exchange: share of layer time in the "
                "state exchange;\nGFLOP/s: recurrence flops per forward+backward (%.2f GFLOP on one device, %.2f "
                "with the CP summaries and G pass) / wall time;\n%% peak: of the FP32 FMA peak measured in this run, "
                "%.1f GFLOP/s on %zu threads (%s)\n",
                one_flops / 1e9, cp_flops / 1e9, peak.gflops, peak.threads, peak.target.c_str());
    std::printf("max rel error %.3e; outputs and gradients bitwise equal across exact protocols: %s\n", worst,
                all_bitwise ? "yes" : "NO");
  }
  if (!all_bitwise) throw Error("exact protocols disagree bitwise");
}

}  // namespace

void add_run_command(CLI::App& app) {
  auto cfg = std::make_shared<RunConfig>();
  CLI::App* cmd = app.add_subcommand(
      "run", "the main job: the context-parallel KDA layer for every protocol vs one device");
  cmd->add_option("--ranks,-P", cfg->ranks, "in-process ranks")->check(CLI::Range(1, 1024))->capture_default_str();
  cmd->add_option("--batch,-B", cfg->batch, "batch size")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--tokens,-T", cfg->tokens, "sequence length")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--heads,-H", cfg->heads, "query/key heads")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--value-heads", cfg->value_heads, "value heads (multiple of --heads; 0: same)")->capture_default_str();
  cmd->add_option("--key-dim,-K", cfg->key_dim, "key dim (multiple of 16 in [16,256])")->capture_default_str();
  cmd->add_option("--value-dim,-V", cfg->value_dim, "value dim (multiple of 16 in [16,256])")->capture_default_str();
  cmd->add_option("--seed", cfg->seed, "input seed")->capture_default_str();
  cmd->add_option("--threads", cfg->threads, "threads per rank (0: hardware threads / ranks)")->capture_default_str();
  cmd->add_option("--timeout", cfg->timeout_s, "seconds a rank waits for a peer")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_flag("--json", cfg->json, "print JSON instead of a table");
  cmd->callback([cfg] { run(*cfg); });
}

}  // namespace kdacp::cli
