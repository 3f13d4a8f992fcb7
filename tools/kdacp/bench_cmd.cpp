// `kdacp bench kernels|protocols|layer`: how close the fold kernels, the
// protocols and the KDA layer (per algorithm) come to what the host can do,
// as ratios measured in one run.
// Human table by default, --json for scripts (one array of flat records),
// --plot FILE for a PNG or SVG drawn by gnuplot from those records.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "commands.hpp"
#include "exchange_flags.hpp"
#include "flags.hpp"
#include "kdacp/admission.hpp"
#include "kdacp/error.hpp"
#include "kdacp/job.hpp"
#include "kdacp/report/bench_report.hpp"
#include "layer_flags.hpp"

namespace kdacp::cli {
namespace {

struct BenchArgs {
  report::KernelBenchConfig kernels{{64, 128, 256}, {1, 4, 16, 64}, {1, 0}, 16, {}, 0.2};
  report::ProtocolBenchConfig protocols{{2, 4, 8, 16}, {1, 16, 64}, 128, {}, 0.2};
  std::vector<std::string> directions{"forward", "backward"};
  double min_time = 0.2;  // each timing repeats this long (at least three runs)
  bool json = false;
  bool quick = false;
  bool quiet = false;
  std::string plot;
};

void run(const std::string& mode, BenchArgs& args) {
  auto& kc = args.kernels;
  auto& pc = args.protocols;
  kc.min_time = pc.min_time = args.min_time;
  if (args.quick) {
    report::make_quick(kc);
    report::make_quick(pc);
  }
  // Kernels sweep the directions as given; protocols forward first.
  for (const std::string& d : args.directions)
    kc.directions.push_back(d == "forward" ? Direction::forward : Direction::backward);
  for (Direction d : {Direction::forward, Direction::backward})
    if (std::count(kc.directions.begin(), kc.directions.end(), d) > 0) pc.directions.push_back(d);
  const report::BenchOutput output{args.json, !args.quiet, args.plot};
  if (mode == "kernels") report::run_kernel_bench(kc, output);
  else report::run_protocol_bench(pc, output);
}

// `kdacp bench layer`: the CLI's side of report::bench_layer.
struct LayerArgs {
  report::LayerBenchConfig layer;
  std::size_t value_heads = 0;  // 0: H
  std::vector<std::string> algorithms{"recurrent", "chunk"};
  ExchangeFlags exchange;
  bool json = false, quick = false, quiet = false, recompute = !defaults::kKeepForward;
  std::string max_memory;
};

void run_layer(LayerArgs& a) {
  report::LayerBenchConfig& c = a.layer;
  c.keep_forward = !a.recompute;
  c.algorithms.clear();
  for (const std::string& name : a.algorithms) c.algorithms.push_back(parse_algorithm_flag(name, "--algorithms"));
  if (a.quick) {
    report::make_quick(c);
    a.value_heads = 0;
  }
  check_value_heads(c.shape.heads, a.value_heads);
  c.shape.value_heads = a.value_heads ? a.value_heads : c.shape.heads;
  kda::validate(c.shape);
  if (c.ranks > c.shape.tokens)
    throw InvalidArgument(fmt::format("--ranks {} is more ranks than T = {} tokens", c.ranks, c.shape.tokens));
  check_threads(std::max<std::size_t>(c.ranks, 1), c.threads_per_rank);
  c.method = a.exchange.protocol;
  c.group_size = a.exchange.group_size;
  c.exchange = exchange_options(a.exchange, job::layer_summary_shape(c.shape));
  report::run_layer_bench(c, a.max_memory, report::BenchOutput{a.json, !a.quiet, ""});
}

void add_layer_command(CLI::App& bench) {
  auto a = std::make_shared<LayerArgs>();
  a->exchange.protocol = "p2p";
  CLI::App* cmd = bench.add_subcommand(
      "layer", "the KDA layer's forward+backward per algorithm (recurrent, chunk) on one rank and in CP: "
               "time, GFLOP/s vs the FP32 peak, speed-up and error against the first algorithm");
  report::LayerBenchConfig& c = a->layer;
  add_layer_shape_flags(*cmd, c.shape, a->value_heads, "sequence length");
  add_int(*cmd, "--ranks,-P", c.ranks, "in-process ranks of the context-parallel runs (0: one rank only)",
          IntRange{0, kRanksRange.max});
  add_exchange_flags(*cmd, a->exchange);
  cmd->add_option("--algorithms", a->algorithms,
                  "algorithms to run, in this order; the first is the baseline of speed-ups and errors "
                  "(recurrent, chunk)")
      ->capture_default_str();
  add_int(*cmd, "--threads", c.threads_per_rank,
          "threads per rank of the context-parallel runs (0: hardware threads / ranks); the one-rank runs use "
          "every hardware thread",
          kThreadsRange);
  add_int(*cmd, "--repeat", c.repeats, "timed runs per algorithm and run, interleaved; the median is reported",
          IntRange{1, 1000});
  add_int(*cmd, "--warmup", c.warmup_steps,
          "untimed forward+backward steps before each timed one, on the same layer and buffers (a training "
          "loop's steady state)",
          IntRange{0, 100});
  cmd->add_flag("--cold", c.cold,
                "also time each run's first step on a fresh layer (no untimed step), once per repeat: the "
                "'cold / warm' column");
  add_recompute_flag(*cmd, a->recompute);
  cmd->add_flag("--phases", c.phases,
                "also report where each run's time goes: the slowest rank's summary, G pass, exchange, forward and "
                "backward (with --cold, cold and warm and their difference)");
  cmd->add_flag("--deterministic", c.deterministic,
                "also run the context-parallel runs in the deterministic mode (kdacp kda --deterministic), the "
                "'deterministic CP' rows: the cost of P-invariant bytes beside the default mode");
  add_ulysses_flag(*cmd, c.ulysses)
      ->description("also run the context-parallel runs as Ulysses x state CP (kdacp kda --ulysses) over head groups "
                    "of U ranks, U dividing -P, -H and --value-heads, or auto (the cost model's U; needs --protocol "
                    "auto): the 'Ulysses' rows, timed beside plain state CP in the same run");
  add_int(*cmd, "--docs", c.docs,
          "pack the T tokens into this many documents of random lengths (each >= 1, seeded by --seed; B = 1), "
          "as kdacp run --docs, and run the layer over them with cu_seqlens",
          IntRange{1, 1 << 24})
      ->default_str("none");
  add_int(*cmd, "--seed", c.seed, "input seed", IntRange{});
  add_max_memory(*cmd, a->max_memory);
  cmd->add_flag("--json", a->json, "print one JSON array of flat records instead of a table");
  cmd->add_flag("--quick", a->quick, "tiny shape for smoke tests (T=300, H=1, K=V=32, P=2, one run)");
  cmd->add_flag("--quiet,-q", a->quiet, "no progress lines on stderr");
  cmd->callback([a] { run_layer(*a); });
}

void add_common(CLI::App& cmd, BenchArgs& a) {
  cmd.add_flag("--json", a.json, "print one JSON array of flat records instead of a table");
  add_path(cmd, "--plot", a.plot, "also draw the records with gnuplot into FILE (.png or .svg)", "a file name");
  cmd.add_flag("--quick", a.quick, "tiny sweep for smoke tests (seconds)");
  cmd.add_flag("--quiet,-q", a.quiet, "no progress lines on stderr");
  add_real(cmd, "--min-time", a.min_time, "seconds each timing repeats for (at least 3 runs)", kMinTimeRange);
  cmd.add_option("--direction", a.directions, "forward and/or backward")
      ->check(CLI::IsMember({"forward", "backward"}))
      ->capture_default_str();
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto args = std::make_shared<BenchArgs>();
  CLI::App* bench = app.add_subcommand("bench", "measure kernels, protocols and the KDA layer against the host's limits");
  bench->require_subcommand(1);
  CLI::App* kern = bench->add_subcommand(
      "kernels", "GFLOP/s of the fused fold vs the measured FMA peak, an OpenBLAS loop and the scalar kernel");
  add_common(*kern, *args);
  add_ints(*kern, "--dims", args->kernels.dims, "K = V values", kDimRange);
  add_ints(*kern, "--chains", args->kernels.chains, "chain lengths", IntRange{1, 1 << 20});
  add_ints(*kern, "--threads", args->kernels.threads, "thread counts (0: all hardware threads)", kThreadsRange);
  add_int(*kern, "--bh", args->kernels.slabs, "B·H slabs folded in parallel", kSizeRange);
  kern->callback([args] { run("kernels", *args); });
  CLI::App* prot = bench->add_subcommand(
      "protocols", "each protocol's time vs its floor and its peak extra memory vs the theoretical one");
  add_common(*prot, *args);
  add_ints(*prot, "--ranks,-P", args->protocols.ranks, "in-process CP sizes", IntRange{1, 1024});
  add_ints(*prot, "--bh", args->protocols.slabs, "B·H values", kSizeRange);
  add_int(*prot, "--key-dim,-K", args->protocols.key_dim, "K = V", kDimRange);
  prot->callback([args] { run("protocols", *args); });
  add_layer_command(*bench);
  add_bench_exchange_command(*bench);
}

}  // namespace kdacp::cli
