// kdacp plan: the cost model's table for a hypothetical cluster, auto's
// choice, and optionally a gnuplot chart of time vs P per protocol. The
// report is kdacp/testing/plan_report.hpp; this file parses the flags.
#include <cstdint>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "commands.hpp"
#include "flags.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/error.hpp"
#include "kdacp/testing/packing.hpp"
#include "kdacp/testing/plan_report.hpp"
#include "kdacp/units.hpp"
#include "layer_flags.hpp"

namespace kdacp::cli {

namespace {

struct PlanConfig {
  std::size_t ranks = 1024, batch = 1, heads = 32, key_dim = 128, value_dim = 128;
  std::string alpha, bandwidth, group_alpha, group_bandwidth, calibration, memory_budget, plot;
  double gflops = 0;
  // The layout and the cut pattern: without a token count (--tokens,
  // --seqlens) only the layout's owners are known, and there are no cuts.
  LayoutFlags layout;
  testing::Packing packing;
  std::size_t tokens = 0;  // 0: none given
  std::uint64_t seed = 0;
  // Ulysses × state CP (--tokens-per-rank asks for it).
  std::size_t tokens_per_rank = 0, activation_bytes = 2, node_size = 8;
  bool json = false;
};

// Which of the flags that need another were given.
struct PlanGiven {
  bool tokens = false, tokens_per_rank = false, activation_bytes = false, node_size = false;
};

// The most tokens `kdacp plan` takes (a hypothetical stream, never allocated).
constexpr std::size_t kPlanMaxTokens = std::size_t{1} << 40;

// What the flags say about the cluster and the stream, checked once: T (0:
// none) and the packing's cu_seqlens (empty: one sequence per row).
testing::PlanRequest plan_request(const PlanConfig& c, const PlanGiven& given) {
  const bool tokens_given = given.tokens;
  check_layout_flags(c.layout);
  if (!given.tokens_per_rank) {
    if (given.activation_bytes)
      throw InvalidArgument("--activation-bytes needs --tokens-per-rank N, the activations it prices");
    if (given.node_size) throw InvalidArgument("--node-size needs --tokens-per-rank N, the all-to-alls it prices");
  } else {
    if (!c.layout.split.empty())
      throw InvalidArgument("--split describes P ranks, expected no --split with --tokens-per-rank (Ulysses' state "
                            "exchange runs over P/U ranks)");
    if (tokens_given && (c.tokens % c.ranks != 0 || c.tokens / c.ranks != c.tokens_per_rank))
      // Both at most 2^40 and P at most 2^20: the product fits.
      throw InvalidArgument(fmt::format("--tokens-per-rank {} with --tokens {} on P = {} ranks, expected --tokens {} "
                                        "(or no --tokens)",
                                        c.tokens_per_rank, c.tokens, c.ranks, c.tokens_per_rank * c.ranks));
  }
  testing::PlanRequest r{c.ranks, c.batch, c.heads, c.key_dim, c.value_dim, c.layout.layout == "zigzag", 0, {}, {}};
  r.tokens = testing::packed_tokens(c.packing, c.tokens, tokens_given, kPlanMaxTokens);
  if (r.tokens == 0) {
    if (c.packing.docs > 0)
      throw InvalidArgument(
          fmt::format("--docs {} needs --tokens T, the stream the documents are packed into", c.packing.docs));
    if (!c.layout.split.empty()) throw InvalidArgument("--split needs --tokens T (or --seqlens), the tokens it splits");
  }
  if (r.tokens > 0) r.cu_seqlens = testing::packed_cu_seqlens(c.packing, c.batch, r.tokens, c.seed);
  r.layout_at = [layout = c.layout, tokens = r.tokens](std::size_t p) { return layout_of(layout, tokens, p); };
  if (given.tokens_per_rank) {
    UlyssesOptions u;
    u.tokens_per_rank = c.tokens_per_rank;
    u.activation_bytes = c.activation_bytes;
    u.node_size = c.node_size;
    r.ulysses = u;
  }
  return r;
}

CostParams params_of(const PlanConfig& c) {
  CostParams p = c.calibration.empty() ? CostParams{} : load_cost_params(c.calibration);
  if (!c.alpha.empty()) p.alpha_s = parse_seconds(c.alpha, "--alpha");
  if (!c.bandwidth.empty()) p.beta_s_per_byte = 1 / parse_rate(c.bandwidth, "--bandwidth");
  if (!c.group_alpha.empty()) p.group_alpha_s = parse_seconds(c.group_alpha, "--group-alpha");
  if (!c.group_bandwidth.empty())
    p.group_beta_s_per_byte = 1 / parse_rate(c.group_bandwidth, "--group-bandwidth");
  if (c.gflops > 0) p.gflops = c.gflops;
  if (!c.alpha.empty() || !c.bandwidth.empty() || c.gflops > 0) p.source = "command line";
  return p;
}

void run_plan(const PlanConfig& cfg, const PlanGiven& given) {
  const CostParams params = params_of(cfg);
  const testing::PlanRequest request = plan_request(cfg, given);
  const std::size_t budget = cfg.memory_budget.empty() ? 0 : parse_bytes(cfg.memory_budget, "--memory-budget");
  testing::PlanRequest priced = request;
  // Nodes the cost parameters name (node_ranks) are the all-to-alls' islands
  // unless --node-size says otherwise (then predict_ulysses refuses the mismatch).
  if (priced.ulysses && !given.node_size && params.node_ranks > 0) priced.ulysses->node_size = params.node_ranks;
  testing::print_plan(priced, params, budget, cfg.plot, cfg.json);
}

}  // namespace

void add_plan_command(CLI::App& app) {
  auto cfg = std::make_shared<PlanConfig>();
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
    run_plan(*cfg, {tokens->count() > 0, per_rank->count() > 0, act_bytes->count() > 0, node->count() > 0});
  });
}

}  // namespace kdacp::cli
