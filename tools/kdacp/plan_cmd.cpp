// kdacp plan: the cost model's table for a hypothetical cluster, auto's
// choice, and optionally a gnuplot chart of time vs P per protocol. The
// report is kdacp/report/plan_report.hpp; this file parses the flags.
#include <memory>

#include "commands.hpp"
#include "flags.hpp"
#include "kdacp/report/plan_report.hpp"
#include "layer_flags.hpp"

namespace kdacp::cli {

using report::kPlanMaxTokens;

void add_plan_command(CLI::App& app) {
  auto cfg = std::make_shared<report::PlanFlags>();
  CLI::App* cmd = app.add_subcommand(
      "plan", "predict every protocol's time and memory for a hypothetical cluster (cost model)");
  // P is hypothetical here, so larger than any run; the shape limits are the runs'.
  add_int(*cmd, "--ranks,-P", cfg->ranks, "CP size P", IntRange{1, 1 << 20});
  add_bhkv_flags(*cmd, cfg->batch, cfg->heads, cfg->key_dim, cfg->value_dim);
  add_quantity(*cmd, "--alpha", cfg->alpha, "per-message latency, e.g. 5us (default 5us)", Quantity::seconds);
  add_quantity(*cmd, "--bandwidth", cfg->bandwidth, "per-rank bandwidth, e.g. 50GB/s (default 45GB/s)",
               Quantity::rate);
  add_real(*cmd, "--gflops", cfg->gflops, "fold throughput per rank in GFLOP/s", kPositive)->default_str("40000");
  add_quantity(*cmd, "--group-alpha", cfg->group_alpha, "latency inside an all-gather group (NVLink)",
               Quantity::seconds);
  add_quantity(*cmd, "--group-bandwidth", cfg->group_bandwidth, "bandwidth inside an all-gather group",
               Quantity::rate);
  add_path(*cmd, "--calibration", cfg->calibration, "JSON from `kdacp calibrate` (flags override it)",
           "a JSON file name");
  add_quantity(*cmd, "--memory-budget", cfg->memory_budget, "per-rank budget for auto, e.g. 2GiB", Quantity::bytes);
  add_path(*cmd, "--plot", cfg->plot, "write a PNG of time vs P per protocol (gnuplot) and its script FILE.gp",
           "a file name");
  auto* tokens = add_int(*cmd, "--tokens,-T", cfg->tokens,
                         "tokens of the stream, for the layout's part boundaries and cuts (with --seqlens: their sum)",
                         IntRange{1, kPlanMaxTokens})
                     ->default_str("none");
  add_layout_flags(*cmd, cfg->layout);
  add_packing_flags(*cmd, cfg->packing, kPlanMaxTokens, "; parts where one starts are cuts, which shorten the chain");
  add_int(*cmd, "--seed", cfg->seed, "seed of --docs' packing (as in kdacp run)", IntRange{});
  auto* per_rank = add_int(*cmd, "--tokens-per-rank", cfg->tokens_per_rank,
                           "T/P: also price Ulysses x state CP, an all-to-all over U ranks of a head group and the "
                           "state exchange over P/U, for every U dividing H and P",
                           IntRange{1, kPlanMaxTokens})
                       ->default_str("none");
  auto* act_bytes = add_int(*cmd, "--activation-bytes", cfg->activation_bytes,
                            "bytes per activation element the all-to-alls move (bf16: 2)", IntRange{1, 8});
  auto* node = add_int(*cmd, "--node-size", cfg->node_size,
                       "ranks per NVLink island: all-to-all steps inside one cost --group-alpha/--group-bandwidth",
                       IntRange{1, 1 << 20});
  cmd->add_flag("--json", cfg->json, "print one JSON object instead of the tables");
  cmd->callback([cfg, tokens, per_rank, act_bytes, node] {
    cfg->tokens_given = tokens->count() > 0;
    cfg->tokens_per_rank_given = per_rank->count() > 0;
    cfg->activation_bytes_given = act_bytes->count() > 0;
    cfg->node_size_given = node->count() > 0;
    report::run_plan(*cfg);
  });
}

}  // namespace kdacp::cli
